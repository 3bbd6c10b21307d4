"""The GRPO maths against independent NumPy computations of the same formulas."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import assert_f32_close, f32_tolerance, tiny_additions
from mlx.utils import tree_flatten

from mlx_grpo import logprobs
from mlx_grpo.config import GRPOConfig, LoRAConfig
from mlx_grpo.cpu import native
from mlx_grpo.cpu.layers import use_fast_attention, use_fast_swiglu
from mlx_grpo.grpo import (
    LossInputs,
    aggregate,
    group_advantages,
    group_positions,
    grpo_loss,
    lane_pieces,
    micro_batches,
    objective,
    per_token_loss,
    zero_variance_groups,
)
from mlx_grpo.logprobs import (
    SPARSE_HEAD_SHARE,
    _packable,
    _Packed,
    completion_logprobs,
    effective_lengths,
    shared_inputs,
    splittable,
)
from mlx_grpo.models import (
    adapters_disabled,
    adapters_folded,
    apply_lora,
    trainable_count,
)

# ---------------------------------------------------------------- advantages


def np_advantages(r: np.ndarray, g: int, scale: str) -> np.ndarray:
    groups = r.reshape(-1, g)
    a = groups - groups.mean(1, keepdims=True)
    if scale == "group":
        a = a / (groups.std(1, ddof=1, keepdims=True) + 1e-4)
    elif scale == "batch":
        a = a / (r.std(ddof=1) + 1e-4)
    return a.reshape(-1)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_match_numpy(scale):
    rng = np.random.default_rng(0)
    r = rng.random(24).astype(np.float32)
    got = np.array(group_advantages(mx.array(r), 8, scale))
    np.testing.assert_allclose(got, np_advantages(r, 8, scale), rtol=1e-5, atol=1e-6)


def test_all_equal_groups_get_zero_advantage_and_are_flagged():
    r = mx.array([1.0, 1, 1, 1, 0, 1, 0, 1, 0.5, 0.5, 0.5, 0.5])
    a = np.array(group_advantages(r, 4, "group"))
    assert np.all(a[:4] == 0) and np.all(a[8:] == 0)
    assert np.allclose(a[4:8], [-0.866, 0.866, -0.866, 0.866], atol=1e-3)
    assert np.array(zero_variance_groups(r, 4)).tolist() == [True, False, True]


def test_advantages_reject_ragged_groups():
    with pytest.raises(ValueError, match="G=4"):
        group_advantages(mx.array([1.0, 2.0, 3.0]), 4)


# ---------------------------------------------------------------- the loss on log-probs


def np_loss_weights(mask, loss_type, max_new):
    """w with loss = sum(w * per-token loss), per the aggregation rules."""
    n = mask.shape[0]
    if loss_type == "grpo":
        return mask / mask.sum(1, keepdims=True) / n
    if loss_type == "dr_grpo":
        return mask / (n * max_new)
    if loss_type in ("turn", "episode"):  # each run of loss tokens (a reply) weighs 1
        w = np.zeros_like(mask)
        for i in range(n):
            j, runs = 0, []
            while j < mask.shape[1]:
                k = j
                while k < mask.shape[1] and mask[i, k] > 0:
                    k += 1
                if k > j:
                    runs.append((j, k))
                j = k + 1
            for j, k in runs:  # split evenly; "episode": the row's replies share one unit
                w[i, j:k] = 1.0 / (k - j) / n / (len(runs) if loss_type == "episode" else 1)
        return w
    return mask / mask.sum()


def np_loss_and_grad(
    logp, old, ref, adv, mask, eps_lo, eps_hi, beta, loss_type, max_new, level="token"
):
    """Value and d loss / d logp, written out by hand (no autodiff)."""
    w = np_loss_weights(mask, loss_type, max_new)
    a = adv[:, None]
    if level == "sequence":  # GSPO: one ratio per row, s_i = exp(mean over mask of log-ratios)
        length = mask.sum(1, keepdims=True)
        ratio = np.exp(((logp - old) * mask).sum(1, keepdims=True) / length)
    else:
        ratio = np.exp(logp - old)
    unclipped = ratio * a
    clipped = np.clip(ratio, 1 - eps_lo, 1 + eps_hi) * a
    surrogate = np.broadcast_to(-np.minimum(unclipped, clipped), logp.shape)
    # The min picks the unclipped term (gradient -A * d ratio) unless the clipped term is
    # smaller, which happens only outside the clip range (gradient 0 there).
    d_surrogate = np.where(unclipped <= clipped, -a * ratio, 0.0)  # d term / d log ratio
    if level == "sequence":
        # Every token of row i carries the same term (total weight W_i = sum_t w_it), and
        # d log s_i / d logp_it = mask_it / |o_i|.
        grad = d_surrogate * w.sum(1, keepdims=True) * mask / length
    else:
        grad = d_surrogate * w
    d = ref - logp
    value = ((surrogate + beta * (np.exp(d) - d - 1)) * w).sum()
    return value, grad + beta * (1 - np.exp(d)) * w


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "turn", "episode"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_loss_and_gradient_match_numpy(loss_type, beta, level):
    rng = np.random.default_rng(1)
    n, c = 12, 7
    logp = -rng.random((n, c)).astype(np.float32) * 3
    # Ratios well outside 1 +- 0.2, per token and (through the row offsets) per sequence.
    drift = rng.normal(0, 0.3, (n, c)) + rng.normal(0, 0.3, (n, 1))
    old = logp + drift.astype(np.float32)
    ref = logp + rng.normal(0, 0.2, (n, c)).astype(np.float32)
    adv = rng.normal(0, 1, n).astype(np.float32)
    mask = (rng.random((n, c)) > 0.3).astype(np.float32)
    mask[:, 0] = 1

    def f(lp):
        tok, *_ = per_token_loss(
            lp, mx.array(old), mx.array(ref), mx.array(adv), 0.2, 0.28, beta, mx.array(mask), level
        )
        return aggregate(tok, mx.array(mask), loss_type, 10)

    value, grad = mx.value_and_grad(f)(mx.array(logp))
    ref_value, ref_grad = np_loss_and_grad(
        logp, old, ref, adv, mask, 0.2, 0.28, beta, loss_type, 10, level
    )
    # Each value is a sum of at most n * c float32 terms.
    assert_f32_close(value.item(), ref_value, n * c, "loss")
    assert_f32_close(np.array(grad) * mask, ref_grad * mask, n * c, "gradient")
    # The test can fail: some tokens (rows, at sequence level) are clipped (zero
    # gradient) and some are not.
    assert (np.array(grad)[mask > 0] == 0).any() == (beta == 0)


def _expected_kl_term(theta0: mx.array, ref: mx.array, beta: float):
    """(gradient at theta0 of beta x the KL term, the logged kl), both as expectations over
    every token of the categorical policy softmax(theta0): each token is one sample,
    weighted by its probability, which is held fixed (on-policy sampling)."""
    p0 = mx.softmax(theta0)

    def f(theta):
        logp = (theta - mx.logsumexp(theta))[:, None]  # [V, 1]
        tok, kl, *_ = per_token_loss(
            logp, mx.stop_gradient(logp), ref[:, None], mx.zeros(len(p0)), 0.2, 0.2, beta
        )
        return (p0 * tok[:, 0]).sum(), (p0 * kl[:, 0]).sum()

    (_, kl), grad = mx.value_and_grad(f)(theta0)
    return grad, kl


def test_the_kl_term_on_the_policys_own_samples_follows_the_gradient_of_its_kl():
    """In expectation over the policy's samples, beta x the k3 term's gradient is that
    of the forward KL(ref || pi) in closed form, not the reverse KL(pi || ref)'s; the
    logged `kl` (k3) has the expectation KL(pi || ref)."""
    rng = np.random.default_rng(7)
    v, beta = 6, 0.5
    theta0 = mx.array(rng.normal(0, 2, v).astype(np.float32))
    ref = mx.array(rng.normal(0, 2, v).astype(np.float32))
    ref = ref - mx.logsumexp(ref)

    def forward(theta):
        return beta * (mx.exp(ref) * (ref - theta + mx.logsumexp(theta))).sum()

    def reverse(theta):
        logp = theta - mx.logsumexp(theta)
        return beta * (mx.exp(logp) * (logp - ref)).sum()

    grad, kl = _expected_kl_term(theta0, ref, beta)
    # Each is a sum of V terms after a V-term log-sum-exp.
    assert_f32_close(grad, mx.grad(forward)(theta0), 2 * v, "k3")
    other = mx.grad(reverse)(theta0)
    assert np.abs(np.array(grad - other)).max() > 0.1 * np.abs(np.array(grad)).max()
    logp0 = theta0 - mx.logsumexp(theta0)
    assert_f32_close(kl, (mx.softmax(theta0) * (logp0 - ref)).sum(), 2 * v, "kl")


def test_the_loss_adds_beta_times_k3_and_loss_policy_leaves_it_out():
    """The loss and its gradient are the hand-written ones at the config's beta;
    `loss/policy` leaves the KL term out and `kl` is the k3 estimate."""
    rng = np.random.default_rng(3)
    n, c = 8, 5
    logp = -rng.random((n, c)).astype(np.float32) * 3
    ref = logp + rng.normal(0, 0.5, (n, c)).astype(np.float32)
    adv = rng.normal(0, 1, n).astype(np.float32)
    mask = (rng.random((n, c)) > 0.3).astype(np.float32)
    mask[:, 0] = 1
    cfg = GRPOConfig(num_generations=4, beta=0.7, loss_type="dapo")
    batch = LossInputs(
        prompts=[],
        completions=mx.zeros((n, c), mx.int32),
        mask=mx.array(mask),
        advantages=mx.array(adv),
        old_logprobs=None,
        ref_logprobs=mx.array(ref),
        max_new_tokens=c,
    )

    def f(lp):
        return objective(lp, mx.zeros((n, c)), batch, cfg)

    (value, metrics), grad = mx.value_and_grad(f)(mx.array(logp))
    d = (ref - logp).astype(np.float64)
    want, want_grad = np_loss_and_grad(logp, logp, ref, adv, mask, 0.2, 0.2, 0.7, "dapo", c)
    assert_f32_close(value.item(), want, n * c, "loss")
    assert_f32_close(np.array(grad) * mask, want_grad * mask, n * c, "gradient")
    policy, _ = np_loss_and_grad(logp, logp, ref, adv, mask, 0.2, 0.2, 0.0, "dapo", c)
    assert_f32_close(metrics["loss/policy"].item(), policy, n * c, "loss/policy")
    k3 = (mask * (np.exp(d) - d - 1)).sum() / mask.sum()
    assert_f32_close(metrics["kl"].item(), k3, n * c, "kl")
    # The KL part is more than rounding: the checks can fail.
    assert abs(want - policy) > 1e-3 * abs(want)


def test_turn_loss_is_grpo_for_single_turn_completions():
    rng = np.random.default_rng(4)
    tok = mx.array(rng.normal(size=(5, 9)).astype(np.float32))
    mask = np.zeros((5, 9), np.float32)
    for i, n in enumerate([9, 3, 1, 6, 4]):
        mask[i, :n] = 1  # one reply each: a run of loss tokens from the start
    a = aggregate(tok, mx.array(mask), "turn", 9).item()
    b = aggregate(tok, mx.array(mask), "grpo", 9).item()
    assert abs(a - b) <= 1e-6 * max(1.0, abs(b))


def test_clip_fraction_counts_clipped_tokens():
    logp = mx.array([[0.0, 0.0, 0.0]])
    old = mx.array([[-0.5, 0.0, 0.5]])  # ratios e^0.5 > 1.2, 1, e^-0.5 < 0.8
    _, _, clipped_pos, _ = per_token_loss(logp, old, None, mx.array([1.0]), 0.2, 0.2, 0.0)
    _, _, clipped_neg, _ = per_token_loss(logp, old, None, mx.array([-1.0]), 0.2, 0.2, 0.0)
    assert np.array(clipped_pos).tolist() == [[True, False, False]]
    assert np.array(clipped_neg).tolist() == [[False, False, True]]


def test_sequence_ratio_is_the_exp_of_the_mean_token_log_ratio_over_the_mask():
    logp = mx.array([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    old = mx.array([[-0.3, 0.0, 0.6, 9.0], [-0.1, -0.1, 5.0, 5.0]])
    mask = mx.array([[1.0, 1, 1, 0], [1, 1, 0, 0]])  # the 9.0 and 5.0 are padding
    adv = mx.array([1.0, 1.0])
    _, _, clipped, ratio = per_token_loss(logp, old, None, adv, 0.2, 0.2, 0.0, mask, "sequence")
    np.testing.assert_allclose(np.array(ratio)[:, 0], np.exp([-0.1, 0.1]), rtol=1e-6)
    assert np.array(clipped).tolist() == [[False], [False]]
    _, _, clipped, _ = per_token_loss(logp, old, None, adv, 0.05, 0.05, 0.0, mask, "sequence")
    assert np.array(clipped).tolist() == [[False], [True]]  # 1.105 > 1.05 with A > 0


# ---------------------------------------------------------------- log-probs from the model


def np_log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _groups(seed=2, prompt_lens=(5, 9), g=3, max_c=6):
    """B prompts of different lengths and G right-padded completions for each."""
    rng = np.random.default_rng(seed)
    prompts = [mx.array(rng.integers(3, 200, size=p).tolist()) for p in prompt_lens]
    n = len(prompt_lens) * g
    lens = rng.integers(1, max_c + 1, size=n)
    lens[0] = max_c
    comp = np.zeros((n, max_c), dtype=np.int32)
    for i, k in enumerate(lens):
        comp[i, :k] = rng.integers(3, 200, size=k)
    return prompts, mx.array(comp), lens


@pytest.fixture(params=["packed-native", "packed", "per-group"])
def tiny_lp(request, tiny, monkeypatch):
    """The tiny llama through each of `completion_logprobs`' passes: packed, its attention
    the native op (`mlx_grpo.cpu.native`, where it builds on a Linux CPU) or MLX's ops
    (`fastmath.attention`, everywhere else), or group by group (mlx_lm's)."""
    model, tokenizer = tiny
    took = []  # per call of the native op: whether it computed (not fell back)
    if request.param == "packed-native":
        if native.module() is None:
            pytest.skip(f"no native packed attention here: {native.why()}")
        real = native.packed_attention

        def counted(*args):
            out = real(*args)
            took.append(out is not None)
            return out

        monkeypatch.setattr(native, "packed_attention", counted)
    if request.param == "packed":
        monkeypatch.setattr(native, "packed_attention", lambda *args: None)
    if request.param.startswith("packed"):
        use_fast_attention(model)
    assert _packable(model) == request.param.startswith("packed")
    yield model, tokenizer
    assert all(took)  # the native path did not fall back to MLX's ops


def test_completion_logprobs_match_full_logits(tiny_lp):
    model, _ = tiny_lp
    prompts, comp, lens = _groups()
    lp, ent = completion_logprobs(model, prompts, comp)
    g = comp.shape[0] // len(prompts)
    for i in range(comp.shape[0]):
        p = np.array(prompts[i // g]).tolist()
        row = p + np.array(comp[i, : lens[i]]).tolist()
        full = np_log_softmax(np.array(model(mx.array(row)[None])[0]))
        for j in range(lens[i]):
            assert abs(lp[i, j].item() - full[len(p) + j - 1, row[len(p) + j]]) < 1e-4
            h = -(np.exp(full[len(p) + j - 1]) * full[len(p) + j - 1]).sum()
            assert abs(ent[i, j].item() - h) < 1e-3


def test_logprob_gradients_equal_full_passes_through_mlx_log_softmax(tiny_lp):
    """One prompt pass shared by the group (and the written-out gradient of the
    log-softmax) gives the values and gradients of G full passes of the model through
    MLX's own logsumexp and its chain rule."""
    model, _ = tiny_lp
    assert splittable(model)  # the shared-prompt path is the one under test
    apply_lora(model, LoRAConfig(rank=4), seed=5)
    _randomize_lora_b(model)
    prompts, comp, weights, mask = _weighted_groups(seed=5)

    def shared(m):
        return (completion_logprobs(m, prompts, comp)[0] * weights * mask).sum()

    _assert_full_pass_value_and_gradients(model, shared, prompts, comp, weights, mask)


def _weighted_groups(seed: int):
    """`_groups(seed)` as (prompts, completions, per-token weights in -2..2, the mask of
    each row's own length): what the full-pass comparisons weigh their log-probs by."""
    prompts, comp, lens = _groups(seed=seed)
    weights = mx.array((np.arange(comp.size).reshape(comp.shape) % 5 - 2).astype(np.float32))
    mask = mx.array((np.arange(comp.shape[1])[None] < lens[:, None]).astype(np.float32))
    return prompts, comp, weights, mask


def _assert_full_pass_value_and_gradients(model, loss, prompts, comp, weights, mask):
    """loss(model) (a value, or (value, aux)) and its gradients equal `_full_passes`'
    within float32 rounding, and some gradient is not 0; returns aux."""
    out, g1 = nn.value_and_grad(model, loss)(model)
    v1, aux = out if isinstance(out, tuple) else (out, None)
    v2, g2 = nn.value_and_grad(model, lambda m: _full_passes(m, prompts, comp, weights, mask))(
        model
    )
    n = tiny_additions(vars(model.args))
    assert_f32_close(v1, v2, n, "value")
    for (k, a), (_, b) in zip(tree_flatten(g1), tree_flatten(g2)):
        assert_f32_close(a, b, n, k)
    assert any(mx.abs(a).max().item() > 0 for _, a in tree_flatten(g1))
    return aux


def _full_passes(m, prompts, comp, weights, mask):
    """sum of weights * mask * log p(token) over every completion token, each row a full
    pass of the model through MLX's own logsumexp: the reference of the shared passes."""
    g = comp.shape[0] // len(prompts)
    total = mx.array(0.0)
    for i in range(comp.shape[0]):
        p = prompts[i // g]
        logits = m(mx.concatenate([p, comp[i]])[None])[0, p.shape[0] - 1 : -1]
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        picked = mx.take_along_axis(lp, comp[i][:, None], axis=-1)[:, 0]
        total = total + (picked * weights[i] * mask[i]).sum()
    return total


def test_a_model_the_split_passes_cannot_take_runs_full_sequences_alike(tiny, monkeypatch):
    """`_full_sequence_logprobs`, the pass of any mlx_lm model that the split passes
    cannot take (sliding windows, SSM state; here the tiny llama said to be one): the
    log-probs and entropies of the group pass, its gradients (the entropies carry none
    in either: they are only logged), and the value and gradients of per-row full passes
    through MLX's own log-softmax, within float32 rounding."""
    model, _ = tiny
    apply_lora(model, LoRAConfig(rank=4), seed=5)
    _randomize_lora_b(model)
    prompts, comp, weights, mask = _weighted_groups(seed=3)

    def weighted(m):
        lp, ent = completion_logprobs(m, prompts, comp)
        return ((lp + ent) * weights * mask).sum(), (lp, ent)

    def entropies(m):
        return (completion_logprobs(m, prompts, comp)[1] * weights * mask).sum()

    def no_gradient(m):
        grads = nn.value_and_grad(m, entropies)(m)[1]
        return all(not np.array(a).any() for _, a in tree_flatten(grads))

    (v_split, (lp_split, ent_split)), g_split = nn.value_and_grad(model, weighted)(model)
    assert no_gradient(model)
    ran, real = [], logprobs._full_sequence_logprobs

    def counted(*args, **kwargs):
        ran.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(logprobs, "splittable", lambda m: False)
    monkeypatch.setattr(logprobs, "_full_sequence_logprobs", counted)
    (v_full, (lp_full, ent_full)), g_full = nn.value_and_grad(model, weighted)(model)
    assert ran and no_gradient(model)
    n = tiny_additions(vars(model.args))
    assert_f32_close(lp_full, lp_split, n, "log-probs")
    assert_f32_close(ent_full, ent_split, n, "entropies")
    assert_f32_close(v_full, v_split, n, "value")
    for (k, a), (_, b) in zip(tree_flatten(g_full), tree_flatten(g_split)):
        assert_f32_close(a, b, n, k)

    def log_probs_only(m):
        return (completion_logprobs(m, prompts, comp)[0] * weights * mask).sum()

    _assert_full_pass_value_and_gradients(model, log_probs_only, prompts, comp, weights, mask)


def _alike_openings():
    """Two groups of four rows, some opening with an earlier row's tokens, as episodes
    of a multi-turn group that take the same first actions do: row 1 departs from row 0
    after 5 tokens; row 2 from row 1 after 7 (5 of them row 0's); row 3 is row 0's
    first 7 tokens; rows 5 and 7 open with row 4's first 4. The loss mask has holes (the
    environment's tokens) and ends at each row's length."""
    rng = np.random.default_rng(8)
    prompts = [mx.array(rng.integers(3, 200, size=p).tolist()) for p in (5, 9)]
    comp = rng.integers(3, 200, size=(8, 10)).astype(np.int32)
    comp[1, :5] = comp[0, :5]
    comp[2, :7] = comp[1, :7]
    comp[3, :7] = comp[0, :7]
    comp[5, :4] = comp[7, :4] = comp[4, :4]
    lens = np.array([10, 9, 10, 7, 10, 8, 6, 10])
    cols = np.arange(10)[None]
    comp[cols >= lens[:, None]] = 0
    mask = (cols < lens[:, None]) & ((cols % 4 != 2) | (cols == lens[:, None] - 1))
    return prompts, mx.array(comp), mx.array(mask.astype(np.float32))


def test_rows_that_open_alike_share_positions_and_give_full_pass_values_and_gradients(
    tiny_lp, monkeypatch
):
    """A row whose first inputs are an earlier row's of its group takes their positions
    in the packed pass (and a row that shares a departing row's takes those of both)
    instead of running them again: the same log-probs and gradients as full passes of
    every row, within float32 rounding."""
    model, _ = tiny_lp
    monkeypatch.setattr(logprobs, "MIN_SHARED_INPUTS", 2)
    apply_lora(model, LoRAConfig(rank=4), seed=6)
    _randomize_lora_b(model)
    prompts, comp, mask = _alike_openings()
    lengths = effective_lengths(mask)
    shared = shared_inputs(np.array(comp), lengths, 4)
    assert shared == [None, (0, 5), (1, 7), (0, 6), None, (4, 4), None, (4, 4)]
    layout = _Packed([5, 9], 4, lengths, shared)
    inputs = sum(n - 1 for n in lengths)
    assert layout.offset.shape[0] == 5 + 9 + inputs - (5 + 7 + 6 + 4 + 4)
    weights = mx.array((np.arange(comp.size).reshape(comp.shape) % 5 - 2).astype(np.float32))

    def packed(m):
        lp, ent = completion_logprobs(m, prompts, comp, mask=mask)
        return (lp * weights * mask).sum(), lp * mask

    lp1 = _assert_full_pass_value_and_gradients(model, packed, prompts, comp, weights, mask)
    monkeypatch.setattr(logprobs, "MIN_SHARED_INPUTS", 1 << 30)  # every row its own positions
    (_, lp_apart), _ = nn.value_and_grad(model, packed)(model)
    n = tiny_additions(vars(model.args))
    assert_f32_close(lp1, lp_apart, n, "log-probs shared and apart")


def test_rows_share_no_positions_while_lora_dropout_draws(tiny, monkeypatch):
    """Under LoRA dropout each position draws its own mask, so no row takes another's
    positions while training; in evaluation (no draws) the same rows share."""
    model, _ = tiny
    use_fast_attention(model)
    monkeypatch.setattr(logprobs, "MIN_SHARED_INPUTS", 2)
    apply_lora(model, LoRAConfig(rank=4, dropout=0.3), seed=6)
    prompts, comp, mask = _alike_openings()
    seen = []
    real = _Packed.__init__

    def spy(self, prompt_lens, g, lengths, shared=None):
        seen.append(shared)
        real(self, prompt_lens, g, lengths, shared)

    monkeypatch.setattr(_Packed, "__init__", spy)
    model.train()
    completion_logprobs(model, prompts, comp, mask=mask)
    assert not logprobs.shares_inputs(model)  # what micro-batches are cut by
    model.eval()
    completion_logprobs(model, prompts, comp, mask=mask)
    assert logprobs.shares_inputs(model)
    assert seen[0] == [None] * 8
    assert seen[1] == [None, (0, 5), (1, 7), (0, 6), None, (4, 4), None, (4, 4)]


def test_chunked_logprobs_and_gradients_equal_unchunked(tiny_lp):
    model, _ = tiny_lp
    apply_lora(model, LoRAConfig(rank=4), seed=3)
    _randomize_lora_b(model)
    prompts, comp, _ = _groups(seed=3)

    def f(m, chunk):
        lp, _ = completion_logprobs(m, prompts, comp, chunk)
        return (lp * mx.arange(comp.shape[1])).sum()

    whole, g1 = nn.value_and_grad(model, lambda m: f(m, 1 << 24))(model)
    # vocab 259, 6 positions: one row per chunk
    parts, g2 = nn.value_and_grad(model, lambda m: f(m, 6 * 259))(model)
    n = tiny_additions(vars(model.args))
    assert_f32_close(whole, parts, n, "value")
    for (k, a), (_, b) in zip(tree_flatten(g1), tree_flatten(g2)):
        assert_f32_close(a, b, n, k)


def test_sparse_mask_head_matches_the_dense_head_values_and_gradients(tiny_lp):
    """Multi-turn masks (a few model tokens between long observations): the head runs
    only at the mask's positions and gives the dense path's values and gradients there."""
    model, _ = tiny_lp
    apply_lora(model, LoRAConfig(rank=4), seed=4)
    _randomize_lora_b(model)
    prompts, comp, lens = _groups(seed=4)
    c = comp.shape[1]
    turns = (np.arange(c) % 5 < 1)[None] & (np.arange(c)[None] < lens[:, None])
    turns[1] = False  # a row with nothing in the loss
    mask = mx.array(turns.astype(np.float32))
    assert 0 < turns.mean() < SPARSE_HEAD_SHARE
    weights = mx.array((np.arange(comp.size).reshape(comp.shape) % 5 - 2).astype(np.float32))

    def run(m, sparse):
        lp, ent = completion_logprobs(m, prompts, comp, mask=mask if sparse else None)
        return (lp * weights * mask).sum(), (lp * mask, ent * mask)

    (v1, (lp1, e1)), g1 = nn.value_and_grad(model, lambda m: run(m, True))(model)
    (v2, (lp2, e2)), g2 = nn.value_and_grad(model, lambda m: run(m, False))(model)
    n = tiny_additions(vars(model.args))
    for what, a, b in [("logprobs", lp1, lp2), ("entropy", e1, e2), ("value", v1, v2)]:
        assert_f32_close(a, b, n, what)
    for (k, a), (_, b) in zip(tree_flatten(g1), tree_flatten(g2)):
        assert_f32_close(a, b, n, k)
    assert any(mx.abs(a).max().item() > 0 for _, a in tree_flatten(g1))
    lp_sparse, _ = completion_logprobs(model, prompts, comp, mask=mask)
    assert (np.array(lp_sparse)[~turns] == 0).all()  # off the mask: not computed


def test_prompt_and_padding_tokens_do_not_enter_the_loss(tiny_lp):
    model, _ = tiny_lp
    apply_lora(model, LoRAConfig(rank=4), seed=4)
    _randomize_lora_b(model)
    prompts = [mx.array([5, 6, 7]), mx.array([11, 12])]
    comp = np.array([[8, 9, 10], [8, 9, 0], [13, 14, 0], [15, 16, 17]], dtype=np.int32)
    mask = mx.array([[1.0, 1, 1], [1, 1, 0], [1, 1, 0], [1, 1, 1]])
    cfg = GRPOConfig(beta=0.0, epsilon=0.99, epsilon_high=100.0)

    def loss_of(c):
        # old log-probs of 0 make the ratio exp(logp), so the value depends on them
        adv = mx.array([1.0, -1.0, 0.5, -0.5])
        batch = LossInputs(prompts, mx.array(c), mask, adv, mx.zeros((4, 3)), None, 3)
        return grpo_loss(model, batch, cfg)[0].item()

    base = loss_of(comp)
    padded = comp.copy()
    padded[1, 2] = padded[2, 2] = 77  # padding
    assert loss_of(padded) == pytest.approx(base, abs=1e-6)
    changed = comp.copy()
    changed[0, 1] = 99  # a completion token
    assert abs(loss_of(changed) - base) > 1e-4


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "turn", "episode"])
def test_rank_shares_with_global_counts_sum_to_the_whole_batch(tiny, loss_type, level):
    """Data-parallel runs: two shares of a batch (uneven token counts), each divided
    by the whole batch's counts, add up to the whole batch's loss, metrics and
    gradient; divided by their own counts they do not."""
    model, _ = tiny
    apply_lora(model, LoRAConfig(rank=4), seed=4)
    _randomize_lora_b(model)
    prompts = [mx.array([5, 6, 7]), mx.array([11, 12]), mx.array([3, 4, 5, 6])]
    comp = mx.array(np.random.default_rng(0).integers(3, 200, (6, 5)), dtype=mx.int32)
    mask = mx.array(
        [[1.0, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]]
        + [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    )
    adv = mx.array([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    old = mx.array(np.random.default_rng(1).normal(-5, 1, (6, 5)).astype(np.float32))
    cfg = GRPOConfig(
        beta=0.04, loss_type=loss_type, epsilon_high=0.28, importance_sampling_level=level
    )
    grad_fn = nn.value_and_grad(model, lambda m, b: grpo_loss(m, b, cfg))

    def run(rows, groups, **totals):
        ref = mx.zeros((len(rows), 5)) - 4.0
        batch = LossInputs(
            [prompts[g] for g in groups], comp[rows], mask[rows], adv[rows], old[rows], ref, 5
        )
        for k, v in totals.items():
            setattr(batch, k, v)
        (loss, m), grads = grad_fn(model, batch)
        return {"loss": loss, **m}, dict(tree_flatten(grads))

    whole, g_whole = run(list(range(6)), [0, 1, 2])
    totals = {"total_rows": 6, "total_tokens": mask.sum().item()}
    a, g_a = run([0, 1], [0], **totals)
    b, g_b = run([2, 3, 4, 5], [1, 2], **totals)
    n = tiny_additions(vars(model.args))
    for k in whole:
        assert_f32_close(a[k] + b[k], whole[k], n, k)
    for k in g_whole:
        assert_f32_close(g_a[k] + g_b[k], g_whole[k], n, k)
    a_own, _ = run([0, 1], [0])
    b_own, _ = run([2, 3, 4, 5], [1, 2])
    assert abs((a_own["loss"] + b_own["loss"]).item() - whole["loss"].item()) > 1e-3


def _three_groups():
    """Three groups of 4 rows of 9 tokens on prompts of 4, 7 and 3 tokens, row lengths
    9, 2, 5, 1 | 3, 3, 8, 6 | 9, 9, 9, 9 (group costs, prompt + row lengths: 21, 27, 39),
    a random mask ending at each row's last token, and advantages; and the rng, to draw
    more from."""
    rng = np.random.default_rng(3)
    prompts = [mx.array(rng.integers(3, 200, p).tolist()) for p in (4, 7, 3)]
    g, c = 4, 9
    comp = mx.array(rng.integers(3, 200, (3 * g, c)), dtype=mx.int32)
    lens = [9, 2, 5, 1, 3, 3, 8, 6, 9, 9, 9, 9]
    mask = np.zeros((3 * g, c), np.float32)
    for i, n in enumerate(lens):
        mask[i, :n] = rng.random(n) < 0.7
        mask[i, n - 1] = 1.0
    adv = mx.array(rng.normal(size=3 * g).astype(np.float32))
    return prompts, comp, mask, adv, rng


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "turn", "episode"])
def test_micro_batches_give_the_whole_batch_loss_metrics_and_gradient(tiny_lp, loss_type, level):
    """The update split into micro-batches (whole groups together, a long group cut
    into runs of rows) sums to the one-piece update: loss, metrics and gradient."""
    from mlx_grpo.dist import Dist
    from mlx_grpo.update import policy_gradient

    model, _ = tiny_lp
    apply_lora(model, LoRAConfig(rank=4), seed=5)
    _randomize_lora_b(model, seed=1)
    prompts, comp, mask, adv, rng = _three_groups()
    g, c = 4, 9
    old = mx.array(rng.normal(-5, 1, (3 * g, c)).astype(np.float32))
    ref = mx.array(rng.normal(-5, 1, (3 * g, c)).astype(np.float32))
    batch = LossInputs(prompts, comp, mx.array(mask), adv, old, ref, c)
    cfg = GRPOConfig(
        beta=0.04, loss_type=loss_type, epsilon_high=0.28, importance_sampling_level=level
    )
    grad_fn = nn.value_and_grad(model, lambda m, b: grpo_loss(m, b, cfg))

    # Group costs (prompt + row lengths): 21, 27, 39. At 30 positions groups 0 and 1
    # go alone and group 2 is cut into runs of rows: 3 + 9 + 9 + 9, then 3 + 9.
    pieces = micro_batches(batch, 30)
    assert [len(p.prompts) for p in pieces] == [1, 1, 1, 1]
    assert [p.completions.shape[0] for p in pieces] == [4, 4, 3, 1]
    assert all(p.total_rows == 12 and p.total_tokens == mask.sum() for p in pieces)
    assert len(micro_batches(batch, 50)) == 2  # groups 0 and 1 together, then group 2
    assert micro_batches(batch, 87)[0] is batch

    def update(max_positions):
        loss, m, grads, norm, _ = policy_gradient(model, grad_fn, batch, Dist(), 1e9, max_positions)
        return {"loss": loss, **m}, dict(tree_flatten(grads))

    whole, g_whole = update(None)
    n = tiny_additions(vars(model.args))
    for budget in (30, 50):
        split, g_split = update(budget)
        for k in whole:
            assert_f32_close(split[k], whole[k], n, k)
        for k in g_whole:
            assert_f32_close(g_split[k], g_whole[k], n, k)


def test_micro_batches_count_a_group_by_the_positions_its_rows_do_not_share(monkeypatch):
    """A group whose rows open alike runs fewer positions (`logprobs.shared_inputs`), and
    micro-batches are cut by what the packed pass runs: prompt, then each row up to its
    last loss token less what it shares."""
    monkeypatch.setattr(logprobs, "MIN_SHARED_INPUTS", 2)
    prompts, comp, mask = _alike_openings()
    batch = LossInputs(prompts, comp, mask, mx.zeros(8), None, None, 10)
    lengths = effective_lengths(mask)  # [10, 9, 10, 7] and [10, 8, 6, 10]
    assert group_positions(batch, lengths) == [5 + 36 - (5 + 7 + 6), 9 + 34 - (4 + 4)]
    assert micro_batches(batch, 58)[0] is batch
    # a pass that shares nothing (dropout draws, the compiled loss) counts every row whole
    assert group_positions(batch, lengths, share=False) == [41, 43]
    assert [len(p.prompts) for p in micro_batches(batch, 58, share=False)] == [1, 1]
    monkeypatch.setattr(logprobs, "MIN_SHARED_INPUTS", 1 << 30)
    assert group_positions(batch, lengths) == [41, 43]
    assert [len(p.prompts) for p in micro_batches(batch, 58)] == [1, 1]


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "turn"])
def test_lanes_give_the_whole_batch_reference_loss_metrics_and_gradient(tiny_lp, loss_type):
    """The update with a micro-batch's pieces side by side on streams of their own
    (`device.Lanes`: runs of whole groups, or runs of a group's rows) gives the
    one-lane update's reference log-probs, loss, metrics and gradient; each piece's graph
    is built on its own stream."""
    from mlx_grpo.device import Lanes
    from mlx_grpo.dist import Dist
    from mlx_grpo.update import policy_gradient, reference_pass

    model, _ = tiny_lp
    apply_lora(model, LoRAConfig(rank=4), seed=5)
    _randomize_lora_b(model, seed=1)
    prompts, comp, mask, adv, _ = _three_groups()
    g, c = 4, 9
    cfg = GRPOConfig(beta=0.04, loss_type=loss_type)
    grad_fn = nn.value_and_grad(model, lambda m, b: grpo_loss(m, b, cfg))

    def batch(groups):
        rows = [gi * g + j for gi in groups for j in range(g)]
        take = mx.array(rows)
        return LossInputs(
            [prompts[i] for i in groups], comp[take], mx.array(mask[rows]), adv[take], None, None, c
        )

    # Group costs (prompt + row lengths) 21, 27, 39: two lanes take groups 0 and 1, then
    # group 2; a lone group goes in runs of its rows (row lengths 9, 9, 9, 9: 2 and 2).
    assert [p.completions.shape[0] for p in lane_pieces(batch([0, 1, 2]), 2)] == [8, 4]
    assert [p.completions.shape[0] for p in lane_pieces(batch([2]), 2)] == [2, 2]
    assert [len(p.prompts) for p in lane_pieces(batch([0, 1, 2]), 3)] == [1, 1, 1]
    assert lane_pieces(batch([0, 1, 2]), 1)[0].completions.shape[0] == 12

    seen = []

    def on_stream(piece):
        seen.append(mx.default_stream(mx.default_device()))
        return piece.completions.sum()

    Lanes(2).map(on_stream, lane_pieces(batch([0, 1, 2]), 2))
    assert len(seen) == 2 and seen[0] != seen[1]
    assert mx.default_stream(mx.default_device()) not in seen

    n = tiny_additions(vars(model.args))
    for groups in ([0, 1, 2], [2]):
        out = {}
        for lanes in (1, 2, 3):
            b = batch(groups)
            reference_pass(model, b, cfg, None, Lanes(lanes))
            loss, m, grads, _, _ = policy_gradient(model, grad_fn, b, Dist(), 1e9, 30, Lanes(lanes))
            out[lanes] = b.ref_logprobs, {"loss": loss, **m}, dict(tree_flatten(grads))
        ref_one, one, g_one = out[1]
        for lanes in (2, 3):
            ref, split, g_split = out[lanes]
            assert_f32_close(ref, ref_one, n, "ref_logprobs")
            for k in one:
                assert_f32_close(split[k], one[k], n, k)
            for k in g_one:
                assert_f32_close(g_split[k], g_one[k], n, k)


def test_two_lanes_by_default_only_on_a_cpu_with_two_blas_threads_and_a_wide_evaluation(
    monkeypatch,
):
    """`auto_lanes`: lanes pay where a second core would wait, and only where MLX
    evaluates them side by side; a narrow evaluation order would queue them one after
    the other, each on half the BLAS threads."""
    from types import SimpleNamespace

    from mlx_grpo.cpu import blas as blaslib
    from mlx_grpo.cpu.lanes import EVAL_WIDTH, auto_lanes
    from mlx_grpo.device import update_lanes

    prev = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        cases = [  # (BLAS threads or no BLAS of ours, MLX_BFS_MAX_WIDTH or unset, lanes)
            (2, str(EVAL_WIDTH), 2),
            (8, "4096", 2),
            (2, None, 1),
            (2, "20", 1),
            (2, "wide", 1),
            (1, str(EVAL_WIDTH), 1),
            (None, str(EVAL_WIDTH), 1),
        ]
        for threads, width, want in cases:
            blas = None if threads is None else SimpleNamespace(threads=threads)
            monkeypatch.setitem(blaslib.state, "blas", blas)
            if width is None:
                monkeypatch.delenv("MLX_BFS_MAX_WIDTH", raising=False)
            else:
                monkeypatch.setenv("MLX_BFS_MAX_WIDTH", width)
            assert auto_lanes() == want, (threads, width)
            assert update_lanes(None).n == want
            assert update_lanes(None, compiled=True).n == 1
            assert update_lanes(3).n == 3
    finally:
        mx.set_default_device(prev)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "turn", "episode"])
