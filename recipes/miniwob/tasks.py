"""MiniWoB++ in a real Chromium, played by the web agent of web_browsing.

The same agent as web_browsing: the same system prompt and worked examples, the same
accessibility-tree lines, the same action grammar and parsers, the same reward
components (rewards/web.py), so one adapter can be trained on either and measured on
both. Pages are MiniWoB++'s own task HTML (the `miniwob` package), driven in pooled
headless Chromium browsers (browser.py); MiniWoB's raw reward decides success (page.py).

Task types (`recipe.params`):

    types        which types to play: "train" (default), "transfer" (the suite types
                 not trained on), "suite" (every suite type), or a list of type names
                 (any MiniWoB type, in the suite or not: "click-pie", ...)
    train_types  the trained types (at most 15; default TRAIN)
    browsers     browsers in the pool (default 4)

The suite (suite.py, suite.json) is the set of types a scripted policy written with the
grammar alone solves on at least 95% of seeds. Levels are task types ordered by the
embedded model's greedy success before training (base.json, written by
`python -m recipes.miniwob.levels`), easiest first, so the curriculum chooses among
types. Seeds: training draws from [0, 1e6), held-out tasks use 1e6 + the run seed's
block, and the suite check uses 2e6 and up (MiniWoB's "train" data mode throughout, as
in the suite check).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from mlx_grpo.config import ConfigError
from mlx_grpo.recipe import Task
from recipes.miniwob.browser import HTML, NoBrowser, find_browser
from recipes.miniwob.page import MiniWoBEnv
from recipes.miniwob.suite import SCRIPTS, load_suite, player, suite_types
from recipes.web_agent import agent_messages, instructions, syntax_error
from rewards.web import components

MAX_TRAIN_TYPES = 15
TRAIN = (
    "click-button",
    "click-link",
    "click-dialog",
    "click-tab",
    "click-option",
    "click-checkboxes",
    "click-collapsible",
    "enter-text",
    "enter-password",
    "login-user",
    "focus-text-2",
    "choose-list",
    "enter-date",
    "read-table",
    "simple-arithmetic",
)
SLACK = 1  # steps allowed beyond the script's longest success (multi-step types)
UNKNOWN_STEPS = 8  # step limit of a type the suite has no record of
VERBS = {"click", "type", "select"}
BASE_FILE = Path(__file__).with_name("base.json")
EVAL_SEEDS = 1_000_000


def resolve_types(types, train_types) -> list[str]:
    """The type names `types` stands for (see the module docstring)."""
    train = list(train_types)
    if len(train) > MAX_TRAIN_TYPES:
        raise ValueError(f"train_types: at most {MAX_TRAIN_TYPES} types, got {len(train)}")
    suite = suite_types()
    if types == "train":
        names = train
    elif types == "transfer":
        names = [t for t in suite if t not in train]
    elif types == "suite":
        names = suite
    elif isinstance(types, (list, tuple)) and types:
        names = list(types)
    else:
        raise ValueError(
            f"types: 'train', 'transfer', 'suite' or a list of MiniWoB types, got {types!r}"
        )
    unknown = [t for t in [*names, *train] if not (HTML / f"{t}.html").exists()]
    if unknown:
        raise ValueError(f"unknown MiniWoB task types: {', '.join(unknown)}")
    return names


def levels(names: list[str]) -> dict[str, int]:
    """Level of each type: 1 for the type the base model solves most often, and so on
    (types base.json lacks come last, in the order given)."""
    base = json.loads(BASE_FILE.read_text()) if BASE_FILE.exists() else {}
    order = sorted(names, key=lambda t: (-base[t] if t in base else 1.0, names.index(t)))
    return {t: i + 1 for i, t in enumerate(order)}


def make_tasks(
    split: str,
    n: int,
    seed: int,
    types="train",
    train_types=TRAIN,
    browsers: int = 4,
) -> list[Task]:
    """`n` episodes cycling through the types; train seeds drawn from (seed, type, k),
    held-out seeds the k-th of the run seed's block."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if not isinstance(browsers, int) or browsers < 1:
        raise ValueError(f"browsers must be a positive integer, got {browsers!r}")
    try:
        find_browser()
    except NoBrowser as e:
        raise ConfigError(f"recipe miniwob: {e}") from None
    names = resolve_types(types, train_types)
    level = levels(names)
    suite = load_suite()
    # Every type gets the same prompt: a click, then a form (type, select, submit).
    messages = agent_messages(instructions(VERBS), {"click"}, VERBS)
    tasks = []
    for i in range(n):
        name, k = names[i % len(names)], i // len(names)
        if split == "train":
            episode_seed = random.Random(f"miniwob:{seed}:{name}:{k}").randrange(EVAL_SEEDS)
        else:
            episode_seed = EVAL_SEEDS + (seed * 10_007 + k) % EVAL_SEEDS
        record = suite.get(name)
        steps = record["max_steps"] if record else UNKNOWN_STEPS
        tasks.append(
            Task(
                id=f"miniwob-{split}-{name}-{episode_seed}",
                level=level[name],
                messages=messages,
                payload={
                    "task": name,
                    "seed": episode_seed,
                    "mode": "train",
                    "max_steps": steps if steps == 1 else steps + SLACK,
                    "shortest": record["steps"] if record else 1,
                    "browsers": browsers,
                },
            )
        )
    return tasks


def make_env(task: Task) -> MiniWoBEnv:
    p = task.payload
    env = MiniWoBEnv(p["task"], p["seed"], p["mode"], p["max_steps"], p["browsers"])
    env.record = p.get("record", False)  # screenshots for pictures.py
    return env


def demonstrate(task: Task):
    """The type's scripted policy (suite.py), for the types that have one: what
    guidance.enabled shows the policy."""
    name = task.payload["task"]
    return player(name) if name in SCRIPTS else None


def reward(task: Task, episode) -> dict:
    """The shared web components (`success`: full credit); MiniWoB's raw reward is
    logged as `raw_reward` and BrowserGym's success rule (a raw reward above 0) as
    `browsergym_success`, unweighted; a browser that failed names the failure."""
    env = episode.env
    out = {
        **components(task, episode, syntax_error),
        "raw_reward": env.raw_reward or 0.0,
        "browsergym_success": float(env.outcome().browsergym_success),
    }
    if env.failure:
        out["failure"] = env.failure
    return out
