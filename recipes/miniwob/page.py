"""A MiniWoB++ episode in a real browser, seen and driven in the web agent's language.

The page is read with MiniWoB's own `core.getDOMInfo()` (visible elements, with the
element refs MiniWoB assigns per episode) and shown as the accessibility-tree lines of
recipes/web_agent.py, one element per line, the ref as the element's id:

    button "Submit" [6]                      button, input type=button/submit/reset
    link "Tab #2" [8]                        a
    textbox "Username" [7] value=""          input (text-like types), textarea
    checkbox "KrK" [16] checked=false        input type=checkbox (radio: radio)
    combobox "options" [4] value="" options=["Iran","Chad"]      select
    text "Section #45" [4]                   text; the id is its element's (clicking it
                                             clicks that element)

A control's name is its <label>, else its aria-label, placeholder, title, name or id;
buttons and links are named by their text. Controls the grammar cannot operate (sliders,
colour pickers, canvases) are not shown.

Actions are parsed as in web_browsing (strict for `format`, lenient for what is executed)
and executed with MiniWoB's element actions: `click` is `core.elementClick(ref)`; `type`
clicks the field, empties it and types the text key by key; `select` picks the option
and fires the change events. MiniWoB's own reward decides success: `WOB_RAW_REWARD_GLOBAL
> 0` once the task says it is done (BrowserGym's rule), never scaled by time.
"""

from __future__ import annotations

import time
from typing import NamedTuple

from mlx_grpo.env import StepResult
from recipes.miniwob.browser import BrowserError, PageError, Window
from recipes.miniwob.browser import pool as browser_pool
from recipes.web_agent import (
    Action,
    InvalidAction,
    check_target,
    element_ref,
    read_reply,
    render_element,
)

OBSERVE = r"""
var root = core.getDOMInfo(), els = core.previousDOMInfo, out = [];
var TEXTBOX = /^(text|password|email|number|search|tel|url|date|time|datetime-local|month|week)$/;
function clean(s) { return (s || '').replace(/\s+/g, ' ').trim(); }
function nameOf(el) {
  if (el.labels && el.labels.length) return clean(el.labels[0].textContent);
  return clean(el.getAttribute('aria-label') || el.getAttribute('placeholder') ||
               el.getAttribute('title') || el.getAttribute('name') || el.id);
}
function roleOf(el) {
  var tag = el.tagName;
  if (tag === 'BUTTON') return 'button';
  if (tag === 'A') return 'link';
  if (tag === 'SELECT') return 'combobox';
  if (tag === 'TEXTAREA') return 'textbox';
  if (tag !== 'INPUT') return null;
  var t = el.type;
  if (t === 'checkbox' || t === 'radio') return t;
  if (t === 'button' || t === 'submit' || t === 'reset') return 'button';
  return TEXTBOX.test(t) ? 'textbox' : 'skip';
}
function walk(n, parentRef, inLabel) {
  if (n.tag === 't') {
    if (!inLabel) out.push({role: 'text', label: clean(n.text), id: parentRef});
    return;
  }
  var el = els[n.ref], role = roleOf(el);
  if (role === 'skip') return;
  if (role) {
    var item = {role: role, id: n.ref};
    if (role === 'button' || role === 'link')
      item.label = clean(el.tagName === 'INPUT' ? el.value : el.textContent) || nameOf(el);
    else item.label = nameOf(el);
    if (role === 'textbox') item.value = el.value;
    if (role === 'checkbox' || role === 'radio') item.value = el.checked;
    if (role === 'combobox') {
      item.options = Array.prototype.map.call(el.options, function (o) { return clean(o.text); });
      item.value = el.selectedIndex >= 0 ? item.options[el.selectedIndex] : '';
    }
    out.push(item);
    return;
  }
  if (n.text !== undefined) {
    if (clean(n.text) && !inLabel) out.push({role: 'text', label: clean(n.text), id: n.ref});
    return;
  }
  var labels = el.tagName === 'LABEL' && el.control && el.contains(el.control);
  n.children.forEach(function (c) { walk(c, n.ref, inLabel || labels); });
}
walk(root, null, false);
return out;
"""
START = """
Math.seedrandom(arguments[0]);
core.setDataMode(arguments[1]);
core.startEpisodeReal();
"""
STATE = "return [WOB_TASK_READY, WOB_DONE_GLOBAL, WOB_RAW_REWARD_GLOBAL, WOB_REWARD_REASON];"
# jQuery UI animates tabs, accordions and menus; observe once they settle.
SETTLE = "return window.jQuery ? jQuery(':animated').length : 0;"
# The longest waits, in seconds, for a page to be built and for its animations to end;
# a page that is ready sooner is observed sooner.
BUILD_S = 5.0
SETTLE_S = 3.0
CLICK = "return core.elementClick(arguments[0]);"
FOCUS_AND_EMPTY = """
var r = core.elementClick(arguments[0]);
if (r !== true) return r;
var el = core.previousDOMInfo[arguments[0]];
if ('value' in el) el.value = '';
return true;
"""
SELECT = """
var el = core.previousDOMInfo[arguments[0]];
el.selectedIndex = arguments[1];
el.dispatchEvent(new Event('input', {bubbles: true}));
el.dispatchEvent(new Event('change', {bubbles: true}));
return true;
"""
APPLIES_TO = {
    "click": ("button", "link", "checkbox", "radio", "text", "textbox", "combobox"),
    "type": ("textbox",),
    "select": ("combobox",),
}


def render(items: list[dict]) -> str:
    """The page's lines (one per element; `items` from OBSERVE)."""
    return "\n".join(render_element(it, it.get("value")) for it in items) or "(empty page)"


