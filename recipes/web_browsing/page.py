"""What the model reads and writes on the simulated web: pages and actions.

A page is shown as a compact accessibility tree, one element per line: role, label,
element id, then the value or options of a field:

    Page: Pine Cloud > Settings > Profile
    textbox "Email" [12] value="ana@pine.io"
    combobox "Plan" [7] value="Free" options=["Free","Pro","Team"]
    checkbox "Email alerts" [5] checked=false
    link "Billing" [3]
    button "Save changes" [9]
    row "INV-1043 | Mar 2 | $120 | Paid" [20]
    text "Logs are kept for 30 days."

A reply is one action, exactly one of

    click "label" [id]    type "label" [id] "text"    select "label" [id] "option"
    back                  stop "answer"

An element is named the way the page shows it, its quoted label then its id: the id
decides which element is acted on, and a label that is not that element's makes the
action invalid. Writing the label first is what lets a small model find the id: it copies
the label from the goal, and the id is what follows that label on the page.

Two parsers read a reply. `parse_action` is strict: the whole reply (surrounding
whitespace aside) must be one well-formed action, and when it is not, the error says
why; the `format` reward component scores this. `find_action` is lenient: the first
action found anywhere in the reply, case-insensitively, with curly quotes allowed and the
label optional; this is the action the environment executes, so that a reply in the
embedded model's own style (`Click [11] button "Profile" to open it.`) still acts and
`success` has signal before the format is learned. Leniently, `back` counts only as the
reply's first word, since the word is common in prose.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

VERBS = ("click", "type", "select", "back", "stop")
USAGE = {
    "click": 'click "label" [id]',
    "type": 'type "label" [id] "text"',
    "select": 'select "label" [id] "option"',
    "back": "back",
    "stop": 'stop "answer"',
}
_QUOTE_NOUN = {"type": "text", "select": "option", "stop": "answer"}
_TARGETED = ("click", "type", "select")


@dataclass(frozen=True)
class Action:
    """One parsed action: its verb, the element id it targets, its quoted text, and the
    label it gives the element (None when a lenient reply named the element by id only)."""

    verb: str
    target: int | None = None
    text: str | None = None
    label: str | None = None

    def __str__(self) -> str:
        parts = [self.verb]
        if self.label is not None:
            parts.append(f'"{self.label}"')
        if self.target is not None:
            parts.append(f"[{self.target}]")
        if self.text is not None:
            parts.append(f'"{self.text}"')
        return " ".join(parts)


class ActionSyntaxError(ValueError):
    """A reply that is not exactly one well-formed action; the message says why."""


_REF = r'"([^"\n]*)" \[(\d+)\]'  # an element: its label, then its id
_STRICT = {
    "click": re.compile(rf"click {_REF}"),
    "type": re.compile(rf'type {_REF} "([^"\n]*)"'),
    "select": re.compile(rf'select {_REF} "([^"\n]*)"'),
    "back": re.compile(r"back\b"),
    "stop": re.compile(r'stop "([^"\n]*)"'),
}
_STRICT_REF = {verb: re.compile(rf"{verb} {_REF}") for verb in _TARGETED}
_LEADING_WORD = re.compile(r"[A-Za-z]+")

_Q = '"\u201c\u201d'  # straight and curly double quotes
_QUOTED = rf"[{_Q}]([^{_Q}\n]*)[{_Q}]"
_LOOSE_REF = rf"(?:{_QUOTED}\s*)?\[\s*(\d+)\s*\]"  # the label is optional
_LENIENT = {
    "click": re.compile(rf"\bclick\s*{_LOOSE_REF}", re.IGNORECASE),
    "type": re.compile(rf"\btype\s*{_LOOSE_REF}\s*{_QUOTED}", re.IGNORECASE),
    "select": re.compile(rf"\bselect\s*{_LOOSE_REF}\s*{_QUOTED}", re.IGNORECASE),
    "stop": re.compile(rf"\bstop\s*{_QUOTED}", re.IGNORECASE),
    "back": re.compile(r"^\s*back\b", re.IGNORECASE),
}


def _action(verb: str, groups: tuple[str | None, ...]) -> Action:
    if verb in _TARGETED:
        label, target, *text = groups
        return Action(verb, int(target), text[0] if text else None, label)
    return Action(verb, None, groups[0] if groups else None)


def element_ref(el: dict) -> str:
    """How an action names element `el`: its quoted label, then its id in brackets."""
    return f'"{el["label"]}" [{el["id"]}]'


def parse_action(reply: str) -> Action:
    """The reply as one action, or ActionSyntaxError saying what is wrong.

    >>> parse_action(' type "City" [7] "Paris" ')
    Action(verb='type', target=7, text='Paris', label='City')
    """
    text = reply.strip()
    if not text:
        raise ActionSyntaxError("the reply is empty")
    word = _LEADING_WORD.match(text)
    if word is None:
        raise ActionSyntaxError(f"a reply starts with a verb: {', '.join(VERBS)}")
    verb = word.group(0)
    if verb.lower() in VERBS and verb != verb.lower():
        raise ActionSyntaxError(f"write the verb in lower case: {verb.lower()}")
    if verb not in VERBS:
        raise ActionSyntaxError(f"unknown verb '{verb}'; use one of {', '.join(VERBS)}")
    m = _STRICT[verb].match(text)
    if m is None:
        raise ActionSyntaxError(_usage_error(verb, text))
    rest = text[m.end() :].strip()
    if rest:
        shown = rest if len(rest) <= 30 else rest[:27] + "..."
        raise ActionSyntaxError(f"expected one action, found more text after it: '{shown}'")
    return _action(verb, m.groups())


def _usage_error(verb: str, text: str) -> str:
    """Why `text`, which starts with `verb` but does not match it strictly, is wrong."""
    usage = USAGE[verb]
    if "\u201c" in text or "\u201d" in text:
        return f"use straight double quotes: {usage}"
    loose = _LENIENT[verb].match(text)
    if verb in _TARGETED and loose and loose.group(1) is None:
        return f"name the element by its quoted label before its id: {usage}"
    if loose:
        return f"put one space between the parts: {usage}"
    if verb in _TARGETED and not _STRICT_REF[verb].match(text):
        return f"{verb} needs the element's quoted label and its id in brackets: {usage}"
    # click and back match strictly once their element is right: what is left lacks a quote
    return f"{verb} needs a quoted {_QUOTE_NOUN[verb]}: {usage}"


def syntax_error(reply: str) -> str | None:
    """Why the reply is not exactly one well-formed action; None when it is.

    >>> syntax_error('click "Save" [3]') is None, syntax_error("stop")
    (True, 'stop needs a quoted answer: stop "answer"')
    """
    try:
        parse_action(reply)
    except ActionSyntaxError as e:
        return str(e)
    return None


def find_action(reply: str) -> Action | None:
    """The first action anywhere in the reply, case-insensitively (None if there is none).

    >>> str(find_action('Click [11] button "Profile" to open the profile.'))
    'click [11]'
    >>> find_action("I would press the save button.") is None
    True
    """
    found = [(m.start(), verb, m) for verb, rx in _LENIENT.items() if (m := rx.search(reply))]
    if not found:
        return None
    _, verb, m = min(found, key=lambda f: f[0])
    return _action(verb, m.groups())


def render_element(el: dict, value: str | bool | None = None) -> str:
    """One accessibility-tree line; `value` is a field's current value."""
    role, label = el["role"], el["label"]
    if role == "text":
        return f'text "{label}"'
    head = f'{role} "{label}" [{el["id"]}]'
    if role == "textbox":
        return f'{head} value="{value}"'
    if role == "combobox":
        options = ",".join(f'"{o}"' for o in el["options"])
        return f'{head} value="{value}" options=[{options}]'
    if role == "checkbox":
        return f"{head} checked={'true' if value else 'false'}"
    return head


def render_page(brand: str, page: dict, values: dict[int, str | bool]) -> str:
    """The page header line, then one line per element; `values` by element id."""
    lines = [f"Page: {brand} > {page['title']}"]
    lines += [render_element(el, values.get(el.get("id"))) for el in page["elements"]]
    return "\n".join(lines)
