"""Episodes no sampled policy solves: two turns, each answered "yes". The tiny random
model never says it, so every group is all-zero and only a demonstration teaches it."""

from mlx_grpo.env import StepResult
from mlx_grpo.recipe import Task


def make_tasks(split, n, seed):
    return [
        Task(
            id=f"{split}-{seed}-{i}",
            level=1,
            messages=[{"role": "system", "content": f"answer yes, twice ({i})"}],
            payload={},
        )
        for i in range(n)
    ]


class YesEnv:
    def __init__(self):
        self.replies = 0

    def reset(self) -> str:
        return "go"

    def step(self, action: str) -> StepResult:
        self.replies += 1
        return StepResult("again", self.replies >= 2, {})


def make_env(task):
    return YesEnv()


def demonstrate(task):
    return ["yes", "yes"]


def reward(task, episode):
    return {"match": float(episode.actions == ["yes", "yes"])}