def test_folded_alike_rows_give_the_loss_metrics_and_gradient_of_every_row(tiny, loss_type, level):
    """update.fold_alike_rows: a group's alike rows (the same episode) folded into one
    row of mask k give the loss, metrics and gradient of all of them, under every loss
    type; rows that differ in a token, the mask, the advantage or the kind (a
    demonstration) are not folded, and an empty row stays empty."""
    from mlx_grpo.dist import Dist
    from mlx_grpo.logprobs import completion_logprobs
    from mlx_grpo.update import fold_alike_rows, policy_gradient

    model, _ = tiny
    apply_lora(model, LoRAConfig(rank=4), seed=5)
    _randomize_lora_b(model, seed=1)
    rng = np.random.default_rng(4)
    prompts = [mx.array(rng.integers(3, 200, p).tolist()) for p in (4, 7, 5)]
    g, c = 4, 9
    comp = rng.integers(3, 200, (3 * g, c)).astype(np.int32)
    mask = np.zeros((3 * g, c), np.float32)
    for i, n in enumerate([9, 5, 7, 3, 8, 8, 8, 8, 6, 6, 6, 6]):
        mask[i, :n] = rng.random(n) < 0.7
        mask[i, n - 1] = 1.0
    adv = rng.normal(size=3 * g).astype(np.float32)
    old = rng.normal(-5, 1, (3 * g, c)).astype(np.float32)
    ref = rng.normal(-5, 1, (3 * g, c)).astype(np.float32)
    adv[0], old[0] = abs(adv[0]) + 0.1, old[0] - 2.0  # row 0 clipped, token and sequence

    def same(i, j):
        comp[i], mask[i], adv[i], old[i], ref[i] = comp[j], mask[j], adv[j], old[j], ref[j]

    for i in (1, 2, 3):  # group 0: rows 0, 1, 3 alike; 2 another mask
        same(i, 0)
    mask[2, 1] = 1.0 - mask[2, 1]
    for i in (5, 6, 7):  # group 1: 4, 5 alike; 6 another token; 7 another advantage
        same(i, 4)
    comp[6, 2] += 1
    adv[7] += 0.5
    for i in (9, 10):  # group 2: 8, 9 alike; 10 a demonstration; 11 empty
        same(i, 8)
    mask[11] = 0.0
    demos = [0.0] * 10 + [1.0, 0.0]
    cfg = GRPOConfig(
        beta=0.04, loss_type=loss_type, epsilon_high=0.28, importance_sampling_level=level
    )
    grad_fn = nn.value_and_grad(model, lambda m, b: grpo_loss(m, b, cfg))

    def update(m):
        batch = LossInputs(
            prompts, mx.array(comp), mx.array(m), mx.array(adv), mx.array(old), mx.array(ref), c
        )
        loss, metrics, grads, _, _ = policy_gradient(model, grad_fn, batch, Dist(), 1e9, None)
        return {"loss": loss, **metrics}, dict(tree_flatten(grads))

    whole, g_whole = update(mask)
    folded_mask = mask.copy()
    assert fold_alike_rows(comp, folded_mask, adv, demos, g) == 4
    assert folded_mask.max(axis=1).tolist() == [3, 0, 1, 0, 2, 0, 1, 1, 2, 0, 1, 0]
    folded, g_folded = update(folded_mask)
    assert whole["clip/frac"] > 0
    n = tiny_additions(vars(model.args))
    for k in whole:
        assert_f32_close(folded[k], whole[k], n, k)
    for k in g_whole:
        assert_f32_close(g_folded[k], g_whole[k], n, k)
    if level == "sequence":  # TRL's mean over completions, an empty one at ratio 1
        logp = np.array(completion_logprobs(model, prompts, mx.array(comp))[0], np.float64)
        tokens = mask.sum(axis=1)
        log_ratio = ((logp - old) * mask).sum(axis=1) / np.maximum(tokens, 1)
        expected = np.where(tokens > 0, np.exp(log_ratio), 1.0).mean()
        assert_f32_close(folded["ratio/mean"], expected, n, "ratio/mean")


