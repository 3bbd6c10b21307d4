"""The web agent's language, shared by every web recipe (web_browsing's simulated sites,
miniwob's real pages in Chromium): what the model reads, what it writes, and how it is
told.

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


def read_reply(reply: str) -> tuple[Action | None, dict]:
    """The action a reply executes (the strict parse when the reply is well formed, else
    the first action found in it; None when there is none) and a step's `info` so far:
    `format`, `syntax` (why not well formed), `action` (canonical), `valid` (None until
    it is executed) and `error` (why the turn does nothing, so far: no action found).

    >>> read_reply('Click [3] now')[1]["action"], read_reply("hello")[1]["error"]
    ('click [3]', "unknown verb 'hello'; use one of click, type, select, back, stop")
    """
    try:
        action, syntax = parse_action(reply), None
    except ActionSyntaxError as e:
        action, syntax = find_action(reply), str(e)
    info = {
        "format": syntax is None,
        "syntax": syntax,
        "action": None if action is None else str(action),
        "valid": None,
        "error": syntax if action is None else None,
    }
    return action, info


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
    """One accessibility-tree line; `value` is a field's current value. Text has an id
    only where it can be clicked (real pages); a checkbox or radio's value is its state."""
    role, label = el["role"], el["label"]
    if role == "text" and el.get("id") is None:
        return f'text "{label}"'
    head = f'{role} "{label}" [{el["id"]}]'
    if role == "textbox":
        return f'{head} value="{value}"'
    if role == "combobox":
        options = ",".join(f'"{o}"' for o in el["options"])
        return f'{head} value="{value}" options=[{options}]'
    if role in ("checkbox", "radio"):
        return f"{head} checked={'true' if value else 'false'}"
    return head


def render_page(brand: str, page: dict, values: dict[int, str | bool]) -> str:
    """The page header line, then one line per element; `values` by element id."""
    lines = [f"Page: {brand} > {page['title']}"]
    lines += [render_element(el, values.get(el.get("id"))) for el in page["elements"]]
    return "\n".join(lines)


class InvalidAction(ValueError):
    """An action that does not apply to the page; the message says why."""


_HINT = {
    "textbox": 'use type {ref} "text"',
    "combobox": 'use select {ref} "option"',
    "checkbox": "use click {ref}",
    "radio": "use click {ref}",
    "button": "use click {ref}",
    "link": "use click {ref}",
    "text": "use click {ref}",
    "row": "it is only text",
}


def check_target(action: Action, el: dict | None, applies_to: dict[str, tuple[str, ...]]) -> None:
    """InvalidAction unless `action` may act on `el` (None: no element has its id): the
    label the reply gave, if any, must be the element's (`el["labels"]`, when present,
    lists every label the page shows with that id), and the element's role must be one
    that `applies_to[verb]` allows.

    >>> check_target(Action("type", 3, "x", "Save"), {"role": "button", "label": "Save", "id": 3},
    ...              {"type": ("textbox",)})
    Traceback (most recent call last):
    ...
    recipes.web_agent.InvalidAction: type does not apply to button "Save" [3]; use click "Save" [3]
    """
    if el is None:
        raise InvalidAction(f"there is no element [{action.target}] on this page")
    role, eid, label = el["role"], el["id"], el["label"]
    if action.label is not None:
        given = action.label.strip().casefold()
        if given not in {s.casefold() for s in el.get("labels", [label])}:
            raise InvalidAction(f'[{eid}] is {role} "{label}", not "{action.label}"')
    if role not in applies_to[action.verb]:
        hint = _HINT[role].format(ref=element_ref(el))
        raise InvalidAction(f"{action.verb} does not apply to {role} {element_ref(el)}; {hint}")


# How the agent is told: the actions it may use, each with an example, and worked
# examples shown as earlier turns of the conversation (a small model copies a
# demonstrated reply far more reliably than it follows a described grammar). The
# examples are on a made-up "Demo" site, in an environment's own words.
INTRO = (
    'You are using a website to reach a goal. A page lists one element per line: role "label" [id].\n'
    'Reply with exactly one action and nothing else; name an element as "label" [id]. The actions:'
)
ACTION_HELP = {
    "click": 'click "label" [id] - press a button or link, or toggle a checkbox. For button "Save" [3], reply: click "Save" [3]',
    "type": 'type "label" [id] "text" - fill a textbox. Example: type "City" [7] "Paris"',
    "select": 'select "label" [id] "option" - choose an option of a combobox. Example: select "Plan" [9] "Pro"',
    "back": "back - return to the previous page.",
    "stop": 'stop "answer" - give the answer to a question and finish. Example: stop "30 days"',
}


