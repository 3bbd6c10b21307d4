"""Recipes: a folder with `recipe.toml` (run defaults) and its tasks and rewards.

Tasks come from `tasks.py`, which defines

    make_tasks(split: str, n: int, seed: int, **params) -> list[Task]

or from a JSONL file named by `recipe.tasks` (one task a line: `prompt` or `messages`,
optional `id`, `level`, `split`; every other field goes to the task's payload).

Rewards come from `tasks.py` (when it defines one) and from the functions named in
`recipe.rewards`, whose components are added to its:

    reward(task: Task, completion: str) -> float | dict[str, float]
    reward_batch(tasks: list[Task], groups: list[list[str]]) -> list[list[dict]]
        (optional, preferred when present: one call per step with every group's G
        completions, for rewards that run in parallel or compare samples in a group;
        one that also takes `deadline=` gets the time.monotonic() by which to return,
        scoring what finished, so that a slow completion costs only its own score)

`recipe.rewards` maps a component name to "module:function" or "file.py:function"
(relative to the recipe folder). Such a function has the signature above, or TRL's
`f(completions: list[str], **kwargs) -> list[float]`, called once per step with
`prompts` (each task's messages), `task_ids`, `levels` and every payload field as
per-completion lists. A function returning a dict contributes each of its keys.

Each call is bounded by recipe.reward_timeout_s: a per-completion call that passes it
costs that completion (0, fail/timeout); a batch call (reward_batch without `deadline`,
TRL-style) that passes it costs the whole step's completions, with one warning naming
the recipe.

Multi-turn recipes (see mlx_grpo/env.py) add `make_env(task) -> Env`, and their
`reward(task, episode)` receives the Episode.

A reward dict may carry `failure: str` naming why a completion failed (a sandbox limit,
a wrong answer...); it is not a component, and the trainer counts each reason per step
as `fail/<reason>`. Tasks are deterministic in (split, n, seed, params) and the train
and eval splits never share a task. The run's reward is the weighted sum of the
components named in `recipe.weights`; components without a weight are logged but not
optimised.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import json
import math
import random
import sys
import threading
import time
import traceback
from collections.abc import Callable
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


# Failures of the machinery, not of the policy: a browser that crashed or hung under an
# episode (the sandbox's limits, by contrast, are the program's own doing). Training gives
# such a completion no advantage; compare leaves its task out.
INFRASTRUCTURE_FAILURES = frozenset({"browser"})


@dataclass
class Scored:
    """The reward of one completion, with its components and any error raised."""

    reward: float
    components: dict[str, float]
    error: str | None = None
    failure: str | None = None


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
    if path.is_dir():
        raise ConfigError(f"recipe: {path} has no recipe.toml (not a recipe folder)")
    raise ConfigError(f"recipe: '{name}' not found (built-in recipes: {', '.join(known)})")


def recipe_defaults(name: str) -> dict:
    """The run-config layer from the recipe's recipe.toml, with recipe.name filled in."""
    folder = recipe_dir(name)
    data = read_toml(folder / "recipe.toml")
    data.setdefault("recipe", {})["name"] = name
    return data


