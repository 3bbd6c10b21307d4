"""The one device seam: what the rest of mlx-grpo asks of the machine it runs on.

The training path calls these names only; which device-specific code stands behind them
is decided here.
"""

from mlx_grpo.lanes import Lanes, update_lanes
from mlx_grpo.procmem import keep_freed_memory as prepare_training

__all__ = ["Lanes", "prepare_training", "update_lanes"]
