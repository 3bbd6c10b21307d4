"""The benchmarks (not needed to train, compare or export):

    python -m mlx_grpo.bench             speed: mlx-grpo against TRL and mlx-lm-lora (speed.py)
    python -m mlx_grpo.bench.curriculum  curriculum strategies at an equal token budget
    python -m mlx_grpo.bench.ops         the vocabulary-wide ops (exp, sampling) alone

work_unit.py is the one GRPO work unit every system runs; run_*.py run it in each
system's own process (the peers in their own virtual environments); floor.py measures
the machine's GEMM rate and bandwidth and splits a step by phase and op class.
"""
