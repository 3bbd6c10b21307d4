"""The browser: a web_browsing task's environment, and its goal check.

`WebEnv` shows the goal and the start page, then applies one reply per step. The reply's
action is the strict parse when the reply is well formed and otherwise the first action
found in it (page.py); a reply with no action at all is an invalid action that still uses
a step. Each observation starts with one line saying what happened ("Clicked link
"Billing" [4]." / "Invalid action: ...") followed by the new page, or "(page unchanged)".

The episode ends when a button that does not open a page is pressed (it acts: submit a
form, delete a project...), on `stop "answer"` (allowed on any task; on a task that is
not a question it gives up), or when the task's step limit is reached. Single-step tasks
have a limit of one step.

`info` of each step: `format` (the reply is exactly one well-formed action), `syntax`
(why not, or None), `action` (what was executed, canonical, or None), `valid` (the action
hit an existing element of the right kind, under its own label when the reply gave one;
None when nothing was executed) and `error`
(why the turn did nothing: no action found, or an invalid one; None otherwise).
"""

from __future__ import annotations

import re
from typing import NamedTuple

from mlx_grpo.env import StepResult
from recipes.web_agent import (
    Action,
    InvalidAction,
    check_target,
    element_ref,
    read_reply,
    render_element,
    render_page,
)

_APPLIES_TO = {
    "click": ("link", "button", "checkbox"),
    "type": ("textbox",),
    "select": ("combobox",),
}
_NOT_WORDS = re.compile(r"[^a-z0-9@./:\-]+")
_FILLERS = frozenset({"a", "an", "the", "on", "at", "of", "to", "from", "per", "for", "in", "is"})


def _tokens(text: str) -> set[str]:
    return {t.strip(".:") for t in _NOT_WORDS.sub(" ", text.lower()).split()} - {""}


def answer_matches(answer: str, value: str, sentence: str) -> bool:
    """The answer names the value and says nothing the sentence stating it does not.

    Case, punctuation, "$" and "%" are ignored; filler words in the value are optional.

    >>> s = "Logs are kept for 30 days."
    >>> [answer_matches(a, "30", s) for a in ("30", "30 days", s, "14", "30 or 14 days", "")]
    [True, True, True, False, False, False]
    """
    given = _tokens(answer)
    need = _tokens(value) - _FILLERS or _tokens(value)
    return bool(given) and need <= given <= _tokens(sentence) | need


class Outcome(NamedTuple):
    """The goal check: whether each condition is met, and any field changed that the
    goal said nothing about (success needs all conditions and no side effects)."""

    met: tuple[bool, ...]
    side_effects: tuple[str, ...]

    @property
    def success(self) -> bool:
        return all(self.met) and not self.side_effects

    @property
    def progress(self) -> float:
        """The share of conditions met, where the last one (the press or the answer that
        ends the episode) counts only once all the others are: submitting an unfilled
        form is not half a solution, and paying for it taught the policy to press
        submit first."""
        if not self.met:
            return 0.0
        *before, last = self.met
        return (sum(before) + (last and all(before))) / len(self.met)


class WebEnv:
    """One episode on one site; fully determined by its arguments (the task payload)."""

    def __init__(
        self,
        site: dict,
        goal: str,
        conditions: list[dict],
        max_steps: int,
        keep: list[dict] | None = None,
    ):
        self.site, self.goal, self.conditions = site, goal, conditions
        self.max_steps, self.keep = max_steps, keep or []
        self.brand = site["brand"]
        self._elements = {
            key: {el["id"]: el for el in page["elements"] if "id" in el}
            for key, page in site["pages"].items()
        }
        self.reset()

    def reset(self) -> str:
        self.page = self.site["start"]
        self.history: list[str] = []
        self.visited = {self.page}
        self.values = {
            key: {i: el["value"] for i, el in els.items() if "value" in el}
            for key, els in self._elements.items()
        }
        self.pressed: tuple[str, int] | None = None
        self.answer: str | None = None
        self.steps = 0
        self.done = False
        return f"Goal: {self.goal}\n{self.render()}"

    def render(self) -> str:
        return render_page(self.brand, self.site["pages"][self.page], self.values[self.page])

    def step(self, reply: str) -> StepResult:
        if self.done:
            raise RuntimeError("step() after the episode ended")
        self.steps += 1
        action, info = read_reply(reply)
        note, changed = "", False
        if action is not None:
            try:
                note, changed = self._execute(action)
                info["valid"] = True
            except InvalidAction as e:
                info.update(valid=False, error=str(e))
        if info["error"] is not None:
            note = f"Invalid action: {info['error']}."
        if not self.done and self.steps >= self.max_steps:
            self.done = True
            note += " Step limit reached."
        page = self.render() if changed else "(page unchanged)"
        return StepResult(f"{note}\n{page}", self.done, info)

    def _execute(self, action: Action) -> tuple[str, bool]:
        """Apply an action: (what happened, whether the page changed)."""
        if action.verb == "stop":
            self.answer, self.done = action.text, True
            return f'Stopped with the answer "{action.text}".', False
        if action.verb == "back":
            if not self.history:
                raise InvalidAction("there is no previous page")
            self.page = self.history.pop()
            return "Went back.", True
        el = self._elements[self.page].get(action.target)
        check_target(action, el, _APPLIES_TO)
        role, eid, ref = el["role"], el["id"], element_ref(el)
        values = self.values[self.page]
        if action.verb == "type":
            values[eid] = action.text
            return f'Typed "{action.text}" into {ref}.', True
        if action.verb == "select":
            wanted = action.text.strip().casefold()
            option = next((o for o in el["options"] if o.casefold() == wanted), None)
            if option is None:
                raise InvalidAction(f'{ref} has no option "{action.text}"')
            values[eid] = option
            return f'Selected "{option}" in {ref}.', True
        if role == "checkbox":
            values[eid] = not values[eid]
            return f"{'Checked' if values[eid] else 'Unchecked'} {ref}.", True
        shown = render_element(el)
        if "to" in el:
            self.history.append(self.page)
            self.page = el["to"]
            self.visited.add(self.page)
            return f"Clicked {shown}.", True
        self.pressed, self.done = (self.page, eid), True
        return f"Clicked {shown}.", False

    def outcome(self) -> Outcome:
        """The goal check on the current state."""
        met = tuple(self._met(c) for c in self.conditions)
        changed = tuple(
            f'"{k["label"]}" was changed'
            for k in self.keep
            if self.values[k["page"]][k["id"]] != self._elements[k["page"]][k["id"]]["value"]
        )
        return Outcome(met, changed)

    def _met(self, c: dict) -> bool:
        kind = c["kind"]
        if kind == "press":
            return self.pressed == (c["page"], c["id"])
        if kind == "visit":
            return c["page"] in self.visited
        if kind == "answer":
            return self.answer is not None and answer_matches(
                self.answer, c["value"], c["sentence"]
            )
        if kind == "value":
            value = self.values[c["page"]][c["id"]]
            if isinstance(value, str):
                return value.strip().casefold() == c["value"].casefold()
            return value == c["value"]
        raise ValueError(f"unknown goal condition {kind!r}")
