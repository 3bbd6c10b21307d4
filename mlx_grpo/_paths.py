"""Where mlx-grpo keeps what it makes once per machine (converted models, BLAS verdicts)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`$MLX_GRPO_CACHE`, or ~/.cache/mlx-grpo."""
    return Path(os.environ.get("MLX_GRPO_CACHE") or Path.home() / ".cache" / "mlx-grpo")
