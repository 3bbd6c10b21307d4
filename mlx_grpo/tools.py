"""Tools: plain Python functions the model calls during an episode.

A tool is a function with type hints and a Google-style docstring (the shape TRL's
`tools=[...]` and transformers' chat templates take); its JSON schema is built by
`transformers.utils.get_json_schema`, so a recipe's tools render exactly as they would
for `tokenizer.apply_chat_template(messages, tools=...)`.

The model calls tools in Qwen's and Hermes' format, one or more per reply:

    <tool_call>
    {"name": "increment", "arguments": {"step": 3}}
    </tool_call>

`ToolEnv` plugs tools into the multi-turn protocol of `mlx_grpo/env.py`: each reply's
calls are parsed and run (each with a deadline), their results are the next
observation, and the episode ends at the first reply without a call (the answer). A
call that cannot be parsed, an unknown tool, arguments the function does not take, an
exception and a timeout each become a result the model reads (`{"error": ...}`) and a
failure counted by tool and kind (`ToolStats`); none of them stops the run.

Rendering: an environment offers its tools as `prompt_tools`, and the rollout encodes
the episode's prompt with them (`render_prompt`): templates that render `tools`
themselves (Qwen2.5, Hermes, Llama 3.1...) get them through their own `tools=`; for
templates that do not (the embedded SmolLM2's), `tools_prompt` writes the same schemas
as text in the Hermes wording, which `with_tools` puts in the system message. Tool results are shown as Qwen2.5's template
shows them, inside the user turn that follows the reply:

    <tool_response>
    {"result": 3}
    </tool_response>
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from mlx_grpo.config import ConfigError
from mlx_grpo.env import StepResult
from mlx_grpo.recipe import bounded, first_line

# Why a call failed, as counted in `ToolStats.failures`:
#   bad_call      the <tool_call> body is not JSON {"name": str, "arguments": {...}}
#   unknown_tool  no tool has that name
#   bad_arguments the function does not take those arguments (missing, unexpected)
#   error         the tool raised
#   timeout       the tool gave no result within its deadline
FAILURE_KINDS = ("bad_call", "unknown_tool", "bad_arguments", "error", "timeout")

# The name a failure is counted under when the call named no tool.
UNNAMED = "unnamed"
# ... and when it named a tool there is none of: a name the model made up is counted
# under one name, not its own, so that invented names cannot add metrics without end.
UNKNOWN = "unknown"


@dataclass(frozen=True)
class Tool:
    """A function the model may call, with the JSON schema its template renders."""

    name: str
    function: Callable
    schema: dict


def as_tool(fn: Callable, field_name: str = "tools") -> Tool:
    """`fn` as a Tool; its schema from its type hints and docstring (transformers'
    `get_json_schema`). A function without them is a one-line ConfigError."""
    if isinstance(fn, Tool):
        return fn
    if not callable(fn):
        raise ConfigError(f"{field_name}: {fn!r} is not a function")
    from transformers.utils import get_json_schema

    name = getattr(fn, "__name__", repr(fn))
    try:
        schema = get_json_schema(fn)
    except Exception as e:  # transformers' own parsing errors name the argument
        raise ConfigError(f"{field_name}: {name}: {first_line(e)}") from None
    return Tool(schema["function"]["name"], fn, schema)


def as_tools(fns: Iterable[Callable], field_name: str = "tools") -> dict[str, Tool]:
    """Tools by name; two tools of one name are a ConfigError (the model could not tell
    them apart)."""
    tools: dict[str, Tool] = {}
    for fn in fns:
        tool = as_tool(fn, field_name)
        if tool.name in tools:
            raise ConfigError(f"{field_name}: two tools are named {tool.name}")
        tools[tool.name] = tool
    return tools


def tools_prompt(tools: Iterable[Tool]) -> str:
    """The tools as text, in the Hermes wording (what Qwen2.5's template writes in its
    system message), for chat templates that do not render `tools` themselves.

    >>> def add(a: int, b: int) -> int:
    ...     '''Add two integers.
    ...
    ...     Args:
    ...         a: The first.
    ...         b: The second.
    ...     '''
    ...     return a + b
    >>> print(tools_prompt([as_tool(add)]).splitlines()[0])
    # Tools
    """
    lines = "\n".join(json.dumps(t.schema) for t in tools)
    return (
        "# Tools\n\n"
        "You may call one or more functions to help with the user's request.\n\n"
        "The functions you can call are described in JSON within <tools></tools> tags:\n"
        f"<tools>\n{lines}\n</tools>\n\n"
        "To call a function, write a JSON object with its name and arguments within "
        "<tool_call></tool_call> tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\n\n'
        "The results come back within <tool_response></tool_response> tags. "
        "When you have the answer, reply without a tool call."
    )


def with_tools(messages: list[dict], tools: Iterable[Tool]) -> list[dict]:
    """`messages` with the tools described in the system message (`tools_prompt` before
    any system text of their own): the rendering for templates without `tools`."""
    text = tools_prompt(tools)
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0], content=f"{messages[0]['content']}\n\n{text}")
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


_PROBE = {
    "type": "function",
    "function": {
        "name": "probe_tool_4f1c",
        "description": "A probe.",
        "parameters": {"type": "object", "properties": {}},
    },
}


def template_renders_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template writes the tools it is given into the
    prompt (rendering with a probe tool shows its name); templates that ignore `tools`
    would silently drop them."""
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], tools=[_PROBE], tokenize=False
        )
    except Exception:  # a template that fails on `tools` does not support them
        return False
    return isinstance(text, str) and _PROBE["function"]["name"] in text


