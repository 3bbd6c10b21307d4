"""Atomic checkpoints of everything a run needs to continue exactly (the folder layout:
`mlx_grpo.runfolder`).

A step folder is written under a temporary name, each file fsynced, and renamed when
complete; `latest` and the top-level adapters are replaced atomically
(mlx_grpo.durable), so a run killed at any moment, or a power cut, leaves the previous
checkpoint intact. A checkpoint that cannot be read (a truncated or foreign file) is
reported in one line naming the file.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from mlx_grpo.durable import crash_point, fsync_dir, write_atomic, write_new
from mlx_grpo.runfolder import RunFolder, step_of


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message is one line. `saved`: the
    step folder itself was written (only `latest` or the adapters' copy were not)."""

    def __init__(self, message: str, saved: bool = False):
        super().__init__(message)
        self.saved = saved


@dataclass
class TrainState:
    step: int
    counters: dict
    curriculum: dict


def _write_json(path: Path, data) -> None:
    write_atomic(path, json.dumps(data, indent=2) + "\n")


def _save_safetensors(path: Path, arrays: dict) -> None:
    """Serialized by MLX, written by Python: a full disk is OSError(ENOSPC) naming the
    file (MLX's own write says only '[write] Unable to write N bytes')."""
    buf = io.BytesIO()
    mx.save_safetensors(buf, arrays)
    write_new(path, buf.getbuffer())
    crash_point()


def save_arrays(path: Path, arrays: dict) -> None:
    """`arrays` in the safetensors file `path`, whole or not at all (written beside it
    under a temporary name, fsynced, then renamed)."""
    tmp = path.with_name(f".{path.stem}.tmp.safetensors")
    try:
        _save_safetensors(tmp, arrays)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def save_checkpoint(
    run_dir: Path,
    step: int,
    model,
    optimizer,
    adapter_config: dict,
    state: TrainState,
    keep_last: int,
) -> Path:
    """Write step folder `step-NNNNNN`, point `latest` at it, prune older ones (the
    newest `keep_last` of them stay, this one included)."""
    run = RunFolder(run_dir)
    final, tmp = run.step_dir(step), run.tmp_step_dir(step)
    prev = run.latest_step_dir()
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        adapters = dict(tree_flatten(model.trainable_parameters()))
        _save_safetensors(tmp / run.ADAPTERS, adapters)
        _write_json(tmp / run.ADAPTER_CONFIG, adapter_config)
        _save_safetensors(tmp / run.OPTIMIZER, dict(tree_flatten(optimizer.state)))
        _write_json(
            tmp / run.STATE,
            {"step": state.step, "counters": state.counters, "curriculum": state.curriculum},
        )
        fsync_dir(tmp)
        if final.exists():
            remove_step(final)
        os.rename(tmp, final)
        fsync_dir(run.path)
        crash_point()
    except (OSError, RuntimeError) as e:  # RuntimeError: MLX failing to serialize
        shutil.rmtree(tmp, ignore_errors=True)
        kept = f"; the previous checkpoint {prev} is intact" if prev else ""
        why = getattr(e, "strerror", None) or _why(e)
        raise CheckpointError(f"checkpoint: cannot write {final}: {why}{kept}") from e
    try:
        publish(final)
    except OSError as e:
        raise CheckpointError(
            f"checkpoint: {final} is saved, but `latest` or the run's copy of its adapters "
            f"could not be updated: {e.strerror or _why(e)} (a resume mends them)",
            saved=True,
        ) from e
    prune(run, step, keep_last)
    return final


def prune(run: RunFolder, step: int, keep_last: int) -> None:
    """Remove the step folders before `step` but the newest `keep_last - 1` complete
    ones, with what a kill left: a folder whose removal it cut short (no state.json),
    a temporary step folder it cut short. Step 0 (the warm start's adapters, what the
    GRPO steps are measured against: `compare --a <run>@0 --b <run>`) always stays."""
    older = [d for d in run.step_dirs(complete=False) if step_of(d.name) < step]
    whole = [d for d in older if (d / run.STATE).exists()]
    older = [d for d in older if not (step_of(d.name) == 0 and d in whole)]
    kept = set(whole[-(keep_last - 1) :]) if keep_last > 1 else set()
    for old in older:
        if old not in kept:
            remove_step(old)
    for old in run.path.glob(".tmp-step-*"):
        shutil.rmtree(old, ignore_errors=True)


def remove_step(folder: Path) -> None:
    """A step folder removed state.json first, so that a kill partway leaves a folder
    that is not taken for a checkpoint (and is removed by the next `prune`)."""
    (folder / RunFolder.STATE).unlink(missing_ok=True)
    fsync_dir(folder)
    shutil.rmtree(folder, ignore_errors=True)


