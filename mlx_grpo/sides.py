"""The two sides of `python -m mlx_grpo.compare`: what a spec names (`default`, a model
folder or Hub id, a run folder, a step folder, `RUN@step-NNNNNN`), loading it, and the
check that both sides tokenize the prompts alike."""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from mlx_grpo.checkpoint import CheckpointError, load_arrays
from mlx_grpo.config import ConfigError, ModelConfig, RunConfig, build_config
from mlx_grpo.recipe import Recipe, Task
from mlx_grpo.runfolder import RunFolder, step_of


class CompareError(RuntimeError):
    """Two sides that cannot be compared as asked; the message is one line."""


@dataclass
class Side:
    """One model to evaluate: a base model and, optionally, LoRA adapters."""

    flag: str  # "a" or "b": the command-line option that named it
    spec: str  # as given
    model: ModelConfig
    adapter: Path | None = None  # folder with adapters.safetensors + adapter_config.json
    run_dir: Path | None = None
    run_config: RunConfig | None = None
    step: int | None = None
    # A run's (or step's) adapters as they were when the command began (`_freeze`): the
    # run may still be training, replacing its own copy and pruning old steps.
    frozen: Path | None = None

    @property
    def weights(self) -> Path | None:
        """The folder the adapters are read from (loaded, hashed for the cache)."""
        return self.frozen or self.adapter

    @property
    def name(self) -> str:
        return self.flag.upper()

    def describe(self) -> str:
        if self.run_dir is not None:
            at = f", step {self.step}" if self.step is not None else ""
            return f"run {self.run_dir}{at} (model {self.model.path} + LoRA)"
        if self.adapter is not None:
            return f"{self.model.path} + adapter {self.adapter}"
        return "default (embedded SmolLM2-135M-Instruct)" if self.spec == "default" else self.spec

    def to_dict(self) -> dict:
        return {
            "spec": self.spec,
            "description": self.describe(),
            "model": self.model.model_dump(),
            "adapter": str(self.adapter) if self.adapter else None,
            "run": str(self.run_dir) if self.run_dir else None,
            "step": self.step,
            "trained_on": self.run_config.recipe.model_dump() if self.run_config else None,
        }


def _read_run_config(run_dir: Path, flag: str) -> RunConfig:
    path = RunFolder(run_dir).config_file
    try:
        return build_config(json.loads(path.read_text()), source="config")
    except (ValueError, ConfigError) as e:
        first = str(e).strip().splitlines()[0]
        raise CompareError(f"--{flag}: {path}: {first}") from None


