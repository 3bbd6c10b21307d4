"""Doubling tasks whose completions are replaced by hostile or correct programs, in turn."""

import rewards.code as code
from mlx_grpo.recipe import Task

PROGRAMS = [
    "def f(x):\n    while True:\n        pass",
    "import os\ndef f(x):\n    while True:\n        os.fork()",
    "def f(x):\n    return len(bytearray(10 * 10**9))",
    "import os\ndef f(x):\n    os._exit(0)",
    "def f(x):\n    open('/etc/mlx-grpo-escape', 'w')\n    return 2 * x",
    "import socket\ndef f(x):\n    socket.socket()\n    return 2 * x",
    "def f(x):\n    print('x' * 10**7)\n    return 2 * x",
    "def f(x):\n    return 2 * x",
]


def make_tasks(split, n, seed):
    tests = [{"args": [a], "expected": 2 * a} for a in (1, 5, -3)]
    return [
        Task(
            f"{split}-{i}",
            1,
            [{"role": "user", "content": f"double {i}"}],
            {"func": "f", "tests": tests},
        )
        for i in range(n)
    ]


def reward_batch(tasks, groups):
    k = 0
    swapped = []
    for group in groups:
        swapped.append([])
        for _ in group:
            swapped[-1].append(f"```python\n{PROGRAMS[k % len(PROGRAMS)]}\n```")
            k += 1
    return code.reward_batch(tasks, swapped)


def reward(task, completion):
    return code.reward(task, completion)
