"""output.report_to: what TensorBoard, W&B (offline) and trackio hold after a run that
was killed and resumed, read back with each tracker's own reader, against metrics.jsonl.

`make test` installs every tracker extra; a tracker whose package is absent is skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mlx_grpo.config import ConfigError, build_config, parse_overrides
from mlx_grpo.evaluate import TaskResult, summarize
from mlx_grpo.log import PROCESS_METRICS
from mlx_grpo.trackers import PROJECT, TrackerError, require, wandb_history

TOY = Path(__file__).parent / "data" / "toy"

# A run whose checkpoint at step 4 is never written: the process ends (os._exit, as a
# kill -9 would) after step 4 was logged everywhere, so --resume redoes steps 3 and 4
# from the step-2 checkpoint.
KILLED_AT_SAVE = r"""
import os, sys
import mlx_grpo.runstate as runstate

real = runstate.save_checkpoint

def save(run_dir, step, *args):
    if step == 4:
        os._exit(137)
    return real(run_dir, step, *args)

runstate.save_checkpoint = save
from mlx_grpo.cli import main
main(sys.argv[1:])
"""


def _have(module: str) -> bool:
    try:
        __import__(module)
        return True
    except ImportError:
        return False


def _env(tmp: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "TRACKIO_"))}
    # No API key anywhere: W&B must choose offline mode by itself.
    return {
        **env,
        "PYTHONUNBUFFERED": "1",
        "NETRC": str(tmp / "no-netrc"),
        "TRACKIO_DIR": str(tmp / "trackio"),
        "WANDB_CONFIG_DIR": str(tmp / "wandb-config"),
        "WANDB_CACHE_DIR": str(tmp / "wandb-cache"),
        "WANDB_DATA_DIR": str(tmp / "wandb-data"),
    }


def _metrics(run: Path) -> dict[int, dict]:
    """{step: metrics} of metrics.jsonl, and the base model's held-out figures as step 0,
    without timings (a step the killed run logged and the resumed run redid differs in
    them, and a tracker may hold either)."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    out = {r["step"]: {k: v for k, v in r.items() if k != "step"} for r in rows}
    evals = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    base = summarize([TaskResult(**r) for e in evals if e["step"] == 0 for r in e["results"]])
    assert base, "the base model's evaluation is in eval.jsonl"
    out[0] = base
    return {
        s: {k: v for k, v in m.items() if not k.startswith(PROCESS_METRICS)} for s, m in out.items()
    }


def _sampled_steps(run: Path) -> list[int]:
    """The steps samples.jsonl holds (every sample_every, and each run's first step)."""
    rows = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    return sorted({r["step"] for r in rows})


def _check_sample_steps(steps: list[int], run: Path) -> None:
    """Once per step, at the steps of the uninterrupted run (every sample_every, and the
    first) and at most also at the resumed run's first step (samples.jsonl has it; a
    tracker that kept the killed run's step 3 has no samples there)."""
    assert len(steps) == len(set(steps)), steps
    assert {1, 2, 4, 6} <= set(steps) <= set(_sampled_steps(run)), steps


def _tensorboard(run: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


@pytest.fixture(scope="module")
def killed_and_resumed(tiny_model_dir, tmp_path_factory):
    """(run folder, env): 6 steps, killed at step 4's checkpoint, resumed to the end."""
    tmp = tmp_path_factory.mktemp("trackers")
    names = [n for n in ("tensorboard", "wandb", "trackio") if _have(n)]  # package = name
    if not names:
        pytest.skip("no tracker extra installed (pip install 'mlx-grpo[trackers]')")
    args = [
        "train",
        "--recipe",
        str(TOY),
        f"--model.path={tiny_model_dir}",
        f"--output.dir={tmp}",
        "--output.run=tracked",
        "--train.steps=6",
        "--output.save_every=2",
        "--train.sample_every=2",
        "--train.eval_every=3",
        f"--output.report_to={','.join(names)}",
    ]
    env = _env(tmp)
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_AT_SAVE, *args], env=env, capture_output=True, timeout=600
    )
    assert killed.returncode == 137, killed.stdout.decode() + killed.stderr.decode()
    run = tmp / "tracked"
    assert json.loads((run / "latest").read_text())["step"] == 2
    first_id = json.loads((run / "trackers.json").read_text())["run_id"]
    resumed = subprocess.run(
        [sys.executable, "-m", "mlx_grpo", "train", "--resume", str(run)],
        env=env,
        capture_output=True,
        timeout=600,
    )
    said = resumed.stdout.decode() + resumed.stderr.decode()
    assert resumed.returncode == 0, said
    assert "report_to:" in said
    state = json.loads((run / "trackers.json").read_text())
    assert state["run_id"] == first_id  # the same tracker run goes on
    return run, env, state, names