# ---------------------------------------------------------------- LoRA and the reference


def _randomize_lora_b(model, seed=0):
    mx.random.seed(seed)
    for _, m in model.named_modules():
        if hasattr(m, "lora_b"):
            m.lora_b = mx.random.normal(m.lora_b.shape) * 0.05
    mx.eval(model.parameters())


def test_only_lora_parameters_train(tiny):
    model, _ = tiny
    apply_lora(model, LoRAConfig(rank=4, num_layers=1, keys=["self_attn.q_proj"]), seed=0)
    names = [k for k, _ in tree_flatten(model.trainable_parameters())]
    assert names == [
        "model.layers.1.self_attn.q_proj.lora_a",
        "model.layers.1.self_attn.q_proj.lora_b",
    ]
    assert trainable_count(model) == 64 * 4 + 4 * 64


def test_reference_equals_base_model(tiny, tiny_model_dir):
    from mlx_lm import load

    model, _ = tiny
    base, _ = load(str(tiny_model_dir))
    apply_lora(model, LoRAConfig(rank=4), seed=0)
    _randomize_lora_b(model)
    x = mx.array([[5, 6, 7, 8, 9]])
    with adapters_disabled(model):
        ref = model(x)
    assert mx.allclose(ref, base(x), atol=1e-6).item()
    assert not mx.allclose(model(x), base(x), atol=1e-3).item()  # adapters are back on


