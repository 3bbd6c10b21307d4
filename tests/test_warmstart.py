"""The supervised warm start (`train.sft_steps`): its loss is the mean negative
log-likelihood of the demonstrations' own tokens, its draw spreads over the levels, it
raises the demonstrations' likelihood, and a run takes it after the base model's
held-out evaluation and before the first GRPO step."""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import cut_back, f32_tolerance, tiny_additions

from mlx_grpo.cli import cmd_train, resolve_config
from mlx_grpo.config import RolloutConfig
from mlx_grpo.grpo import micro_batches
from mlx_grpo.log import PROCESS_METRICS
from mlx_grpo.recipe import Recipe, Task
from mlx_grpo.rollout import Rollout
from mlx_grpo.trainer import TrainingError
from mlx_grpo.update import build_loss_inputs
from mlx_grpo.warmstart import by_level, demonstrations, sft_loss, warm_start

TOY_ENV = Path(__file__).parent / "data" / "toy_env"
CFG = RolloutConfig(max_new_tokens=6, max_turns=3, max_prompt_tokens=10**6)


def _reference_nll(model, prompts, comps) -> float:
    """Mean -log p over the loss tokens, from one plain forward per sequence (float64 sums)."""
    total, count = 0.0, 0
    for prompt, c in zip(prompts, comps):
        seq = prompt + c.tokens
        logits = model(mx.array(seq)[None])[0].astype(mx.float32)
        logp = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True), dtype=np.float64)
        mask = c.loss_mask or [1] * len(c.tokens)
        for i, (t, m) in enumerate(zip(c.tokens, mask)):
            if m:
                total -= logp[len(prompt) + i - 1, t]
                count += 1
    return total / count


def test_sft_loss_is_the_mean_nll_of_the_replies_and_micro_batches_add_up(tiny, tiny_model_dir):
    model, tok = tiny
    recipe = Recipe(str(TOY_ENV), {"finished": 1.0, "short": 0.5}, {})
    prompts, comps, kept = demonstrations(recipe, tok, recipe.tasks("train", 6, 0), CFG)
    assert len(comps) == 6 and {t.payload["turns"] for t in kept} == {1, 2, 3}
    shown = Rollout(prompts, comps, 1)
    batch = build_loss_inputs(shown, mx.ones(len(comps)), CFG.max_new_tokens * CFG.max_turns, False)
    # Only the replies (and their EOS) are in the loss, never the environment's tokens.
    replies = len(tok.encode("ok", add_special_tokens=False)) + 1
    assert batch.mask.sum().item() == replies * sum(t.payload["turns"] for t in kept)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    tol = f32_tolerance(tiny_additions(config) + int(batch.mask.sum().item()))
    whole = sft_loss(model, batch)[0].item()
    assert whole == pytest.approx(_reference_nll(model, prompts, comps), rel=tol)
    pieces = micro_batches(batch, 40)
    assert len(pieces) > 1
    assert sum(sft_loss(model, p)[0].item() for p in pieces) == pytest.approx(whole, rel=tol)


def test_by_level_draws_evenly_over_the_levels_without_repeats():
    tasks = [Task(f"t{i}", lv, []) for i, lv in enumerate([1] * 10 + [2] * 3 + [3] * 10)]
    rng = np.random.default_rng(0)
    got = by_level(tasks, 12, rng)
    assert len({t.id for t in got}) == 12
    counts = Counter(t.level for t in got)
    assert counts[2] == 3  # all that level has
    assert abs(counts[1] - counts[3]) <= 1 and counts[1] + counts[3] == 9
    assert len(by_level(tasks, 100, rng)) == len(tasks)


def test_warm_start_raises_the_likelihood_of_held_out_demonstrations(tiny, tmp_path):
    model, tok = tiny
    from mlx_grpo.models import apply_lora

    cfg, _, _ = resolve_config(
        ["--recipe", str(TOY_ENV), "--train.sft_steps=6", "--train.sft_batch_size=4",
         "--train.sft_learning_rate=3e-3", f"--output.dir={tmp_path}", "--output.run=w"]
    )  # fmt: skip
    apply_lora(model, cfg.lora, seed=0)
    recipe = Recipe.from_config(cfg.recipe)
    held = demonstrations(recipe, tok, recipe.tasks("eval", 6, 0), cfg.rollout)
    before = _reference_nll(model, held[0], held[1])
    out = warm_start(model, tok, recipe, recipe.tasks("train", 32, 0), cfg)
    after = _reference_nll(model, held[0], held[1])
    assert out["demonstrations"] == 24 and out["levels"] == {1: 8, 2: 8, 3: 8}
    assert len(out["nll"]) == 6 and out["nll"][-1] < out["nll"][0]
    assert after < before - 0.5, (before, after)


