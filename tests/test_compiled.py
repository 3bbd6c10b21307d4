"""The compiled update (`engine.compile`) against the eager one: same loss, metrics and
gradients within float32 rounding, and a bounded number of compiled shapes."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import assert_f32_close, f32_tolerance, tiny_additions
from mlx.utils import tree_flatten

from mlx_grpo.compiled import PAD, CompiledLossAndGrad, padded
from mlx_grpo.config import GRPOConfig, LoRAConfig
from mlx_grpo.dist import Dist
from mlx_grpo.grpo import LossInputs, grpo_loss, micro_batches
from mlx_grpo.logprobs import effective_lengths
from mlx_grpo.models import apply_lora
from mlx_grpo.update import policy_gradient


def _lora(model, seed=5):
    apply_lora(model, LoRAConfig(rank=4), seed=seed)
    mx.random.seed(seed)
    for _, m in model.named_modules():
        if hasattr(m, "lora_b"):
            m.lora_b = mx.random.normal(m.lora_b.shape) * 0.05
    mx.eval(model.parameters())


def _batch(seed, prompt_lens, g, c, lens, sparse_group=None):
    """Random groups: prompts of the given lengths, G right-padded rows each with its
    loss mask (about 70% of each row's tokens; `sparse_group`'s rows about 20%, which
    sends the eager path to its sparse output head), advantages, old and reference
    log-probs."""
    rng = np.random.default_rng(seed)
    prompts = [mx.array(rng.integers(3, 200, p).tolist()) for p in prompt_lens]
    n = len(prompt_lens) * g
    comp = mx.array(rng.integers(3, 200, (n, c)), dtype=mx.int32)
    mask = np.zeros((n, c), np.float32)
    for i, k in enumerate(lens):
        share = 0.2 if sparse_group is not None and i // g == sparse_group else 0.7
        mask[i, :k] = rng.random(k) < share
        mask[i, k - 1] = 1.0 if k else 0.0
    adv = mx.array(rng.normal(size=n).astype(np.float32))
    old = mx.array(rng.normal(-5, 1, (n, c)).astype(np.float32))
    ref = mx.array(rng.normal(-5, 1, (n, c)).astype(np.float32))
    return LossInputs(prompts, comp, mx.array(mask), adv, old, ref, c)


def _update(model, grad_fn, batch, max_positions=None):
    loss, m, grads, _, _ = policy_gradient(model, grad_fn, batch, Dist(), 1e9, max_positions)
    return {"loss": loss, **m}, dict(tree_flatten(grads))


@pytest.mark.parametrize(
    "loss_type, level, beta, iterations",
    [
        ("dapo", "token", 0.04, 1),
        ("grpo", "token", 0.0, 2),
        ("dr_grpo", "token", 0.04, 2),
        ("turn", "token", 0.04, 1),
        ("grpo", "sequence", 0.04, 2),
        ("turn", "sequence", 0.0, 1),
        ("episode", "token", 0.04, 1),
    ],
)
def test_compiled_update_equals_the_eager_update(tiny, loss_type, level, beta, iterations):
    """Prompts of three lengths (one a multiple of 32, so unpadded), completions of
    several lengths (past 32, so two blocks), a group on the eager sparse head, and a
    micro-batch budget that cuts a group into runs of rows: loss, every metric and every
    gradient agree with the eager update (with two rows marked as demonstrations, which
    the metrics report apart)."""
    model, _ = tiny
    _lora(model)
    g, c = 4, 40
    lens = [40, 2, 5, 1, 3, 3, 8, 6, 33, 5, 5, 5]
    batch = _batch(3, (4, 32, 37), g, c, lens, sparse_group=1)
    cfg = GRPOConfig(
        num_generations=g,
        beta=beta,
        num_iterations=iterations,
        loss_type=loss_type,
        epsilon_high=0.28,
        importance_sampling_level=level,
    )
    batch.guided = mx.array([0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0], mx.float32)
    if iterations == 1:
        batch.old_logprobs = None
    eager = nn.value_and_grad(model, lambda m, b: grpo_loss(m, b, cfg))
    compiled = CompiledLossAndGrad(model, cfg)
    n = tiny_additions(vars(model.args))
    want, g_want = _update(model, eager, batch)
    # At 60 positions group 2 (prompt 37; rows 33, 5, 5, 5) is cut into runs of 1 and 3
    # rows, each compiled in its own shape.
    assert [p.completions.shape[0] for p in micro_batches(batch, 60)] == [4, 4, 1, 3]
    for budget in (None, 60):
        got, g_got = _update(model, compiled, batch, budget)
        for k in want:
            assert_f32_close(got[k], want[k], n, k)
        for k in g_want:
            assert_f32_close(g_got[k], g_want[k], n, k)
    assert any(np.abs(np.array(v)).max() > 0 for v in g_want.values())
    assert want["guided/token_frac"].item() > 0
    assert compiled.traces > 0


def test_compiled_update_fails_when_padding_reaches_the_loss(tiny, monkeypatch):
    """The check above can fail: with the prompt's padding visible to the completions
    (a causal mask only), the compiled loss moves away from the eager one."""
    from mlx_grpo import compiled as module

    model, _ = tiny
    _lora(model)
    batch = _batch(4, (5,), 4, 6, [6, 4, 2, 5])
    cfg = GRPOConfig(num_generations=4)
    batch.old_logprobs = None
    eager = nn.value_and_grad(model, lambda m, b: grpo_loss(m, b, cfg))
    want, _ = _update(model, eager, batch)

    def causal_only(self, n, return_array=False, window_size=None):
        q = mx.arange(self.offset, self.offset + n)[:, None]
        return mx.arange(self.offset + n)[None] <= q

    monkeypatch.setattr(module._LeftPadded, "make_mask", causal_only)
    got, _ = _update(model, CompiledLossAndGrad(model, cfg), batch)
    assert abs(got["loss"].item() - want["loss"].item()) > 1e-4


def test_ten_steps_of_varied_lengths_compile_a_bounded_number_of_shapes(tiny):
    """Ten batches with random prompt and completion lengths: one trace per distinct
    padded shape (prompt block, completion block), and none when shapes repeat."""
    model, _ = tiny
    _lora(model)
    g = 4
    cfg = GRPOConfig(num_generations=g, beta=0.0)
    compiled = CompiledLossAndGrad(model, cfg)
    rng = np.random.default_rng(0)
    shapes, batches = set(), []
    for step in range(10):
        plens = rng.integers(3, 70, size=2).tolist()
        c = int(rng.integers(2, 60))
        lens = rng.integers(1, c + 1, size=2 * g).tolist()
        batch = _batch(step, plens, g, c, lens)
        batch.old_logprobs = None
        batches.append(batch)
        eff = effective_lengths(batch.mask)
        for b, p in enumerate(plens):
            shapes.add((padded(p), padded(max(eff[b * g : (b + 1) * g]))))
        _update(model, compiled, batch)
    assert compiled.traces == len(shapes)
    # Prompts under 70 and completions under 60 tokens: at most 3 x 2 shapes, ever.
    assert compiled.traces <= 3 * 2 < 2 * 10
    for batch in batches:
        _update(model, compiled, batch)
    assert compiled.traces == len(shapes)


def test_padding_rule():
    assert [padded(n) for n in (1, PAD, PAD + 1)] == [PAD, PAD, 2 * PAD]


def test_a_compiled_run_trains_like_the_eager_run(tiny_model_dir, tmp_path):
    """`--engine.compile=true` on the toy recipe: the first step (same rollout) has the eager
    step's loss, gradient norm and metrics, and the run logs its compiled shapes."""
    import json
    from pathlib import Path

    from mlx_grpo.cli import cmd_train

    toy = Path(__file__).parent / "data" / "toy"

    def run(name, *extra):
        args = ["--recipe", str(toy), f"--model.path={tiny_model_dir}"]
        args += [f"--output.dir={tmp_path}", f"--output.run={name}", "--train.steps=2", *extra]
        assert cmd_train(args) == 0
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines]

    eager, compiled = run("eager"), run("compiled", "--engine.compile=true")
    n = tiny_additions(json.loads((tiny_model_dir / "config.json").read_text()))
    first, want = compiled[0], eager[0]
    for k in ("grad_norm", "entropy", "reward/mean"):
        assert_f32_close(first[k], want[k], n, k)
    # With one iteration the loss is a sum of advantages that cancels to about 0: its
    # rounding is relative to the advantages summed, not to itself.
    for k in ("loss/total", "loss/policy"):
        assert abs(first[k] - want[k]) <= f32_tolerance(n) * want["advantage/abs_mean"], k
    assert all(r["compile/traces"] >= 1 for r in compiled)
    assert "compile/traces" not in eager[0]