def test_folded_adapters_sample_the_same_policy_and_unfold_exactly(tiny):
    from mlx_lm.tuner.lora import LoRALinear

    model, _ = tiny
    apply_lora(model, LoRAConfig(rank=4), seed=0)
    _randomize_lora_b(model)
    model.eval()
    x = mx.array([[5, 6, 7, 8, 9]])
    before, n_trainable = dict(tree_flatten(model.parameters())), trainable_count(model)
    with adapters_folded(model):
        folded = model(x)
        assert not any(isinstance(m, LoRALinear) for _, m in model.named_modules())
        assert trainable_count(model) == 0  # nothing to train while folded
    # W x + s B (A x) against (W + s B A) x: one more reduction over the rank per layer
    assert_f32_close(folded, model(x), tiny_additions(vars(model.args)), "logits")
    after = dict(tree_flatten(model.parameters()))
    assert before.keys() == after.keys()
    assert all(mx.array_equal(before[k], after[k]).item() for k in before)
    assert trainable_count(model) == n_trainable > 0

    model.train()  # LoRA dropout: nothing is folded
    with adapters_folded(model):
        assert any(isinstance(m, LoRALinear) for _, m in model.named_modules())
    model.eval()
    model.set_dtype(mx.bfloat16)  # 16-bit weights would round the update away
    with adapters_folded(model):
        assert any(isinstance(m, LoRALinear) for _, m in model.named_modules())


