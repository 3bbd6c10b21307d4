"""Task families of the web_browsing recipe, each at integer difficulties.

click  1: 2-3 buttons, the goal quotes the label.       2: 4-6 buttons, distractors share
          the target's verb or object.                  3: 8-12 buttons, the goal says it
          with other words ("Remove the draft." for "Delete draft").
form   1: one textbox to fill, then submit.             2: a textbox and a combobox among
          3-4 fields.                                   3: a textbox, a combobox and a
          checkbox among 4-5 fields with near-labels, goal in plain words ("then save").
fact   1: the answer is on the page, among 3 facts.     2: among 5-6 facts or 3-4 rows.
       3: from the docs index, open the right article.  4: from the dashboard, find it in
          the docs or a table.
nav    1: open a section named in the goal, press a button there.
       2: open a form two links away (path named in the goal), change one field, submit.
       3: the same with 1-2 fields and no path in the goal, which says it in plain words.

A family returns a TaskSpec: the site, the goal, the goal's conditions, the fields that
must stay as they are, and the golden solution (canonical actions).
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from recipes.web_agent import element_ref
from recipes.web_browsing.sites import (
    CLICK_TITLES,
    FACT_TOPICS,
    FIELDS,
    FORM_DISTRACTORS,
    FORM_TOPICS,
    SUBMIT_LABELS,
    Fact,
    FieldSpec,
    SiteBuilder,
    action_label,
    action_pairs,
    button,
    dashboard,
    display_name,
    docs,
    synonym_goal,
)


@dataclass(frozen=True)
class TaskSpec:
    """What a family makes: everything the environment and the reward need."""

    site: dict
    goal: str
    conditions: list[dict]  # success needs all; the last is the act ending the episode
    solution: list[str]  # the shortest action sequence that reaches the goal
    keep: list[dict] = field(default_factory=list)  # fields that must keep their value


# The actions each (family, difficulty) needs: the level's prompt explains these.
NEEDED: dict[tuple[str, int], tuple[str, ...]] = {
    ("click", 1): ("click",),
    ("click", 2): ("click",),
    ("click", 3): ("click",),
    ("form", 1): ("click", "type"),
    ("form", 2): ("click", "type", "select"),
    ("form", 3): ("click", "type", "select"),
    ("fact", 1): ("stop",),
    ("fact", 2): ("stop",),
    ("fact", 3): ("click", "back", "stop"),
    ("fact", 4): ("click", "back", "stop"),
    ("nav", 1): ("click", "back"),
    ("nav", 2): ("click", "type", "select", "back"),
    ("nav", 3): ("click", "type", "select", "back"),
}


def press(page: str, el: dict) -> dict:
    return {"kind": "press", "page": page, "id": el["id"], "label": el["label"]}


def visit(page: str) -> dict:
    return {"kind": "visit", "page": page}


def set_value(page: str, el: dict, value: str | bool) -> dict:
    return {"kind": "value", "page": page, "id": el["id"], "label": el["label"], "value": value}


def answer(fact: Fact) -> dict:
    return {"kind": "answer", "value": fact.value, "sentence": fact.sentence}


def by_label(page: dict, label: str) -> dict:
    return next(el for el in page["elements"] if el["label"] == label)


def path_to(site: dict, target: str) -> list[tuple[str, dict]]:
    """The (page, element) clicks that lead from the start page to `target` (BFS)."""
    start = site["start"]
    came: dict[str, tuple[str, dict] | None] = {start: None}
    queue = deque([start])
    while queue:
        key = queue.popleft()
        for el in site["pages"][key]["elements"]:
            to = el.get("to")
            if to and to not in came:
                came[to] = (key, el)
                queue.append(to)
    steps: list[tuple[str, dict]] = []
    while came[target] is not None:
        step = came[target]
        steps.append(step)
        target = step[0]
    return steps[::-1]


def fill_action(el: dict, value: str | bool) -> str:
    """The canonical action that gives field `el` the value `value`."""
    if el["role"] == "checkbox":
        return f"click {element_ref(el)}"
    verb = "type" if el["role"] == "textbox" else "select"
    return f'{verb} {element_ref(el)} "{value}"'


def change_words(el: dict, value: str | bool, plain: bool) -> str:
    """A goal's words for one field change: quoted labels, or plain words when `plain`."""
    role, label = el["role"], el["label"]
    if plain:
        name = display_name(label)
        if role == "checkbox":
            return f"turn {'on' if value else 'off'} {name}"
        verb = "set" if role == "textbox" else "change"
        return f'{verb} the {name} to "{value}"'
    if role == "checkbox":
        return f'{"check" if value else "uncheck"} "{label}"'
    verb = "type" if role == "textbox" else "select"
    return f'{verb} "{value}" in "{label}"'


