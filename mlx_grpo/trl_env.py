"""TRL's agent shapes, run as they are: `environment_factory`, `tools=` and the reward
functions that read `environments`.

TRL's `GRPOTrainer(environment_factory=MyEnv, tools=[...], reward_funcs=[...])` takes a
class whose instances hold one episode's state: `reset(**kwargs)` starts it (returning
the prompt, or None when the dataset holds it), every other public method is a tool,
and an optional `get_reward()` scores the episode from that state. `TRLEnvironment`
turns the same three arguments into a recipe's parts:

    # recipes/counter/tasks.py
    from mlx_grpo.trl_env import TRLEnvironment

    trl = TRLEnvironment(IncrementEnv, reward_funcs=[reached_target])
    make_tasks, make_env, reward, reward_batch = (
        trl.make_tasks, trl.make_env, trl.reward, trl.reward_batch
    )

As in TRL: a fresh instance per episode; `reset` gets the task's `prompt` (its messages)
and every payload field as keyword arguments (a JSONL task's extra columns, as TRL
passes a dataset row's); `reset`'s string is the first user message; `get_reward` is a
component named after the class; each reward function is called once per step with
`completions` (each episode's assistant and tool messages, TRL's conversational
format), `prompts`, `environments` (one instance per completion), `task_ids` and the
payload fields as per-completion lists, and its floats are a component named after it
(None, TRL's "not applicable", scores 0). Rewards, `get_reward` and tools may be
`async def`, as in TRL.

Where mlx-grpo differs: GRPO compares the G episodes of a task, so they must start from
one state. An environment that samples its task with `random` or `numpy.random` in
`reset` (TRL's IncrementEnv does) is reset with both seeded from the task's id, and the
generators' states are put back afterwards: the G episodes of a task start alike, and
the same task starts alike in every run.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import random
from collections.abc import Callable, Iterable
from contextlib import contextmanager

import numpy as np

from mlx_grpo.config import ConfigError
from mlx_grpo.recipe import Task
from mlx_grpo.tools import ToolEnv, as_tools

# Methods of an environment class that are not tools (TRL's reserved names).
RESERVED = ("reset", "get_reward")


def environment_tools(instance) -> list[Callable]:
    """The tools of an environment instance: its public bound methods but `reset` and
    `get_reward`, as TRL finds them."""
    return [
        member
        for name, member in inspect.getmembers(instance, predicate=inspect.ismethod)
        if name not in RESERVED and not name.startswith("_")
    ]


def awaited(value):
    """A reward's value, awaited when the function was `async def` (TRL takes both)."""
    return asyncio.run(value) if inspect.iscoroutine(value) else value


def _seed_of(key: str) -> int:
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16)


@contextmanager
def seeded_globals(key: str):
    """Python's and numpy's global generators seeded from `key` within the block, and
    their states restored after it (the run's own draws are not disturbed)."""
    py_state, np_state = random.getstate(), np.random.get_state()
    seed = _seed_of(key)
    random.seed(seed)
    np.random.seed(seed)
    try:
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)


def _prompt(task: Task, first_observation: str) -> list[dict]:
    """An episode's prompt messages as TRL passes `prompts`: the task's, then `reset`'s
    string where it gave one (the tools are the template's, not a message)."""
    if not first_observation:
        return list(task.messages)
    return [*task.messages, {"role": "user", "content": first_observation}]


class TRLEnvironment:
    """A recipe's `make_tasks`, `make_env`, `reward` and `reward_batch` from TRL's
    `environment_factory` (None: tools only), `tools` and `reward_funcs`."""

    def __init__(
        self,
        environment_factory: Callable | None = None,
        tools: Iterable[Callable] = (),
        reward_funcs: Iterable[Callable] = (),
        timeout_s: float = 10.0,
        announce: bool = True,
    ):
        self.factory = environment_factory
        self.tools = list(tools)
        self.reward_funcs = list(reward_funcs)
        self.timeout_s = timeout_s
        self.announce = announce
        self.owns_reward = False
        self.name = "environment"
        if environment_factory is not None:
            # One probe instance, as TRL makes one: its methods must be tools (hints and
            # docstrings), checked now rather than at the first episode.
            probe = environment_factory()
            if not callable(getattr(probe, "reset", None)):
                raise ConfigError(
                    f"environment_factory: {type(probe).__name__} has no reset() (TRL requires one)"
                )
            self.name = type(probe).__name__
            self.owns_reward = callable(getattr(probe, "get_reward", None))
            as_tools([*self.tools, *environment_tools(probe)], "environment_factory")
        else:
            as_tools(self.tools)
        if not self.owns_reward and not self.reward_funcs:
            raise ConfigError(
                "reward_funcs: none given, and the environment has no get_reward() to score itself"
            )

    def make_tasks(self, split: str, n: int, seed: int, **params) -> list[Task]:
        """`n` tasks for an environment that samples its own (TRL without a dataset):
        no messages, `reset` (seeded by the id) writes the prompt; `params`
        (recipe.params) are every task's payload, so `reset` receives them. Train and
        eval ids differ, so their samples are drawn apart (a tiny task space may still
        repeat a state)."""
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        return [
            Task(id=f"{split}-{seed}-{i}", level=1, messages=[], payload=dict(params))
            for i in range(n)
        ]

    def make_env(self, task: Task) -> ToolEnv:
        """A ToolEnv over a fresh instance (its methods and the standalone tools); the
        instance is `env.environment`."""
        instance = self.factory() if self.factory is not None else None
        methods = environment_tools(instance) if instance is not None else []

        def start():
            if instance is None:
                return None
            with seeded_globals(task.id):
                return instance.reset(prompt=task.messages, **task.payload)

        env = ToolEnv([*self.tools, *methods], start, self.timeout_s, self.announce)
        env.environment = instance
        return env

    def reward_batch(self, tasks: list[Task], groups: list[list]) -> list[list[dict]]:
        """Every episode's components: `get_reward()` under the class's name, then each
        reward function's under its own, called once for the whole step."""
        flat = [(t, ep) for t, g in zip(tasks, groups) for ep in g]
        rows: list[dict] = [{} for _ in flat]
        if self.owns_reward:
            for row, (_, ep) in zip(rows, flat):
                row[self.name] = float(awaited(ep.env.environment.get_reward()))
        if self.reward_funcs:
            kwargs = self._reward_kwargs(flat, self.factory is not None)
            for fn in self.reward_funcs:
                name = getattr(fn, "__name__", "reward")
                values = list(awaited(fn(**kwargs)))
                if len(values) != len(flat):
                    raise ValueError(
                        f"{name}: returned {len(values)} rewards for {len(flat)} episodes"
                    )
                for row, v in zip(rows, values):
                    row[name] = 0.0 if v is None else float(v)
        out, i = [], 0
        for g in groups:
            out.append(rows[i : i + len(g)])
            i += len(g)
        return out

    def reward(self, task: Task, episode) -> dict:
        """One episode's components (`reward_batch` for a group of one)."""
        return self.reward_batch([task], [[episode]])[0][0]

    @staticmethod
    def _reward_kwargs(flat: list, with_environments: bool) -> dict:
        keys = sorted({k for t, _ in flat for k in t.payload})
        kwargs = {
            "completions": [ep.env.messages for _, ep in flat],
            "prompts": [_prompt(t, ep.env.first_observation) for t, ep in flat],
            "task_ids": [t.id for t, _ in flat],
            **{k: [t.payload.get(k) for t, _ in flat] for k in keys},
        }
        if with_environments:  # (TRL passes them only with an environment_factory)
            kwargs["environments"] = [ep.env.environment for _, ep in flat]
        return kwargs