def test_a_run_warms_up_after_the_base_evaluation(tiny_model_dir, tmp_path, monkeypatch):
    """The base evaluation sees the adapters as initialised (LoRA's B is zero); the warm
    start runs once, before step 1, and its summary is in the run folder; a resumed run
    does not run it again."""
    import mlx_grpo.trainer as trainer
    from mlx_grpo import evaluate

    lora_b_norms, calls = [], []
    make = evaluate.make_eval_fn

    def recording(model, *a, **k):
        fn = make(model, *a, **k)

        def wrapped(step, extra):
            norms = [float(mx.abs(v).sum()) for k, v in _flat(model) if k.endswith("lora_b")]
            lora_b_norms.append((step, sum(norms)))
            return fn(step, extra)

        return wrapped

    real = trainer.warm_start

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(evaluate, "make_eval_fn", recording)
    monkeypatch.setattr(trainer, "warm_start", counting)
    args = ["--recipe", str(TOY_ENV), f"--model.path={tiny_model_dir}", "--train.sft_steps=2"]
    args += [f"--output.dir={tmp_path}", "--output.run=r", "--train.eval_every=3"]
    assert cmd_train(args) == 0
    assert lora_b_norms[0] == (0, 0.0) and lora_b_norms[-1][1] > 0
    summary = json.loads((tmp_path / "r" / "warmstart.json").read_text())
    assert len(summary["nll"]) == 2 and summary["demonstrations"] == 16
    assert calls == [1]
    # Step 0 is checkpointed after the warm start: a run killed before its first
    # step's checkpoint resumes past the warm start, to the same run.
    from mlx_grpo.runfolder import RunFolder

    run = RunFolder(tmp_path / "r")
    assert [p.name for p in run.step_dirs()][0] == "step-000000"
    cut = cut_back(run.path, tmp_path / "cut", 0)
    assert cmd_train(["--resume", str(cut)]) == 0
    assert calls == [1]
    rows = [
        [
            {k: v for k, v in json.loads(x).items() if not k.startswith(PROCESS_METRICS)}
            for x in lines
        ]
        for lines in ((d / "metrics.jsonl").read_text().splitlines() for d in (run.path, cut))
    ]
    assert rows[0] == rows[1] and len(rows[0]) == 3
    assert (cut / "eval.jsonl").read_text() == (run.path / "eval.jsonl").read_text()
    x, y = (mx.load(str(d / "adapters.safetensors")) for d in (run.path, cut))
    assert all(mx.array_equal(x[k], y[k]).item() for k in x)
    assert cmd_train(["--resume", str(tmp_path / "r"), "--train.steps=8"]) == 0
    assert calls == [1]


