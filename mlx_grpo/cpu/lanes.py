"""How many lanes the update runs in on a CPU (`device.update_lanes`), and the evaluation
width that lets two lanes interleave.

MLX's CPU backend runs a stream's ops on one thread, and only the BLAS calls use more
than one core: while that thread does the elementwise work of a pass (norms, rotary
embeddings, attention's softmax, the log-softmax over the vocabulary, their gradients),
OpenBLAS's other threads wait. On the work unit's policy pass that is about half of
the time. The groups of a micro-batch do not depend on each other, so `device.Lanes`
runs them (or runs of a group's rows) as separate graphs on streams of their own, each
BLAS call with its share of the threads (`blas.threads_shared`), and evaluates them
together: one lane's elementwise work runs while another's GEMMs run. The pieces'
losses, metrics and gradients sum to the batch's, as micro-batches' do
(`grpo.lane_pieces`).

MLX evaluates a graph in breadth-first order only up to a width (`MLX_BFS_MAX_WIDTH`,
20 by default), deeper than that depth-first: two lanes' graphs would then be queued
one after the other. `widen_evaluation` widens it before MLX runs
(`device.prepare_process`); where it is narrower (a width the user set), the update
runs in one lane unless `engine.update_lanes` asks for more.

Nothing here imports MLX: `widen_evaluation` runs before it is loaded.
"""

from __future__ import annotations

import os

from mlx_grpo.cpu import blas

# The work unit's two lanes interleaved from about this width on, and not at 200.
EVAL_WIDTH = 1000
MLX_DEFAULT_WIDTH = 20


def widen_evaluation() -> None:
    """Before MLX runs anything (it reads the width once): a breadth-first width wide
    enough for the update's lanes to run side by side. A value already set is kept."""
    os.environ.setdefault("MLX_BFS_MAX_WIDTH", str(EVAL_WIDTH))


def auto_lanes() -> int:
    """On a CPU: 2 where this process's BLAS has two threads or more and MLX evaluates
    wide enough for two lanes to interleave (`eval_width`), else 1 (lanes queued one
    after the other would only halve each one's BLAS threads)."""
    chosen = blas.state["blas"]
    threads = chosen is not None and (chosen.threads or 0) >= 2
    return 2 if threads and eval_width() >= EVAL_WIDTH else 1


def eval_width() -> int:
    """The breadth-first width MLX evaluates with (`MLX_BFS_MAX_WIDTH`, default 20)."""
    try:
        return int(os.environ.get("MLX_BFS_MAX_WIDTH", MLX_DEFAULT_WIDTH))
    except ValueError:
        return MLX_DEFAULT_WIDTH
