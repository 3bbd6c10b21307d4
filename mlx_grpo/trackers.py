"""`output.report_to`: the run's logs mirrored to TensorBoard, Weights & Biases or
trackio, as TRL's option of that name does.

Each tracker is an optional extra (`pip install 'mlx-grpo[tensorboard]'`, `[wandb]`,
`[trackio]`, or `[trackers]` for all three), imported only when asked for; `require`
checks them at start so that a missing one fails in one line before the model loads.

What each receives: every metric of `metrics.jsonl` under its own name at its step
(held-out evaluations included, the base model's at step 0), the full config once,
and the sampled completions with their reward components as a table on the steps
whose samples are logged (TensorBoard: a Markdown text table).

Where the logs go is written to the run folder's `trackers.json`: TensorBoard event
files in `<run>/tensorboard/`; W&B in `<run>/wandb/` (offline mode when no API key is
set or its server cannot be reached: `wandb sync <run>/wandb/offline-run-*` uploads
it later; WANDB_MODE, when set, decides); trackio in its local store (project
`mlx-grpo`, run `<run folder>-<id>`; `trackio show` opens it).

A resumed run continues the same tracker run (`trackers.json` keeps its id) and each
tracker ends up holding every step exactly once. The run folder's logs are the truth:
on resume each tracker is asked which steps it holds, and receives the steps it lacks
from `metrics.jsonl`, `samples.jsonl` and `eval.jsonl` (cut back to the checkpoint),
then every new step it lacks. A kill that lost a tracker's buffered records (W&B
writes nothing offline until its run finishes) thus leaves no gap, and steps that a
tracker kept from before the kill are not sent twice (TensorBoard's steps are read
back from its event files with TensorBoard's own reader).
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import sys
import time
from pathlib import Path

import numpy as np

from mlx_grpo.durable import read_jsonl, write_atomic
from mlx_grpo.recipe import first_line
from mlx_grpo.runfolder import RunFolder

STATE_FILE = "trackers.json"
PROJECT = "mlx-grpo"  # the W&B project (unless WANDB_PROJECT) and the trackio project
SAMPLE_COLUMNS = ("task", "completion", "reward", "components", "finish_reason")


class TrackerError(RuntimeError):
    """A tracker that cannot be used (one line)."""


def require(names: list[str]) -> None:
    """Import each tracker's package now, or fail in one line naming its extra (each
    tracker's package and extra bear its name)."""
    import importlib

    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise TrackerError(
                f"output.report_to: {name} needs the {name} package ({e}); install it with "
                f"pip install 'mlx-grpo[{name}]'"
            ) from None


def _scalars(metrics: dict) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in metrics.items()
        if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)
    }


def _rows(samples: list[dict]) -> list[list]:
    return [
        [s["task"], s["completion"] or "", float(s["reward"]), json.dumps(s["components"]),
         s["finish_reason"]]
        for s in samples
    ]  # fmt: skip


class _TensorBoard:
    """TensorBoard's own event-file writer (the `tensorboard` package; no TensorFlow)."""

    def __init__(self, run_dir: Path, run_id: str, config: dict):
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        logdir = run_dir / "tensorboard"
        self.where = {"logdir": str(logdir)}
        self.held: set[int] = set()
        if logdir.is_dir():  # the steps earlier writers flushed (each step flushes whole)
            acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
            acc.Reload()
            self.held = {e.step for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}
        self.writer = EventFileWriter(str(logdir), flush_secs=3600)  # flushed at each step
        if not self.held:
            self._write(
                0, [self._text("config", "```json\n" + json.dumps(config, indent=2) + "\n```")]
            )
            self.writer.flush()

    def holds(self, step: int) -> bool:
        return step in self.held

    def log(self, step: int, scalars: dict[str, float], rows: list[list]) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=k, simple_value=v) for k, v in scalars.items()]
        if rows:
            head = "| " + " | ".join(SAMPLE_COLUMNS) + " |\n|" + "---|" * len(SAMPLE_COLUMNS)
            lines = ["| " + " | ".join(_md_cell(c) for c in r) + " |" for r in rows]
            values.append(self._text("samples", "\n".join([head, *lines])))
        self._write(step, values)
        self.writer.flush()  # returns once the step is in the file

    def _write(self, step: int, values: list) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        self.writer.add_event(
            Event(wall_time=time.time(), step=step, summary=Summary(value=values))
        )

    @staticmethod
    def _text(tag: str, text: str):
        """A text-plugin summary value (what TensorBoard's Text tab shows)."""
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.plugins.text.metadata import create_summary_metadata
        from tensorboard.util.tensor_util import make_tensor_proto

        tensor = make_tensor_proto(np.array(text.encode(), dtype=object))
        meta = create_summary_metadata(display_name=tag, description="")
        return Summary.Value(tag=tag, metadata=meta, tensor=tensor)

    def close(self, failed: bool = False) -> None:
        self.writer.close()


