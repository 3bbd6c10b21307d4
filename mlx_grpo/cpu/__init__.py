"""The speed layer for MLX on a Linux CPU, reached only through `mlx_grpo.device`.

MLX's Linux CPU wheel links a reference BLAS, runs `exp`, the sigmoid and last-axis
reductions one element at a time, and computes attention unfused. These modules make
it fast there:

  build      how the native pieces are compiled and proven in a child process (verdicts)
  blas       a fast BLAS loaded before MLX, and its threads
  skinny     the skinny-GEMM front for decode's few-row products (`skinny.c`)
  native     attention and SwiGLU as native MLX ops (`packed_attention.cpp`)
  fastmath   vectorised exp and row reductions, SwiGLU, blocked attention
  layers     mlx_lm's attention and MLP blocks given the above
  lanes      how many lanes the update runs in, and MLX's evaluation width
  allocator  glibc's allocator kept from handing freed memory back

`mlx_grpo.device` imports them only where MLX computes on a Linux CPU: on Metal or CUDA
none of them is loaded.
"""