def _assert_swap_keeps_the_model(model, swap) -> None:
    """`swap(model)` changes how every block computes, nothing else: the parameter names
    stay (adapters, checkpoints), and logits, loss and LoRA gradients are mlx_lm's up to
    float32 rounding; a second call changes nothing."""
    apply_lora(model, LoRAConfig(rank=4), seed=2)
    _randomize_lora_b(model)
    x = mx.array([[5, 6, 7, 8, 9, 10, 11, 12, 13]])
    names = [k for k, _ in tree_flatten(model.parameters())]

    def loss(m):
        return nn.log_softmax(m(x), axis=-1)[0, :, 3].sum()

    ref_logits = model(x)
    ref_loss, ref_grads = nn.value_and_grad(model, loss)(model)
    assert swap(model) == len(model.layers)
    assert [k for k, _ in tree_flatten(model.parameters())] == names
    fast_loss, fast_grads = nn.value_and_grad(model, loss)(model)
    n = tiny_additions(vars(model.args))
    assert_f32_close(model(x), ref_logits, n, "logits")
    assert_f32_close(fast_loss, ref_loss, n, "loss")
    ref_g, fast_g = dict(tree_flatten(ref_grads)), dict(tree_flatten(fast_grads))
    assert ref_g.keys() == fast_g.keys() and ref_g
    for k in ref_g:
        assert_f32_close(fast_g[k], ref_g[k], n, k)
    assert swap(model) == 0  # already done: nothing left to change