def _check_adapter(path: Path, what: str) -> None:
    names = (RunFolder.ADAPTERS, RunFolder.ADAPTER_CONFIG)
    missing = [f for f in names if not (path / f).exists()]
    if missing:
        raise CompareError(f"{what}: {path} has no {' or '.join(missing)}")
    # Read now: a damaged file must not stop the command after side A's evaluation.
    try:
        load_arrays(path / RunFolder.ADAPTERS)
    except CheckpointError as e:
        raise CompareError(f"{what}: {str(e).removeprefix('checkpoint: ')}") from None
    config = path / RunFolder.ADAPTER_CONFIG
    try:
        if not isinstance(json.loads(config.read_text()), dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        raise CompareError(f"{what}: {config} is unreadable ({e})") from None


def _looks_local(spec: str) -> bool:
    """A path the user meant as a folder here (not a Hub repo id `org/name`)."""
    if spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        return True
    return Path(spec).parent.is_dir()  # e.g. checkpoints/<run> with checkpoints/ here


def resolve_side(flag: str, spec: str, adapter: str | None = None) -> Side:
    """Parse a side's spec (see the module docstring); nothing is loaded yet."""
    opt = f"--{flag} {spec}"
    step_dir = None
    head, at, tail = spec.rpartition("@")
    if at and head and Path(head).expanduser().is_dir():
        run_dir = Path(head).expanduser()
        run = RunFolder(run_dir)
        step_dir = run.find_step(tail)  # RUN@20 or RUN@step-..
        if step_dir is None:
            have = [p.name for p in run.step_dirs(complete=False)]
            raise CompareError(
                f"{opt}: no checkpoint '{tail}' in {run_dir} (has: {', '.join(have) or 'none'})"
            )
    else:
        path = Path(spec).expanduser()
        if spec == "default":
            return _with_adapter(Side(flag, spec, ModelConfig(path="default")), adapter)
        if not path.exists():
            if _looks_local(spec):
                raise CompareError(f"{opt}: no such run or model folder")
            return _with_adapter(Side(flag, spec, ModelConfig(path=spec)), adapter)  # Hub id
        if not path.is_dir():
            raise CompareError(f"{opt}: not a folder (give a run folder or a model folder)")
        if held := RunFolder.holding(path):
            run_dir, step_dir = held[0].path, (held[1] if held[1] != held[0].path else None)
        elif (path / RunFolder.CONFIG).exists():
            return _with_adapter(Side(flag, spec, ModelConfig(path=spec)), adapter)
        else:
            raise CompareError(f"{opt}: neither a model folder nor a run folder (no config.json)")

    if adapter is not None:
        raise CompareError(f"--{flag}-adapter: {spec} is a run folder, which has its own adapters")
    cfg = _read_run_config(run_dir, flag)
    folder = step_dir or RunFolder(run_dir).adapters_dir()
    if not (folder / RunFolder.ADAPTERS).exists():
        raise CompareError(f"{opt}: {folder} has no adapters.safetensors (no checkpoint saved yet)")
    _check_adapter(folder, opt)
    frozen = _freeze(folder, opt)
    return Side(flag, spec, cfg.model, folder, run_dir, cfg, RunFolder.saved_step(frozen), frozen)


def _freeze(folder: Path, opt: str, run: bool = True) -> Path:
    """A copy of a run's (or step's, or with `run` False an adapter folder's) adapters
    and the file naming their step, removed at exit: a run that trains on during the
    comparison replaces its own copy of the adapters and prunes old steps; the side stays
    what it was when the command began. A run's step folder must still hold its
    state.json (else it was being pruned)."""
    name = folder.resolve().name or "adapters"  # ("." names the folder it is)
    names = [RunFolder.ADAPTERS, RunFolder.ADAPTER_CONFIG]
    names.append(RunFolder.STATE if step_of(name) is not None else RunFolder.LATEST)
    needed = names if run and names[2] == RunFolder.STATE else names[:2]
    tmp = Path(tempfile.mkdtemp(prefix="mlx-grpo-side-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)  # the temporary folder only
    copy = tmp / name
    try:
        copy.mkdir()
        for file in names:
            if (folder / file).exists() or file in needed:
                shutil.copyfile(folder / file, copy / file)
    except FileNotFoundError:
        raise CompareError(
            f"{opt}: {folder} was removed while being read (a training run pruned it); "
            "run the command again"
        ) from None
    except OSError as e:
        raise CompareError(
            f"{opt}: cannot copy its adapters to {tmp} ({e.strerror}); set TMPDIR "
            "to a folder with room"
        ) from None
    return copy


def _with_adapter(side: Side, adapter: str | None) -> Side:
    if adapter is not None:
        side.adapter = Path(adapter).expanduser()
        _check_adapter(side.adapter, f"--{side.flag}-adapter")
        side.frozen = _freeze(side.adapter, f"--{side.flag}-adapter", run=False)
    return side


def load_side(side: Side):
    """(model, tokenizer) of a side: the base through models.load_model (dequantized on
    CPU), then its adapters with mlx_lm's load_adapters, as `mlx_lm.load(...,
    adapter_path=...)` would."""
    from mlx_lm.tuner.utils import load_adapters

    from mlx_grpo.models import ModelLoadError, load_model

    try:
        model, tokenizer = load_model(side.model)
    except ModelLoadError as e:
        raise CompareError(f"--{side.flag} {side.spec}: {e}") from None
    if side.weights is not None:
        try:
            load_adapters(model, str(side.weights))
        except (ValueError, KeyError, TypeError, FileNotFoundError) as e:
            lines = [x.strip() for x in str(e).strip().splitlines() if x.strip()]
            more = f" ({lines[1]}{'; ...' if len(lines) > 2 else ''})" if len(lines) > 1 else ""
            raise CompareError(
                f"--{side.flag} {side.spec}: the adapters in {side.adapter} do not fit "
                f"{side.model.path}: {lines[0] if lines else type(e).__name__}{more}"
            ) from None
    return model, tokenizer


def _load_tokenizer(side: Side):
    from mlx_lm.utils import load_tokenizer

    from mlx_grpo.models import resolve_model_path

    try:
        return load_tokenizer(resolve_model_path(side.model.path))
    except Exception as e:  # hub, file and tokenizer errors of many types: one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CompareError(
            f"--{side.flag} {side.spec}: cannot load the tokenizer of {side.model.path}: {first}"
        ) from None


def prompt_tokens(tokenizer, recipe: Recipe, tasks: list[Task], max_prompt_tokens: int):
    """The token ids of every task's first prompt, as the rollout encodes it (each
    environment closed again: a MiniWoB one holds a browser window)."""
    from mlx_grpo.warmstart import first_prompt

    return [first_prompt(recipe, tokenizer, t, max_prompt_tokens) for t in tasks]


def check_tokenizers(a: Side, b: Side, recipe: Recipe, tasks: list[Task], max_prompt_tokens: int):
    """Refuse when the two sides would see different prompt tokens: then the same task
    is not the same input, and the sides' token counts and truncation differ."""
    if a.model.path == b.model.path:
        return
    ta, tb = _load_tokenizer(a), _load_tokenizer(b)
    pa = prompt_tokens(ta, recipe, tasks, max_prompt_tokens)
    pb = prompt_tokens(tb, recipe, tasks, max_prompt_tokens)
    for task, x, y in zip(tasks, pa, pb):
        if x != y:
            at = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
            raise CompareError(
                f"A ({a.model.path}) and B ({b.model.path}) tokenize the prompts differently "
                f"(task {task.id}: {len(x)} vs {len(y)} tokens, first difference at token "
                f"{at}); compare models that share a tokenizer, or pass "
                "--allow-tokenizer-mismatch"
            )
