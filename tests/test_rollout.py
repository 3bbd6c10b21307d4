"""Group rollouts through mlx_lm's BatchGenerator with a shared prompt prefill."""

from __future__ import annotations

import json
import math

import mlx.core as mx
import numpy as np
import pytest
from conftest import assert_f32_close, tiny_additions
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

from mlx_grpo.config import RolloutConfig
from mlx_grpo.rollout import (
    GreedySampler,
    KeyedSampler,
    encode_prompt,
    generate_groups,
    keyed_samplers,
)


def _prompts(tokenizer):
    msgs = ["hi", "what is 2 + 2?", "a much longer question about nothing at all"]
    return [encode_prompt(tokenizer, [{"role": "user", "content": m}], 512) for m in msgs]


def test_groups_are_contiguous_and_complete(tiny):
    model, tok = tiny
    prompts = _prompts(tok)
    out = generate_groups(model, tok, prompts, 4, RolloutConfig(max_new_tokens=6))
    assert len(out.completions) == 12
    assert [c.prompt_index for c in out.completions] == [0] * 4 + [1] * 4 + [2] * 4
    for c in out.completions:
        assert 1 <= len(c.tokens) <= 6
        assert c.finish_reason in ("stop", "length")
        assert (c.finish_reason == "length") == (len(c.tokens) == 6 and c.tokens[-1] != 2)
    assert out.generated_tokens == sum(len(c.tokens) for c in out.completions)


@pytest.mark.parametrize("compiled", [True, False])
def test_shared_prefill_decodes_like_mlx_lm_generate(tiny, compiled):
    """`GreedySampler` samples from the shared-cache batch (compiled decoder, or mlx_lm's
    generator) equal mlx_lm's one-prompt decoding with its own greedy sampler."""
    model, tok = tiny
    prompts = _prompts(tok)
    greedy = make_sampler(temp=0.0)
    cfg = RolloutConfig(max_new_tokens=8, compile_decode=compiled)
    out = generate_groups(model, tok, prompts, 2, cfg, sampler=GreedySampler())
    for i, p in enumerate(prompts):
        want = []
        for t, _ in generate_step(mx.array(p), model, max_tokens=8, sampler=greedy):
            want.append(int(t))
            if t in tok.eos_token_ids:
                break
        for c in out.completions[2 * i : 2 * i + 2]:
            assert c.tokens == want


def test_stop_token_is_kept_in_tokens_but_not_in_text(tiny):
    model, tok = tiny
    eos = tok.eos_token_id
    calls = {"n": 0}

    def scripted(logprobs):  # 'A', 'B', then EOS for every sequence
        calls["n"] += 1
        nxt = {1: tok.encode("A")[-1], 2: tok.encode("B")[-1]}.get(calls["n"], eos)
        return mx.full((logprobs.shape[0],), nxt, dtype=mx.uint32)

    out = generate_groups(
        model, tok, _prompts(tok)[:1], 3, RolloutConfig(max_new_tokens=10), scripted
    )
    for c in out.completions:
        assert c.tokens[-1] == eos and len(c.tokens) == 3
        assert c.finish_reason == "stop" and c.text == "AB"


def test_long_prompts_are_cut_from_the_left(tiny):
    _, tok = tiny
    msgs = [{"role": "user", "content": "x" * 300}]
    full = encode_prompt(tok, msgs, 10_000)
    cut = encode_prompt(tok, msgs, 20)
    assert len(cut) == 20 and cut == full[-20:]
    assert tok.decode(cut).endswith("<|im_start|>assistant\n")


def test_sampling_is_seeded(tiny):
    """With no sampler given, the keyed samplers' keys come from MLX's global random
    state: the same `mx.random.seed` draws the same tokens, another seed others."""
    model, tok = tiny
    cfg = RolloutConfig(max_new_tokens=8, temperature=1.0)
    runs = []
    for seed in (7, 7, 8):
        mx.random.seed(seed)
        runs.append(
            [c.tokens for c in generate_groups(model, tok, _prompts(tok), 4, cfg).completions]
        )
    assert runs[0] == runs[1] != runs[2]
    assert len({tuple(t) for t in runs[0]}) > 3  # temperature really samples


