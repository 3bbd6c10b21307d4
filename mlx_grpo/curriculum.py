"""Task selection. Every curriculum samples tasks, hears back their group rewards, and
checkpoints its whole state (`state_dict` / `load_state_dict`) so a resumed run draws
exactly the tasks the uninterrupted run would have drawn."""

from __future__ import annotations

import numpy as np

from mlx_grpo.config import CurriculumConfig
from mlx_grpo.recipe import Task


class UniformCurriculum:
    """Tasks drawn uniformly without replacement within an epoch over the train split;
    keeps per-level statistics of what the groups scored."""

    def __init__(self, tasks: list[Task], seed: int, levels: list[int] | None = None):
        if levels is not None:
            tasks = [t for t in tasks if t.level in set(levels)]
        if not tasks:
            raise ValueError(f"curriculum: no training tasks at levels {levels}")
        self.tasks = tasks
        self.rng = np.random.default_rng(seed)
        self.order: list[int] = []
        self.seen: dict[str, list[float]] = {}  # level -> [groups, reward sum, zero-var groups]

    def sample(self, n: int) -> list[Task]:
        out = []
        for _ in range(n):
            if not self.order:
                self.order = self.rng.permutation(len(self.tasks)).tolist()
            out.append(self.tasks[self.order.pop()])
        return out

    def update(self, tasks: list[Task], group_rewards: list[list[float]]) -> None:
        for task, rewards in zip(tasks, group_rewards):
            s = self.seen.setdefault(str(task.level), [0, 0.0, 0])
            s[0] += 1
            s[1] += float(np.mean(rewards))
            s[2] += int(max(rewards) - min(rewards) <= 1e-8)

    def state_dict(self) -> dict:
        return {
            "rng": self.rng.bit_generator.state,
            "order": list(self.order),
            "seen": {k: list(v) for k, v in self.seen.items()},
            "num_tasks": len(self.tasks),
        }

    def load_state_dict(self, state: dict) -> None:
        if state["num_tasks"] != len(self.tasks):
            raise ValueError(
                f"curriculum: checkpoint has {state['num_tasks']} train tasks, this run "
                f"{len(self.tasks)} (recipe params or train_size changed)"
            )
        self.rng.bit_generator.state = state["rng"]
        self.order = list(state["order"])
        self.seen = {k: list(v) for k, v in state["seen"].items()}


def make_curriculum(cfg: CurriculumConfig, tasks: list[Task], seed: int) -> UniformCurriculum:
    return UniformCurriculum(tasks, seed, cfg.levels)
