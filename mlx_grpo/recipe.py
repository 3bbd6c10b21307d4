"""Recipes: a folder with `recipe.toml` (run defaults) and `tasks.py` (tasks + reward).

`tasks.py` defines

    make_tasks(split: str, n: int, seed: int, **params) -> list[Task]
    reward(task: Task, completion: str) -> float | dict[str, float]

and, for multi-turn recipes (see mlx_grpo/env.py),

    make_env(task: Task) -> Env              # reset() -> str, step(text) -> StepResult
    reward(task: Task, episode: Episode) -> float | dict[str, float]

Tasks are deterministic in (split, n, seed, params) and the train and eval splits
never share a task. The run's reward is the weighted sum of the components named in
`recipe.weights`; components without a weight are logged but not optimised.
"""

from __future__ import annotations

import importlib.util
import math
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import recipes as _builtin_recipes
from mlx_grpo.config import ConfigError, read_toml


@dataclass(frozen=True)
class Task:
    """One prompt for the policy: a stable id, a difficulty level, chat messages, and
    whatever the reward needs to judge a completion (answer, tests, page...)."""

    id: str
    level: int
    messages: list[dict]
    payload: dict = field(default_factory=dict)


@dataclass
class Scored:
    """The reward of one completion, with its components and any error raised."""

    reward: float
    components: dict[str, float]
    error: str | None = None


def recipe_dir(name: str) -> Path:
    """A built-in recipe name (`recipes/<name>/`) or a path to a recipe folder."""
    path = Path(name)
    if (path / "recipe.toml").exists():
        return path
    for base in _builtin_recipes.__path__:
        cand = Path(base) / name
        if (cand / "recipe.toml").exists():
            return cand
    known = sorted(
        p.name
        for base in _builtin_recipes.__path__
        for p in Path(base).iterdir()
        if (p / "recipe.toml").exists()
    )
    raise ConfigError(f"recipe: '{name}' not found (built-in recipes: {', '.join(known)})")


def recipe_defaults(name: str) -> dict:
    """The run-config layer from the recipe's recipe.toml, with recipe.name filled in."""
    folder = recipe_dir(name)
    data = read_toml(folder / "recipe.toml")
    data.setdefault("recipe", {})["name"] = name
    return data


class Recipe:
    """A loaded recipe: its tasks and its weighted reward."""

    def __init__(self, name: str, weights: dict[str, float], params: dict[str, Any]):
        self.name = name
        self.dir = recipe_dir(name)
        self.module = _load_module(self.dir)
        self.weights = dict(weights)
        self.params = dict(params)
        self._checked = False
        self.multi_turn = callable(getattr(self.module, "make_env", None))

    @property
    def max_reward(self) -> float:
        """The best weighted reward (components are in [0, 1])."""
        return sum(w for w in self.weights.values() if w > 0) or 1.0

    def make_env(self, task: Task):
        return self.module.make_env(task)

    def first_messages(self, task: Task, env=None) -> list[dict]:
        """The prompt's messages: the task's, then (multi-turn) the env's first observation."""
        if env is None:
            return task.messages
        return [*task.messages, {"role": "user", "content": env.reset()}]

    def tasks(self, split: str, n: int, seed: int) -> list[Task]:
        try:
            tasks = self.module.make_tasks(split, n, seed, **self.params)
        except TypeError as e:
            raise ConfigError(f"recipe.params: {self.dir / 'tasks.py'}: {e}") from None
        if not tasks:
            raise ConfigError(f"recipe: {self.name} made no {split} tasks with {self.params}")
        return tasks

    def score(self, task: Task, completion) -> Scored:
        """Weighted reward of one completion (text, or an Episode for multi-turn
        recipes). A reward that raises or returns a non-finite value scores 0 on
        every component and reports the error."""
        try:
            out = self.module.reward(task, completion)
            comps = (
                {"reward": float(out)}
                if isinstance(out, (int, float))
                else {k: float(v) for k, v in out.items()}
            )
            if not all(math.isfinite(v) for v in comps.values()):
                raise ValueError(f"non-finite reward component in {comps}")
        except Exception as e:
            err = "".join(traceback.format_exception_only(type(e), e)).strip()
            comps = dict.fromkeys(self.weights or ["reward"], 0.0)
            return Scored(0.0, comps, err)
        self._check_weights(comps)
        if not self.weights:
            total = sum(comps.values()) if len(comps) == 1 else comps.get("reward", 0.0)
        else:
            total = sum(w * comps.get(k, 0.0) for k, w in self.weights.items())
        return Scored(total, comps)

    def _check_weights(self, comps: dict[str, float]) -> None:
        if self._checked:
            return
        missing = [k for k in self.weights if k not in comps]
        if missing:
            raise ConfigError(
                f"recipe.weights: {', '.join(missing)} not produced by the reward "
                f"(components: {', '.join(comps)})"
            )
        if not self.weights and len(comps) > 1 and "reward" not in comps:
            raise ConfigError(
                f"recipe.weights: the reward has components {', '.join(comps)}; give each a weight"
            )
        self._checked = True


def _load_module(folder: Path) -> ModuleType:
    path = folder / "tasks.py"
    if not path.exists():
        raise ConfigError(f"recipe: {path} is missing (it defines make_tasks and reward)")
    mod_name = f"mlx_grpo_recipe_{folder.name}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    spec.loader.exec_module(module)
    for attr in ("make_tasks", "reward"):
        if not callable(getattr(module, attr, None)):
            raise ConfigError(f"recipe: {path} does not define {attr}()")
    return module