def test_keyed_samples_do_not_depend_on_the_batch(tiny):
    """Each completion draws from its own key: a group samples the same tokens alone
    or batched with other groups (as on one rank of a data-parallel run), and the
    filters of make_sampler still apply (top_k=1 is greedy)."""
    model, tok = tiny
    cfg = RolloutConfig(max_new_tokens=10, temperature=1.0)
    prompts = _prompts(tok)
    keys = mx.random.split(mx.random.key(3), 12)
    together = generate_groups(model, tok, prompts, 4, cfg, keyed_samplers(cfg, keys))
    apart = [
        c
        for i in range(3)
        for c in generate_groups(
            model, tok, prompts[i : i + 1], 4, cfg, keyed_samplers(cfg, keys[4 * i : 4 * i + 4])
        ).completions
    ]
    assert [c.tokens for c in together.completions] == [c.tokens for c in apart]
    assert len({tuple(c.tokens) for c in apart}) > 6  # temperature really samples
    other = generate_groups(
        model, tok, prompts, 4, cfg, keyed_samplers(cfg, mx.random.split(mx.random.key(4), 12))
    )
    assert [c.tokens for c in other.completions] != [c.tokens for c in apart]

    greedy_cfg = cfg.model_copy(update={"top_k": 1})
    top1 = generate_groups(model, tok, prompts, 4, greedy_cfg, keyed_samplers(greedy_cfg, keys))
    greedy = generate_groups(model, tok, prompts, 4, cfg, make_sampler(temp=0.0))
    assert [c.tokens for c in top1.completions] == [c.tokens for c in greedy.completions]


@pytest.mark.parametrize("vocab", [300, 12_000])
def test_top_k_candidates_are_mlx_lm_s(vocab):
    """The keyed sampler's fast top-k/top-p candidates (`top_k_candidates`) are exactly
    the tokens mlx_lm's apply_top_p then apply_top_k keep (12,000 words: k = 5 and 20
    go by blocks, `fastmath.top_k`)."""
    from mlx_lm.sample_utils import apply_top_k, apply_top_p

    from mlx_grpo.rollout import top_k_candidates

    mx.random.seed(3)
    for spread in (0.5, 2.0, 6.0):
        logits = mx.random.normal((6, vocab)) * spread
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        for k, p in ((5, 0.5), (20, 0.95), (20, 1.0), (50, 0.9)):
            ref = logprobs if p >= 1.0 else apply_top_p(logprobs, p)
            ref = apply_top_k(ref, k)
            ids, vals = top_k_candidates(logprobs, k, p)
            for row in range(6):
                want = {i for i, v in enumerate(ref[row].tolist()) if v > -float("inf")}
                got = {
                    i for i, v in zip(ids[row].tolist(), vals[row].tolist()) if v > -float("inf")
                }
                assert got == want, (spread, k, p, row)


@pytest.mark.parametrize(
    "settings",
    [
        dict(temperature=0.8, top_k=4, top_p=0.95),  # the fast top-k path
        dict(temperature=0.8, top_p=0.9),
        dict(temperature=1.5, min_p=0.3),  # mlx_lm's filters, in their order
        dict(temperature=1.5, min_p=0.5, top_k=4),  # min-p keeps fewer than top-k
        dict(temperature=0.7, top_p=0.95, min_p=0.2),
        dict(temperature=1.3),
    ],
)
def test_keyed_draws_follow_mlx_lm_s_distribution(settings):
    """40,000 keyed draws from one row of log-probs, through `draw_rows` (under
    `KeyedSampler.draw`) and `draw_logits` (the compiled decode step's): each token's
    frequency is mlx_lm's probability for it (mlx_lm's apply_top_p, apply_min_p and
    apply_top_k as `make_sampler` chains them, then the tempered softmax) within 0.01,
    four standard deviations at most; tokens mlx_lm's filters drop are never drawn.
    Every setting but the last drops tokens of this row."""
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

    cfg = RolloutConfig(**settings)
    logits = mx.array([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 1.2, -2.0]])
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    ref = logprobs
    if cfg.top_p < 1.0:
        ref = apply_top_p(ref, cfg.top_p)
    if cfg.min_p > 0:
        ref = apply_min_p(ref, cfg.min_p)
    if cfg.top_k > 0:
        ref = apply_top_k(ref, cfg.top_k)
    want = np.array(mx.softmax(ref / cfg.temperature, axis=-1)[0])
    assert (want == 0).any() == (cfg.top_p < 1 or cfg.min_p > 0 or cfg.top_k > 0)
    n, v = 40_000, logits.shape[1]
    sampler = KeyedSampler(cfg, mx.random.key(0))
    keys = mx.random.split(mx.random.key(12), n)
    from_logprobs, _ = sampler.draw_rows(keys, mx.broadcast_to(logprobs, (n, v)))
    from_logits, _, _ = sampler.draw_logits(keys, mx.broadcast_to(logits, (n, v)))
    for draws in (from_logprobs, from_logits):
        freq = np.bincount(np.array(draws), minlength=v) / n
        assert np.all(freq[want == 0] == 0), (freq, want)
        assert np.abs(freq - want).max() < 0.01, (freq, want)


