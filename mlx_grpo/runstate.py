"""A run's state: where it starts (fresh, a kept start, a checkpoint), its counters,
what it keeps on disk and how it is saved, a full disk and Ctrl-C included.

A run is crash-consistent: the logs are cut back to the checkpoint a resume starts
from, so a resumed run writes exactly what the uninterrupted one would have. A run
stopped before its first checkpoint keeps its start (the base evaluation, the warm
start's steps) for a start with the same settings (`checkpoint.save_start`).
"""

from __future__ import annotations

import json
import shutil
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from mlx_grpo.checkpoint import (
    CheckpointError,
    TrainState,
    load_arrays,
    load_checkpoint,
    load_start,
    publish,
    save_arrays,
    save_checkpoint,
    save_start,
)
from mlx_grpo.config import RunConfig
from mlx_grpo.credit import TrainingError
from mlx_grpo.dist import Dist
from mlx_grpo.durable import FULL_DISK, cut_jsonl, write_atomic
from mlx_grpo.log import JsonlWriter
from mlx_grpo.runfolder import RunFolder
from mlx_grpo.update import adapters


class RunState:
    """One run's folder and what the loop keeps in it. Made at the run's start: it
    claims where the run begins (`start`, the last step done) and its `counters`,
    restored from `resume_from` or fresh, and writes the run's config."""

    def __init__(
        self, cfg: RunConfig, run_dir: Path, model, optimizer, curriculum, adapter_cfg: dict,
        dist: Dist, say, resume_from: Path | None = None,
    ):  # fmt: skip
        self.cfg, self.run_dir, self.model, self.optimizer = cfg, run_dir, model, optimizer
        self.curriculum, self.adapter_cfg, self.dist, self.say = curriculum, adapter_cfg, dist, say
        self.resume_from = resume_from
        self.folder = RunFolder(run_dir)
        self.metrics_log = JsonlWriter(self.folder.metrics_file)
        self.samples_log = JsonlWriter(self.folder.samples_file)
        self.settings = start_settings(cfg)
        fresh = resume_from is None and dist.size == 1
        self.kept = kept_start(self.folder, self.settings) if fresh else None
        self.go_on = cfg.output.on_full_disk == "continue"
        self.start, self.counters = begin(
            dist, self.folder, resume_from, model, optimizer, curriculum, say,
            self.kept and self.kept.get("base"),
        )  # fmt: skip
        # (a resume's once its checkpoint has loaded: one that fails changes nothing)
        dist.run_on_main(lambda: self.folder.write_config(cfg))

    def base_eval(self, evaluate_fn, trackers, info) -> None:
        """The base model's held-out figures (rank 0): where the curves in eval.jsonl
        start; kept from a stopped start with the same settings."""
        base = self.kept and self.kept.get("base")
        if base:
            info("held-out before training: kept from the start that was stopped")
        else:
            base = evaluate_fn(0, {"rollout_tokens": 0})
            self.kept = {"settings": self.settings, "base": base, "sft_step": 0}
            if self.dist.size == 1:
                keep_start(self.folder, self.kept, None, None, self.go_on, self.say)
        trackers.log(0, base)
        shown = {
            k: round(v, 3) for k, v in base.items() if k.count("/") == 1 and k != "time/eval_s"
        }
        info(f"held-out before training: {shown}")

    def warm_start_keeper(self):
        """`warm_start`'s `on_step`: keeps each of its steps but the last (step 0's
        checkpoint keeps that one) in a single-process run."""
        base = (self.kept or {}).get("base")

        def keep(k: int, sft_optimizer, nll: list[float], seconds: float) -> None:
            if self.dist.size == 1 and k < self.cfg.train.sft_steps:
                state = {"settings": self.settings, "base": base, "sft_step": k}
                state.update(nll=nll, seconds=seconds)
                keep_start(self.folder, state, self.model, sft_optimizer, self.go_on, self.say)

        return keep

    def write_warm_start(self, summary: dict) -> None:
        self.dist.run_on_main(
            lambda: write_atomic(self.folder.warmstart_file, json.dumps(summary) + "\n")
        )

    def reference(self):
        """The KL term's reference adapters (`start_reference`)."""
        return start_reference(self.cfg, self.folder, self.model, self.resume_from, self.dist)

    def checkpoint(self, step: int, go_on: bool) -> None:
        """Save step `step` on rank 0 only (a failure there stops every rank); with
        `go_on`, a full disk costs only this checkpoint (`save`)."""
        state = TrainState(step, self.counters.__dict__.copy(), self.curriculum.state_dict())
        args = (self.run_dir, step, self.model, self.optimizer, self.adapter_cfg, state)
        args += (self.cfg.output.keep_last,)
        self.dist.run_on_main(lambda: save(args, go_on, self.say))

    def write_step(self, step: int, metrics: dict, samples, trackers) -> None:
        """The step's metrics, `samples()` and their trackers' copy (on rank 0)."""

        def write() -> None:
            self.metrics_log.write(metrics)
            records = samples()
            for record in records:
                self.samples_log.write(record)
            trackers.log(step, metrics, records)

        self.dist.run_on_main(write)


