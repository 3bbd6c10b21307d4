"""The held-out evaluations `python -m mlx_grpo.compare` has run, kept per machine, so
that comparing runs against the same base evaluates the base once.

An entry is found only under a key made of everything that decides the results:
- the model: each file of its local folder by path, size, inode and times (small files,
  the config and tokenizer among them, by their bytes) and the load settings; a Hub id
  is never kept, since its snapshot can change under the same name;
- the adapters' bytes (`adapters.safetensors`, `adapter_config.json`);
- the code: the bytes of mlx_grpo, recipes and rewards, of the recipe's folder and of
  every module loaded from outside the Python installation, and the version of every
  installed distribution;
- the machine: CPU identity, BLAS and threads, MLX device;
- what is played: the recipe (folder, weights, params), the rollout settings the
  evaluation reads, every task, and the sampling settings.
A side is not kept when any of that cannot be read or is not plain data, nor when a
reward raised or a sample failed for a reason that depends on the moment (a time
limit, a crashed sandbox or browser, a kill from outside). Entries live in
`$MLX_GRPO_CACHE/evals` (by default ~/.cache/mlx-grpo/evals); `compare --no-cache`
evaluates anew and replaces them.
What a recipe reads from outside these (a judge model's files, the browser binary) is
not in the key: after changing those, use `--no-cache`.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import sys
import time
from pathlib import Path

import mlx_grpo
from mlx_grpo._paths import cache_root
from mlx_grpo.evaluate import TaskResult

FORMAT = 2
# Failure reasons that depend on load or timing, not on the reply alone.
TRANSIENT = frozenset({"timeout", "cpu_time", "crashed", "bad_report", "browser", "killed"})
_SKIP_DIRS = {"__pycache__", "docs", ".pytest_cache"}
_SMALL = 1 << 20  # files up to this size are keyed by their bytes
# The keys of mx.device_info() that identify a device (CPU, Metal, CUDA).
_CHIP_KEYS = frozenset(
    {"device_name", "architecture", "compute_capability_major", "compute_capability_minor"}
)


def cache_dir() -> Path:
    return cache_root() / "evals"


def _digest_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _files(folder: Path, suffixes: tuple[str, ...] | None = None) -> list[Path]:
    out = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("."))
        out += [Path(root) / f for f in sorted(files) if not suffixes or f.endswith(suffixes)]
    return out


def _model_files(folder: Path) -> list:
    """Each file by path, size, inode and times (which copies do not carry over), small
    ones by their bytes too; hashing gigabytes of weights on every compare would cost
    more than the evaluation it saves."""
    out = []
    for p in _files(folder):
        st = p.stat()
        small = _digest_file(p) if st.st_size <= _SMALL else None
        out.append([str(p.resolve()), st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns, small])
    return out


def _installed(path: str) -> bool:
    real = os.path.realpath(path)
    for prefix in {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}:
        root = os.path.realpath(prefix)
        try:
            if os.path.commonpath([real, root]) == root:
                return True
        except ValueError:  # another drive
            continue
    return False


def _project_sources(recipe_folder: Path) -> dict[str, str]:
    """sha256 of mlx_grpo, recipes and rewards, the recipe folder, and every module
    loaded from outside the Python installation (a recipe's own helpers)."""
    folders = [Path(mlx_grpo.__file__).parent, recipe_folder]
    for name in ("recipes", "rewards"):
        module = sys.modules.get(name)
        folders += [Path(p) for p in getattr(module, "__path__", [])]
    paths = {p for f in folders if f.is_dir() for p in _files(f)}
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if isinstance(file, str) and file.endswith(".py") and not _installed(file):
            paths.add(Path(file))
    return {str(p.resolve()): _digest_file(p) for p in sorted(paths) if p.is_file()}


def _distributions() -> list[list[str]]:
    return sorted(
        {(d.metadata["Name"] or "?", d.version) for d in importlib.metadata.distributions()}
    )


def _machine() -> dict:
    import mlx.core as mx

    from mlx_grpo.device import blas_in_use, cpu_signature

    try:
        info = mx.device_info()
    except Exception:  # older MLX, or a backend without it
        info = {}
    # What names the chip, not what it holds now: CUDA's device_info also reports
    # free_memory, which differs on every call and would make every key new.
    device = {k: info[k] for k in sorted(_CHIP_KEYS & set(info))} or None
    return {
        "cpu": cpu_signature(),
        "blas": blas_in_use(),
        "device": str(mx.default_device()),
        "device_info": device,
        "python": sys.version,
    }


def settings_material(cfg, recipe_folder: Path, tasks, samples, temperature, seed, batch_tasks):
    """What both sides of a compare share: code, libraries, machine, what is played.
    Computed once, before either side plays (which imports more modules)."""
    # --temperature decides; evaluation plays every episode to its end
    rollout = cfg.rollout.model_dump(exclude={"temperature", "end_on_ill_formed"})
    if temperature == 0:  # greedy: the sampling filters are not used
        for k in ("top_p", "top_k", "min_p"):
            rollout.pop(k, None)
    return {
        "format": FORMAT,
        "sources": _project_sources(recipe_folder),
        "distributions": _distributions(),
        "machine": _machine(),
        "recipe": [str(recipe_folder.resolve()), cfg.recipe.weights, cfg.recipe.params],
        "rewards": cfg.recipe.rewards,
        "rollout": rollout,
        "tasks": [[t.id, t.level, t.messages, t.payload] for t in tasks],
        "sampling": [samples, temperature, seed, batch_tasks],
    }


def side_key(side, settings: dict) -> str | None:
    """The key of one side's evaluation under `settings_material(...)` (a hex digest),
    or None when the side is not kept (a Hub id; a model, adapter or setting that
    cannot be read or is not plain data)."""
    from mlx_grpo.models import resolve_model_path

    try:
        folder = Path(resolve_model_path(side.model.path)).expanduser()
        if not folder.is_dir():
            return None  # a Hub id: the same name can load another snapshot
        adapter = None
        if side.weights is not None:
            names = ("adapters.safetensors", "adapter_config.json")  # what load_adapters reads
            adapter = {n: _digest_file(side.weights / n) for n in names}
        model = side.model.model_dump(exclude={"init_adapter"})  # compare never reads it
        if side.weights is None:
            settings = {**settings, "rollout": dict(settings["rollout"], fold_adapters=None)}
        material = {
            **settings,
            "model": model,
            "model_files": _model_files(folder),
            "adapter": adapter,
        }
        blob = json.dumps(material, sort_keys=True)  # no fallback: not plain data, no key
    except (OSError, TypeError, ValueError):
        return None
    return hashlib.sha256(blob.encode()).hexdigest()


def load(key: str | None, task_ids: list[str]) -> tuple[list[TaskResult], dict] | None:
    """(results, {"seconds", "saved"}) of a kept evaluation of these tasks, or None."""
    if key is None:
        return None
    try:
        data = json.loads((cache_dir() / f"{key}.json").read_text())
        results = [TaskResult(**r) for r in data["results"]]
        meta = {"seconds": float(data["seconds"]), "saved": str(data["saved"])}
    except (OSError, ValueError, KeyError, TypeError):  # absent, or cut short: evaluate again
        return None
    if [r.id for r in results] != task_ids:
        return None
    return results, meta


def keepable(results: list[TaskResult]) -> bool:
    """No reward raised and no sample failed for a reason of the moment."""
    return not any(r.errors or TRANSIENT & set(r.failures) for r in results)


def store(key: str | None, results: list[TaskResult], seconds: float) -> bool:
    """Keep an evaluation (written whole or not at all); False when it is not kept (no
    key, not `keepable`, or the cache folder cannot be written: the compare goes on)."""
    if key is None or not keepable(results):
        return False
    folder = cache_dir()
    data = {
        "saved": time.strftime("%Y-%m-%d %H:%M"),
        "seconds": seconds,
        "results": [r.to_dict() for r in results],
    }
    tmp = folder / f".{key}.{os.getpid()}.tmp"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data))
        os.replace(tmp, folder / f"{key}.json")
    except OSError:
        with contextlib.suppress(OSError):  # (no folder to remove it from, say)
            tmp.unlink(missing_ok=True)
        return False
    return True
