"""Web browsing on simulated SaaS dashboards: click, fill forms, find facts, navigate.

Each task is an episode on a procedurally generated site (sites.py), shown as an
accessibility tree (page.py) by the environment (browser.py); the model replies with one
action per turn. Task families and their difficulties are described in families.py; the
global ladder below is what the curriculum sees as `Task.level`:

    level  families            shortest solutions (turns)
    1      click 1             1: 2-3 buttons, the label quoted in the goal
    2      click 2, fact 1     1: 4-6 buttons sharing words / stop with one of 3 facts
    3      click 3, form 1,    1: synonyms among 8-12 buttons / 2: fill a textbox, submit /
           fact 2              1: one of 5-6 facts or 3-4 table rows
    4      form 2, fact 3,     3: textbox + combobox / 2: open the right docs article /
           nav 1               2: open a section, press a button there
    5      form 3, fact 4,     4: three field kinds, near-labels, plain words / 2-3: find a
           nav 2               fact from the dashboard / 4: a form two links deep
    6      nav 3               4-5: the same without the path, in plain words

Tasks of a level share their system prompt, which lists only the actions the level needs,
each with an example. A task's step limit is its shortest solution, plus SLACK when that
takes more than one step (single-step tasks end after one turn).

Brands, and so sites, are split between train and eval by a hash of the brand's name.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

from mlx_grpo.recipe import Task
from recipes.web_agent import agent_messages, instructions, syntax_error
from recipes.web_browsing.browser import WebEnv
from recipes.web_browsing.families import NEEDED, make_spec
from recipes.web_browsing.sites import BRANDS, site_fingerprint
from rewards.web import components

LEVELS: dict[int, tuple[tuple[str, int], ...]] = {
    1: (("click", 1),),
    2: (("click", 2), ("fact", 1)),
    3: (("click", 3), ("form", 1), ("fact", 2)),
    4: (("form", 2), ("fact", 3), ("nav", 1)),
    5: (("form", 3), ("fact", 4), ("nav", 2)),
    6: (("nav", 3),),
}
SLACK = 2  # extra steps allowed beyond the shortest solution of a multi-step task


def system_prompt(level: int) -> str:
    """The instructions for `level`: the grammar of the actions its families need."""
    return instructions(level_verbs(level))


def level_verbs(level: int) -> set[str]:
    return {verb for fam in LEVELS[level] for verb in NEEDED[fam]}


def task_messages(level: int, family: str, difficulty: int) -> list[dict]:
    """The level's instructions, then worked examples of the actions the family needs."""
    return agent_messages(system_prompt(level), set(NEEDED[family, difficulty]))


def make_tasks(split: str, n: int, seed: int, levels: Sequence[int] = tuple(LEVELS)) -> list[Task]:
    """`n` distinct tasks of `split`, cycling through `levels` and, within a level,
    through its families. Task k of a level is drawn from (split, seed, level, k) (drawn
    again, with the attempt number, in the rare case that it repeats an earlier task)."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    bad = [lv for lv in levels if lv not in LEVELS]
    if bad:
        raise ValueError(f"unknown levels {bad}; levels are {sorted(LEVELS)}")
    seen: set[tuple[str, str]] = set()
    counts = dict.fromkeys(levels, 0)
    tasks: list[Task] = []
    for i in range(n):
        level = levels[i % len(levels)]
        k = counts[level]
        counts[level] += 1
        family, difficulty = LEVELS[level][k % len(LEVELS[level])]
        for attempt in itertools.count():
            rng = random.Random(f"web_browsing:{split}:{seed}:{level}:{k}:{attempt}")
            spec = make_spec(family, difficulty, rng, rng.choice(BRANDS[split]))
            key = (site_fingerprint(spec.site), spec.goal)
            if key not in seen:
                break
            if attempt >= 100:
                raise RuntimeError(f"level {level}: no new {family} task after 100 tries")
        seen.add(key)
        steps = len(spec.solution)
        tasks.append(
            Task(
                id=f"web-{split}-s{seed}-L{level}-{k}",
                level=level,
                messages=task_messages(level, family, difficulty),
                payload={
                    "family": family,
                    "difficulty": difficulty,
                    "site": spec.site,
                    "goal": spec.goal,
                    "conditions": spec.conditions,
                    "keep": spec.keep,
                    "solution": spec.solution,
                    "max_steps": steps if steps == 1 else steps + SLACK,
                },
            )
        )
    return tasks


def make_env(task: Task) -> WebEnv:
    """The task's browser, built from its payload alone."""
    p = task.payload
    return WebEnv(p["site"], p["goal"], p["conditions"], p["max_steps"], p["keep"])


def demonstrate(task: Task) -> list[str]:
    """The shortest solution, one action a turn (what guidance.enabled shows the policy)."""
    return task.payload["solution"]


def reward(task: Task, episode) -> dict[str, float]:
    """The shared web components (rewards/web.py), judging format by this grammar."""
    return components(task, episode, syntax_error)
