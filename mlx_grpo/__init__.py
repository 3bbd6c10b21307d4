"""mlx-grpo: GRPO with LoRA adapters, natively in MLX."""

from mlx_grpo.device import prepare_process

# Before the first `import mlx`: on a Linux CPU, MLX's wheel binds its BLAS symbols as it
# loads (a globally loaded OpenBLAS replaces its slow reference BLAS), and it reads the
# breadth-first width of its evaluation order once (`mlx_grpo.cpu.lanes`).
prepare_process()

__version__ = "0.1.0"
