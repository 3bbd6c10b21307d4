"""mlx-grpo: GRPO with LoRA adapters, natively in MLX."""

from mlx_grpo._blas import use_fast_blas

# Must run before the first `import mlx`: MLX's Linux CPU wheel binds BLAS symbols
# at load time, so a globally loaded OpenBLAS replaces its slow reference BLAS.
use_fast_blas()

__version__ = "0.1.0"
