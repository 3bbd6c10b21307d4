"""Integer arithmetic at difficulty levels.

level 1: a + b with one-digit numbers          level 4: a + b - c with two-digit numbers
level 2: a + b with two-digit numbers          level 5: a * b, two-digit by one-digit
level 3: a - b with two-digit numbers          level 6: a + b with three-digit numbers

A problem's split is a function of its text (a hash), so train and eval never share
a problem, whatever the seed or the sizes asked for.
"""

from __future__ import annotations

import hashlib
import random

from mlx_grpo.recipe import Task
from rewards.arithmetic import reward  # noqa: F401  (the recipe's reward)

INSTRUCTION = "Put only the final number inside <answer></answer>, for example <answer>12</answer>."


def _problem(rng: random.Random, level: int) -> tuple[str, int]:
    """(expression, value) for one problem of `level`."""
    a2, b2 = rng.randint(10, 99), rng.randint(10, 99)
    if level == 1:
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        return f"{a} + {b}", a + b
    if level == 2:
        return f"{a2} + {b2}", a2 + b2
    if level == 3:
        a, b = rng.randint(50, 99), rng.randint(10, 49)
        return f"{a} - {b}", a - b
    if level == 4:
        c = rng.randint(10, 99)
        return f"{a2} + {b2} - {c}", a2 + b2 - c
    if level == 5:
        b = rng.randint(2, 9)
        return f"{a2} * {b}", a2 * b
    if level == 6:
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        return f"{a} + {b}", a + b
    raise ValueError(f"unknown level {level}; levels are 1-6")


LEVELS = (1, 2, 3, 4, 5, 6)
EVAL_SHARE = 10  # one problem in 10 belongs to the eval split


def split_of(expr: str) -> str:
    h = int(hashlib.sha256(expr.encode()).hexdigest()[:8], 16)
    return "eval" if h % EVAL_SHARE == 0 else "train"


# A worked example shown before the question (shots=1): a 135M model rarely uses
# the tags from the instruction alone (~2% of samples), and GRPO needs some signal.
EXAMPLE = [
    {"role": "user", "content": f"What is 3 + 4? {INSTRUCTION}"},
    {"role": "assistant", "content": "<answer>7</answer>"},
]


def make_tasks(
    split: str, n: int, seed: int, levels: list[int] = (1, 2, 3), shots: int = 1
) -> list[Task]:
    """`n` distinct problems of `split`, cycling through `levels`, from `seed`;
    `shots` (0 or 1) worked examples precede the question."""
    if shots not in (0, 1):
        raise ValueError(f"shots must be 0 or 1, got {shots}")
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    bad = [lv for lv in levels if lv not in LEVELS]
    if bad:
        raise ValueError(f"unknown levels {bad}; levels are {sorted(LEVELS)}")
    rng = random.Random(f"arithmetic-{seed}")
    seen: set[str] = set()
    tasks: list[Task] = []
    active = list(levels)
    misses = dict.fromkeys(active, 0)
    while len(tasks) < n and active:
        level = active[len(tasks) % len(active)]
        expr, value = _problem(rng, level)
        if expr in seen or split_of(expr) != split:
            misses[level] += 1
            if misses[level] > 2000:  # this level has no new problems left
                active.remove(level)
            continue
        misses[level] = 0
        seen.add(expr)
        tasks.append(
            Task(
                id=f"{split}-L{level}-{expr.replace(' ', '')}",
                level=level,
                messages=EXAMPLE[: 2 * shots]
                + [{"role": "user", "content": f"What is {expr}? {INSTRUCTION}"}],
                payload={"answer": value, "expr": expr},
            )
        )
    return tasks
