"""Reward components shared by web-agent recipes (recipes/web_browsing; any recipe whose
environment follows `mlx_grpo.env.Env` and whose `outcome()` gives success and progress).
The recipe brings its own action grammar as `syntax_error(reply) -> reason | None`, so
rewards never import a recipe.

Components, each in [0, 1]:

- `success`: the goal check on the environment's final state (right button pressed with
  the right values and nothing else changed, right answer given through `stop`...).
  Prose that contains the answer earns nothing: only a `stop` action answers.
- `progress`: the share of the goal's conditions met (pages reached, fields set...);
  the environment decides what counts (web_browsing: the final press or answer only
  after everything else).
- `format`: the share of turns whose reply is exactly one well-formed action.
- `validity`: the share of executed actions that hit an existing element of the right
  kind (type into a textbox, select an existing option, click something clickable).
- `efficiency`: shortest solution length / steps taken, when successful.
"""

from __future__ import annotations

from collections.abc import Callable

from mlx_grpo.env import Episode, StepResult

SyntaxCheck = Callable[[str], "str | None"]


def format_share(replies: list[str], syntax_error: SyntaxCheck) -> float:
    """Share of replies that are exactly one well-formed action.

    >>> one_word = lambda r: None if r.strip().isalpha() else "one word"
    >>> format_share(["click", "click [3] now", " back\\n"], one_word)
    0.6666666666666666
    """
    return sum(syntax_error(r) is None for r in replies) / len(replies) if replies else 0.0


def validity_share(results: list[StepResult]) -> float:
    """Share of executed actions that were valid (turns with no action do not count; no
    executed action at all scores 0).

    >>> ok, bad, none = ({"valid": True}, {"valid": False}, {"valid": None})
    >>> validity_share([StepResult("", False, i) for i in (ok, bad, none, ok)])
    0.6666666666666666
    """
    executed = [r.info["valid"] for r in results if r.info.get("valid") is not None]
    return sum(executed) / len(executed) if executed else 0.0


def efficiency(success: bool, shortest: int, steps: int) -> float:
    """min(1, shortest / steps) for a success, else 0.

    >>> efficiency(True, 2, 4), efficiency(True, 2, 2), efficiency(False, 2, 2)
    (0.5, 1.0, 0.0)
    """
    return min(1.0, shortest / steps) if success and steps else 0.0


def components(task, episode: Episode, syntax_error: SyntaxCheck) -> dict[str, float]:
    """The components for one episode. The payload gives the shortest solution's length
    as `shortest`, or the solution itself as `solution`."""
    outcome = episode.env.outcome()
    p = task.payload
    shortest = p["shortest"] if "shortest" in p else len(p["solution"])
    return {
        "success": float(outcome.success),
        "progress": outcome.progress,
        "format": format_share(episode.actions, syntax_error),
        "validity": validity_share(episode.results),
        "efficiency": efficiency(outcome.success, shortest, episode.turns),
    }
