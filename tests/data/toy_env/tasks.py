"""Toy episodes: task i lasts 1 + i % 3 turns; every observation names the turn."""

from mlx_grpo.env import Episode, StepResult
from mlx_grpo.recipe import Task


def make_tasks(split, n, seed):
    return [
        Task(
            id=f"{split}-{seed}-{i}",
            level=1 + i % 3,
            messages=[{"role": "system", "content": f"count {i}"}],
            payload={"turns": 1 + i % 3},
        )
        for i in range(n)
    ]


class CountEnv:
    def __init__(self, turns: int):
        self.turns, self.taken = turns, 0

    def reset(self) -> str:
        self.taken = 0
        return "start"

    def step(self, action: str) -> StepResult:
        self.taken += 1
        done = self.taken >= self.turns
        # A short reply is the toy's well-formed one (what `info["format"]` marks).
        return StepResult(
            f"turn {self.taken}: {len(action)} chars", done, {"format": len(action) < 4}
        )


def make_env(task):
    return CountEnv(task.payload["turns"])


def reward(task, episode: Episode):
    short = sum(len(a) < 4 for a in episode.actions) / max(episode.turns, 1)
    return {"finished": float(episode.done), "short": short}


def demonstrate(task):
    """The best episode: one short reply a turn."""
    return ["ok"] * task.payload["turns"]