def instructions(verbs: set[str]) -> str:
    """The system prompt: the grammar of `verbs`, in VERBS order."""
    return "\n".join([INTRO, *(ACTION_HELP[v] for v in VERBS if v in verbs)])


def _form_page(city: str, cycle: str | None) -> str:
    lines = ["Page: Demo > Settings > Address", f'textbox "City" [4] value="{city}"']
    if cycle is not None:
        lines.append(f'combobox "Billing cycle" [5] value="{cycle}" options=["Monthly","Yearly"]')
    return "\n".join([*lines, 'button "Save" [6]', 'button "Cancel" [7]'])


def demo_turns(verbs: set[str]) -> list[tuple[str, str]]:
    """(observation, reply) pairs demonstrating `verbs`: a click, a form (type, then
    select when needed, then submit), a stop with an answer; with `back`, a link opened
    first (then the answer, or a button, on the new page)."""
    turns = []
    if "click" in verbs and "type" not in verbs:  # a form's example ends with a click
        turns.append(
            (
                'Goal: Click "Archive file".\nPage: Demo > Files\n'
                'button "Rename file" [1]\nbutton "Archive file" [2]\nbutton "Share file" [3]',
                'click "Archive file" [2]',
            )
        )
    if "type" in verbs:
        select = "select" in verbs
        goal = 'Goal: Type "Oslo" in "City", ' + (
            'select "Monthly" in "Billing cycle", ' if select else ""
        )
        cycle = "Yearly" if select else None
        turns.append(
            (goal + 'then click "Save".\n' + _form_page("Paris", cycle), 'type "City" [4] "Oslo"')
        )
        last = 'Typed "Oslo" into "City" [4].'
        if select:
            turns.append(
                (f"{last}\n{_form_page('Oslo', 'Yearly')}", 'select "Billing cycle" [5] "Monthly"')
            )
            last = 'Selected "Monthly" in "Billing cycle" [5].'
        turns.append(
            (f"{last}\n{_form_page('Oslo', 'Monthly' if select else None)}", 'click "Save" [6]')
        )
    if "back" in verbs:  # the goal lies on another page: open it, then act there
        turns += _navigation_turns(answer="stop" in verbs)
    elif "stop" in verbs:
        turns.append(
            (
                "Goal: Answer the question: How long are backups kept?\nPage: Demo > Docs\n"
                'text "Exports are ready within 2 hours."\ntext "Backups are kept for 45 days."',
                'stop "45 days"',
            )
        )
    return turns


# A link opened, then the goal reached on the new page: (goal, start page, its lines,
# the link's label, the page it opens, the reply there). The link is [2] on both.
_NAVIGATION = {
    "answer": (
        "Answer the question: How long are backups kept?",
        "Demo > Docs",
        'link "Exports" [1]\nlink "Backups" [2]\nlink "Billing" [3]',
        "Backups",
        'Page: Demo > Docs > Backups\ntext "Backups run every night."\n'
        'text "Backups are kept for 45 days."\nlink "Docs" [4]',
        'stop "45 days"',
    ),
    "press": (
        'Go to "Invoices" and click "Export invoices".',
        "Demo > Dashboard",
        'link "Projects" [1]\nlink "Invoices" [2]\nbutton "Export projects" [3]',
        "Invoices",
        'Page: Demo > Invoices\ntext "Invoice | Date | Amount"\nlink "Dashboard" [4]\n'
        'button "Export invoices" [5]\nbutton "Delete invoices" [6]',
        'click "Export invoices" [5]',
    ),
}


def _navigation_turns(answer: bool) -> list[tuple[str, str]]:
    """A link opened, then an answer read or a button pressed on the new page: the
    reply after the link names an element of the page it opened."""
    goal, page, lines, link, opened, last = _NAVIGATION["answer" if answer else "press"]
    return [
        (f"Goal: {goal}\nPage: {page}\n{lines}", f'click "{link}" [2]'),
        (f'Clicked link "{link}" [2].\n{opened}', last),
    ]


def agent_messages(system: str, *examples: set[str]) -> list[dict]:
    """A task's opening messages: the system prompt, then the worked examples of each
    set of verbs in turn (`demo_turns`)."""
    turns = [t for verbs in examples for t in demo_turns(verbs)]
    return [
        {"role": "system", "content": system},
        *(
            m
            for obs, reply in turns
            for m in ({"role": "user", "content": obs}, {"role": "assistant", "content": reply})
        ),
    ]
