"""How the Linux-CPU layer builds its native pieces and proves them before use.

Three pieces of `mlx_grpo.cpu` are native code: the scipy-openblas32 forwarding shim
(`blas`), the skinny-GEMM front (`skinny`, `skinny.c`) and the attention and SwiGLU
ops (`native`, `packed_attention.cpp`). Each is compiled once per machine with the
system compiler into the cache, and each library (these and every BLAS candidate) is
first run in a child process, so that one that crashes or computes wrong numbers on
this CPU costs a verdict, not the process. The verdicts are cached, keyed by what they
depend on: the probe's code, the library files, this CPU (`cpu_signature`) and this
MLX (`mlx_version`). One module holds that mechanism so that the three agree on it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

from mlx_grpo._paths import cache_root

# The compilers tried for each language, first the one its variable names.
COMPILERS = {"c": ("CC", "cc", "gcc", "clang"), "c++": ("CXX", "c++", "g++", "clang++")}


def compiler(language: str = "c") -> str | None:
    """The system compiler for "c" or "c++", or None."""
    var, *names = COMPILERS[language]
    return next((c for c in (os.environ.get(var), *names) if c and shutil.which(c)), None)


def compile_library(
    source: str,
    name: str,
    args: list[str],
    key: str = "",
    language: str = "c",
    folder: str = "blas",
    timeout: float = 120,
    announce: str = "",
) -> tuple[Path | None, str]:
    """`source` (in `language`, "c" or "c++") compiled with the system compiler into a
    shared library in the cache's `folder`, once per source, arguments and `key`; or
    None and why not. `announce`, if given, goes to stderr as the compiler starts."""
    digest = hashlib.sha256(f"{source}{args}{key}".encode()).hexdigest()[:16]
    out = cache_root() / folder / f"{name}-{digest}.so"
    if out.exists():
        return out, ""
    cc = compiler(language)
    if cc is None:
        return None, f"needs a {language.upper()} compiler ({COMPILERS[language][1]}) to be built"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            src = Path(tmp) / f"{name}.{'cpp' if language == 'c++' else 'c'}"
            src.write_text(source)
            if announce:
                print(announce, file=sys.stderr, flush=True)
            cmd = [cc, "-shared", "-fPIC", "-o", f"{tmp}/{name}.so", str(src), *args]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            if done.returncode != 0:
                return None, f"did not compile: {last_line(done.stderr)}"
            os.replace(f"{tmp}/{name}.so", out)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"could not be built: {e}"
    return out, ""


def last_line(text: str) -> str:
    """The last line of a tool's output that says something, cut to 200 characters."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:200] if lines else ""


def cpu_signature() -> str:
    """The first processor's identity and feature flags from /proc/cpuinfo."""
    keep = ("vendor_id", "cpu family", "model", "model name", "flags", "features",
            "cpu implementer", "cpu architecture", "cpu variant", "cpu part")  # fmt: skip
    try:
        block = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        return platform.machine()
    fields = [line for line in block.splitlines() if line.split(":")[0].strip().lower() in keep]
    return platform.machine() + "\n" + "\n".join(fields)


def mlx_version() -> str:
    """MLX's version and its core library's identity (mlx-cpu and mlx-cuda-13 share a
    version; a build swapped in place is another library)."""
    version = "?"
    for dist in ("mlx", "mlx-cpu"):
        try:
            version = metadata.version(dist)
            break
        except metadata.PackageNotFoundError:
            continue
    try:
        spec = importlib.util.find_spec("mlx")
        roots = list(spec.submodule_search_locations or []) if spec else []
    except (ImportError, ValueError):
        roots = []
    libs = sorted(f for root in roots for f in Path(root).glob("lib/libmlx*"))
    ids = []
    for f in libs:
        try:
            st = f.stat()
            ids.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
        except OSError:
            continue
    return " ".join([version, *ids])


def verdict_file(folder: str, prefix: str, ident: list) -> Path:
    """Where the verdict of a probe is kept: `ident` lists everything its result
    depends on (JSON values), so that a change in any of them is a miss, not a stale
    verdict."""
    key = hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:24]
    return cache_root() / folder / f"{prefix}-{key}.json"


def cached_verdict(path: Path) -> dict | None:
    """A probe's verdict saved at `path` ({"ok": bool, ...}), or None where there is none
    or it is not one (a torn write, an edit, another version's format): a miss."""
    try:
        verdict = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return verdict if isinstance(verdict, dict) and isinstance(verdict.get("ok"), bool) else None


def save_verdict(path: Path, verdict: dict) -> None:
    """Save a probe's verdict at `path`, whole or not at all (a write then a rename)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(verdict))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache only costs a probe per process
