"""gymnasium environments as mlx-grpo environments (the protocol of mlx_grpo/env.py).

A gymnasium `Env` (`reset(seed=...) -> (obs, info)`, `step(action) -> (obs, reward,
terminated, truncated, info)`) whose observations and actions are text plugs in as it
is; any other takes two small functions, `observe(obs) -> str` and `act(text) ->
action`. A recipe's `tasks.py`:

    from mlx_grpo.gym_env import gym_env, gym_return

    make_env = gym_env("MyTextGame-v0")        # or a function task -> gymnasium.Env
    reward = gym_return                         # the episode's rewards, summed

Each episode's environment is reset with a seed from its task's id, so the G episodes
of a task start from one state and a task starts alike in every run. An `act` that
raises ValueError, or an action outside the env's `action_space`, does not step the
environment: the model reads `invalid action: ...`, the turn counts, and the reply is
marked ill-formed (`info["format"]` False). The episode ends when the environment says
terminated or truncated (or at `rollout.max_turns`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from mlx_grpo.env import StepResult


def task_seed(task_id: str) -> int:
    """The reset seed of a task's episodes: the same for its G episodes and every run.

    >>> task_seed("train-0-3") == task_seed("train-0-3") != task_seed("train-0-4")
    True
    """
    return int(hashlib.sha256(task_id.encode()).hexdigest()[:8], 16)


def text_observation(obs: Any) -> str:
    """The default `observe`: a text observation as it is; anything else needs an
    `observe` of its own."""
    if isinstance(obs, str):
        return obs
    raise TypeError(
        f"gym_env: the observation is a {type(obs).__name__}, not text; pass observe=obs->str"
    )


class GymEnv:
    """One gymnasium environment as an mlx-grpo Env. `rewards` holds the reward of each
    step that stepped it; `total` is their sum (what `gym_return` scores)."""

    def __init__(
        self,
        env,
        observe: Callable[[Any], str] = text_observation,
        act: Callable[[str], Any] = str.strip,
        seed: int | None = None,
        options: dict | None = None,
    ):
        self.env = env
        self.observe = observe
        self.act = act
        self.seed = seed
        self.options = options
        self.rewards: list[float] = []
        self.invalid_actions = 0
        self.last_info: dict = {}

    @property
    def total(self) -> float:
        """The episode's return: its steps' rewards summed."""
        return float(sum(self.rewards))

    def reset(self) -> str:
        """Reset with the episode's seed; the first observation as text."""
        self.rewards, self.invalid_actions = [], 0
        obs, self.last_info = self.env.reset(seed=self.seed, options=self.options)
        return self.observe(obs)

    def step(self, action: str) -> StepResult:
        """Turn the reply into an action and step; an invalid one is answered, not played."""
        try:
            move = self.act(action)
            space = getattr(self.env, "action_space", None)
            if space is not None and not space.contains(move):
                raise ValueError(f"{move!r} is not in the action space {space}")
        except ValueError as e:
            self.invalid_actions += 1
            return StepResult(f"invalid action: {e}", False, {"format": False, "error": str(e)})
        obs, reward, terminated, truncated, info = self.env.step(move)
        self.rewards.append(float(reward))
        self.last_info = info
        done = bool(terminated or truncated)
        info = {
            "reward": float(reward),
            "terminated": bool(terminated),
            "truncated": bool(truncated),
        }
        return StepResult("" if done else self.observe(obs), done, info)

    def close(self) -> None:
        """Close the gymnasium environment (a browser, a server connection...)."""
        self.env.close()


def gym_env(
    make: str | Callable[[Any], Any],
    observe: Callable[[Any], str] = text_observation,
    act: Callable[[str], Any] = str.strip,
    **make_kwargs,
) -> Callable[[Any], GymEnv]:
    """`make_env(task)` for a recipe: `make` is a gymnasium id (made with
    `gymnasium.make(make, **make_kwargs)`) or a function `task -> gymnasium.Env`; a
    task's `payload["options"]` goes to `reset(options=...)`."""

    def make_env(task) -> GymEnv:
        if isinstance(make, str):
            import gymnasium

            env = gymnasium.make(make, **make_kwargs)
        else:
            env = make(task)
        return GymEnv(env, observe, act, task_seed(task.id), task.payload.get("options"))

    return make_env


def gym_return(task, episode) -> dict[str, float]:
    """The reward of an episode played in a GymEnv: the sum of its steps' rewards, as
    the component `return` (its range is the environment's)."""
    return {"return": episode.env.total}
