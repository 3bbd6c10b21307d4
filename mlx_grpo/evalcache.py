"""The held-out evaluations `python -m mlx_grpo.compare` has run, kept per machine, so
that comparing runs against the same base evaluates the base once.

An entry is found only under a key made of everything that decides the results: the
model files (path, size and modification time of each) and the adapters' bytes, the
source of mlx_grpo and of the recipe (its folder and every module loaded from outside
the Python installation, such as the shared web agent and rewards), the library
versions, the BLAS and device, the recipe and rollout settings, every task, and the
sampling settings (samples, temperature, seed, tasks per batch). Change any of them and
the side is evaluated again. Results in which a reward raised are not kept (a transient
failure would otherwise stay). Entries live in `$MLX_GRPO_CACHE/evals` (by default
~/.cache/mlx-grpo/evals); `compare --no-cache` evaluates anew and replaces them.
"""

from __future__ import annotations

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

FORMAT = 1
LIBRARIES = ("mlx", "mlx-lm", "transformers", "tokenizers", "miniwob", "selenium")
_SKIP_DIRS = {"__pycache__", "docs", ".pytest_cache"}


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


def _stat(path: Path) -> list:
    st = path.stat()
    return [str(path.resolve()), st.st_size, st.st_mtime_ns]


def _model_files(model_path: str) -> list:
    """Each file of a local model folder by path, size and mtime (hashing gigabytes of
    weights on every compare would cost more than it saves); a Hub id by its local
    snapshot when one is cached, else by name."""
    local = Path(model_path).expanduser()
    if not local.is_dir():
        try:
            from huggingface_hub import snapshot_download

            local = Path(snapshot_download(model_path, local_files_only=True))
        except Exception:  # not downloaded yet: the load will fetch it (and fail if it cannot)
            return [model_path]
    return [_stat(p) for p in _files(local)]


def _project_sources(recipe_folder: Path) -> dict[str, str]:
    """sha256 of mlx_grpo's modules, the recipe folder's files and every other module
    loaded from outside the Python installation (a recipe's shared helpers)."""
    paths = set(_files(Path(mlx_grpo.__file__).parent, (".py",)))
    paths |= set(_files(recipe_folder)) if recipe_folder.is_dir() else set()
    installed = tuple({sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix})
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if file and file.endswith(".py") and not os.path.realpath(file).startswith(installed):
            paths.add(Path(file))
    return {str(p.resolve()): _digest_file(p) for p in sorted(paths) if p.is_file()}


def _versions() -> dict[str, str | None]:
    out = {}
    for name in LIBRARIES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def settings_material(cfg, recipe_folder: Path, tasks, samples, temperature, seed, batch_tasks):
    """What both sides of a compare share: code, libraries, backend, settings, tasks.
    Computed once, before either side plays (which imports more modules)."""
    import mlx.core as mx

    from mlx_grpo._blas import blas_in_use

    return {
        "format": FORMAT,
        "sources": _project_sources(recipe_folder),
        "versions": _versions(),
        "python": sys.version,
        "backend": [blas_in_use(), str(mx.default_device())],
        "recipe": cfg.recipe.model_dump(),
        "rollout": cfg.rollout.model_dump(),
        "tasks": [[t.id, t.level, t.messages, t.payload] for t in tasks],
        "sampling": [samples, temperature, seed, batch_tasks],
    }


def side_key(side, settings: dict) -> str:
    """The key of one side's evaluation under `settings_material(...)`: a hex digest."""
    from mlx_grpo.models import resolve_model_path

    adapter = None
    if side.adapter is not None:
        adapter = {f.name: _digest_file(f) for f in sorted(side.adapter.iterdir()) if f.is_file()}
    material = {
        **settings,
        "model": side.model.model_dump(),
        "model_files": _model_files(resolve_model_path(side.model.path)),
        "adapter": adapter,
    }
    blob = json.dumps(material, sort_keys=True, default=repr).encode()
    return hashlib.sha256(blob).hexdigest()


def load(key: str) -> tuple[list[TaskResult], dict] | None:
    """(results, {"seconds", "saved"}) of a kept evaluation, or None."""
    path = cache_dir() / f"{key}.json"
    try:
        data = json.loads(path.read_text())
        results = [TaskResult(**r) for r in data["results"]]
    except (OSError, ValueError, KeyError, TypeError):  # absent, or cut short: evaluate again
        return None
    return results, {"seconds": data["seconds"], "saved": data["saved"]}


def store(key: str, results: list[TaskResult], seconds: float) -> bool:
    """Keep an evaluation (written whole or not at all); False when it is not kept: a
    reward raised, or the cache folder cannot be written (the compare goes on)."""
    if any(r.errors for r in results):
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
        tmp.unlink(missing_ok=True)
        return False
    return True
