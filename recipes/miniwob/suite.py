"""Which MiniWoB++ task types the web agent's grammar can solve, decided by a script.

A scripted policy per task type reads exactly what the model reads (the goal and the
page's lines, recipes/miniwob/page.py) and writes exactly what the model may write
(web_agent's grammar), one action per turn; it knows nothing else about the page. A type
is in the suite when its script succeeds on at least 95% of seeds (SUITE_SEEDS, disjoint
from training and held-out seeds). Types without a script are outside the suite (they
need coordinates, dragging, canvas, colours or shapes, or a script was not written);
they can still be evaluated by name.

    python -m recipes.miniwob.suite [--seeds 40] [--types a,b]   # measure, write suite.json

suite.json records, per scripted type: successes / seeds, the seeds it failed, the
script's most frequent number of steps (the `shortest` of the efficiency reward) and its
most steps in a success (the episode's step limit, plus slack). It is rewritten after
each type, so a stopped command keeps the types it measured. An episode that the browser
ended (a crash, a hang) is played again and counted in `browser_retries`, not as a
failure of the script.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from mlx_grpo.durable import write_atomic

SUITE_FILE = Path(__file__).with_name("suite.json")
SUITE_SEEDS = range(2_000_000, 2_000_000 + 1000)  # train seeds < 1e6, held-out 1e6-2e6
MEMBERSHIP = 0.95

_LINE = re.compile(
    r'^(\w+) "(.*?)" \[(-?\d+)\](?: value="(.*?)")?(?: checked=(true|false))?(?: options=\[(.*)\])?$'
)


@dataclass
class Item:
    role: str
    label: str
    id: int
    value: str | None = None
    checked: bool | None = None


def read_page(observation: str) -> list[Item]:
    """The element lines of an observation (other lines are skipped)."""
    items = []
    for line in observation.splitlines():
        m = _LINE.match(line)
        if m:
            role, label, eid, value, checked, _ = m.groups()
            items.append(
                Item(role, label, int(eid), value, None if checked is None else checked == "true")
            )
    return items


def click(it: Item) -> str:
    return f'click "{it.label}" [{it.id}]'


def type_(it: Item, text: str) -> str:
    return f'type "{it.label}" [{it.id}] "{text}"'


def select(it: Item, option: str) -> str:
    return f'select "{it.label}" [{it.id}] "{option}"'


def quoted(goal: str) -> list[str]:
    return re.findall(r'"([^"]*)"', goal)


def first(items: list[Item], role: str | None = None, label: str | None = None) -> Item:
    for it in items:
        if (role is None or it.role == role) and (label is None or it.label == label):
            return it
    raise LookupError(f"no {role or 'element'} {label or ''} on the page")


def roles(items: list[Item], role: str) -> list[Item]:
    return [it for it in items if it.role == role]


ORDINAL = re.compile(r"(\d+)(?:st|nd|rd|th)")


class Script:
    """A scripted policy for one episode: `__call__(goal, observation) -> reply`."""

    def __init__(self, fn: Callable):
        self.fn, self.memo = fn, {}

    def __call__(self, goal: str, observation: str) -> str:
        return self.fn(goal, read_page(observation), self.memo)


def _queue(memo: dict, make: Callable[[], list[str]]) -> str:
    """Plan once, then one step per turn."""
    if "plan" not in memo:
        memo["plan"] = make()
    return memo["plan"].pop(0)


def submit_after(memo, items, steps: Callable[[], list[str]], button: str = "Submit") -> str:
    return _queue(memo, lambda: [*steps(), click(first(items, "button", button))])


# -- the scripts ---------------------------------------------------------------------
def click_test(goal, items, memo):
    return click(first(items, "button"))


def click_named_button(goal, items, memo):
    m = re.search(r'button "?([^".]+)"?', goal)
    return click(first(items, "button", quoted(goal)[0] if quoted(goal) else m.group(1)))


def click_button_sequence(goal, items, memo):
    names = re.findall(r"button (\w+)", goal)
    memo["i"] = memo.get("i", -1) + 1
    return click(first(items, "button", names[memo["i"]]))


def click_quoted(goal, items, memo):
    target = quoted(goal)[0]
    return click(next(it for it in items if it.label == target and it.role in ("link", "text")))


def click_dialog(goal, items, memo):
    return click(first(items, "button", "Close"))


def click_tab(goal, items, memo):
    return click(first(items, "link", re.search(r"(Tab #\d+)", goal).group(1)))


def click_or_open(
    target: str,
    items,
    memo,
    hit=lambda it: True,
    opens=lambda it: it.role == "text",
) -> str:
    """Click `target` once shown (an element `hit` accepts), else the next element that
    `opens` something (a tab, a section, a folder, a menu) not clicked yet."""
    found = [it for it in items if it.label == target and hit(it)]
    if found:
        return click(found[0])
    opened = memo.setdefault("opened", set())
    nxt = next(it for it in items if opens(it) and it.label not in opened)
    opened.add(nxt.label)
    return click(nxt)


def find_behind(opener_role: str, opener: str):
    """Click the target once shown, else open the next tab / section not yet opened."""

    def script(goal, items, memo):
        return click_or_open(
            quoted(goal)[-1],
            items,
            memo,
            hit=lambda it: it.role in ("link", "text"),
            opens=lambda it: it.role == opener_role and it.label.startswith(opener),
        )

    return script


def click_collapsible(goal, items, memo):
    return _queue(
        memo, lambda: [click(first(items, "text")), click(first(items, "button", "Submit"))]
    )


def click_choices(goal, items, memo):
    """click-option / click-checkboxes*: tick the named boxes, then Submit."""
    words = re.sub(r"^Select | and click Submit\.$", "", goal)
    names = [] if words.startswith("nothing") else [w.strip() for w in words.split(",")]
    boxes = [it for it in items if it.role in ("checkbox", "radio")]
    return submit_after(memo, items, lambda: [click(first(boxes, label=n)) for n in names])


def enter_quoted(goal, items, memo):
    text = quoted(goal)[0]
    if "upper case" in goal:
        text = text.upper()
    elif "lower case" in goal:
        text = text.lower()
    return submit_after(memo, items, lambda: [type_(first(items, "textbox"), text)])


def enter_password(goal, items, memo):
    pw = quoted(goal)[0]
    return submit_after(memo, items, lambda: [type_(b, pw) for b in roles(items, "textbox")])


def login_user(goal, items, memo):
    user, pw = quoted(goal)[:2]
    return _queue(
        memo,
        lambda: [
            type_(first(items, "textbox", "username"), user),
            type_(first(items, "textbox", "password"), pw),
            click(first(items, "button", "Login")),
        ],
    )


def focus_text(goal, items, memo):
    boxes = roles(items, "textbox")
    m = ORDINAL.search(goal)
    return click(boxes[int(m.group(1)) - 1] if m else boxes[0])


def choose_list(goal, items, memo):
    option = re.search(r"Select (.+) from the (?:scroll )?list", goal).group(1)
    return submit_after(memo, items, lambda: [select(first(items, "combobox"), option)])


def enter_date(goal, items, memo):
    mm, dd, yyyy = re.search(r"(\d\d)/(\d\d)/(\d{4})", goal).groups()
    return submit_after(memo, items, lambda: [type_(first(items, "textbox"), mm + dd + yyyy)])


def enter_time(goal, items, memo):
    h, m, ap = re.search(r"(\d+):(\d\d) ?(AM|PM)", goal).groups()
    return submit_after(
        memo, items, lambda: [type_(first(items, "textbox"), f"{int(h):02d}{m}{ap}")]
    )


def search_engine(goal, items, memo):
    term = quoted(goal)[0]
    k = int(ORDINAL.search(goal).group(1))
    step = memo.setdefault("step", 0)
    memo["step"] += 1
    if step == 0:
        return type_(first(items, "textbox"), term)
    if step == 1:
        return click(first(items, "button", "Search"))
    page, index = divmod(k - 1, 3)
    results = [it for it in roles(items, "link") if not re.fullmatch(r"\d+|[<>]", it.label)]
    if memo.get("page", 0) == page:
        return click(results[index])
    memo["page"] = page
    return click(first(items, "link", str(page + 1)))


def arithmetic(goal, items, memo):
    def answer():
        expr = next(it.label for it in items if it.role == "text" and "=" in it.label)
        a, op, b = re.match(r"(-?\d+) ([-+x*/]) (-?\d+)", expr).groups()
        a, b = int(a), int(b)
        return str({"+": a + b, "-": a - b, "x": a * b, "*": a * b, "/": a // b if b else 0}[op])

    return submit_after(memo, items, lambda: [type_(first(items, "textbox"), answer())])


def algebra(goal, items, memo):
    def answer():
        eq = next(
            it.label
            for it in items
            if it.role == "text" and "x" in it.label and "=" in it.label and it.label != "x ="
        )
        lhs, rhs = (s.strip() for s in eq.split("="))
        rhs = int(rhs)
        for x in range(-1000, 1001):
            if eval(lhs.replace("x", f"({x})")) == rhs:  # noqa: S307 - the page's own digits and +-
                return str(x)
        raise LookupError(eq)

    return submit_after(memo, items, lambda: [type_(first(items, "textbox"), answer())])


def find_word(goal, items, memo):
    k = int(ORDINAL.search(goal).group(1))
    words = " ".join(it.label for it in items if it.role == "text").split()
    word = words[k - 1].strip(".,")
    return submit_after(memo, items, lambda: [type_(first(items, "textbox"), word)])


def read_table(goal, items, memo):
    texts = [it.label for it in items if it.role == "text"]
    if "each label" in goal:
        pairs = dict(zip(texts[0::2], texts[1::2]))
        boxes = roles(items, "textbox")
        labels = [t.rstrip(":") for t in texts if t.endswith(":")]
        return submit_after(
            memo, items, lambda: [type_(b, pairs[lab]) for b, lab in zip(boxes, labels)]
        )
    key = re.search(r"value of (.+?) into", goal).group(1)
    value = texts[texts.index(key) + 1]
    return submit_after(memo, items, lambda: [type_(first(items, "textbox"), value)])


def text_transform(goal, items, memo):
    word = "".join(it.label for it in items if it.role == "text")
    return submit_after(memo, items, lambda: [type_(first(items, "textbox"), word)])


def copy_paste(goal, items, memo):
    boxes = roles(items, "textbox")
    answer = first(boxes, label="answer-input")
    m = ORDINAL.search(goal)
    sources = [b for b in boxes if b is not answer]
    source = sources[int(m.group(1)) - 1] if m else sources[0]
    return submit_after(memo, items, lambda: [type_(answer, source.value)])


def odd_or_even(goal, items, memo):
    def plan():
        steps = []
        for i, it in enumerate(items):
            if it.role == "text" and re.fullmatch(r"-?\d+", it.label):
                odd, even = items[i - 1], items[i + 1]
                steps.append(click(odd if int(it.label) % 2 else even))
        return steps

    return submit_after(memo, items, plan)


def guess_number(goal, items, memo):
    lo, hi = memo.setdefault("range", [0, 9])
    feedback = " ".join(it.label for it in items if it.role == "text")
    if memo.get("typed"):
        memo["typed"] = False
        return click(first(items, "button", "Submit"))
    if "guess" in memo:
        g = memo["guess"]
        if "higher" in feedback.lower():
            lo = g + 1
        elif "lower" in feedback.lower():
            hi = g - 1
    memo["range"] = [lo, hi]
    memo["guess"] = (lo + hi) // 2
    memo["typed"] = True
    return type_(first(items, "textbox"), str(memo["guess"]))


def phone_book(goal, items, memo):
    name, what = re.search(
        r"Find (.+?) in the contact book and click on their (\w+)", goal
    ).groups()
    labels = [it.label for it in items]
    if name in labels:
        i = labels.index(name)
        field = {"phone": "Phone:", "email": "Email:", "address": "Address:"}[what]
        j = labels.index(field, i)
        return click(items[j + 1])
    return click(first(items, "link", ">"))


def scroll_text(goal, items, memo):
    last = first(items, "textbox", "text-area").value.split()[-1].strip(".,")
    return submit_after(memo, items, lambda: [type_(first(items, "textbox", "answer-input"), last)])


def navigate_tree(goal, items, memo):
    return click_or_open(quoted(goal)[0], items, memo)


def click_menu(goal, items, memo):
    target = re.search(r"Select (.+)$", goal).group(1).split(">")[-1].strip()
    return click_or_open(target, items, memo)


def click_widget(goal, items, memo):
    kind = quoted(goal)[0]
    role = {
        "button": "button",
        "checkbox": "checkbox",
        "radio": "radio",
        "text": "textbox",
        "textarea": "textbox",
    }[kind]
    return click(first(items, role))


def unicode_test(goal, items, memo):
    return click(first(items, "button", quoted(goal)[0]))


SCRIPTS: dict[str, Callable] = {
    "click-test": click_test,
    "click-test-2": click_named_button,
    "click-test-transfer": click_named_button,
    "click-button": click_named_button,
    "click-button-sequence": click_button_sequence,
    "click-link": click_quoted,
    "click-dialog": click_dialog,
    "click-dialog-2": click_named_button,
    "click-tab": click_tab,
    "click-tab-2": find_behind("link", "Tab #"),
    "click-tab-2-easy": find_behind("link", "Tab #"),
    "click-tab-2-medium": find_behind("link", "Tab #"),
    "click-tab-2-hard": find_behind("link", "Tab #"),
    "click-collapsible": click_collapsible,
    "click-collapsible-nodelay": click_collapsible,
    "click-collapsible-2": find_behind("text", "Section #"),
    "click-collapsible-2-nodelay": find_behind("text", "Section #"),
    "click-option": click_choices,
    "click-checkboxes": click_choices,
    "click-checkboxes-large": click_choices,
    "click-checkboxes-transfer": click_choices,
    "click-menu": click_menu,
    "click-widget": click_widget,
    "enter-text": enter_quoted,
    "enter-text-2": enter_quoted,
    "enter-text-dynamic": enter_quoted,
    "enter-password": enter_password,
    "login-user": login_user,
    "focus-text": focus_text,
    "focus-text-2": focus_text,
    "choose-list": choose_list,
    "click-scroll-list": choose_list,
    "enter-date": enter_date,
    "enter-time": enter_time,
    "search-engine": search_engine,
    "simple-arithmetic": arithmetic,
    "simple-algebra": algebra,
    "find-word": find_word,
    "read-table": read_table,
    "read-table-2": read_table,
    "text-transform": text_transform,
    "copy-paste": copy_paste,
    "copy-paste-2": copy_paste,
    "odd-or-even": odd_or_even,
    "guess-number": guess_number,
    "phone-book": phone_book,
    "scroll-text": scroll_text,
    "navigate-tree": navigate_tree,
    "unicode-test": unicode_test,
}


def player(task: str) -> Callable[[object, str], str | None]:
    """The type's script as a policy over turns, `reply(env, observation)`: the first
    observation is reset()'s, the next ones step()'s (a line about the action, then the
    page; an unchanged page shows the script the one it saw last). None once the
    script finds nothing to do."""
    script, seen = Script(SCRIPTS[task]), {}

    def reply(env, observation: str) -> str | None:
        page = observation
        if seen:
            page = observation.split("\n", 1)[-1]
            page = seen["page"] if page == "(page unchanged)" else page
        seen["page"] = page
        try:
            return script(env.goal, page)
        except (LookupError, StopIteration, IndexError, AttributeError, ValueError, KeyError):
            return None

    return reply


class Played(NamedTuple):
    success: bool
    steps: int
    raw_reward: float | None
    failure: str | None  # "browser": the browser failed, not the script


def play(task: str, seed: int, max_steps: int = 20, mode: str = "train") -> Played:
    """Play one episode with the type's script. A script that finds nothing to do ends
    the episode as a failure; a browser that fails (at the start too) ends it with
    failure "browser"."""
    from recipes.miniwob.browser import BrowserError, PageError
    from recipes.miniwob.page import MiniWoBEnv

    env, steps = MiniWoBEnv(task, seed, mode, max_steps), 0
    try:
        observation, reply = env.reset(), player(task)
        while (action := reply(env, observation)) is not None:
            result = env.step(action)
            steps += 1
            if result.done:
                break
            observation = result.observation
    except BrowserError as e:
        if isinstance(e, PageError):  # the page's own script: not the browser's fault
            raise
        env.failure = "browser"
    finally:
        env.close()
    return Played(env.outcome().success, steps, env.raw_reward, env.failure)


BROWSER_TRIES = 3


def measure(task: str, seeds: range, play: Callable[[str, int], Played] = play) -> dict:
    """The type's record over `seeds`. An episode the browser ended is played again (a
    crashed browser says nothing of the script), up to BROWSER_TRIES times."""
    runs, retries = [], 0
    for seed in seeds:
        for _ in range(BROWSER_TRIES):
            run = play(task, seed)
            if run.failure != "browser":
                break
            retries += 1
        else:
            raise RuntimeError(
                f"{task} seed {seed}: the browser failed {BROWSER_TRIES} times in a row"
            )
        runs.append(run)
    wins = [r.steps for r in runs if r.success]
    most = max(wins) if wins else max(r.steps for r in runs)
    return {
        "success": len(wins),
        "seeds": len(runs),
        "failed_seeds": [s for s, r in zip(seeds, runs) if not r.success],
        "steps": statistics.mode(wins) if wins else most,
        "max_steps": most,
        **({"browser_retries": retries} if retries else {}),
    }


def load_suite() -> dict[str, dict]:
    """suite.json: per scripted type, {"success": k, "seeds": n, "steps": s}."""
    return json.loads(SUITE_FILE.read_text()) if SUITE_FILE.exists() else {}


def suite_types() -> list[str]:
    """The suite: scripted types with a success share of at least MEMBERSHIP."""
    return [t for t, r in load_suite().items() if r["success"] >= MEMBERSHIP * r["seeds"]]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=40)
    ap.add_argument("--types", default=",".join(SCRIPTS))
    args = ap.parse_args(argv)
    types = args.types.split(",")
    if unknown := [t for t in types if t not in SCRIPTS]:
        ap.error(f"--types: no script for {', '.join(unknown)} (scripted: {', '.join(SCRIPTS)})")
    out = load_suite()
    for task in types:
        try:
            out[task] = record = measure(task, SUITE_SEEDS[: args.seeds])
        except RuntimeError as e:  # no browser, or one that keeps failing
            raise SystemExit(f"suite: {e}") from None
        verdict = "in" if record["success"] >= MEMBERSHIP * record["seeds"] else "out"
        print(
            f"{task:28s} {record['success']:3d}/{record['seeds']}  steps {record['steps']}  "
            f"{verdict}",
            flush=True,
        )
        # each type as it is measured: a kill or a failing browser loses that type only
        write_atomic(SUITE_FILE, json.dumps(dict(sorted(out.items())), indent=1) + "\n")


if __name__ == "__main__":
    main()
