"""Environments: recipes whose tasks are played out over several turns.

A recipe becomes multi-turn by defining `make_env(task) -> Env` in its `tasks.py`.
An episode's first prompt is the task's messages followed by one user message holding
`env.reset()`; after each model turn the environment answers with `env.step(action)`,
whose observation becomes the next user message, until it says `done` or the episode
reaches `rollout.max_turns`. The reward then sees the whole episode, environment
state included: `reward(task, episode: Episode)`.

Only the model's tokens are trained on: the environment's observations (and the chat
template's turn markers around them) are in the sequence the model conditions on, but
never in the loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np

from mlx_grpo.durable import FULL_DISK
from mlx_grpo.recipe import first_line


class EnvError(RuntimeError):
    """An environment's reset or step raised (the message names the recipe, the task
    and the exception): the episode cannot be played on, so the step stops there.
    `prompt`: the index of the rollout's prompt whose episode it was, when known."""

    def __init__(self, message: str, prompt: int | None = None):
        super().__init__(message)
        self.prompt = prompt


def env_call(what: str, fn, *args):
    """`fn(*args)` (an environment's reset or step), its exception as one EnvError line;
    a full disk and a lack of memory pass as they are (the machine's, with advice of
    their own)."""
    try:
        return fn(*args)
    except (EnvError, MemoryError):
        raise
    except Exception as e:
        if isinstance(e, OSError) and e.errno in FULL_DISK:
            raise
        raise EnvError(f"{what} raised {first_line(e)}") from e


class StepResult(NamedTuple):
    observation: str  # shown to the model as the next user message (ignored when done)
    done: bool  # the episode is over (goal reached, answer given, step limit...)
    info: dict  # anything the reward or the logs want (parse errors, validity...)


@runtime_checkable
class Env(Protocol):
    def reset(self) -> str:
        """Start the episode; the first observation (deterministic for a task)."""

    def step(self, action: str) -> StepResult:
        """Apply the model's reply for this turn."""


@dataclass
class Episode:
    """What one sampled episode did, as the reward sees it."""

    env: Any  # the environment in its final state
    actions: list[str] = field(default_factory=list)  # the model's reply at each turn
    results: list[StepResult] = field(default_factory=list)  # the env's answer to each
    done: bool = False  # the environment ended it (False: it ran out of turns)

    @property
    def text(self) -> str:
        """The model's replies, one per line (for logs and text-only rewards)."""
        return "\n".join(self.actions)

    @property
    def turns(self) -> int:
        return len(self.actions)


def ill_formed(result: StepResult) -> bool:
    """Whether the environment marked this step's reply ill-formed (`info["format"]` is
    False; an environment that does not judge format marks nothing)."""
    return result.info.get("format") is False


def turn_spans(loss_mask) -> list[tuple[int, int]]:
    """[start, end) of each reply in an episode's tokens: the runs of its loss mask
    (the model's tokens, between the environment's).

    >>> turn_spans([1, 1, 0, 0, 1, 0, 1])
    [(0, 2), (4, 5), (6, 7)]
    """
    edges = np.diff(np.concatenate([[0], np.asarray(loss_mask) > 0, [0]]).astype(np.int8))
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))