@pytest.mark.slow
def test_a_kill_before_the_first_checkpoint_keeps_the_base_evaluation_and_warm_start(
    tiny_model_dir, tmp_path
):
    """A run with a base evaluation and a 3-step warm start, killed -9 at each write
    point in turn (MLX_GRPO_CRASH_AT, mlx_grpo/durable.py) until its step-0 checkpoint:
    `--resume` ends in the uninterrupted run (metrics, samples, adapters, eval.jsonl,
    the warm start's NLLs), and does not redo what was kept (the base evaluation once
    its record and state were written, each warm-start step once its files were)."""
    import subprocess
    import sys

    from test_trainer import _same_run

    args = ["--recipe", str(TOY_ENV), f"--model.path={tiny_model_dir}", "--train.sft_steps=3"]
    args += ["--train.steps=1", "--train.eval_every=1", "--train.eval_tasks=3"]
    args += ["--lora.dropout=0.1"]  # (the warm start draws its dropout masks from the seed)
    args += [f"--output.dir={tmp_path}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    def train(*extra, crash=None):
        more = {"MLX_GRPO_CRASH_AT": str(crash)} if crash else {}
        return subprocess.run(
            [sys.executable, "-m", "mlx_grpo", "train", *extra],
            env={**env, **more},
            capture_output=True,
            timeout=300,
        )

    assert train(*args, "--output.run=full").returncode == 0
    full = tmp_path / "full"
    kept_base, kept_steps, point = 0, set(), 0
    while True:
        point += 1
        run = tmp_path / f"crash-{point}"
        crashed = train(*args, f"--output.run={run.name}", crash=point)
        assert crashed.returncode == 137, crashed.stdout.decode() + crashed.stderr.decode()
        past = (run / "step-000000" / "state.json").exists()  # the last point to try
        again = ["--resume", str(run)]
        if not (run / "config.json").exists():  # killed before it: start again
            again = [*args, f"--output.run={run.name}"]
        resumed = train(*again)
        said = resumed.stdout.decode() + resumed.stderr.decode()
        assert resumed.returncode == 0 and "Traceback" not in said, (point, said)
        kept_base += "kept from the start that was stopped" in said
        kept_steps |= {int(k) for k in re.findall(r"continuing after its step (\d)", said)}
        try:
            _same_run(run, full)
            assert (run / "eval.jsonl").read_text() == (full / "eval.jsonl").read_text()
            nll = [json.loads((d / "warmstart.json").read_text())["nll"] for d in (run, full)]
            assert nll[0] == nll[1]
            assert not (run / "start.partial").exists()
        except AssertionError as e:
            raise AssertionError(f"killed at write point {point}: {e}") from None
        if past:
            break
    assert kept_base > 0 and kept_steps == {1, 2}


def _flat(model):
    from mlx.utils import tree_flatten

    return tree_flatten(model.parameters())


def test_the_warm_start_needs_a_recipe_that_demonstrates(tiny_model_dir, tmp_path):
    from mlx_grpo.trainer import TrainingError

    capitals = Path(__file__).parent / "data" / "capitals"
    args = ["--recipe", str(capitals), f"--model.path={tiny_model_dir}", "--train.sft_steps=2"]
    with pytest.raises(TrainingError, match=r"^train.sft_steps: recipe .* defines no demonstrate"):
        cmd_train([*args, f"--output.dir={tmp_path}", "--output.run=x"])


def test_each_rank_needs_a_demonstration_a_step():
    """Under `mlx.launch` a warm-start step of fewer rows than ranks is refused in one
    line naming the field; without a warm start any batch size goes."""
    from types import SimpleNamespace

    from mlx_grpo.config import TrainConfig
    from mlx_grpo.trainer import TrainingError
    from mlx_grpo.warmstart import check_ranks

    two = SimpleNamespace(size=2)
    with pytest.raises(TrainingError, match=r"train.sft_batch_size=1 is smaller than the 2 ranks"):
        check_ranks(TrainConfig(sft_steps=3, sft_batch_size=1), two)
    check_ranks(TrainConfig(sft_steps=3, sft_batch_size=2), two)
    check_ranks(TrainConfig(sft_steps=0, sft_batch_size=1), two)


def test_the_warm_start_as_the_kl_reference(tiny_model_dir, tmp_path):
    """grpo.reference=start: the KL term's reference is the warm-started adapters, so
    the first step's KL (policy = reference) is zero to float32 rounding while the
    base's is not; the reference is kept beside the step-0 checkpoint, and a resumed
    run reads it back and continues as the uninterrupted run does."""
    from mlx_grpo.runfolder import RunFolder

    def run(name: str, *extra: str) -> list[dict]:
        args = ["--recipe", str(TOY_ENV), f"--model.path={tiny_model_dir}", "--train.sft_steps=2"]
        args += [f"--output.dir={tmp_path}", f"--output.run={name}", "--grpo.beta=0.1"]
        args += ["--credit.skip_zero_variance_groups=false"]  # (the toy's groups often agree)
        assert cmd_train(args + list(extra)) == 0
        return [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    base, start = run("base"), run("start", "--grpo.reference=start")
    # k3 of log-ratios at float32 rounding (~1e-6) is ~1e-12; after a warm start at
    # lr 1e-2 the base is far off.
    assert start[0]["kl"] < 1e-9 < 1e-3 < base[0]["kl"]
    folder = RunFolder(tmp_path / "start")
    ref = mx.load(str(folder.reference_file))
    step0 = mx.load(str(folder.step_dir(0) / RunFolder.ADAPTERS))
    assert ref.keys() == step0.keys() and all(mx.array_equal(ref[k], step0[k]).item() for k in ref)
    assert not (tmp_path / "base" / RunFolder.REFERENCE).exists()

    cut = cut_back(folder.path, tmp_path / "cut", 0)
    assert cmd_train(["--resume", str(cut)]) == 0
    again = [json.loads(x) for x in (cut / "metrics.jsonl").read_text().splitlines()]
    assert [{k: v for k, v in r.items() if not k.startswith(PROCESS_METRICS)} for r in again] == [
        {k: v for k, v in r.items() if not k.startswith(PROCESS_METRICS)} for r in start
    ]
    cut2 = cut_back(folder.path, tmp_path / "cut2", 0)
    (cut2 / RunFolder.REFERENCE).unlink()
    with pytest.raises(
        TrainingError, match=r"grpo.reference=start: .*reference.safetensors not found"
    ):
        cmd_train(["--resume", str(cut2)])