def render_prompt(tokenizer, messages: list[dict], tools: Iterable[Tool]) -> list[int]:
    """The prompt's token ids with the tools rendered: by the chat template itself
    where it renders `tools`, else in the system message (`with_tools`)."""
    tools = list(tools)
    if not tools:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    elif template_renders_tools(tokenizer):
        ids = tokenizer.apply_chat_template(
            messages, tools=[t.schema for t in tools], add_generation_prompt=True, tokenize=True
        )
    else:
        ids = tokenizer.apply_chat_template(
            with_tools(messages, tools), add_generation_prompt=True, tokenize=True
        )
    if hasattr(ids, "input_ids"):  # some tokenizers return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


@dataclass(frozen=True)
class ToolCall:
    """One `<tool_call>` of a reply: its name and arguments, or why it is no call."""

    name: str | None
    arguments: dict | None
    error: str | None = None  # set when the body is not a call (then a bad_call)


# A call's body runs to its closing tag, or to the end of a reply cut off before it.
_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The tool calls of a reply, in order; [] when it makes none (an answer).

    >>> parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
    [ToolCall(name='add', arguments={'a': 1}, error=None)]
    >>> parse_tool_calls('<tool_call>{"name": add}</tool_call>')[0].error
    'not JSON: Expecting value at char 9'
    """
    return [_parse_call(m.group(1)) for m in _CALL.finditer(text)]


def _parse_call(body: str) -> ToolCall:
    try:
        data = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall(None, None, f"not JSON: {e.msg} at char {e.pos}")
    if not isinstance(data, dict):
        return ToolCall(None, None, 'not a JSON object {"name": ..., "arguments": {...}}')
    name = data.get("name")
    # Llama 3.1's templates call the arguments "parameters"; OpenAI's send them as a string
    args = data.get("arguments", data.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    if not isinstance(name, str) or not name:
        return ToolCall(None, None, 'no "name" (a string)')
    if not isinstance(args, dict):
        return ToolCall(name, None, '"arguments" is not a JSON object')
    return ToolCall(name, args)


@dataclass(frozen=True)
class ToolResult:
    """What one call gave the model: the tool's name, the text it reads, and the kind
    of failure (None when the tool returned)."""

    name: str
    content: str
    failure: str | None = None


class ToolTimeout(RuntimeError):
    """A tool gave no result within its deadline."""


def run_with_deadline(fn: Callable, kwargs: dict, timeout_s: float):
    """`fn(**kwargs)` (awaited when it is a coroutine function), or ToolTimeout after
    `timeout_s`. It runs in a daemon thread (`recipe.bounded`): Python cannot stop a
    thread, so a hanging tool is abandoned and costs its own call only (what it does if
    it ever returns, to an environment's state say, still happens)."""

    def call():
        value = fn(**kwargs)
        return asyncio.run(value) if inspect.iscoroutine(value) else value

    name = f"tool {getattr(fn, '__name__', fn)}"
    return bounded(call, timeout_s, name, ToolTimeout(f"no result after {timeout_s:g} s"))


def as_content(value: Any) -> str:
    """A tool's return value as the text the model reads: strings as they are, other
    values as JSON where they have it."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


def call_tool(call: ToolCall, tools: dict[str, Tool], timeout_s: float) -> ToolResult:
    """Run one parsed call; every way it can go wrong is a ToolResult with an error the
    model reads and its failure kind, never an exception."""

    def failed(name: str, kind: str, message: str) -> ToolResult:
        return ToolResult(name, json.dumps({"error": message}), kind)

    if call.error is not None:
        return failed(call.name or UNNAMED, "bad_call", f"bad tool call: {call.error}")
    tool = tools.get(call.name)
    if tool is None:
        known = ", ".join(tools) or "none"
        return failed(call.name, "unknown_tool", f"unknown tool {call.name!r} (tools: {known})")
    try:
        inspect.signature(tool.function).bind(**call.arguments)
    except TypeError as e:
        return failed(tool.name, "bad_arguments", f"{tool.name}: {e}")
    except ValueError:  # a signature that cannot be read: let the call itself tell
        pass
    try:
        value = run_with_deadline(tool.function, call.arguments, timeout_s)
    except ToolTimeout as e:
        return failed(tool.name, "timeout", f"timeout: {tool.name} gave {e}")
    except Exception as e:
        return failed(tool.name, "error", f"{tool.name} raised {first_line(e)}")
    return ToolResult(tool.name, as_content(value))


def tool_responses(results: Iterable[ToolResult]) -> str:
    """The results as the next observation, each as Qwen2.5's template writes a tool
    message inside the user turn."""
    return "\n".join(f"<tool_response>\n{r.content}\n</tool_response>" for r in results)


@dataclass
class ToolStats:
    """Tool calls of one episode (or of many, added up): how many, and the failures by
    (tool, kind)."""

    calls: int = 0
    failures: Counter = field(default_factory=Counter)

    def record(self, result: ToolResult, known: Iterable[str] | None = None) -> None:
        """Count one call, and its failure if it failed; a failure naming none of the
        `known` tools (when given) is counted under UNKNOWN."""
        self.calls += 1
        if result.failure is not None:
            name = result.name
            if known is not None and name not in known and name != UNNAMED:
                name = UNKNOWN
            self.failures[(name, result.failure)] += 1

    def as_record(self) -> dict:
        """The counts as JSON (what ranks exchange): `{"calls": n, "failures":
        {"<tool>/<kind>": n}}`."""
        failures = {f"{name}/{kind}": n for (name, kind), n in sorted(self.failures.items())}
        return {"calls": self.calls, "failures": failures}

    @classmethod
    def from_record(cls, record: dict) -> ToolStats:
        """The inverse of `as_record`."""
        failures = Counter()
        for key, n in record["failures"].items():
            name, kind = key.rsplit("/", 1)
            failures[(name, kind)] += n
        return cls(record["calls"], failures)

    def __iadd__(self, other: ToolStats) -> ToolStats:
        self.calls += other.calls
        self.failures.update(other.failures)
        return self


def episode_tool_stats(envs: Iterable) -> list[ToolStats]:
    """The `tool_stats` of each environment that has them (a ToolEnv's), in order."""
    stats = (getattr(env, "tool_stats", None) for env in envs)
    return [s for s in stats if isinstance(s, ToolStats)]


def tool_metrics(envs: Iterable) -> dict[str, float]:
    """Step metrics from the environments of a step's episodes (those with `tool_stats`):
    `tools/calls_per_episode`, `tools/failures` and `tools/fail/<tool>/<kind>`.

    >>> env = ToolEnv([])
    >>> _ = env.reset(); _ = env.step('<tool_call>{"name": "nope"}</tool_call>')
    >>> tool_metrics([env])
    {'tools/calls_per_episode': 1.0, 'tools/failures': 1.0, 'tools/fail/unknown/unknown_tool': 1.0}
    """
    return stats_metrics(episode_tool_stats(envs))


def stats_metrics(episodes: Iterable[ToolStats]) -> dict[str, float]:
    """`tool_metrics` from the ToolStats of each episode ({} for none)."""
    total, count = ToolStats(), 0
    for stats in episodes:
        total += stats
        count += 1
    if not count:
        return {}
    out = {
        "tools/calls_per_episode": total.calls / count,
        "tools/failures": float(sum(total.failures.values())),
    }
    for (name, kind), n in sorted(total.failures.items()):
        out[f"tools/fail/{name}/{kind}"] = float(n)
    return out


class ToolEnv:
    """An environment (mlx_grpo/env.py's protocol) whose actions are tool calls.

    `prompt_tools` are the tools the rollout renders in the episode's prompt
    (`rollout.episode_prompt`: the chat template's own `tools=` where it writes them,
    else the system message); none when `announce` is False because the task's messages
    describe them already. `reset()` gives the first observation of `start()` when
    given, else "" (the task's messages ask). Each reply's calls run in order, each within `timeout_s`; their results are the
    next observation. A reply without a call is the answer and ends the episode
    (`answer`). `messages` holds the episode as chat messages (assistant replies with
    their `tool_calls`, then `tool` messages), the shape TRL's rewards read;
    `tool_stats` counts calls and failures. A reply with a call that does not parse is
    marked ill-formed (`info["format"]` False), as the web recipes mark theirs.
    """

    def __init__(
        self,
        tools: Iterable[Callable] | dict[str, Tool],
        start: Callable[[], str | None] | None = None,
        timeout_s: float = 10.0,
        announce: bool = True,
    ):
        self.tools = tools if isinstance(tools, dict) else as_tools(tools)
        self.start = start
        self.timeout_s = timeout_s
        self.announce = announce
        self.first_observation = ""
        self._clear()

    def _clear(self) -> None:
        self.messages: list[dict] = []
        self.tool_stats = ToolStats()
        self.answer: str | None = None

    @property
    def prompt_tools(self) -> list[Tool]:
        """The tools the prompt shows the model (none unless `announce`)."""
        return list(self.tools.values()) if self.announce else []

    def reset(self) -> str:
        """The start's observation ("" without one)."""
        self._clear()
        observation = self.start() if self.start is not None else None
        self.first_observation = str(observation) if observation else ""
        return self.first_observation

    def step(self, action: str) -> StepResult:
        """Run the reply's tool calls; a reply without one is the answer."""
        calls = parse_tool_calls(action)
        prose = _CALL.sub("", action).strip()
        if not calls:
            self.answer = action
            self.messages.append({"role": "assistant", "content": action})
            return StepResult("", True, {"tool_calls": 0})
        results = [call_tool(c, self.tools, self.timeout_s) for c in calls]
        for r in results:
            self.tool_stats.record(r, self.tools)
        self.messages.append(
            {
                "role": "assistant",
                "content": prose,
                "tool_calls": [
                    {"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in calls
                ],
            }
        )
        self.messages += [{"role": "tool", "name": r.name, "content": r.content} for r in results]
        failures = [(r.name, r.failure) for r in results if r.failure is not None]
        info = {"tool_calls": len(calls), "failures": failures}
        if any(c.error is not None for c in calls):
            info["format"] = False
        return StepResult(tool_responses(results), False, info)


def tools_env(
    tools: Iterable[Callable], timeout_s: float = 10.0, announce: bool = True
) -> Callable[[Any], ToolEnv]:
    """`make_env(task)` for a recipe whose tasks are answered with the help of `tools`
    (TRL's `tools=[...]` list): the task's messages ask, each episode gets a ToolEnv,
    and the reward reads `episode.env.answer`."""
    schemas = as_tools(tools)  # at load: a tool without hints or docstring fails here

    def make_env(task) -> ToolEnv:
        return ToolEnv(schemas, timeout_s=timeout_s, announce=announce)

    return make_env