def save_start(run_dir: Path, state: dict, model=None, optimizer=None) -> None:
    """What a run has done before its first checkpoint (`state`: its base evaluation,
    the warm-start steps taken so far), kept so that a kill there loses none of it.
    With `model`, its adapters and `optimizer`'s state go with it. The files of
    warm-start step k carry k in their names and `state.json` names k last (atomically),
    so a kill at any instant leaves a state whose files are whole."""
    folder = RunFolder(run_dir).start_dir
    k = int(state.get("sft_step", 0))
    try:
        folder.mkdir(exist_ok=True)
        if model is not None:
            save_arrays(
                folder / f"adapters-{k}.safetensors",
                dict(tree_flatten(model.trainable_parameters())),
            )
            save_arrays(folder / f"optimizer-{k}.safetensors", dict(tree_flatten(optimizer.state)))
        _write_json(folder / RunFolder.STATE, state)
        crash_point()
    except (OSError, RuntimeError) as e:
        why = getattr(e, "strerror", None) or _why(e)
        raise CheckpointError(f"checkpoint: cannot write {folder}: {why}") from e
    for old in folder.glob("*.safetensors"):
        if not old.name.endswith(f"-{k}.safetensors"):
            old.unlink(missing_ok=True)


def load_start(run_dir: Path) -> dict | None:
    """`save_start`'s state (None when there is none, or it cannot be read), with
    "adapters" and "optimizer" (flat dicts of arrays) when a warm-start step was kept."""
    folder = RunFolder(run_dir).start_dir
    try:
        state = json.loads((folder / RunFolder.STATE).read_text())
        k = int(state.get("sft_step", 0))
        if k:
            state["adapters"] = load_arrays(folder / f"adapters-{k}.safetensors")
            state["optimizer"] = load_arrays(folder / f"optimizer-{k}.safetensors")
    except (OSError, ValueError, TypeError, AttributeError, CheckpointError):
        return None
    return state if isinstance(state, dict) else None


def publish(step_dir: Path) -> None:
    """Point `latest` at `step_dir` and make the run folder's top-level adapters its own
    (atomically, each file; a no-op where they already are): a resumed run redoes this,
    in case a kill came after the step folder was renamed into place."""
    run = RunFolder(step_dir.parent)
    if run.latest_named() != step_dir.name:
        _write_json(run.latest_file, {"step_dir": step_dir.name, "step": step_of(step_dir.name)})
    for name in (run.ADAPTERS, run.ADAPTER_CONFIG):
        data, top = (step_dir / name).read_bytes(), run.path / name
        if not top.exists() or top.read_bytes() != data:
            write_atomic(top, data)


def load_checkpoint(step_dir: Path, model, optimizer) -> TrainState:
    """Restore adapters and optimizer state in place; return the trainer state.

    Every mismatch between the checkpoint's adapters and the model is reported at once;
    an unreadable file (truncated, corrupt, not a checkpoint's) in one line naming it.
    """
    adapters = load_arrays(step_dir / RunFolder.ADAPTERS)
    expected = dict(tree_flatten(model.trainable_parameters()))
    errors = [f"missing {k}" for k in expected if k not in adapters]
    errors += [f"unexpected {k}" for k in adapters if k not in expected]
    errors += [
        f"{k}: shape {tuple(v.shape)} != model {tuple(expected[k].shape)}"
        for k, v in adapters.items()
        if k in expected and v.shape != expected[k].shape
    ]
    if errors:
        shown = "; ".join(errors[:5]) + (f"; +{len(errors) - 5} more" if len(errors) > 5 else "")
        raise CheckpointError(f"checkpoint: {step_dir} does not fit this model's LoRA: {shown}")
    opt_file = step_dir / RunFolder.OPTIMIZER
    opt_state = load_arrays(opt_file)
    state_file = step_dir / RunFolder.STATE
    try:
        state = json.loads(state_file.read_text())
        train_state = TrainState(int(state["step"]), dict(state["counters"]), state["curriculum"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint: {state_file} is unreadable ({_why(e)})") from None
    if not isinstance(train_state.curriculum, dict):
        raise CheckpointError(f"checkpoint: {state_file} is unreadable (no curriculum state)")
    model.load_weights(list(adapters.items()), strict=False)
    try:
        optimizer.state = tree_unflatten(list(opt_state.items()))
        mx.eval(model.parameters(), optimizer.state)
    except (ValueError, TypeError, KeyError) as e:
        raise CheckpointError(f"checkpoint: {opt_file} does not fit ({_why(e)})") from None
    return train_state


def load_arrays(path: Path) -> dict:
    """The arrays of a safetensors file, or CheckpointError in one line."""
    try:
        arrays = mx.load(str(path))
    except (OSError, RuntimeError, ValueError) as e:
        raise CheckpointError(f"checkpoint: {path} is unreadable ({_why(e)})") from None
    if not isinstance(arrays, dict):
        raise CheckpointError(f"checkpoint: {path} is not a safetensors file")
    return arrays


def _why(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:200]
