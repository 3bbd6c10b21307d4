"""Toy tasks: any prompt; the reward is the share of ASCII characters in the completion.
`explode_every=k` makes the reward raise on every k-th task (to test error handling)."""

from mlx_grpo.recipe import Task


def make_tasks(split, n, seed, explode_every=0):
    return [
        Task(
            id=f"{split}-{seed}-{i}",
            level=1 + i % 2,
            messages=[{"role": "user", "content": f"say vowels {i}"}],
            payload={"explode": bool(explode_every) and i % explode_every == 0},
        )
        for i in range(n)
    ]


def reward(task, completion):
    if task.payload["explode"]:
        raise RuntimeError("boom")
    ascii_chars = sum(ord(ch) < 128 for ch in completion)
    return {"ascii": ascii_chars / max(len(completion), 1), "short": float(len(completion) < 4)}


def demonstrate(task):
    """A short ASCII answer: the best reward."""
    return ["ab"]