class Recipe:
    """A loaded recipe: its tasks and its weighted reward."""

    def __init__(
        self,
        name: str,
        weights: dict[str, float],
        params: dict[str, Any],
        rewards: dict[str, str] | None = None,
        tasks: str | None = None,
        reward_timeout_s: float = 120.0,
    ):
        self.name = name
        self.reward_timeout_s = reward_timeout_s
        self.dir = recipe_dir(name)
        self.tasks_file = self.dir / tasks if tasks else None
        self.module = _load_module(self.dir, need_tasks=self.tasks_file is None)
        self.reward_fns = {k: load_function(v, self.dir, k) for k, v in (rewards or {}).items()}
        self.own_reward = self.module is not None and callable(getattr(self.module, "reward", None))
        for fn_name in ("reward", "reward_batch"):
            fn = getattr(self.module, fn_name, None) if self.module is not None else None
            if callable(fn) and not (fn_name == "reward" and _is_trl(fn)):
                want = "(tasks, groups)" if fn_name == "reward_batch" else "(task, completion)"
                _check_arity(fn, want, f"recipe: {self.dir / 'tasks.py'}: {fn_name}")
        if not self.own_reward and not self.reward_fns:
            where = self.dir / "tasks.py" if self.module is not None else self.dir
            raise ConfigError(
                f"recipe.rewards: {where} defines no reward(); name reward functions in recipe.rewards"
            )
        if self.tasks_file is not None and not self.tasks_file.exists():
            raise ConfigError(f"recipe.tasks: {self.tasks_file} not found")
        self.weights = dict(weights)
        self.params = dict(params)
        self._checked = False
        self.multi_turn = callable(getattr(self.module, "make_env", None))

    @classmethod
    def from_config(cls, cfg) -> Recipe:
        """From a RecipeConfig (the run config's `recipe` section)."""
        return cls(cfg.name, cfg.weights, cfg.params, cfg.rewards, cfg.tasks, cfg.reward_timeout_s)

    @property
    def max_reward(self) -> float:
        """The best weighted reward (components are in [0, 1])."""
        return sum(w for w in self.weights.values() if w > 0) or 1.0

    def make_env(self, task: Task):
        return self.module.make_env(task)

    def demonstrate(self, task: Task) -> list[str] | Callable | None:
        """The recipe's own way to solve `task` (`demonstrate(task)` in its tasks.py):
        its replies (one per turn), or a policy `reply(env, observation)` asked at each
        turn; None when it has none (see mlx_grpo/guidance.py)."""
        fn = getattr(self.module, "demonstrate", None)
        return fn(task) if callable(fn) else None

    def first_messages(self, task: Task, env=None) -> list[dict]:
        """The prompt's messages: the task's, then (multi-turn) the env's first observation."""
        if env is None:
            return task.messages
        return [*task.messages, {"role": "user", "content": env.reset()}]

    def tasks(self, split: str, n: int, seed: int) -> list[Task]:
        if self.tasks_file is not None:
            tasks = jsonl_tasks(self.tasks_file, split, n, seed)
        else:
            try:
                tasks = self.module.make_tasks(split, n, seed, **self.params)
            except ConfigError:  # the recipe's own one-line message
                raise
            except (TypeError, ValueError) as e:
                raise ConfigError(f"recipe.params: {self.dir / 'tasks.py'}: {e}") from None
        if not tasks:
            raise ConfigError(f"recipe: {self.name} made no {split} tasks with {self.params}")
        if not isinstance(tasks, (list, tuple)):
            got = type(tasks).__name__
        else:
            other = sorted({type(t).__name__ for t in tasks if not isinstance(t, Task)})
            got = f"a list of {', '.join(other)}" if other else ""
        if got:
            raise ConfigError(
                f"recipe: {self.dir / 'tasks.py'}: make_tasks returned {got}, not a list of "
                "mlx_grpo.recipe.Task"
            )
        return list(tasks)

    def score(self, task: Task, completion) -> Scored:
        """Weighted reward of one completion (text, or an Episode for multi-turn
        recipes). A reward that raises or returns a non-finite value scores 0 on
        every component and reports the error."""
        return self.score_groups([task], [[completion]])[0][0]

    def score_groups(self, tasks: list[Task], groups: list[list]) -> list[list[Scored]]:
        """Weighted rewards of every completion of every group (`groups[i]` holds
        completions of `tasks[i]`): one call per step, so that batch rewards (the
        sandbox, a judge model, group diversity) see the whole step at once."""
        flat = [(t, c) for t, g in zip(tasks, groups) for c in g]
        parts: list[list[dict | Exception]] = [[] for _ in flat]
        if self.own_reward:
            for i, out in enumerate(self._module_rewards(tasks, groups)):
                parts[i].append(out)
        for name, fn in self.reward_fns.items():
            for i, out in enumerate(_call_reward(fn, name, flat, self.reward_timeout_s, self.name)):
                parts[i].append(out)
        scored = [self._weigh(p) for p in parts]
        out, i = [], 0
        for g in groups:
            out.append(scored[i : i + len(g)])
            i += len(g)
        return out

    def score_rollout(self, tasks: list[Task], rollout) -> list[Scored]:
        """Every completion's Scored, in rollout order (groups of G per task)."""
        g = rollout.group_size
        comps = rollout.completions
        groups = [
            [c.episode or c.text for c in comps[i * g : (i + 1) * g]] for i in range(len(tasks))
        ]
        return [s for group in self.score_groups(tasks, groups) for s in group]

    def _module_rewards(self, tasks, groups) -> list[dict | Exception]:
        batch = getattr(self.module, "reward_batch", None)
        n = sum(len(g) for g in groups)
        if callable(batch):
            call, timeout_s = lambda: batch(tasks, groups), self.reward_timeout_s
            if _takes_deadline(batch):  # it keeps what finished: give it the time less a margin
                deadline = time.monotonic() + timeout_s - min(DEADLINE_MARGIN_S, timeout_s / 10)
                call = lambda: batch(tasks, groups, deadline=deadline)  # noqa: E731
            try:
                res = bounded(call, timeout_s, "reward_batch")
                if [len(r) for r in res] != [len(g) for g in groups]:
                    raise ValueError("reward_batch returned a different shape than its groups")
                return [r for rs in res for r in rs]
            except Exception as e:
                if isinstance(e, RewardTimeout):
                    warn_batch_timeout(self.name, "reward_batch", n, timeout_s)
                return [e] * n
        flat = [(t, c) for t, g in zip(tasks, groups) for c in g]
        return _call_reward(self.module.reward, "reward", flat, self.reward_timeout_s, self.name)

    def _weigh(self, parts: list) -> Scored:
        errors = [p for p in parts if isinstance(p, Exception)]
        if errors:
            e = errors[0]
            err = "".join(traceback.format_exception_only(type(e), e)).strip()
            failure = "timeout" if isinstance(e, RewardTimeout) else None
            return Scored(0.0, dict.fromkeys(self.weights or ["reward"], 0.0), err, failure)
        comps: dict[str, float] = {}
        failure = None
        try:
            for p in parts:
                for k, v in p.items():
                    if k == "failure":
                        failure = failure or (str(v) if v else None)
                    else:
                        comps[k] = float(v)
            if not all(math.isfinite(v) for v in comps.values()):
                raise ValueError(f"non-finite reward component in {comps}")
        except (TypeError, ValueError, AttributeError) as e:
            err = "".join(traceback.format_exception_only(type(e), e)).strip()
            return Scored(0.0, dict.fromkeys(self.weights or ["reward"], 0.0), err)
        self._check_weights(comps)
        if not self.weights:
            total = sum(comps.values()) if len(comps) == 1 else comps.get("reward", 0.0)
        else:
            total = sum(w * comps.get(k, 0.0) for k, w in self.weights.items())
        return Scored(total, comps, None, failure)

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