def test_fast_swiglu_keeps_the_model_its_parameters_and_gradients(tiny):
    """use_fast_swiglu changes how each block's MLP computes silu(gate) * up (the
    activation itself is within (16 + |g|) unit roundoffs, test_fastmath; the
    reductions after it are the same)."""
    model, _ = tiny
    _assert_swap_keeps_the_model(model, use_fast_swiglu)
    assert all(
        type(layer.mlp).__call__ is not type(layer.mlp).__mro__[1].__call__
        for layer in model.layers
    )


def test_fast_attention_keeps_the_model_its_parameters_and_gradients(tiny):
    """use_fast_attention changes how each block computes softmax(q k^T) v (the
    attention itself is tested against float64 in test_fastmath)."""
    model, _ = tiny
    _assert_swap_keeps_the_model(model, use_fast_attention)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_fast_attention_gives_each_model_familys_logits_with_a_cache(family):
    """Through a KV cache too (a prompt, then a chunk whose causal mask is offset, then
    one decode step without a mask), for each model family whose attention it takes
    over: the logits of mlx_lm's own layers, up to float32 rounding."""
    import importlib

    from mlx_lm.models.cache import make_prompt_cache

    module = importlib.import_module(f"mlx_lm.models.{family}")
    args = dict(
        model_type=family, hidden_size=48, num_hidden_layers=2, intermediate_size=96,
        num_attention_heads=6, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=64,
        rope_theta=10000.0, max_position_embeddings=128, tie_word_embeddings=True,
        head_dim=8,
    )  # fmt: skip
    fields = module.ModelArgs.__dataclass_fields__
    mx.random.seed(0)
    model = module.Model(module.ModelArgs(**{k: v for k, v in args.items() if k in fields}))
    mx.eval(model.parameters())
    chunks = [mx.array([[1, 2, 3, 4, 5, 6, 7]]), mx.array([[8, 9, 10]]), mx.array([[11]])]

    def run():
        cache = make_prompt_cache(model)
        return [model(c, cache=cache) for c in chunks]

    ref = run()
    assert use_fast_attention(model) == 2
    n = 2 * (2 + 2) * 96  # tiny_additions for this config
    for i, (got, want) in enumerate(zip(run(), ref)):
        assert_f32_close(got, want, n, f"{family} chunk {i}")


