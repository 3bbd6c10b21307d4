"""mlx-grpo: GRPO with LoRA adapters, natively in MLX."""

import os
import sys

from mlx_grpo._backend import installed_builds
from mlx_grpo._blas import use_fast_blas

# Must run before the first `import mlx`: MLX's Linux CPU wheel binds BLAS symbols
# at load time, so a globally loaded OpenBLAS replaces its slow reference BLAS.
use_fast_blas()

# Also before MLX runs anything: it reads the breadth-first width of its evaluation
# order once. A CPU build gets one wide enough that the update's lanes run side by side
# (mlx_grpo.lanes; the work unit's two lanes did from about 1000 on, and not at 200); a
# GPU build keeps MLX's default. A value already set is kept.
EVAL_WIDTH = 1000
if sys.platform == "linux" and installed_builds() == {"cpu"}:
    os.environ.setdefault("MLX_BFS_MAX_WIDTH", str(EVAL_WIDTH))

__version__ = "0.1.0"