class Interrupted(Exception):
    """Ctrl-C: the run stopped at the end of step `step`, saved there."""

    def __init__(self, step: int):
        super().__init__(f"interrupted after step {step}")
        self.step = step


class CtrlC:
    """The first Ctrl-C asks the loop to stop at the end of the step, with a checkpoint;
    a second one stops at once (KeyboardInterrupt). Only a single-process run in the
    main thread takes over SIGINT; elsewhere Ctrl-C stops at once, as before."""

    def __init__(self, say, enabled: bool):
        self.say, self.requested, self.prev = say, False, None
        self.enabled = enabled and threading.current_thread() is threading.main_thread()

    def __enter__(self):
        if self.enabled:
            self.prev = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc):
        if self.enabled:
            signal.signal(signal.SIGINT, self.prev)

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self.say("Ctrl-C: stopping at the end of this step, with a checkpoint (Ctrl-C again: now)")


@dataclass
class Counters:
    """Run-level counters, checkpointed with the run."""

    nonfinite_skipped: int = 0
    nonfinite_streak: int = 0
    zero_signal_streak: int = 0
    reward_errors: int = 0
    rollout_tokens: int = 0
    warned: list[str] = field(default_factory=list)
    # What the guards compare each step with: the values of the steps that updated.
    history: dict[str, list[float]] = field(default_factory=dict)
    guard_streak: dict[str, int] = field(default_factory=dict)

    @classmethod
    def saved(cls, counters: dict) -> Counters:
        """The counters a checkpoint's state.json holds, less those of the removed
        controllers (`REMOVED_COUNTERS`)."""
        return cls(**{k: v for k, v in counters.items() if k not in REMOVED_COUNTERS})


# What a checkpoint of a run from before the entropy and KL controllers were removed
# (config.REMOVED) holds besides: their weights, which such a run (its config checked
# by `config.without_removed`) held at grpo.entropy_coef 0 and a fixed grpo.beta.
REMOVED_COUNTERS = ("entropy_coef", "beta")


def unless_full_disk(write, go_on: bool, say, what: str):
    """`write()`'s result; with `go_on`, a full disk (CheckpointError from one) costs only
    this write: one line, and None."""
    try:
        return write()
    except CheckpointError as e:
        full = isinstance(e.__cause__, OSError) and e.__cause__.errno in FULL_DISK
        if not (go_on and full):
            raise
        if e.saved:
            say(f"{e}; going on (output.on_full_disk=continue)")
            return None
        say(f"{e}; going on without {what} (output.on_full_disk=continue)")
        return None


def save(args: tuple, go_on: bool, say) -> str:
    """save_checkpoint(*args); with `go_on`, a full disk costs only this checkpoint. A
    checkpoint written, the run's kept start (`start.partial`) is past."""
    final = unless_full_disk(lambda: save_checkpoint(*args), go_on, say, "this checkpoint")
    if final is None:
        return ""
    shutil.rmtree(RunFolder(args[0]).start_dir, ignore_errors=True)
    return str(final)