def test_a_shared_prefix_is_prefilled_once_with_the_same_caches(tiny, tiny_model_dir):
    """prefill_prompts: the prefix all prompts share is computed once and copied; every
    cache equals the prompt's whole prefill up to float32 reordering, and the copies do
    not share storage (decoding into one leaves the others as they were)."""
    import json

    from conftest import assert_f32_close, tiny_additions

    from mlx_grpo.rollout import MIN_SHARED_PREFIX, _prefill, prefill_prompts

    model, tok = tiny
    system = {"role": "system", "content": "Answer with one word only, please. " * 3}
    prompts = [
        encode_prompt(tok, [system, {"role": "user", "content": m}], 512)
        for m in ("hi", "what is 2 + 2?", "name a colour")
    ]
    common = next(i for i, col in enumerate(zip(*prompts)) if len(set(col)) > 1)
    assert common >= MIN_SHARED_PREFIX
    shared = prefill_prompts(model, prompts)
    whole = [_prefill(model, p) for p in prompts]
    n = tiny_additions(json.loads((tiny_model_dir / "config.json").read_text()))
    for p, s, w in zip(prompts, shared, whole):
        for cs, cw in zip(s, w):
            assert cs.offset == cw.offset == len(p) - 1
            for a, b in zip(cs.state[:2], cw.state[:2]):
                assert_f32_close(a[..., : cs.offset, :], b[..., : cw.offset, :], n, "kv")
    before = [np.array(c.state[0][..., : c.offset, :]) for c in shared[1]]
    model(mx.array([[7, 8, 9]]), cache=shared[0])
    mx.eval([c.state for c in shared[0]])
    after = [np.array(c.state[0][..., : c.offset, :]) for c in shared[1]]
    assert all(np.array_equal(x, y) for x, y in zip(before, after))


@pytest.mark.parametrize("top_k", [0, 5])
def test_batched_keyed_draw_equals_one_call_per_row(top_k):
    """KeyedSampler.draw over many rows gives each row the token its own call gives, and
    leaves each key where its own call would."""
    cfg = RolloutConfig(temperature=1.0, top_k=top_k, top_p=0.9 if top_k else 1.0)
    logits = mx.random.normal((9, 300), key=mx.random.key(1)) * 3
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    keys = mx.random.split(mx.random.key(2), 9)
    rows, batched = keyed_samplers(cfg, keys), keyed_samplers(cfg, keys)
    for _ in range(3):
        one = [rows[i](logprobs[i : i + 1]).item() for i in range(9)]
        assert np.array(KeyedSampler.draw(batched, logprobs)).tolist() == one
    for a, b in zip(rows, batched):
        assert np.array(a.key).tolist() == np.array(b.key).tolist()
    assert len(set(one)) > 3  # the rows really draw from their own keys


@pytest.mark.parametrize("vocab", [200, 5000])
def test_keyed_draw_follows_its_key_stream(vocab):
    """Against a float64 reference built from the key alone: at each draw the key splits
    into (next key, this draw's key), one uniform number u comes from the latter, and the
    token is the first whose cumulative softmax mass exceeds u (5000 words: searched by
    blocks, `fastmath.inverse_cdf`). A draw could differ where u lies within float32
    rounding of a boundary of the float64 CDF; the test's keys put none there."""
    cfg = RolloutConfig(temperature=0.7)
    logits = mx.random.normal((5, vocab), key=mx.random.key(6)) * 2
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    keys = mx.random.split(mx.random.key(9), 5)
    samplers = keyed_samplers(cfg, keys)
    p = np.exp(np.array(logprobs, np.float64) / 0.7)
    cdf = np.cumsum(p / p.sum(axis=1, keepdims=True), axis=1)
    for _ in range(4):
        got = np.array(KeyedSampler.draw(samplers, logprobs)).tolist()
        want = []
        for i in range(5):
            nxt, sub = mx.random.split(keys[i])
            u = mx.random.uniform(shape=(1,), key=sub).item()
            want.append(int(np.searchsorted(cdf[i], u, side="right")))
            keys[i] = nxt
        assert got == want
        assert np.array(mx.stack([s.key for s in samplers])).tolist() == np.array(keys).tolist()


