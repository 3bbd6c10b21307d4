"""The benchmark's fixed work unit, shared by the runner of every system.

Standard library only: the peers' runners import it from their own virtual
environments (PyTorch for TRL, another MLX for mlx-lm-lora). Each runner trains
`steps` steps of the same work unit and prints one JSON record (`emit`) whose fields
`bench.py` reads: per-step wall time, rollout time, generated tokens and reward, the
time from process start to the end of the first step, and the peak resident memory.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import resource
import sys
import time

# The work unit (issue 6): every system gets these settings and these tasks.
BATCH = 2  # prompts per step
GROUP = 8  # completions per prompt
MAX_NEW_TOKENS = 64
TEMPERATURE = 0.8
TOP_P = 0.95
TOP_K = 20
LORA_RANK = 8
LORA_SCALE = 10.0  # mlx_lm's scale; PEFT's lora_alpha = scale * rank = 80
LORA_ALPHA = int(LORA_SCALE * LORA_RANK)
LORA_DROPOUT = 0.0
BETA = 0.04
LEARNING_RATE = 1e-5
LOSS_TYPE = "grpo"
NUM_ITERATIONS = 1
EPSILON = 0.2
MAX_GRAD_NORM = 1.0
N_TASKS = 16
TASK_SEED = 0
# Every linear layer of a llama block (PEFT's "all-linear" leaves out lm_head too).
LORA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

RESULT_TAG = "BENCH_RESULT "  # the runner's JSON line starts with this
STEP_TAG = "BENCH_STEP "  # each finished step, on stderr as it ends (read when a runner is cut off)


def tasks(n: int = N_TASKS, seed: int = TASK_SEED) -> list[dict]:
    """`n` seeded two-digit additions: {'prompt': str, 'answer': int}, in step order.

    >>> tasks(2)[0]["prompt"].endswith("Answer with just the number.")
    True
    """
    rng = random.Random(f"bench-{seed}")
    out = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        out.append({"prompt": f"What is {a} + {b}? Answer with just the number.", "answer": a + b})
    return out


def step_tasks(step: int) -> list[dict]:
    """The B tasks of step `step` (1-based): the 16 tasks in order, cycled."""
    all_tasks = tasks()
    start = ((step - 1) * BATCH) % len(all_tasks)
    return [all_tasks[(start + i) % len(all_tasks)] for i in range(BATCH)]


def reward(completion: str, answer: int) -> float:
    """1.0 if the completion contains `answer` as a standalone integer, else 0.0.

    >>> reward("66 + 24 = 90.", 90), reward("190", 90), reward("90.5", 90), reward("-90", 90)
    (1.0, 0.0, 0.0, 0.0)
    """
    pattern = rf"(?<![\d.\-]){answer}(?!\d|\.\d)"
    return 1.0 if re.search(pattern, completion) else 0.0


def peak_rss_mb() -> float:
    """This process's peak resident set size in MB (ru_maxrss is KB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1 << 20) if sys.platform == "darwin" else rss / 1024


class TimeSpent:
    """A stand-in for `fn` that sums the seconds spent in its calls (`seconds`, which
    the caller resets): how each runner times its system's sampling."""

    def __init__(self, fn):
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args, **kwargs):
        tic = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - tic


def peer_args(model_help: str, argv=None) -> tuple[argparse.Namespace, StepClock]:
    """A peer runner's command line (--t0, --steps, --model) and its step clock."""
    p = argparse.ArgumentParser()
    p.add_argument("--t0", type=float, default=None)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--model", required=True, help=model_help)
    args = p.parse_args(argv)
    return args, StepClock(args.t0 or time.time())


class StepClock:
    """Per-step records and the time to the first finished step, from `t0` (the
    parent's clock when it launched this process, so imports and loading count)."""

    def __init__(self, t0: float):
        self.t0 = t0
        self.steps: list[dict] = []
        self.first_step_at: float | None = None

    def record(self, **fields) -> None:
        if self.first_step_at is None:
            self.first_step_at = time.time() - self.t0
        self.steps.append(fields)
        sys.stderr.write(STEP_TAG + json.dumps(fields) + "\n")
        sys.stderr.flush()

    def result(self, system: str, version: str, **extra) -> dict:
        return {
            "system": system,
            "version": version,
            "steps": self.steps,
            "time_to_first_step_s": self.first_step_at,
            "peak_rss_mb": peak_rss_mb(),
            **extra,
        }


def emit(result: dict) -> None:
    """Print the runner's result as one tagged JSON line on stdout."""
    sys.stdout.write(RESULT_TAG + json.dumps(result) + "\n")
    sys.stdout.flush()
