"""Data-parallel runs over `mx.distributed` (started by `mlx.launch`).

Each rank rolls out and scores a contiguous share of the step's groups; everything
that decides what happens next (rewards, curriculum, gradients, counters) is exchanged
so that every rank takes the same decisions and holds the same adapters. Without a
launcher the group has one member and every method here returns its input untouched,
so a single process runs exactly the code it ran before.

Only small things travel besides the gradients: JSON records (per-completion
rewards, the run's config, a checkpoint's state) and, on resume, the adapters and
optimizer state that rank 0 read from disk.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten


class Dist:
    """The launched processes: `rank`, `size`, and the collectives the trainer uses."""

    def __init__(self, group: mx.distributed.Group | None = None):
        if group is None:
            try:
                group = mx.distributed.init()
            except RuntimeError as e:  # e.g. `mlx.launch -n 1` writes an empty host file
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise DistError(
                    f"mx.distributed.init failed: {first} (one process needs no mlx.launch; "
                    "for several, check the host file)"
                ) from e
        self.group = group
        self.rank = self.group.rank()
        self.size = self.group.size()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def share(self, n: int, rank: int | None = None) -> range:
        """The contiguous indices of n items (groups) this rank (or `rank`) owns."""
        r = self.rank if rank is None else rank
        return range(r * n // self.size, (r + 1) * n // self.size)

    def all_sum(self, x: mx.array) -> mx.array:
        return x if self.size == 1 else mx.distributed.all_sum(x, group=self.group)

    def sum_tree(self, tree):
        """Sum a tree of arrays over ranks with one all_sum per dtype (gradients are
        many small LoRA matrices: one message each would be latency-bound)."""
        if self.size == 1:
            return tree
        flat = tree_flatten(tree)
        out = dict(flat)
        for dtype in sorted({v.dtype for _, v in flat}, key=str):  # same order on all ranks
            items = [(k, v) for k, v in flat if v.dtype == dtype]
            big = self.all_sum(mx.concatenate([v.reshape(-1) for _, v in items]))
            offsets = np.cumsum([v.size for _, v in items])[:-1].tolist()
            for (k, v), part in zip(items, mx.split(big, offsets)):
                out[k] = part.reshape(v.shape)
        return tree_unflatten([(k, out[k]) for k, _ in flat])

    def gather(self, obj) -> list:
        """Every rank's JSON-able `obj`, in rank order, on every rank."""
        if self.size == 1:
            return [obj]
        data = np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8)
        lengths = np.zeros(self.size, dtype=np.int32)
        lengths[self.rank] = data.size
        lengths = np.array(self.all_sum(mx.array(lengths)))
        padded = np.zeros((1, max(int(lengths.max()), 1)), dtype=np.uint8)
        padded[0, : data.size] = data
        rows = np.array(mx.distributed.all_gather(mx.array(padded), group=self.group))
        return [json.loads(rows[r, : lengths[r]].tobytes()) for r in range(self.size)]

    def broadcast(self, obj):
        """Rank 0's JSON-able `obj` on every rank (other ranks may pass anything)."""
        if self.size == 1:
            return obj
        return self.gather(obj if self.is_main else None)[0]

    def run_on_main(self, fn):
        """`fn()` on rank 0 only; its JSON-able result on every rank. If it raises,
        rank 0 re-raises and the others raise `RankZeroError`, so no rank is left
        waiting for a collective that will never come."""
        if self.size == 1:
            return fn()
        result, error = None, None
        if self.is_main:
            try:
                result = fn()
            except Exception as e:  # re-raised below, on every rank
                error = e
        sent = self.broadcast({"result": result, "error": None if error is None else str(error)})
        if error is not None:
            raise error
        if sent["error"] is not None:
            raise RankZeroError(sent["error"])
        return sent["result"]

    def broadcast_arrays(self, arrays: dict[str, mx.array] | None) -> dict[str, mx.array]:
        """Rank 0's flat dict of arrays (any dtype) on every rank."""
        if self.size == 1:
            return arrays
        spec = self.broadcast(
            [[k, list(v.shape), str(v.dtype).split(".")[-1]] for k, v in arrays.items()]
            if self.is_main
            else None
        )
        out = {}
        for dtype in sorted({d for _, _, d in spec}):
            items = [(k, shape) for k, shape, d in spec if d == dtype]
            dt = getattr(mx, dtype)
            if self.is_main:
                big = mx.concatenate([arrays[k].reshape(-1) for k, _ in items])
            else:
                big = mx.zeros((sum(int(np.prod(s)) for _, s in items),), dtype=dt)
            # The other ranks add zeros, so the sum is rank 0's values.
            big = self.all_sum(big)
            offsets = np.cumsum([int(np.prod(s)) for _, s in items])[:-1].tolist()
            for (k, shape), part in zip(items, mx.split(big, offsets)):
                out[k] = part.reshape(shape)
        mx.eval(out)
        return out


class DistError(RuntimeError):
    """The distributed group could not be set up; the message is one line."""


class RankZeroError(RuntimeError):
    """Rank 0 failed; the message is its one-line error."""
