"""Atomic checkpoints of everything a run needs to continue exactly (the folder layout:
`mlx_grpo.runfolder`).

A step folder is written under a temporary name and renamed when complete, and
`latest` and the top-level adapters are replaced with os.replace, so a run killed at
any moment leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from mlx_grpo.runfolder import RunFolder


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message is one line."""


@dataclass
class TrainState:
    step: int
    counters: dict
    curriculum: dict


def _write_json(path: Path, data) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def _replace_file(src: Path, dst: Path) -> None:
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def save_checkpoint(
    run_dir: Path,
    step: int,
    model,
    optimizer,
    adapter_config: dict,
    state: TrainState,
    keep_last: int,
) -> Path:
    """Write step folder `step-NNNNNN`, point `latest` at it, prune old ones."""
    run = RunFolder(run_dir)
    final, tmp = run.step_dir(step), run.tmp_step_dir(step)
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        adapters = dict(tree_flatten(model.trainable_parameters()))
        mx.save_safetensors(str(tmp / run.ADAPTERS), adapters)
        _write_json(tmp / run.ADAPTER_CONFIG, adapter_config)
        mx.save_safetensors(str(tmp / run.OPTIMIZER), dict(tree_flatten(optimizer.state)))
        _write_json(
            tmp / run.STATE,
            {"step": state.step, "counters": state.counters, "curriculum": state.curriculum},
        )
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        _write_json(run.latest_file, {"step_dir": final.name, "step": step})
        for name in (run.ADAPTERS, run.ADAPTER_CONFIG):
            _replace_file(final / name, run.path / name)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        prev = run.latest_step_dir()
        kept = f"; the previous checkpoint {prev} is intact" if prev else ""
        raise CheckpointError(f"checkpoint: cannot write {final}: {e.strerror or e}{kept}") from e
    for old in run.step_dirs()[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(step_dir: Path, model, optimizer) -> TrainState:
    """Restore adapters and optimizer state in place; return the trainer state.

    Every mismatch between the checkpoint's adapters and the model is reported at once.
    """
    adapters = mx.load(str(step_dir / RunFolder.ADAPTERS))
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
    model.load_weights(list(adapters.items()), strict=False)
    opt_state = mx.load(str(step_dir / RunFolder.OPTIMIZER))
    optimizer.state = tree_unflatten(list(opt_state.items()))
    state = json.loads((step_dir / RunFolder.STATE).read_text())
    mx.eval(model.parameters(), optimizer.state)
    return TrainState(state["step"], state["counters"], state["curriculum"])