def test_tensorboard_scalars_equal_metrics_jsonl_once_per_step(killed_and_resumed):
    run, _, _, names = killed_and_resumed
    if "tensorboard" not in names:
        pytest.skip("tensorboard not installed")
    metrics, scalars = _metrics(run), _tensorboard(run)
    assert sorted(metrics) == [0, 1, 2, 3, 4, 5, 6]
    for step, row in metrics.items():
        for key, value in row.items():
            got = [v for s, v in scalars[key] if s == step]
            # One event per step, in float32 (TensorBoard's simple_value).
            assert got == [np.float32(value)], (key, step, got, value)
    # Held-out evaluations at their steps, samples as text where they were logged.
    assert [s for s, _ in scalars["eval/reward"]] == [0, 3, 6]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    assert [e.step for e in acc.Tensors("config")] == [0]
    samples = acc.Tensors("samples")
    _check_sample_steps([e.step for e in samples], run)
    assert "| task | completion |" in samples[0].tensor_proto.string_val[0].decode()


def test_wandb_offline_history_equals_metrics_jsonl_once_per_step(killed_and_resumed):
    run, _, state, names = killed_and_resumed
    if "wandb" not in names:
        pytest.skip("wandb not installed")
    assert state["wandb"]["mode"] == "offline"
    run_id = state["run_id"]
    files = sorted((run / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(files) == 2  # the killed run's and the resumed run's, one W&B run id
    history = [h for f in files for h in wandb_history(f)]
    steps = [s for s, _ in history]
    assert sorted(steps) == sorted(set(steps)) == [0, 1, 2, 3, 4, 5, 6]
    metrics = _metrics(run)
    for step, items in history:
        for key, value in metrics[step].items():
            assert items[key] == value, (key, step)
    tables = {s: items for s, items in history if items.get("samples/_type") == "table-file"}
    _check_sample_steps(list(tables), run)
    per_step = [json.loads(x)["step"] for x in (run / "samples.jsonl").read_text().splitlines()]
    assert all(t["samples/nrows"] == per_step.count(s) for s, t in tables.items())


def test_trackio_store_equals_metrics_jsonl_once_per_step(killed_and_resumed, monkeypatch):
    run, env, state, names = killed_and_resumed
    if "trackio" not in names:
        pytest.skip("trackio not installed")
    from trackio import sqlite_storage

    monkeypatch.setattr(sqlite_storage, "TRACKIO_DIR", Path(env["TRACKIO_DIR"]))
    logs = sqlite_storage.SQLiteStorage.get_logs(PROJECT, run=state["trackio"]["run"])
    steps = [r["step"] for r in logs]
    assert steps == [0, 1, 2, 3, 4, 5, 6], steps
    metrics = _metrics(run)
    for r in logs:
        for key, value in metrics[r["step"]].items():
            assert r[key] == value, (key, r["step"])
    _check_sample_steps([r["step"] for r in logs if "samples" in r], run)


def _report_to(value: str) -> list[str]:
    return build_config(overrides=parse_overrides([f"--output.report_to={value}"])).output.report_to


def test_report_to_parses_trl_style_values():
    assert _report_to("tensorboard,wandb") == ["tensorboard", "wandb"]
    assert _report_to('["trackio"]') == ["trackio"]
    assert _report_to("none") == []
    assert _report_to("all") == ["tensorboard", "wandb", "trackio"]
    with pytest.raises(ConfigError, match="output.report_to"):
        _report_to("mlflow")


def test_a_missing_tracker_fails_in_one_line_naming_its_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now raises ImportError
    with pytest.raises(TrackerError, match=r"pip install 'mlx-grpo\[wandb\]'") as e:
        require(["wandb"])
    assert "\n" not in str(e.value)


class _Fake:
    """A tracker backend that records, and fails where told to."""

    def __init__(self, fail_log=False, fail_close=False):
        self.logged, self.closed = [], []
        self.fail_log, self.fail_close = fail_log, fail_close

    def holds(self, step):
        return False

    def log(self, step, scalars, rows):
        if self.fail_log:
            raise ConnectionError("wandb service is gone\nmore")
        self.logged.append(step)

    def close(self, failed=False):
        self.closed.append(failed)
        if self.fail_close:
            raise OSError(28, "No space left on device")


def test_a_tracker_that_fails_is_left_out_and_the_run_goes_on(tmp_path):
    """One backend's error (a dead W&B service, a full disk under TensorBoard) is a
    warning; the others log on, every one closes, and a crash is closed as one."""
    from mlx_grpo.trackers import Trackers

    said = []
    trackers = Trackers(tmp_path, [], {}, warn=said.append)
    bad, good, closing = _Fake(fail_log=True), _Fake(), _Fake(fail_close=True)
    trackers.backends = {"wandb": bad, "tensorboard": good, "trackio": closing}
    trackers.log(1, {"reward/mean": 0.5})
    trackers.log(2, {"reward/mean": 0.6})
    assert list(trackers.backends) == ["tensorboard", "trackio"] and good.logged == [1, 2]
    assert said == [
        "report_to wandb: logging step 1 failed (ConnectionError: wandb service is gone); "
        "it is left out for the rest of the run (metrics.jsonl holds every step)"
    ]
    assert bad.closed == [True]
    with pytest.raises(ValueError), trackers:
        raise ValueError("a crash")
    assert good.closed == [True] and closing.closed == [True]  # each closed, as failed
    assert (
        said[-1]
        == "report_to trackio: closing failed (OSError: [Errno 28] No space left on device)"
    )

    class Interrupted(Exception):  # the trainer's Ctrl-C: saved, resumable, no failure
        pass

    with pytest.raises(Interrupted), trackers:
        raise Interrupted
    assert good.closed == [True, False]


def test_a_warning_that_quotes_model_output_is_printed_as_it_is(capsys):
    """ "[/INST] 42" read as rich markup raised MarkupError mid-step; "[answer]" vanished."""
    from mlx_grpo.log import Display

    display = Display(3, 0, "off", "t")
    display.warn("reward raised: invalid literal for int(): '[/INST] 42' [answer]")
    display.info("the reply was [bold]")
    out = capsys.readouterr().out
    assert "warning: reward raised: invalid literal for int(): '[/INST] 42' [answer]" in out
    assert "the reply was [bold]" in out


def test_a_wandb_login_that_fails_online_goes_on_offline(tmp_path, monkeypatch):
    """A key the server refuses, HTTPS blocked, its init timeout: the run logs offline
    (and says where to sync from) instead of stopping after the model loaded."""
    wandb = pytest.importorskip("wandb")
    from types import SimpleNamespace

    from mlx_grpo import trackers as tr

    modes = []

    def init(**kw):
        modes.append(kw["mode"])
        if kw["mode"] == "online":
            raise wandb.errors.CommError("401: user is not logged in")
        return SimpleNamespace(step=0, log=lambda *a, **k: None, finish=lambda **k: None)

    monkeypatch.setattr(tr, "_wandb_mode", lambda: "online")
    monkeypatch.setattr(wandb, "init", init)
    backend = tr._WandB(tmp_path, "abcd1234", {})
    assert modes == ["online", "offline"] and backend.where["mode"] == "offline"
    assert backend.where["sync"].startswith("wandb sync ")


def test_a_wandb_of_ones_own_is_where_the_key_and_the_server_are_looked_for(tmp_path, monkeypatch):
    from mlx_grpo import trackers as tr

    tried = []

    def connect(address, timeout):
        tried.append(address)
        raise OSError("unreachable")

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_BASE_URL", "http://wandb.example.org:8080")
    netrc = tmp_path / "netrc"
    netrc.write_text("machine wandb.example.org login user password k\n")
    monkeypatch.setenv("NETRC", str(netrc))
    monkeypatch.setattr(tr.socket, "create_connection", connect)
    assert tr._wandb_mode() == "offline" and tried == [("wandb.example.org", 8080)]
    netrc.write_text("machine api.wandb.ai login user password k\n")  # another server's key
    assert tr._wandb_mode() == "offline" and len(tried) == 1