class Outcome(NamedTuple):
    """The task's verdict: MiniWoB's raw reward (None: the task never ended).

    `success` is full credit, a raw reward of 1, as the miniwob package's own
    `get_binary_reward` asks. A task with partial credit pays less for a partly right
    answer: click-checkboxes pays (right - wrong) / boxes, so Submit with nothing
    ticked reaches a raw reward above 0 whenever fewer than half the boxes are targets
    (38% of its episodes), which a policy rewarded for `raw_reward > 0` learns at once.
    `browsergym_success` is that looser rule, BrowserGym's, for published figures."""

    raw_reward: float | None

    @property
    def success(self) -> bool:
        return self.raw_reward is not None and self.raw_reward >= 1.0 - 1e-9

    @property
    def browsergym_success(self) -> bool:
        return self.raw_reward is not None and self.raw_reward > 0

    @property
    def progress(self) -> float:
        return max(0.0, self.raw_reward or 0.0)


class MiniWoBEnv:
    """One episode of MiniWoB task type `task` with seed `seed`, in a pooled browser.

    A window is taken at `reset` and given back when the episode ends (`close`, or the
    task or the step limit ending it). A browser that fails mid-episode ends the episode
    with `failure = "browser"`; it is restarted for the next one."""

    def __init__(self, task: str, seed: int, mode: str, max_steps: int, browsers: int = 4):
        self.task, self.seed, self.mode = task, seed, mode
        self.max_steps, self.browsers = max_steps, browsers
        self.window: Window | None = None
        self.record = False  # keep a screenshot of the page at each step (pictures)
        self.screenshots: list[bytes] = []

    def reset(self) -> str:
        self.close()
        self.steps, self.done = 0, False
        self.raw_reward: float | None = None
        self.failure: str | None = None
        self.screenshots = []
        try:
            return self._start()
        except BrowserError:  # a browser that died between episodes: once more, afresh
            self.close()
            return self._start()

    def _start(self) -> str:
        self.window = browser_pool(self.browsers).acquire()
        self.window.load(self.task)
        self.window.run(START, self.seed, self.mode)
        deadline = time.monotonic() + BUILD_S  # some tasks build their page asynchronously
        while not self.window.run(STATE)[0] and time.monotonic() < deadline:
            time.sleep(0.05)
        goal = self.window.run("return core.getUtterance();")
        # a few tasks answer {"utterance": ..., "fields": ...}
        self.goal = goal["utterance"] if isinstance(goal, dict) else goal
        self._observe()
        return f"Goal: {self.goal}\n{render(self.items)}"

    def _observe(self) -> None:
        deadline = time.monotonic() + SETTLE_S
        while self.window.run(SETTLE) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.items = self.window.run(OBSERVE)
        if self.record:
            self.screenshots.append(self.window.screenshot())

    def element(self, ref: int) -> dict | None:
        """The element with id `ref` on the current page, with every label shown for it."""
        lines = [it for it in self.items if it["id"] == ref]
        if not lines:
            return None
        control = next((it for it in lines if it["role"] != "text"), lines[0])
        return {**control, "labels": [it["label"] for it in lines]}

    def step(self, reply: str) -> StepResult:
        if self.done:
            raise RuntimeError("step() after the episode ended")
        self.steps += 1
        action, info = read_reply(reply)
        before = render(self.items)
        note = ""
        try:
            if action is not None:
                try:
                    note = self._execute(action)
                    info["valid"] = True
                except PageError as e:  # the page's script refused it: the action's fault
                    info.update(valid=False, error=f"the page raised {e}")
                except InvalidAction as e:
                    info.update(valid=False, error=str(e))
            ready, done, raw, reason = self.window.run(STATE)
            if done:
                self.done, self.raw_reward = True, float(raw)
                info["reason"] = reason
            else:
                self._observe()
        except BrowserError as e:
            self.done, self.failure = True, "browser"
            info.update(error=f"the browser failed: {e}")
        if info["error"] is not None:
            note = f"Invalid action: {info['error']}."
        if not self.done and self.steps >= self.max_steps:
            self.done = True
            note += " Step limit reached."
        if self.done:
            self.close()
            return StepResult(note.strip(), True, info)
        page = render(self.items)
        return StepResult(
            f"{note.strip()}\n{page if page != before else '(page unchanged)'}", False, info
        )

    def _execute(self, action: Action) -> str:
        if action.verb not in APPLIES_TO:
            raise InvalidAction(f"{action.verb} is not available on this page")
        el = self.element(action.target)
        check_target(action, el, APPLIES_TO)
        ref = element_ref(el)
        if action.verb == "select":
            wanted = action.text.strip().casefold()
            index = next((i for i, o in enumerate(el["options"]) if o.casefold() == wanted), None)
            if index is None:
                raise InvalidAction(f'{ref} has no option "{action.text}"')
            self.window.run(SELECT, el["id"], index)
            return f'Selected "{el["options"][index]}" in {ref}.'
        js = FOCUS_AND_EMPTY if action.verb == "type" else CLICK
        result = self.window.run(js, el["id"])
        if result is not True:
            raise InvalidAction(f"{ref} cannot be clicked: {result}")
        if action.verb == "type":
            self.window.keys(action.text)
            return f'Typed "{action.text}" into {ref}.'
        return f"Clicked {el['role']} {ref}."

    def outcome(self) -> Outcome:
        return Outcome(self.raw_reward)

    def close(self) -> None:
        """Give the window back (the episode's verdict stays readable)."""
        if self.window is not None:
            self.window.release()
            self.window = None
