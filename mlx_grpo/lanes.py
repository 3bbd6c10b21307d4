"""The update's independent pieces side by side on a CPU (`grpo.update_lanes`).

MLX's CPU backend runs a stream's ops on one thread, and only the BLAS calls use more
than one core: while that thread does the elementwise work of a pass (norms, rotary
embeddings, attention's softmax, the log-softmax over the vocabulary, their gradients),
OpenBLAS's other threads wait. On the work unit's policy pass that is about half of
the time. The groups of a micro-batch do not depend on each other, so `Lanes` runs them
(or runs of a group's rows) as separate graphs on streams of their own, each BLAS call
with its share of the threads (`_blas.threads_shared`), and evaluates them together:
one lane's elementwise work runs while another's GEMMs run. The pieces' losses,
metrics and gradients sum to the batch's, as micro-batches' do (`grpo.lane_pieces`).

MLX evaluates a graph in breadth-first order only up to a width (`MLX_BFS_MAX_WIDTH`,
20 by default), deeper than that depth-first: two lanes' graphs would then be queued
one after the other. `mlx_grpo` widens it on CPU builds before MLX runs
(`mlx_grpo.EVAL_WIDTH`); where it is narrower (another build, or a width the user set),
the update runs in one lane unless `grpo.update_lanes` asks for more.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence

import mlx.core as mx

from mlx_grpo import EVAL_WIDTH, _blas

MLX_DEFAULT_WIDTH = 20


def auto_lanes() -> int:
    """2 where MLX computes on the CPU with a BLAS of two threads or more and evaluates
    wide enough for two lanes to interleave (`eval_width`), else 1: a GPU runs a
    stream's kernels on all its cores already, and lanes queued one after the other
    would only halve each one's BLAS threads."""
    blas = _blas._state["blas"]
    on_cpu = mx.default_device() == mx.cpu
    threads = blas is not None and (blas.threads or 0) >= 2
    return 2 if on_cpu and threads and eval_width() >= EVAL_WIDTH else 1


def eval_width() -> int:
    """The breadth-first width MLX evaluates with (`MLX_BFS_MAX_WIDTH`, default 20)."""
    try:
        return int(os.environ.get("MLX_BFS_MAX_WIDTH", MLX_DEFAULT_WIDTH))
    except ValueError:
        return MLX_DEFAULT_WIDTH


class Lanes:
    """`n` streams on the default device."""

    def __init__(self, n: int):
        self.n = n
        self.streams = [mx.new_stream(mx.default_device()) for _ in range(n)] if n > 1 else []

    def map(self, fn: Callable, pieces: Sequence) -> list:
        """[fn(piece) for piece in pieces], evaluated: piece i's graph is built on
        stream i, and all of them are evaluated in one call, side by side. At most `n`
        pieces; a single piece runs as it is."""
        if len(pieces) > self.n:
            raise ValueError(f"{len(pieces)} pieces for {self.n} lanes")
        if len(pieces) == 1:
            out = [fn(pieces[0])]
            mx.eval(out)
            return out
        with _blas.threads_shared(len(pieces)):
            out = []
            for piece, stream in zip(pieces, self.streams):
                with mx.stream(stream):
                    out.append(fn(piece))
            mx.eval(out)
        return out


_MADE: dict[tuple[int, int], Lanes] = {}


def update_lanes(requested: int | None, compiled: bool = False) -> Lanes:
    """The lanes of the update (`grpo.update_lanes`; None: `auto_lanes`), made once per
    thread and count (MLX streams belong to the thread that made them). A compiled
    update (`grpo.compile`) runs in one lane."""
    n = 1 if compiled else (auto_lanes() if requested is None else requested)
    key = (threading.get_ident(), n)
    if key not in _MADE:
        _MADE[key] = Lanes(n)
    return _MADE[key]
