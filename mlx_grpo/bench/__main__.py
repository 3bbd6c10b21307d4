from mlx_grpo.bench.speed import main

main()