def _md_cell(value) -> str:
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    return text.replace("|", "\\|").replace("\n", "<br>")


def _wandb_mode() -> str:
    """WANDB_MODE if set; online with an API key and a reachable server (WANDB_BASE_URL's,
    for a W&B of one's own, else api.wandb.ai); else offline."""
    from urllib.parse import urlsplit

    if mode := os.environ.get("WANDB_MODE"):
        return mode
    url = urlsplit(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai")
    host = url.hostname or "api.wandb.ai"
    port = url.port or (80 if url.scheme == "http" else 443)
    has_key = bool(os.environ.get("WANDB_API_KEY"))
    if not has_key:
        try:
            netrc = Path(os.environ.get("NETRC") or Path.home() / ".netrc")
            has_key = netrc.exists() and host in netrc.read_text(errors="replace")
        except (OSError, RuntimeError):  # no home
            has_key = False
    if not has_key:
        return "offline"
    try:
        socket.create_connection((host, port), timeout=3).close()
        return "online"
    except OSError:
        return "offline"


def wandb_history(path: Path) -> list[tuple[int, dict]]:
    """(step, {key: value}) of each history record in a W&B run file (`run-<id>.wandb`,
    written offline), in order.

    The file is a LevelDB-style log (wandb 0.31 ships no Python reader for it): a 7-byte
    header, then 32 KiB blocks of chunks (crc32c, 2-byte length, type: full, first,
    middle, last) that join into serialized `Record` protobufs. A torn tail (a kill
    while writing) ends the read.
    """
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = Path(path).read_bytes(), 32768
    pos, record, history = 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if kind == 0 or pos + 7 + length > len(data):
            break
        record += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full, last
            r = pb.Record.FromString(record)
            record = b""
            if r.HasField("history"):
                items = {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in r.history.item
                    if i.value_json
                }
                history.append((r.history.step.num, items))
    return history


class _RunTracker:
    """W&B and trackio share one API: `lib.Table(columns, data)`, `run.log(values,
    step=)`, `run.finish()`; `held` is the set of steps the tracker already has."""

    lib: object  # the wandb or trackio module
    run: object
    held: set[int]

    def holds(self, step: int) -> bool:
        return step in self.held

    def log(self, step: int, scalars: dict[str, float], rows: list[list]) -> None:
        if rows:
            scalars = {**scalars, "samples": self.lib.Table(list(SAMPLE_COLUMNS), rows)}
        self.run.log(scalars, step=step)

    def close(self, failed: bool = False) -> None:
        self.run.finish()


class _WandB(_RunTracker):
    def __init__(self, run_dir: Path, run_id: str, config: dict):
        import wandb

        self.lib = wandb
        mode = _wandb_mode()
        folder = run_dir / "wandb"

        def start(mode: str):
            return wandb.init(
                project=os.environ.get("WANDB_PROJECT", PROJECT),
                name=run_dir.name,
                id=run_id,
                resume="allow",
                dir=str(run_dir),
                config=config,
                mode=mode,
                settings=wandb.Settings(console="off", silent=True),
            )

        try:
            self.run = start(mode)
        except Exception:  # a key the server refuses, HTTPS blocked, its init timeout
            if mode != "online":
                raise
            mode = "offline"  # the run goes on; `wandb sync` sends it later
            self.run = start(mode)
        # Offline, the steps this run's earlier offline parts hold; online, the server
        # says (`below`): offline parts sent since are there, others are for `sync`.
        offline = sorted(folder.glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
        if mode == "offline":
            self.held = {step for f in offline for step, _ in wandb_history(f)}
        else:
            self.held = set()
        # Online, a resumed run's step counter starts after the server's last step.
        self.below = self.run.step
        self.where = {"dir": str(folder), "mode": mode, "id": run_id}
        if mode == "offline":
            self.where["sync"] = f"wandb sync {folder}/offline-run-*-{run_id}"

    def holds(self, step: int) -> bool:
        return step in self.held or step < self.below

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)  # a crash shows as one in W&B


class _Trackio(_RunTracker):
    def __init__(self, run_dir: Path, run_id: str, config: dict):
        import trackio
        from trackio.sqlite_storage import SQLiteStorage
        from trackio.utils import TRACKIO_DIR

        self.lib = trackio
        name = f"{run_dir.name}-{run_id}"  # folder names repeat across output dirs
        self.held = {r["step"] for r in SQLiteStorage.get_logs(PROJECT, run=name)}
        self.run = trackio.init(
            project=PROJECT,
            name=name,
            config=config,
            resume="allow",
            embed=False,
            auto_log_cpu=False,
            auto_log_gpu=False,
        )
        self.where = {"dir": str(TRACKIO_DIR), "project": PROJECT, "run": name}


BACKENDS = {"tensorboard": _TensorBoard, "wandb": _WandB, "trackio": _Trackio}


class Trackers:
    """The trackers of one run. With none asked for, every call does nothing and
    nothing is written."""

    def __init__(self, run_dir: Path, names: list[str], config: dict, warn=None):
        self.names = list(names)
        self.backends: dict = {}
        self.warn = warn or (lambda text: print(f"warning: {text}", file=sys.stderr))
        if not self.names:
            return
        state_file = Path(run_dir) / STATE_FILE
        run_id = _read_state(state_file).get("run_id") or secrets.token_hex(4)
        for name in self.names:
            self.backends[name] = BACKENDS[name](Path(run_dir), run_id, config)
        where = {n: b.where for n, b in self.backends.items()}
        write_atomic(state_file, json.dumps({"run_id": run_id, **where}, indent=2) + "\n")
        for step, metrics, samples in run_history(run_dir):  # what a resumed run holds
            self.log(step, metrics, samples)

    def where(self) -> str:
        """One line: where each tracker's logs are."""
        return "; ".join(
            f"{name}: " + ", ".join(f"{k} {v}" for k, v in b.where.items())
            for name, b in self.backends.items()
        )

    def log(self, step: int, metrics: dict, samples: list[dict] | None = None) -> None:
        """`metrics` (and `samples`, the step's samples.jsonl records) at `step`, to every
        tracker that does not hold this step yet."""
        scalars, rows = _scalars(metrics), _rows(samples or [])
        for name, backend in list(self.backends.items()):
            if backend.holds(step):
                continue
            try:
                backend.log(step, scalars, rows)
            except Exception as e:  # a tracker's failure is not the run's
                del self.backends[name]
                self.warn(
                    f"report_to {name}: logging step {step} failed ({first_line(e)}); it "
                    "is left out for the rest of the run (metrics.jsonl holds every step)"
                )
                try:
                    backend.close(failed=True)
                except Exception:
                    pass

    def close(self, failed: bool = False) -> None:
        """Close every tracker (`failed`: the run ended by an error), each whatever the
        others do."""
        for name, backend in self.backends.items():
            try:
                backend.close(failed)
            except Exception as e:
                self.warn(f"report_to {name}: closing failed ({first_line(e)})")

    def __enter__(self) -> Trackers:
        return self

    def __exit__(self, kind, *exc) -> None:
        # Ctrl-C (Interrupted: saved, resumable) is no failure; anything else is.
        self.close(failed=kind is not None and kind.__name__ not in _STOPPED)


_STOPPED = ("Interrupted", "KeyboardInterrupt")


def run_history(run_dir: Path) -> list[tuple[int, dict, list[dict]]]:
    """(step, metrics, samples) of each step a run folder's logs hold, in order: the base
    model's held-out evaluation (eval.jsonl's step 0, summarized again) first."""
    from mlx_grpo.evaluate import TaskResult, summarize

    run = RunFolder(run_dir)
    rows = {r["step"]: r for r in read_jsonl(run.metrics_file)[0] if "step" in r}
    for e in read_jsonl(run.eval_file)[0]:
        if e.get("step") == 0 and e.get("results"):
            rows[0] = summarize([TaskResult(**r) for r in e["results"]])
    samples: dict[int, list[dict]] = {}
    for s in read_jsonl(run.samples_file)[0]:
        samples.setdefault(s.get("step"), []).append(s)
    return [(step, rows[step], samples.get(step, [])) for step in sorted(rows)]


def _read_state(path: Path) -> dict:
    try:
        state = json.loads(path.read_text())
        return state if isinstance(state, dict) else {}
    except (OSError, ValueError):
        return {}
