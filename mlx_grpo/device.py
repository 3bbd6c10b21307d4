"""The one device seam: what the rest of mlx-grpo asks of the machine it runs on.

On a GPU (Metal, CUDA) MLX's own ops are the fast ones, and nothing here changes them;
on Metal the training keeps its memory wired as mlx_lm's trainer does (`wire_memory`).
On a Linux CPU, MLX's wheel needs help to be fast: a BLAS loaded before MLX, native
attention and SwiGLU ops, vectorised exp and reductions, its allocator kept from
handing memory back, the update in two lanes. All of that is `mlx_grpo.cpu`, and this
module is the only one that reaches it, once `linux_cpu()` says MLX computes on a
Linux CPU: on Metal or CUDA none of its modules is imported.

  prepare_process()     before MLX is loaded (`import mlx_grpo`): fast BLAS, eval width
  prepare_training()    before the training loop or an evaluation: the allocator
                        (Linux CPU), Metal's wired-memory limit (`wire_memory`)
  adapt_model(model)    this device's attention and MLP in the model's blocks
  packs_rows(model)     whether the model runs the packed pass (`logprobs._Packed`)
  cpu_kernels()         the CPU's ops for `mlx_grpo.fastmath`, or None on a GPU
  Lanes, update_lanes   the update's pieces side by side (2 lanes on a CPU)
  blas_in_use(), blas_library(), native_in_use(), cpu_signature()
                        what this process computes with, for run headers and keys

Nothing here imports MLX at module level: `import mlx_grpo` calls `prepare_process`
before MLX is loaded.
"""

from __future__ import annotations

import platform
import sys
import threading
from collections.abc import Callable, Sequence
from contextlib import nullcontext

from mlx_grpo._backend import installed_builds

# MLX builds that compute on a GPU (`_backend.BUILDS`); `make install` leaves one only
# where it ran a kernel on the GPU.
GPU_BUILDS = frozenset({"cuda12", "cuda13"})


def linux_cpu() -> bool:
    """Whether MLX computes on a Linux CPU in this process: on Linux, where MLX's
    default device is its CPU. Before MLX is loaded (`prepare_process`), where its
    default device cannot be asked without loading it, the installed build says: no
    CUDA build, a CPU."""
    if sys.platform != "linux":
        return False
    mx = sys.modules.get("mlx.core")
    if mx is None:
        return not installed_builds() & GPU_BUILDS
    return mx.default_device() == mx.cpu


def prepare_process() -> None:
    """What must happen before MLX is loaded (`mlx_grpo/__init__.py` calls it): on a
    Linux CPU, a fast BLAS loaded globally (MLX's wheel binds its BLAS symbols as it
    loads, `cpu.blas`) and MLX's evaluation order widened for the update's lanes (MLX
    reads the width once, `cpu.lanes`). Nothing elsewhere."""
    if not linux_cpu():
        return
    from mlx_grpo.cpu import blas, lanes

    blas.use_fast_blas()
    lanes.widen_evaluation()


def prepare_training() -> bool:
    """Before the training loop, and before each batch of evaluation episodes: on a
    Linux CPU, glibc's allocator keeps the memory it frees (`cpu.allocator`: MLX frees
    and allocates the same buffers every step, and memory handed back comes again as
    fresh pages); on Metal, the wired-memory limit (`wire_memory`). Returns whether
    either applied; False elsewhere."""
    wired = wire_memory() is not None
    if not linux_cpu():
        return wired
    from mlx_grpo.cpu.allocator import keep_freed_memory

    return keep_freed_memory() or wired


def wire_memory() -> int | None:
    """On Metal, the wired-memory limit raised to the GPU's recommended working set, as
    mlx_lm's trainer does (`maybe_set_recommended_wired_limit`): memory up to it stays
    resident, so that a model near the machine's size is not paged out between steps
    (macOS 15 and later act on the limit; it is kept for the process). Returns the
    limit set, or None where Metal is unavailable or names no working set (a Linux
    CPU, CUDA)."""
    import mlx.core as mx

    if not mx.metal.is_available():
        return None
    limit = mx.device_info().get("max_recommended_working_set_size")
    if not limit:
        return None
    mx.set_wired_limit(limit)
    return limit


def adapt_model(model) -> int:
    """Give the model's blocks this device's attention and gated MLP: on a Linux CPU the
    CPU's own (`cpu.layers`: blocked attention, vectorised SwiGLU, and the hook the
    packed pass needs); elsewhere mlx_lm's stay. Returns how many modules changed."""
    if not linux_cpu():
        return 0
    from mlx_grpo.cpu import layers

    return layers.adapt(model)


