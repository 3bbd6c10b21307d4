"""One rank of an `mlx.launch` job for tests/test_dist.py.

    python tests/dist_rank.py ROOT train ARGS...

Runs `python -m mlx_grpo train ARGS...` from ROOT/rank<R> (its own folder, as if each
rank were a machine of its own: relative paths such as --output.dir land there), then
saves the adapters this rank ends with to ROOT/adapters-rank<R>.safetensors.
DIST_RANK_NO_ROOM (below) makes rank 0's disk full at one write.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# isort: off
import mlx_grpo  # noqa: F401  (first: loads OpenBLAS before mlx)

# isort: on
import mlx.core as mx
from mlx.utils import tree_flatten

import mlx_grpo.trainer as trainer
from mlx_grpo.cli import main

root = Path(sys.argv[1])
rank = mx.distributed.init().rank()
work = root / f"rank{rank}"
work.mkdir(parents=True, exist_ok=True)
os.chdir(work)
real_train = trainer.train


def train_and_save(model, *args, **kwargs):
    out = real_train(model, *args, **kwargs)
    adapters = dict(tree_flatten(model.trainable_parameters()))
    mx.save_safetensors(str(root / f"adapters-rank{rank}.safetensors"), adapters)
    return out


trainer.train = train_and_save
# DIST_RANK_NO_ROOM=<log name>:<step>: rank 0's disk is full when that log gets that step.
if rank == 0 and os.environ.get("DIST_RANK_NO_ROOM"):
    import errno

    import mlx_grpo.log as log

    name, step = os.environ["DIST_RANK_NO_ROOM"].split(":")
    real_append = log.append_record

    def no_room(path, record):
        if Path(path).name == name and record.get("step") == int(step):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real_append(path, record)

    log.append_record = no_room
main(sys.argv[2:])
