"""Atomic checkpoints of everything a run needs to continue exactly.

    checkpoints/<run>/
      config.json                 the run's full config
      adapters.safetensors        latest adapters  } mlx_lm.load(model, adapter_path=<run>)
      adapter_config.json                          }
      latest                      name of the newest complete step folder
      step-000020/                adapters, adapter_config.json, optimizer.safetensors,
                                  state.json (step, counters, curriculum)
      metrics.jsonl, samples.jsonl

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

STEP_PREFIX = "step-"


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


def step_dirs(run_dir: Path) -> list[Path]:
    return sorted(p for p in run_dir.glob(f"{STEP_PREFIX}*") if (p / "state.json").exists())


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
    final = run_dir / f"{STEP_PREFIX}{step:06d}"
    tmp = run_dir / f".tmp-{final.name}"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        adapters = dict(tree_flatten(model.trainable_parameters()))
        mx.save_safetensors(str(tmp / "adapters.safetensors"), adapters)
        _write_json(tmp / "adapter_config.json", adapter_config)
        mx.save_safetensors(str(tmp / "optimizer.safetensors"), dict(tree_flatten(optimizer.state)))
        _write_json(
            tmp / "state.json",
            {"step": state.step, "counters": state.counters, "curriculum": state.curriculum},
        )
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        _write_json(run_dir / "latest", {"step_dir": final.name, "step": step})
        _replace_file(final / "adapters.safetensors", run_dir / "adapters.safetensors")
        _replace_file(final / "adapter_config.json", run_dir / "adapter_config.json")
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        prev = latest_step_dir(run_dir)
        kept = f"; the previous checkpoint {prev} is intact" if prev else ""
        raise CheckpointError(f"checkpoint: cannot write {final}: {e.strerror or e}{kept}") from e
    for old in step_dirs(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def saved_step(folder: Path) -> int | None:
    """The step a step folder (its state.json) or a run folder (its `latest` pointer)
    holds, or None when there is none to read."""
    name = "state.json" if folder.name.startswith(STEP_PREFIX) else "latest"
    try:
        return int(json.loads((folder / name).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def latest_step_dir(run_dir: Path) -> Path | None:
    """The newest complete step folder (from `latest`, else by name), or None."""
    pointer = run_dir / "latest"
    if pointer.exists():
        try:
            cand = run_dir / json.loads(pointer.read_text())["step_dir"]
            if (cand / "state.json").exists():
                return cand
        except (ValueError, KeyError):
            pass
    dirs = step_dirs(run_dir)
    return dirs[-1] if dirs else None


def load_checkpoint(step_dir: Path, model, optimizer) -> TrainState:
    """Restore adapters and optimizer state in place; return the trainer state.

    Every mismatch between the checkpoint's adapters and the model is reported at once.
    """
    adapters = mx.load(str(step_dir / "adapters.safetensors"))
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
    opt_state = mx.load(str(step_dir / "optimizer.safetensors"))
    optimizer.state = tree_unflatten(list(opt_state.items()))
    state = json.loads((step_dir / "state.json").read_text())
    mx.eval(model.parameters(), optimizer.state)
    return TrainState(state["step"], state["counters"], state["curriculum"])