def packs_rows(model) -> bool:
    """Whether every block's attention hands a packed layout (`logprobs._Packed`) the
    attention, so that the update runs one packed pass: only where `adapt_model` gave
    the blocks the CPU's attention (on a GPU, never)."""
    if not linux_cpu():
        return False
    from mlx_grpo.cpu.layers import attends_through_cache

    return all(attends_through_cache(layer.self_attn) for layer in model.layers)


def cpu_kernels():
    """`mlx_grpo.cpu.fastmath` where MLX computes on a Linux CPU now, else None (MLX's
    own ops are the fast ones): what `mlx_grpo.fastmath` dispatches on. Asked at every
    op, as the default device can change."""
    if not linux_cpu():
        return None
    from mlx_grpo.cpu import fastmath

    return fastmath


# ------------------------------------------------------------------------------ lanes


def _threads_shared(ways: int):
    """Each BLAS call on 1/`ways` of the threads inside the block, on a Linux CPU."""
    if not linux_cpu():
        return nullcontext()
    from mlx_grpo.cpu.blas import threads_shared

    return threads_shared(ways)


class Lanes:
    """`n` streams on the default device, for the update's independent pieces (a
    micro-batch's groups, or runs of a group's rows: `grpo.lane_pieces`), each built as
    a graph of its own and all evaluated together. On a CPU one lane's elementwise work
    then runs while another's GEMMs run, each BLAS call on its share of the threads
    (`cpu.lanes`)."""

    def __init__(self, n: int):
        import mlx.core as mx

        self.n = n
        self.streams = [mx.new_stream(mx.default_device()) for _ in range(n)] if n > 1 else []

    def map(self, fn: Callable, pieces: Sequence) -> list:
        """[fn(piece) for piece in pieces], evaluated: piece i's graph is built on
        stream i, and all of them are evaluated in one call, side by side. At most `n`
        pieces; a single piece runs as it is."""
        import mlx.core as mx

        if len(pieces) > self.n:
            raise ValueError(f"{len(pieces)} pieces for {self.n} lanes")
        if len(pieces) == 1:
            out = [fn(pieces[0])]
            mx.eval(out)
            return out
        with _threads_shared(len(pieces)):
            out = []
            for piece, stream in zip(pieces, self.streams):
                with mx.stream(stream):
                    out.append(fn(piece))
            mx.eval(out)
        return out


_MADE: dict[tuple[int, int], Lanes] = {}


def _auto_lanes() -> int:
    """The lanes that pay here: on a Linux CPU `cpu.lanes.auto_lanes` (2 with a BLAS of
    two threads or more and a wide evaluation order), else 1: a GPU runs a stream's
    kernels on all its cores already."""
    if not linux_cpu():
        return 1
    from mlx_grpo.cpu.lanes import auto_lanes

    return auto_lanes()


def update_lanes(requested: int | None, compiled: bool = False) -> Lanes:
    """The lanes of the update (`engine.update_lanes`; None: as many as pay on this
    device), made once per thread and count (MLX streams belong to the thread that made
    them). A compiled update (`engine.compile`) runs in one lane."""
    n = 1 if compiled else (_auto_lanes() if requested is None else requested)
    key = (threading.get_ident(), n)
    if key not in _MADE:
        _MADE[key] = Lanes(n)
    return _MADE[key]


# ------------------------------------------------------------------ what runs here


def blas_in_use() -> str:
    """What MLX computes its matmuls with in this process, for the first line of a run."""
    if linux_cpu():
        from mlx_grpo.cpu import blas

        return blas.blas_in_use()
    return "MLX built-in BLAS" if sys.platform == "linux" else "Accelerate"


def blas_library() -> str | None:
    """The BLAS this process gave MLX, as `MLX_GRPO_OPENBLAS` names it for another
    process (its library's path, or "builtin" for MLX's own); None where none was
    chosen (not a Linux CPU)."""
    if not linux_cpu():
        return None
    from mlx_grpo.cpu import blas

    chosen = blas.state["blas"]
    return None if chosen is None else (chosen.path or "builtin")


def native_in_use() -> bool:
    """Whether this process computes attention and SwiGLU with the native ops (loaded
    at their first use, on a Linux CPU only)."""
    if not linux_cpu():
        return False
    from mlx_grpo.cpu import native

    return native.loaded()


def cpu_signature() -> str:
    """This machine's CPU for cache keys and bench records: on a Linux CPU, its identity
    and feature flags (/proc/cpuinfo, `cpu.build.cpu_signature`); elsewhere, where the
    GPU computes, its architecture."""
    if not linux_cpu():
        return platform.machine()
    from mlx_grpo.cpu.build import cpu_signature as signature

    return signature()