def test_length_buckets_match_unbucketed_values_and_gradients(tiny_lp, monkeypatch):
    """Completions run in length buckets (each padded to its own longest row) give the
    log-probs and gradients of one padded batch at every position that counts."""
    import mlx_grpo.logprobs as logprobs

    model, _ = tiny_lp
    apply_lora(model, LoRAConfig(rank=4), seed=6)
    _randomize_lora_b(model)
    prompts, comp, lens = _groups(seed=6, g=4, max_c=7)
    lens = lens.copy()
    lens[5] = 0  # a row with nothing in the loss
    mask = mx.array((np.arange(comp.shape[1])[None] < lens[:, None]).astype(np.float32))
    assert logprobs.effective_lengths(mask) == lens.tolist()
    weights = mx.array((np.arange(comp.size).reshape(comp.shape) % 5 - 2).astype(np.float32))
    monkeypatch.setattr(logprobs, "BUCKET_OVERHEAD_POSITIONS", 0)  # one bucket per length
    assert len(logprobs.length_buckets(lens[:4].tolist())) == len(set(lens[:4].tolist()))

    def run(lengths):
        def f(m):
            lp, ent = completion_logprobs(m, prompts, comp, lengths=lengths)
            return (lp * weights * mask).sum(), (lp * mask, ent * mask)

        return nn.value_and_grad(model, f)(model)

    (v1, (lp1, e1)), g1 = run(lens.tolist())
    (v2, (lp2, e2)), g2 = run(None)
    n = tiny_additions(vars(model.args))
    for what, a, b in [("logprobs", lp1, lp2), ("entropy", e1, e2), ("value", v1, v2)]:
        assert_f32_close(a, b, n, what)
    for (k, a), (_, b) in zip(tree_flatten(g1), tree_flatten(g2)):
        assert_f32_close(a, b, n, k)


