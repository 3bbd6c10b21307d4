"""The benchmark's 16 two-digit additions and its reward, as an mlx-grpo recipe."""

from __future__ import annotations

from mlx_grpo.bench import work_unit
from mlx_grpo.recipe import Task


def make_tasks(split: str, n: int, seed: int) -> list[Task]:
    return [
        Task(
            id=f"bench-{i}",
            level=1,
            messages=[{"role": "user", "content": t["prompt"]}],
            payload={"answer": t["answer"]},
        )
        for i, t in enumerate(work_unit.tasks()[:n])
    ]


def reward(task: Task, completion: str) -> float:
    return work_unit.reward(completion, task.payload["answer"])