def near_label(a: FieldSpec, b: FieldSpec) -> bool:
    """Two fields whose labels share a word ("Email alerts", "SMS alerts")."""
    return bool(set(a.label.lower().split()) & set(b.label.lower().split()))


def capitalised(sentence: str) -> str:
    return sentence[:1].upper() + sentence[1:]


def form_goal(
    b: SiteBuilder, key: str, targets: list[dict], plain: bool
) -> tuple[str, list[dict], list[str], list[dict]]:
    """Change `targets` (elements of the form page `key`) and submit: the goal's words
    (uncapitalised), conditions, solution steps and the fields to keep."""
    page = b.pages[key]
    submit = next(el for el in page["elements"] if el.get("submit"))
    words, conditions, steps = [], [], []
    for el in targets:
        value = b.new_value(FIELDS[el["label"]], el["value"])
        words.append(change_words(el, value, plain))
        conditions.append(set_value(key, el, value))
        steps.append(fill_action(el, value))
    conditions.append(press(key, submit))
    steps.append(f"click {element_ref(submit)}")
    ending = "then save" if plain else f'then click "{submit["label"]}"'
    goal = ", ".join([*words, ending]) + "."
    fields = [el for el in page["elements"] if "value" in el and el not in targets]
    keep = [{"page": key, "id": el["id"], "label": el["label"]} for el in fields]
    return goal, conditions, steps, keep


# ---- families --------------------------------------------------------------------------


def click_task(rng: random.Random, brand: str, difficulty: int) -> TaskSpec:
    b = SiteBuilder(brand, rng)
    n = {1: rng.randint(2, 3), 2: rng.randint(4, 6), 3: rng.randint(8, 12)}[difficulty]
    pairs = action_pairs(rng, n, near=difficulty >= 2)
    target = pairs[0]
    rng.shuffle(pairs)
    page = b.add("page", rng.choice(CLICK_TITLES), "hub", [button(action_label(*p)) for p in pairs])
    el = by_label(page, action_label(*target))
    if difficulty < 3:
        goal = f'Click "{el["label"]}".'
    else:
        goal = capitalised(synonym_goal(rng, *target) + ".")
    return TaskSpec(b.site("page"), goal, [press("page", el)], [f"click {element_ref(el)}"])


def form_task(rng: random.Random, brand: str, difficulty: int) -> TaskSpec:
    b = SiteBuilder(brand, rng)
    topic = rng.choice(sorted(FORM_TOPICS))
    specs = FORM_TOPICS[topic]
    roles = {1: ("textbox",), 2: ("textbox", "combobox"), 3: ("textbox", "combobox", "checkbox")}
    size = {1: rng.randint(1, 2), 2: rng.randint(3, 4), 3: rng.randint(4, 5)}[difficulty]
    wanted = [rng.choice([s for s in specs if s.role == r]) for r in roles[difficulty]]
    rest = [s for s in specs if s not in wanted]
    chosen = wanted + rng.sample(rest, size - len(wanted))
    if difficulty == 3 and not any(near_label(s, w) for s in chosen[3:] for w in wanted):
        # keep a field whose label looks like a target's ("Email" / "Backup email")
        near = [s for s in rest if any(near_label(s, w) for w in wanted)]
        if near:
            chosen[-1] = rng.choice(near)
    rng.shuffle(chosen)
    others = ["Cancel"] if difficulty == 1 else rng.sample(FORM_DISTRACTORS, difficulty - 1)
    page = b.form("page", f"Settings > {topic}", chosen, rng.choice(SUBMIT_LABELS), others)
    labels = {s.label for s in wanted}
    targets = [el for el in page["elements"] if el["label"] in labels]
    goal, conditions, steps, keep = form_goal(b, "page", targets, plain=difficulty >= 3)
    return TaskSpec(b.site("page"), capitalised(goal), conditions, steps, keep)