def start_settings(cfg: RunConfig) -> dict:
    """What decides a run's base evaluation and warm start: all its settings but its
    length and where it writes (a run may be started again to go further)."""
    settings = cfg.model_dump(mode="json", exclude={"output"})
    settings["train"].pop("steps", None)
    return settings


def kept_start(run: RunFolder, settings: dict) -> dict | None:
    """The kept start of a run (`checkpoint.save_start`) when its settings are
    `settings` (`start_settings`), else None (and nothing of it is kept)."""
    kept = load_start(run.path)
    if kept is None or kept.get("settings") != settings:
        shutil.rmtree(run.start_dir, ignore_errors=True)
        return None
    return kept


def keep_start(run: RunFolder, state: dict, model, optimizer, go_on: bool, say) -> None:
    """`save_start`; with `go_on`, a full disk costs only this (as a checkpoint)."""
    unless_full_disk(lambda: save_start(run.path, state, model, optimizer), go_on, say, "it")


def begin(
    dist: Dist, run: RunFolder, resume_from, model, optimizer, curriculum, say, keep_base=False
):
    """(first step to run - 1, counters): restored from `resume_from`, whose step the
    logs are cut back to; else fresh, with the same adapters on every rank (and
    eval.jsonl's base evaluation kept with `keep_base`)."""
    if resume_from is None:

        def clear() -> None:  # a run started again before its first checkpoint: no old steps
            for log in run.logs:
                cut_jsonl(log, 0 if keep_base and log == run.eval_file else -1)

        dist.run_on_main(clear)
        if dist.size > 1:  # the same adapters everywhere even if the ranks' RNGs differ
            sent = dist.broadcast_arrays(adapters(model) if dist.is_main else None)
            model.load_weights(list(sent.items()), strict=False)
        return 0, Counters()
    st = resume(dist, resume_from, model, optimizer)
    curriculum.load_state_dict(st.curriculum)

    def mend() -> None:
        shutil.rmtree(run.start_dir, ignore_errors=True)  # (past it)
        for log in run.logs:
            if note := cut_jsonl(log, st.step):
                say(note)
        publish(resume_from)

    dist.run_on_main(mend)
    return st.step, Counters.saved(st.counters)


def start_reference(cfg: RunConfig, run: RunFolder, model, resume_from, dist: Dist):
    """The adapters the KL term holds the policy near under `grpo.reference=start`:
    the model's as the GRPO steps begin, kept in the run folder, or read back from it
    on a resume. None: the base (the adapters switched off), which is also where a run
    without a warm start or an initial adapter starts."""
    if not cfg.reference_is_start:
        return None
    if resume_from is None:
        reference = adapters(model)
        dist.run_on_main(lambda: save_arrays(run.reference_file, reference))
        return reference

    held = []

    def read():
        if not run.reference_file.exists():
            raise TrainingError(
                f"grpo.reference=start: {run.reference_file} not found (the run was "
                "started with grpo.reference=base; resume it with that)"
            )
        held.append(load_arrays(run.reference_file))

    dist.run_on_main(read)  # (raises on every rank)
    return dist.broadcast_arrays(held[0] if held else None)


def resume(dist: Dist, step_dir: Path, model, optimizer) -> TrainState:
    """Rank 0 reads the checkpoint and sends it to the others (which need no copy
    of the run folder)."""
    if dist.size == 1:
        return load_checkpoint(step_dir, model, optimizer)
    st = dist.run_on_main(lambda: load_checkpoint(step_dir, model, optimizer).__dict__)
    sent = dist.broadcast_arrays(adapters(model) if dist.is_main else None)
    opt = dist.broadcast_arrays(dict(tree_flatten(optimizer.state)) if dist.is_main else None)
    if not dist.is_main:
        model.load_weights(list(sent.items()), strict=False)
        optimizer.state = tree_unflatten(list(opt.items()))
        mx.eval(model.parameters(), optimizer.state)
    return TrainState(**st)