# ---------------------------------------------------------------- demonstration rows


def test_demonstration_rows_are_reported_apart_from_the_samples(tiny):
    """With demonstrations in the batch (guidance.enabled), `entropy` is the token mean over
    the sampled rows only, and `guidance/entropy` and `guidance/logp` the token means
    over the demonstration rows, each against the model's full logits through MLX's own
    softmax; `kl` and `guidance/kl` likewise, the k3 estimate from those log-probs;
    `entropy/reinforced` the token mean over the sampled rows with a positive advantage;
    whole or in micro-batches; the loss and its gradient do not change. A batch of
    demonstrations alone has no on-policy `entropy`, `kl` or `entropy/reinforced`."""
    from mlx_grpo.dist import Dist
    from mlx_grpo.grpo import split_guided, split_reinforced
    from mlx_grpo.update import policy_gradient

    model, _ = tiny
    apply_lora(model, LoRAConfig(rank=4), seed=6)
    _randomize_lora_b(model, seed=2)
    prompts, comp, lens = _groups(seed=6, prompt_lens=(5, 9, 4), g=4, max_c=7)
    n, c = comp.shape
    mask = mx.array((np.arange(c)[None] < lens[:, None]).astype(np.float32))
    adv = mx.array(np.random.default_rng(6).normal(size=n).astype(np.float32))
    demo = np.zeros(n, np.float32)
    demo[[3, 4]] = 1.0  # the last row of group 0, the first of group 1
    cfg = GRPOConfig(beta=0.04)
    grad_fn = nn.value_and_grad(model, lambda m, b: grpo_loss(m, b, cfg))
    ref = None  # set below, from the model's own log-probs

    def update(guided, max_positions=None):
        batch = LossInputs(prompts, comp, mask, adv, None, ref, c, guided=guided)
        loss, m, grads, _, _ = policy_gradient(model, grad_fn, batch, Dist(), 1e9, max_positions)
        m = split_reinforced(split_guided({k: v.item() for k, v in m.items()}))
        return loss, m, dict(tree_flatten(grads))

    g = n // len(prompts)
    logp, ent = np.zeros((n, c)), np.zeros((n, c))
    for i in range(n):
        p = prompts[i // g]
        logits = model(mx.concatenate([p, comp[i]])[None])[0, p.shape[0] - 1 : -1]
        logits = logits.astype(mx.float32)
        log_p = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        ent[i] = np.array(-(mx.softmax(logits, axis=-1) * log_p).sum(-1))
        logp[i] = np.array(mx.take_along_axis(log_p, comp[i][:, None], axis=-1)[:, 0])
    on = np.array(mask)
    sampled, shown = on * (1 - demo[:, None]), on * demo[:, None]
    up = np.array(adv)[:, None] > 0
    k = tiny_additions(vars(model.args))
    # A reference about a nat from the policy: k3 = e^d - d - 1, d = ref - logp.
    d = np.random.default_rng(7).normal(size=(n, c))
    ref = mx.array((logp + d).astype(np.float32))
    k3 = np.expm1(d) - d

    def assert_kl_close(got, rows, what):
        """k3 amplifies the error of log p by |dk3/dlogp| = |e^d - 1| per token."""
        want = (k3 * rows).sum() / rows.sum()
        cond = (np.abs(np.expm1(d)) * np.abs(logp) * rows).sum() / (k3 * rows).sum()
        assert abs(got - want) <= f32_tolerance(k) * (1 + cond) * want, (what, got, want)

    plain_loss, plain, plain_g = update(None)
    assert not any(key.startswith("guidance/") for key in plain)
    assert_f32_close(plain["entropy"], (ent * on).sum() / on.sum(), k, "entropy, no demos")
    assert_kl_close(plain["kl"], on, "kl, no demos")
    want = (ent * on * up).sum() / (on * up).sum()
    assert_f32_close(plain["entropy/reinforced"], want, k, "reinforced H, no demos")
    for budget in (None, 20):
        loss, m, grads = update(mx.array(demo), budget)
        assert_f32_close(m["entropy"], (ent * sampled).sum() / sampled.sum(), k, "entropy")
        assert_f32_close(m["guidance/entropy"], (ent * shown).sum() / shown.sum(), k, "demo H")
        assert_f32_close(m["guidance/logp"], (logp * shown).sum() / shown.sum(), k, "demo logp")
        want = (ent * sampled * up).sum() / (sampled * up).sum()
        assert_f32_close(m["entropy/reinforced"], want, k, "reinforced H")
        assert_kl_close(m["kl"], sampled, "kl")
        assert_kl_close(m["guidance/kl"], shown, "demo kl")
        assert m["guidance/token_frac"] == pytest.approx(shown.sum() / on.sum(), rel=1e-6)
        assert_f32_close(loss, plain_loss, k, "loss")
        for key in plain_g:
            assert_f32_close(grads[key], plain_g[key], k, key)
    # The split is not a rounding effect: the two kinds of rows differ here.
    assert abs(m["entropy"] - plain["entropy"]) > 1e-3
    assert abs(m["kl"] - plain["kl"]) > 1e-3
    assert abs(m["entropy/reinforced"] - m["entropy"]) > 1e-3
    assert abs(m["entropy/reinforced"] - plain["entropy/reinforced"]) > 1e-3
    assert 0 < up[:, 0].sum() < n and up[[3, 4], 0].any()  # both signs; a demo row is positive
    _, alone, _ = update(mx.ones(n))
    assert "entropy" not in alone and "kl" not in alone and "entropy/reinforced" not in alone
    assert_kl_close(alone["guidance/kl"], on, "kl, demonstrations alone")
