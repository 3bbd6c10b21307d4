"""Load OpenBLAS ahead of MLX on Linux CPUs.

MLX's Linux CPU wheel ships a reference BLAS (~5-7 GFLOP/s for float32 GEMM here).
Loading OpenBLAS from the `cmeel-openblas` wheel with RTLD_GLOBAL before the first
`import mlx` makes MLX resolve its BLAS calls there (~130-190 GFLOP/s). Everything
else (macOS, an mlx already imported, a missing libgfortran) keeps MLX's own BLAS.
MLX_GRPO_OPENBLAS=/path/to/libopenblas.so picks another OpenBLAS build;
MLX_GRPO_NO_OPENBLAS=1 turns the whole thing off.

When `mlx.launch` starts several ranks on one machine, each would run as many
OpenBLAS threads as there are cores, and OpenBLAS threads spin while they wait: the
ranks then slow each other down many times over. Unless OPENBLAS_NUM_THREADS is set,
each rank gets its share of the cores.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import sys
import sysconfig
from pathlib import Path

_state: dict[str, str | None] = {"blas": None}


def _openblas_path() -> Path | None:
    if override := os.environ.get("MLX_GRPO_OPENBLAS"):  # e.g. Debian's libopenblas0-pthread
        return Path(override)
    for base in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        lib = Path(base) / "cmeel.prefix" / "lib" / "libopenblas.so.0"
        if lib.exists():
            return lib
    return None


def local_ranks(env=os.environ) -> int:
    """How many ranks of this `mlx.launch` job run on this machine (1 outside one):
    the ranks whose ring address has the same IP as ours (MLX_HOSTFILE), or MPI's
    local size."""
    if mpi := env.get("OMPI_COMM_WORLD_LOCAL_SIZE"):
        return int(mpi)
    rank, path = env.get("MLX_RANK"), env.get("MLX_HOSTFILE")
    if rank is None or not path:
        return 1
    try:
        hosts = json.loads(Path(path).read_text())
        ips = [h[0].rsplit(":", 1)[0] for h in hosts]
        return ips.count(ips[int(rank)])
    except (OSError, ValueError, IndexError, KeyError, TypeError, AttributeError):
        return 1


def use_fast_blas() -> str | None:
    """Load OpenBLAS globally if this is Linux and mlx is not imported yet.

    Returns the path loaded, or None. Prints a one-line warning when OpenBLAS is
    installed but cannot be loaded (usually a missing libgfortran.so.5).
    """
    if _state["blas"] is not None or sys.platform != "linux":
        return _state["blas"]
    if os.environ.get("MLX_GRPO_NO_OPENBLAS") or "mlx.core" in sys.modules:
        return None
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    lib = _openblas_path()
    if lib is None:
        return None
    if "OPENBLAS_NUM_THREADS" not in os.environ and (n := local_ranks()) > 1:
        os.environ["OPENBLAS_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // n))
    try:
        ctypes.CDLL(str(lib), mode=os.RTLD_GLOBAL)
    except OSError as e:
        print(
            f"mlx-grpo: warning: OpenBLAS not usable ({e}); running on MLX's slower "
            "built-in BLAS (install libgfortran5 to fix)",
            file=sys.stderr,
        )
        return None
    _state["blas"] = str(lib)
    return _state["blas"]


def blas_in_use() -> str:
    """A short name of the BLAS MLX uses in this process, for logs."""
    return "openblas" if _state["blas"] else "builtin"