def fact_task(rng: random.Random, brand: str, difficulty: int) -> TaskSpec:
    b = SiteBuilder(brand, rng)
    if difficulty == 1:
        topic = rng.choice(sorted(FACT_TOPICS))
        b.article("page", f"Docs > {topic}", rng.sample(FACT_TOPICS[topic], 3))
        start = "page"
    elif difficulty == 2:
        kind = rng.choice(("faq", "invoices", "team"))
        if kind == "faq":
            topics = rng.sample(sorted(FACT_TOPICS), 2)
            specs = [s for t in topics for s in rng.sample(FACT_TOPICS[t], 3)]
            rng.shuffle(specs)
            b.article("page", "Docs > FAQ", specs[: rng.randint(5, 6)])
        elif kind == "invoices":
            b.invoices("page", "Billing", rng.randint(3, 4), [])
        else:
            b.add("page", "Team", "table", b.member_rows("page", b.members(rng.randint(3, 4))))
        start = "page"
    elif difficulty == 3:
        docs(b, rng.sample(sorted(FACT_TOPICS), rng.randint(3, 4)))
        start = "docs"
    else:
        dashboard(b)
        start = "home"
    fact = rng.choice(b.facts)
    site = b.site(start)
    path = path_to(site, fact.page)
    goal = f"Answer the question: {fact.question}"
    conditions = [visit(el["to"]) for _, el in path] + [answer(fact)]
    solution = [f"click {element_ref(el)}" for _, el in path] + [f'stop "{fact.value}"']
    return TaskSpec(site, goal, conditions, solution)


def nav_task(rng: random.Random, brand: str, difficulty: int) -> TaskSpec:
    b = SiteBuilder(brand, rng)
    dashboard(b)
    site = b.site("home")
    if difficulty == 1:
        key = rng.choice(["projects", "billing"])
        actions = [el for el in b.pages[key]["elements"] if el["role"] == "button"]
        el = rng.choice(actions)
        path = path_to(site, key)
        goal = f'Go to "{b.pages[key]["title"]}" and click "{el["label"]}".'
        conditions = [visit(p["to"]) for _, p in path] + [press(key, el)]
        solution = [f"click {element_ref(p)}" for _, p in path] + [f"click {element_ref(el)}"]
        return TaskSpec(site, goal, conditions, solution)
    key = rng.choice(sorted(k for k, p in b.pages.items() if p["kind"] == "form"))
    page = b.pages[key]
    fields = [el for el in page["elements"] if "value" in el]
    targets = rng.sample(fields, 1 if difficulty == 2 else rng.randint(1, 2))
    targets.sort(key=page["elements"].index)
    plain = difficulty >= 3
    change, conditions, steps, keep = form_goal(b, key, targets, plain)
    path = path_to(site, key)
    if not plain:
        where = " > ".join(f'"{el["label"]}"' for _, el in path)
        goal = f"Go to {where}, {change}"
    elif key.startswith("team/"):
        goal = f"For {page['title'].split(' > ')[1]}, {change}"
    else:
        goal = capitalised(change)
    conditions = [visit(el["to"]) for _, el in path] + conditions
    solution = [f"click {element_ref(el)}" for _, el in path] + steps
    return TaskSpec(site, goal, conditions, solution, keep)


FAMILIES: dict[str, Callable[[random.Random, str, int], TaskSpec]] = {
    "click": click_task,
    "form": form_task,
    "fact": fact_task,
    "nav": nav_task,
}


def make_spec(family: str, difficulty: int, rng: random.Random, brand: str) -> TaskSpec:
    """One task of `family` at `difficulty` on a site of `brand`."""
    if (family, difficulty) not in NEEDED:
        raise ValueError(f"unknown family/difficulty {family}/{difficulty}")
    return FAMILIES[family](rng, brand, difficulty)