class RewardTimeout(RuntimeError):
    """A reward function gave no result within recipe.reward_timeout_s."""


# What a reward_batch that takes `deadline` is left for its own work after the deadline
# (at most a tenth of reward_timeout_s): it must return before the batch is given up.
DEADLINE_MARGIN_S = 5.0


def _takes_deadline(fn) -> bool:
    """Whether `fn` accepts a `deadline` keyword (a time.monotonic() value by which it
    returns, keeping the completions that finished)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "deadline" in params


def warn_batch_timeout(recipe: str, what: str, n: int, timeout_s: float) -> None:
    """One line on stderr when a batch reward is given up as a whole: every completion
    of the step scores 0 (fail/timeout), the quick ones too."""
    print(
        f"warning: recipe {recipe}: {what} gave no result in {timeout_s:g} s "
        f"(recipe.reward_timeout_s); all {n} completions of this step score 0 as "
        "fail/timeout (a reward_batch that takes `deadline` keeps the ones that finished)",
        file=sys.stderr,
    )


def bounded(call: Callable[[], Any], timeout_s: float, what: str, late: Exception | None = None):
    """`call()`'s result, or `late` (default: RewardTimeout) raised after `timeout_s`
    seconds. The call runs in a daemon thread, which is abandoned on timeout (Python
    cannot stop a thread; it no longer holds up the run). Rewards and tools use it."""
    box: dict = {}

    def run():
        try:
            box["value"] = call()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    worker = threading.Thread(target=run, daemon=True, name=what)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise late or RewardTimeout(
            f"{what}: no result after {timeout_s:g} s (recipe.reward_timeout_s)"
        )
    if "error" in box:
        raise box["error"]
    return box["value"]


def _call_reward(
    fn, name: str, flat: list[tuple[Task, Any]], timeout_s: float = 120.0, recipe: str = "?"
) -> list[dict | Exception]:
    """`fn` on every (task, completion): per completion, or once for a TRL-style
    `f(completions, **kwargs)`; each result as a dict of components, or the exception
    (RewardTimeout for a call that took longer than `timeout_s`: a TRL-style call
    times out as a whole, with one warning naming `recipe`)."""
    if _is_trl(fn):
        try:
            keys = sorted({k for t, _ in flat for k in t.payload})
            kwargs = {k: [t.payload.get(k) for t, _ in flat] for k in keys}
            values = bounded(
                lambda: fn(
                    completions=[c if isinstance(c, str) else str(c) for _, c in flat],
                    prompts=[t.messages for t, _ in flat],
                    task_ids=[t.id for t, _ in flat],
                    levels=[t.level for t, _ in flat],
                    **kwargs,
                ),
                timeout_s,
                name,
            )
            values = list(values)
            if len(values) != len(flat):
                raise ValueError(
                    f"{name}: returned {len(values)} rewards for {len(flat)} completions"
                )
            return [_as_components(name, v) for v in values]
        except Exception as e:
            if isinstance(e, RewardTimeout):
                warn_batch_timeout(recipe, name, len(flat), timeout_s)
            return [e] * len(flat)
    out: list[dict | Exception] = []
    for task, completion in flat:
        try:
            value = bounded(lambda t=task, c=completion: fn(t, c), timeout_s, name)
            if value is None:  # (TRL's "not applicable" is for its batch signature only)
                raise TypeError(f"{name} returned None, not a number or a dict of components")
            out.append(_as_components(name, value))
        except Exception as e:
            out.append(e)
    return out


def _as_components(name: str, value) -> dict:
    if isinstance(value, dict):
        return value
    if value is None:  # TRL: "not applicable to this sample"
        return {name: 0.0}
    return {name: float(value)}


def _is_trl(fn) -> bool:
    """TRL's reward signature: the first parameter is `completions` (plus **kwargs)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    return bool(params) and params[0].name == "completions"