@pytest.mark.parametrize("temp,top_k", [(1.0, 0), (0.7, 0), (0.7, 5)])
def test_draw_from_logits_is_the_draw_from_log_probs_and_gives_the_entropy(temp, top_k):
    """`draw_logits` (the compiled decode step's) on logits: the tokens and next keys
    `draw_rows` gives on their log-probs, and the entropy of the untempered softmax,
    against float64 within (V + 14 + ln2 max|lp|) unit roundoffs of sum |p lp| <=
    max |lp| (fastmath.entropy's bound). A draw could differ from the other where u lies
    within float32 rounding of a boundary; the test's keys put none there."""
    cfg = RolloutConfig(temperature=temp, top_k=top_k, top_p=0.9 if top_k else 1.0)
    v = 3000
    scale = mx.array([1.0, 3, 10, 1, 3, 10])[:, None]
    logits = mx.random.normal((6, v), key=mx.random.key(3)) * scale + 4.0
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    sampler = keyed_samplers(cfg, mx.random.split(mx.random.key(4), 1))[0]
    keys = mx.random.split(mx.random.key(5), 6)
    for _ in range(3):
        tokens, got, after = sampler.draw_logits(keys, logits)
        want_tokens, want_after = sampler.draw_rows(keys, logprobs)
        assert np.array(tokens).tolist() == np.array(want_tokens).tolist()
        assert np.array(after).tolist() == np.array(want_after).tolist()
        keys = after
    x = np.array(logits, np.float64)
    lp = x - x.max(axis=1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(axis=1, keepdims=True))
    want = -(np.exp(lp) * lp).sum(axis=1)
    big = np.abs(lp).max()
    bound = (v + 14 + math.log(2) * big * math.log2(math.e)) * big * 2.0**-24
    assert np.all(np.abs(np.array(got, np.float64) - want) <= bound)


def test_decode_step_samples_the_tokens_of_mlx_lm_step(tiny, tiny_model_dir):
    """The compiled decode step, with the fast normaliser and batched keyed draws from
    the logits, samples the same tokens as mlx_lm's own step (`compile_decode=false`:
    each row's sampler called on mlx_lm's log-probs) for the same keys, leaves the keys
    where it leaves them, and gives the same entropies up to float32 rounding (the
    layers' reductions, an attention row of at most the compiled cache's capacity, then
    the sum over the vocabulary)."""
    from mlx_grpo.decode import capacity
    from mlx_grpo.rollout import decode_traces

    model, tok = tiny
    prompts = _prompts(tok)
    keys = mx.random.split(mx.random.key(8), 12)
    runs = []
    for compiled in (True, False):
        cfg = RolloutConfig(max_new_tokens=12, temperature=1.0, compile_decode=compiled)
        samplers = keyed_samplers(cfg, keys)
        runs.append((generate_groups(model, tok, prompts, 4, cfg, samplers), samplers))
    (fast, fast_keys), (plain, plain_keys) = runs
    assert decode_traces(model)  # the first run took the compiled path
    assert [c.tokens for c in fast.completions] == [c.tokens for c in plain.completions]
    assert len({tuple(c.tokens) for c in fast.completions}) > 6
    assert [np.array(s.key).tolist() for s in fast_keys] == [
        np.array(s.key).tolist() for s in plain_keys
    ]
    config = json.loads((tiny_model_dir / "config.json").read_text())
    longest = max(map(len, prompts)) + 12
    assert_f32_close(
        [h for c in fast.completions for h in c.entropies],
        [h for c in plain.completions for h in c.entropies],
        tiny_additions(config) + longest + capacity(longest + 1),
        "entropies",
    )