def load_function(spec: str, folder: Path, field_name: str = "reward"):
    """'package.module:function' or 'file.py:function' (relative to `folder`)."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise ConfigError(
            f"recipe.rewards.{field_name}: '{spec}' is not 'module:function' or 'file.py:function'"
        )
    if target.endswith(".py"):
        path = (folder / target).resolve()
        if not path.exists():
            raise ConfigError(f"recipe.rewards.{field_name}: {path} not found")
        module = _import_path(path, f"mlx_grpo_reward_{path.stem}_{_short_hash(str(path))}")
    else:
        try:
            module = importlib.import_module(target)
        except Exception as e:  # not found, or a module that fails as it imports
            raise ConfigError(
                f"recipe.rewards.{field_name}: cannot import {target}: {first_line(e)}"
            ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"recipe.rewards.{field_name}: {target} has no function {attr}")
    if not _is_trl(fn):
        what = f"recipe.rewards.{field_name}: {spec}"
        _check_arity(fn, "(task, completion)", what, " (or TRL's (completions, **kwargs))")
    return fn


def _check_arity(fn, want: str, what: str, also: str = "") -> None:
    """ConfigError unless `fn` can be called with the positional arguments `want` names
    ('(task, completion)'); a function whose signature cannot be read passes."""
    try:
        sig = inspect.signature(fn, follow_wrapped=False)  # (what a decorator takes)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(*range(want.count(",") + 1))
    except TypeError:
        bare = [p.replace(annotation=p.empty) for p in sig.parameters.values()]
        takes = sig.replace(parameters=bare, return_annotation=sig.empty)
        raise ConfigError(f"{what} takes {takes}; a reward takes {want}{also}") from None


def _short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def _import_path(path: Path, mod_name: str) -> ModuleType:
    """Import a recipe's own Python file; one that does not import (a syntax error, a
    missing package, an exception at import) is a ConfigError naming its file and line."""
    spec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(mod_name, None)
        raise ConfigError(f"recipe: {_where(e, path)}: {first_line(e)}") from None
    return module


def first_line(e: BaseException) -> str:
    """'SyntaxError: invalid syntax', 'ModuleNotFoundError: No module named 'x''."""
    text = (e.msg if isinstance(e, SyntaxError) else str(e)).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def _where(e: Exception, path: Path) -> str:
    """'file:line' of the error in `path` (a syntax error's own, else the innermost frame
    in that file), or the file alone."""
    if isinstance(e, SyntaxError) and e.filename and e.lineno:
        return f"{e.filename}:{e.lineno}"
    lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if Path(f.filename) == path]
    return f"{path}:{lines[-1]}" if lines else str(path)


def jsonl_tasks(path: Path, split: str, n: int, seed: int, eval_share: int = 10) -> list[Task]:
    """Tasks of `split` from a JSONL file, shuffled by `seed`, at most `n`. A line
    without `split` belongs to eval when the hash of its id falls in 1 of `eval_share`."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    tasks: list[Task] = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{lineno}: invalid JSON: {e.msg}") from None
            if not isinstance(row, dict) or not ("prompt" in row or "messages" in row):
                raise ConfigError(f"{path}:{lineno}: a task needs 'prompt' or 'messages'")
            messages = row.pop("messages", None) or [{"role": "user", "content": row.pop("prompt")}]
            row.pop("prompt", None)
            tid = str(row.pop("id", None) or _short_hash(json.dumps(messages)))
            level = row.pop("level", 1)
            if not isinstance(level, int):
                raise ConfigError(f"{path}:{lineno}: level must be an integer, got {level!r}")
            row_split = row.pop("split", None)
            if row_split is None:
                row_split = "eval" if int(_short_hash(tid), 16) % eval_share == 0 else "train"
            if row_split != split:
                continue
            tasks.append(Task(id=tid, level=level, messages=messages, payload=row))
    random.Random(f"jsonl-{seed}").shuffle(tasks)
    return tasks[:n]


def _load_module(folder: Path, need_tasks: bool = True) -> ModuleType | None:
    path = folder / "tasks.py"
    if not path.exists():
        if not need_tasks:
            return None
        raise ConfigError(
            f"recipe: {path} is missing (it defines make_tasks; or set recipe.tasks to a JSONL file)"
        )
    module = _import_path(path, f"mlx_grpo_recipe_{folder.name}_{_short_hash(str(path.resolve()))}")
    if need_tasks and not callable(getattr(module, "make_tasks", None)):
        raise ConfigError(f"recipe: {path} does not define make_tasks()")
    return module
