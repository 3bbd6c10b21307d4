"""Tools: schemas from docstrings, calls parsed from the reply, every failure a message
the model reads and a counted failure, and TRL's agent shapes (`environment_factory`,
`tools=`, rewards reading `environments`) run as they are."""

from __future__ import annotations

import json
import re
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path

import mlx.core as mx
import pytest
from conftest import CHAT_TEMPLATE, recipe_folder, write_byte_tokenizer

from mlx_grpo.config import ConfigError, RolloutConfig, build_config
from mlx_grpo.env import Episode, turn_spans
from mlx_grpo.recipe import Recipe, Task, recipe_defaults
from mlx_grpo.tools import (
    ToolEnv,
    as_tool,
    parse_tool_calls,
    render_prompt,
    template_renders_tools,
    tool_metrics,
)
from mlx_grpo.trl_env import TRLEnvironment

# TRL's own environment_factory example (docs/source/grpo_trainer.md, "Environments"),
# as it is there but for its import of trl.
TRL_INCREMENT_ENV = '''
import random


class IncrementEnv:
    # Reserved methods
    def reset(self, **kwargs) -> str | None:  # required; called at the start of each rollout
        self.counter = 0
        self.target = random.randint(1, 6)  # self-sample the task
        return f"Increment the counter by {self.target}."  # returned string becomes the prompt

    def get_reward(self) -> float:  # optional: the environment scores itself from its own state
        return float(self.counter == self.target)

    # Public methods (exposed as tools)
    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter
'''
_ns: dict = {}
exec(TRL_INCREMENT_ENV, _ns)  # noqa: S102 - the example's own text, as a user pastes it
IncrementEnv = _ns["IncrementEnv"]


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


def call(name, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_a_tool_schema_comes_from_its_type_hints_and_docstring():
    assert as_tool(IncrementEnv().increment).schema == {
        "type": "function",
        "function": {
            "name": "increment",
            "description": "Increment the internal counter.",
            "parameters": {
                "type": "object",
                "properties": {
                    "step": {"type": "integer", "description": "Value to add to the counter."}
                },
                "required": ["step"],
            },
            "return": {"type": "integer", "description": "The updated counter value."},
        },
    }
    assert as_tool(multiply).schema["function"]["parameters"]["required"] == ["a", "b"]


def test_a_tool_without_hints_is_a_one_line_error_naming_it():
    def lookup(key):
        """Look up a key."""

    with pytest.raises(ConfigError, match=r"^tools: lookup: .*missing a type hint") as e:
        as_tool(lookup)
    assert "\n" not in str(e.value)


def test_calls_are_parsed_in_order_from_prose_and_a_cut_off_reply():
    text = f"Let me see. {call('a', x=1)} and {call('b')}\n<tool_call>\n" + '{"name": "c", "arg'
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error is None) for c in calls] == [
        ("a", {"x": 1}, True),
        ("b", {}, True),
        (None, None, False),
    ]
    # Llama's "parameters", and arguments sent as a JSON string (OpenAI's shape)
    text = '<tool_call>{"name": "a", "parameters": {"x": 2}}</tool_call>'
    assert parse_tool_calls(text)[0].arguments == {"x": 2}
    text = '<tool_call>{"name": "a", "arguments": "{\\"x\\": 3}"}</tool_call>'
    assert parse_tool_calls(text)[0].arguments == {"x": 3}
    assert parse_tool_calls("The answer is 42.") == []


def test_every_failure_kind_is_a_tool_message_and_a_counted_failure():
    """One reply makes six calls: a body that is not JSON, an unknown tool, arguments
    the tool does not take, a tool that raises, one that hangs, and a good one. Each
    gets its own tool message, in order; the hang costs its deadline only, and the call
    after it still runs; the failures are counted by tool and kind (a tool the model
    made up under "unknown", so invented names add no metrics)."""
    release = threading.Event()

    def boom(x: int) -> int:
        """Raise.

        Args:
            x: Anything.
        """
        raise KeyError("no such row")

    def hang() -> str:
        """Never answer (until the test ends)."""
        release.wait(60)
        return "late"

    env = ToolEnv([multiply, boom, hang], timeout_s=0.5)
    env.reset()
    reply = "".join(
        [
            "<tool_call>{'name': 'multiply'}</tool_call>",
            call("divide", a=1, b=2),
            call("multiply", a=1),
            call("boom", x=1),
            call("hang"),
            call("multiply", a=6, b=7),
        ]
    )
    tic = time.perf_counter()
    try:
        result = env.step(reply)
    finally:
        release.set()
    assert time.perf_counter() - tic < 0.5 + 2.0
    assert not result.done and result.info["format"] is False
    tool_msgs = [m for m in env.messages if m["role"] == "tool"]
    assert [m["name"] for m in tool_msgs] == [
        "unnamed",
        "divide",
        "multiply",
        "boom",
        "hang",
        "multiply",
    ]
    errors = [json.loads(m["content"]).get("error", "") for m in tool_msgs[:5]]
    assert errors[0].startswith("bad tool call: not JSON")
    assert errors[1] == "unknown tool 'divide' (tools: multiply, boom, hang)"
    assert "missing a required argument: 'b'" in errors[2]
    assert errors[3] == "boom raised KeyError: 'no such row'"
    assert errors[4] == "timeout: hang gave no result after 0.5 s"
    assert tool_msgs[5]["content"] == "42"
    # the observation the model reads: every result, in order, as Qwen2.5 shows them
    blocks = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", result.observation, re.S)
    assert blocks == [m["content"] for m in tool_msgs]
    kinds = ["bad_call", "unknown_tool", "bad_arguments", "error", "timeout"]
    names = ["unnamed", "divide", "multiply", "boom", "hang"]
    counted = ["unnamed", "unknown", "multiply", "boom", "hang"]
    assert env.tool_stats.calls == 6
    assert env.tool_stats.failures == Counter(dict.fromkeys(zip(counted, kinds), 1))
    assert result.info["failures"] == list(zip(names, kinds))
    final = env.step("It is 42.")
    assert final.done and env.answer == "It is 42."
    metrics = tool_metrics([env, ToolEnv([multiply])])  # a second episode made no call
    assert metrics["tools/calls_per_episode"] == 3.0 and metrics["tools/failures"] == 5.0
    assert metrics["tools/fail/hang/timeout"] == 1.0


def test_hanging_tools_cost_their_own_calls_only():
    """Three calls to a tool that never answers take about three deadlines, not
    forever, and the episode plays on."""
    release = threading.Event()

    def stuck(n: int) -> int:
        """Hang.

        Args:
            n: Ignored.
        """
        release.wait(60)
        return n

    env = ToolEnv([stuck, multiply], timeout_s=0.2)
    env.reset()
    tic = time.perf_counter()
    try:
        result = env.step(call("stuck", n=1) + call("stuck", n=2) + call("stuck", n=3))
    finally:
        release.set()
    assert 0.6 <= time.perf_counter() - tic < 0.6 + 2.0
    assert env.tool_stats.failures == Counter({("stuck", "timeout"): 3})
    assert env.step(call("multiply", a=2, b=3)).observation.count("6") == 1
    assert not result.done


def _tokenizer(tmp_path, template: str):
    from transformers import PreTrainedTokenizerFast

    write_byte_tokenizer(tmp_path)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    tok.chat_template = template
    return tok


QWEN_LIKE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}\n{{ t | tojson }}"
    "{% endfor %}\n</tools><|im_end|>\n{% endif %}" + CHAT_TEMPLATE
)


def test_tools_render_through_the_template_where_it_can_and_the_system_message_else(tmp_path):
    messages = [{"role": "user", "content": "What is 6 times 7?"}]
    tools = [as_tool(multiply)]
    schema = json.dumps(tools[0].schema)
    own = _tokenizer(tmp_path, QWEN_LIKE)
    assert template_renders_tools(own)
    text = own.decode(render_prompt(own, messages, tools))
    assert f"<tools>{schema}</tools>" in text and "# Tools" not in text  # (jinja trim_blocks)
    plain = _tokenizer(tmp_path, CHAT_TEMPLATE)  # (SmolLM2's template: no tools)
    assert not template_renders_tools(plain)
    text = plain.decode(render_prompt(plain, messages, tools))
    assert text.startswith("<|im_start|>system\n# Tools") and schema in text
    assert text.endswith("<|im_start|>user\nWhat is 6 times 7?<|im_end|>\n<|im_start|>assistant\n")


def _target(observation: str) -> int:
    return int(re.search(r"Increment the counter by (\d+)\.", observation).group(1))


def test_trls_environment_factory_example_runs_unchanged_on_a_scripted_policy():
    """TRL's IncrementEnv: a fresh instance per episode, `reset`'s string as the first
    observation, `increment` as the tool the prompt offers, `get_reward` as a component named after the class,
    and a TRL reward function given the instances as `environments`."""
    seen = []

    def counter_reward(completions, environments, **kwargs):
        seen.append((completions, environments))
        return [float(e.counter) for e in environments]

    trl = TRLEnvironment(IncrementEnv, reward_funcs=[counter_reward])
    tasks = trl.make_tasks("train", 4, 0)
    episodes = []
    for task, overshoot in zip(tasks, [0, 1, 0, 2]):
        env = trl.make_env(task)
        first = env.reset()
        assert re.fullmatch(r"Increment the counter by \d\.", first)
        assert [t.name for t in env.prompt_tools] == ["increment"]
        target = _target(first)
        episode = Episode(env=env)
        for reply in [call("increment", step=target + overshoot), "Done."]:
            episode.actions.append(reply)
            episode.results.append(env.step(reply))
        assert (
            episode.results[0].observation
            == f"<tool_response>\n{target + overshoot}\n</tool_response>"
        )
        assert episode.results[-1].done
        episodes.append(episode)
    rewards = trl.reward_batch(tasks[:2], [episodes[:2], episodes[2:]])
    got = [r["IncrementEnv"] for g in rewards for r in g]
    assert got == [1.0, 0.0, 1.0, 0.0]
    completions, environments = seen[0]
    assert environments == [e.env.environment for e in episodes]
    assert completions[0][0]["tool_calls"][0]["function"]["name"] == "increment"
    assert completions[0][1]["role"] == "tool" and completions[0][-1]["content"] == "Done."
    assert [r["counter_reward"] for g in rewards for r in g] == [
        float(e.env.environment.counter) for e in episodes
    ]


def test_a_self_sampling_environment_starts_alike_within_a_task():
    """TRL's IncrementEnv draws its target with `random`: the G episodes of a task get
    one target (seeded by the task id), and the run's own random state is untouched."""
    import random

    trl = TRLEnvironment(IncrementEnv)
    tasks = trl.make_tasks("train", 12, 0)
    state = random.getstate()
    firsts = [[trl.make_env(t).reset() for _ in range(4)] for t in tasks]
    assert random.getstate() == state
    assert all(len(set(f)) == 1 for f in firsts)
    assert len({_target(f[0]) for f in firsts}) > 1  # tasks still differ


def test_a_dataset_row_reaches_reset_as_keyword_arguments():
    """TRL's second example: the dataset holds the task, `reset(target, **kwargs)`
    receives its columns (and the prompt), and returns None."""

    class RowEnv:
        def reset(self, target, **kwargs) -> None:
            self.counter, self.target, self.prompt = 0, target, kwargs["prompt"]

        def get_reward(self) -> float:
            return float(self.counter == self.target)

        def increment(self, step: int) -> int:
            """Increment the counter.

            Args:
                step: Value to add.
            """
            self.counter += step
            return self.counter

    trl = TRLEnvironment(RowEnv, announce=False)
    msgs = [{"role": "user", "content": "Increment the counter to 3."}]
    task = Task("t", 1, msgs, {"target": 3})
    env = trl.make_env(task)
    assert env.reset() == "" and env.prompt_tools == []
    env.step(call("increment", step=3))
    env.step("ok")
    assert env.environment.prompt == msgs and trl.reward(task, _episode(env)) == {"RowEnv": 1.0}


def _episode(env):
    return Episode(env=env, done=True)


def test_a_trl_tools_list_answers_a_question():
    """TRL's `tools=[multiply]` with a reward function reading the completions."""

    def correct(completions, answer, **kwargs):
        return [float(str(a) in c[-1]["content"]) for c, a in zip(completions, answer)]

    trl = TRLEnvironment(tools=[multiply], reward_funcs=[correct])
    task = Task("q", 1, [{"role": "user", "content": "What is 6 times 7?"}], {"answer": 42})
    env = trl.make_env(task)
    assert env.reset() == "" and [t.name for t in env.prompt_tools] == ["multiply"]
    assert (
        env.step(call("multiply", a=6, b=7)).observation == "<tool_response>\n42\n</tool_response>"
    )
    assert env.step("42").done
    assert trl.reward(task, _episode(env)) == {"correct": 1.0}


def test_an_environment_whose_tool_has_no_docstring_fails_at_load():
    class Bare:
        def reset(self, **kwargs):
            return "go"

        def move(self, direction: str) -> str:
            return direction

    with pytest.raises(ConfigError, match=r"^environment_factory: move: .*docstring"):
        TRLEnvironment(Bare, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)])
    with pytest.raises(ConfigError, match="reward_funcs: none given"):
        TRLEnvironment(tools=[multiply])


RECIPE = TRL_INCREMENT_ENV + textwrap.dedent(
    """
    from mlx_grpo.trl_env import TRLEnvironment

    trl = TRLEnvironment(IncrementEnv)
    make_tasks, make_env, reward, reward_batch = (
        trl.make_tasks, trl.make_env, trl.reward, trl.reward_batch
    )
    """
)


def test_the_trl_example_plays_through_the_trainers_rollout_from_a_recipe_file(tiny, tmp_path):
    """A recipe file holding TRL's class plays real episodes with the tiny model, the
    model's tokens scripted: a call to `increment` by the target, then an answer. The
    prompt describes the tool (in the system message: the template has no `tools`). The
    tool's answer is in the sequence but not in the loss, the trained ids are the ids
    sampled, and `get_reward` scores both episodes 1."""
    model, tok = tiny
    folder = recipe_folder(tmp_path, "counter", RECIPE)
    recipe = Recipe(str(folder), {"IncrementEnv": 1.0}, {})
    assert recipe.multi_turn
    (task,) = recipe.tasks("train", 1, 0)
    target = _target(recipe.make_env(task).reset())
    eos = tok.eos_token_id
    first = [*tok.encode(call("increment", step=target), add_special_tokens=False), eos]
    x = tok.encode("x", add_special_tokens=False)[0]
    pos = {"n": 0}

    def scripted(logprobs):
        """Every row: the call, then (the generator may draw one token ahead of a turn's
        end, and drops it) a few x and an EOS: the answer."""
        n = pos["n"]
        pos["n"] += 1
        token = first[n] if n < len(first) else (x if n < len(first) + 4 else eos)
        return mx.full((logprobs.shape[0],), token, dtype=mx.uint32)

    from mlx_grpo.rollout import rollout_tasks

    cfg = RolloutConfig(max_new_tokens=len(first), max_turns=3, max_prompt_tokens=2048)
    rollout = rollout_tasks(model, tok, recipe, [task], 2, cfg, sampler=scripted)
    prompt = tok.decode(rollout.prompts[0])  # (the tiny template renders no tools itself)
    assert prompt.startswith("<|im_start|>system\n# Tools") and '"name": "increment"' in prompt
    asked = f"<|im_start|>user\nIncrement the counter by {target}.<|im_end|>\n"
    assert prompt.endswith(asked + "<|im_start|>assistant\n")
    for c in rollout.completions:
        call_text, answer = c.episode.actions
        assert call_text == call("increment", step=target) and re.fullmatch("x+", answer)
        assert c.episode.done
        replies = [c.tokens[a:b] for a, b in turn_spans(c.loss_mask)]
        assert replies == [first, [x] * len(answer) + [eos]]  # trained ids: as sampled
        outside = tok.decode([t for t, m in zip(c.tokens, c.loss_mask) if not m])
        assert f"<tool_response>\n{target}\n</tool_response>" in outside
    scored = recipe.score_rollout([task], rollout)
    assert [s.reward for s in scored] == [1.0, 1.0] and all(s.error is None for s in scored)
    # The warm start and guidance start a demonstration from the prompt the group samples.
    from mlx_grpo.warmstart import first_prompt

    assert first_prompt(recipe, tok, task, cfg.max_prompt_tokens) == rollout.prompts[0]


DOCS = Path(__file__).resolve().parents[1] / "docs" / "tools.md"


def _docs_recipe(tmp_path, name: str) -> Recipe:
    """The recipe folder `name` whose files docs/tools.md shows, loaded as a run does."""
    text = DOCS.read_text()
    folder = tmp_path / name
    folder.mkdir()
    for lang, file in (("python", "tasks.py"), ("toml", "recipe.toml")):
        block = re.search(rf"```{lang}\n# {name}/{file}\n(.*?)```", text, re.S)
        assert block, f"docs/tools.md shows no {name}/{file}"
        (folder / file).write_text(block.group(1))
    cfg = build_config(recipe_defaults(str(folder)), defaults_file=folder / "recipe.toml")
    return Recipe.from_config(cfg.recipe)


def _play(recipe: Recipe, task: Task, policy) -> Episode:
    """An episode of `task` with `policy(observation) -> reply`, as the rollout plays it."""
    env = recipe.make_env(task)
    observation = recipe.first_messages(task, env)[-1]["content"]
    episode = Episode(env=env)
    while not episode.done:
        reply = policy(task, observation)
        result = env.step(reply)
        episode.actions.append(reply)
        episode.results.append(result)
        episode.done, observation = result.done, result.observation
    return episode


def test_the_docs_examples_train_as_shown(tmp_path):
    """docs/tools.md's three recipes load as a run loads them and score 1 (or the
    environment's return) on a policy that uses their tools well."""

    def calc_policy(task, observation):
        if observation.startswith("<tool_response>"):
            return f"It is {observation.split()[1]}."
        a, b = map(int, re.findall(r"\d+", task.messages[0]["content"]))
        return call("multiply", a=a, b=b)

    calc = _docs_recipe(tmp_path, "calc")
    train, held_out = calc.tasks("train", 20, 0), calc.tasks("eval", 20, 0)
    assert not {t.messages[0]["content"] for t in train} & {
        t.messages[0]["content"] for t in held_out
    }
    for task in train[:3]:
        assert calc.score(task, _play(calc, task, calc_policy)).reward == 1.0

    def counter_policy(task, observation):
        if observation.startswith("<tool_response>"):
            return "Done."
        return call("increment", step=_target(observation))

    counter = _docs_recipe(tmp_path, "counter")
    for task in counter.tasks("train", 3, 0):
        assert counter.score(task, _play(counter, task, counter_policy)).reward == 1.0

    bounds = {}

    def guess_policy(task, observation):
        lo, hi, last = bounds.get(task.id, (0, 9, None))
        if observation == "higher":
            lo = last + 1
        elif observation == "lower":
            hi = last - 1
        bounds[task.id] = (lo, hi, (lo + hi) // 2)
        return f"{(lo + hi) // 2}\n"

    guess = _docs_recipe(tmp_path, "guess")
    for task in guess.tasks("train", 3, 0):
        episode = _play(guess, task, guess_policy)
        assert episode.results[-1].info["terminated"]
        assert guess.score(task, episode).reward == pytest.approx(1.0 - 0.1 * (episode.turns - 1))


def test_async_tools_rewards_and_get_reward_are_awaited():
    """TRL takes `async def` tools, reward functions and `get_reward`; so do these."""

    class AsyncEnv:
        def reset(self, **kwargs) -> str:
            self.total = 0
            return "Add 2 and 3."

        async def get_reward(self) -> float:
            return float(self.total == 5)

        async def add(self, a: int, b: int) -> int:
            """Add two integers.

            Args:
                a: The first.
                b: The second.
            """
            self.total = a + b
            return self.total

    async def said_five(completions, **kwargs):
        return [float("5" in c[-1]["content"]) for c in completions]

    trl = TRLEnvironment(AsyncEnv, reward_funcs=[said_five])
    task = trl.make_tasks("train", 1, 0)[0]
    env = trl.make_env(task)
    env.reset()
    assert env.step(call("add", a=2, b=3)).observation == "<tool_response>\n5\n</tool_response>"
    env.step("5")
    assert trl.reward(task, _episode(env)) == {"AsyncEnv": 1.0, "said_five": 1.0}


def _first_messages(task: Task, env) -> list[dict]:
    """The prompt's messages as `Recipe.first_messages` makes them."""
    return [*task.messages, {"role": "user", "content": env.reset()}]


def test_a_tool_envs_prompt_renders_its_tools_by_the_template_else_in_the_system_message(
    tmp_path,
):
    """The rollout's prompt of a tools_env episode: the template's own `tools=` where it
    writes them (no Hermes text), else the Hermes text in the system message; the empty
    first observation is no empty user turn. With announce=False the tools are left to
    the task's messages."""
    from mlx_grpo.rollout import episode_prompt
    from mlx_grpo.tools import tools_env

    question = [{"role": "user", "content": "What is 6 times 7?"}]
    task = Task("q", 1, question)
    schema = json.dumps(as_tool(multiply).schema)
    env = tools_env([multiply])(task)
    own = _tokenizer(tmp_path, QWEN_LIKE)
    ids = episode_prompt(own, _first_messages(task, env), env, 4096)
    assert ids == render_prompt(own, question, [as_tool(multiply)])
    assert f"<tools>{schema}</tools>" in own.decode(ids) and "# Tools" not in own.decode(ids)
    plain = _tokenizer(tmp_path, CHAT_TEMPLATE)
    text = plain.decode(episode_prompt(plain, _first_messages(task, env), env, 4096))
    assert text.startswith("<|im_start|>system\n# Tools") and schema in text
    assert text.endswith("<|im_start|>user\nWhat is 6 times 7?<|im_end|>\n<|im_start|>assistant\n")
    quiet = tools_env([multiply], announce=False)(task)
    text = plain.decode(episode_prompt(plain, _first_messages(task, quiet), quiet, 4096))
    assert "<tools>" not in text and "<|im_start|>user\n<|im_end|>" in text  # as before


def _eos_only(tok):
    def sampler(logprobs):
        return mx.full((logprobs.shape[0],), tok.eos_token_id, dtype=mx.uint32)

    return sampler


def test_recipes_without_tools_keep_their_prompts_byte_for_byte(tiny):
    """A recipe whose environment offers no tools (web_browsing, multi-turn) and a
    single-turn one (arithmetic) are prompted as before tools were rendered: the chat
    template of their first messages, nothing added or left out."""
    from mlx_grpo.rollout import rollout_tasks

    model, tok = tiny
    cfg = RolloutConfig(max_new_tokens=1, max_turns=1, max_prompt_tokens=4096)
    for name in ("arithmetic", "web_browsing"):
        recipe = Recipe.from_config(build_config(recipe_defaults(name)).recipe)
        tasks = recipe.tasks("train", 2, 0)
        rollout = rollout_tasks(model, tok, recipe, tasks, 2, cfg, sampler=_eos_only(tok))
        for task, prompt in zip(tasks, rollout.prompts):
            env = recipe.make_env(task) if recipe.multi_turn else None
            before = tok.apply_chat_template(
                recipe.first_messages(task, env), add_generation_prompt=True, tokenize=True
            )
            assert prompt == list(before), name
        assert rollout.tool_stats == []


def _turn_scripted(script: list[list[int]], eos: int, group_size: int, steps: dict):
    """A sampler that draws `script[k]` in turn k of every episode (then EOS: the draws
    past a turn's end, which the generator drops); the turn is told by the
    environments' steps so far (`steps["n"]`, G a turn)."""
    pos = {"turn": 0, "n": 0}

    def sampler(logprobs):
        turn = steps["n"] // group_size
        if turn != pos["turn"]:
            pos.update(turn=turn, n=0)
        ids = script[turn] if turn < len(script) else []
        token = ids[pos["n"]] if pos["n"] < len(ids) else eos
        pos["n"] += 1
        return mx.full((logprobs.shape[0],), token, dtype=mx.uint32)

    return sampler


class StepCounting(ToolEnv):
    def __init__(self, tools, steps: dict):
        super().__init__(tools)
        self.steps = steps

    def step(self, action):
        self.steps["n"] += 1
        return super().step(action)


def _play_scripted(model, tok, script: list[list[int]], group_size: int = 2):
    """A rollout of `group_size` ToolEnv episodes over [multiply] whose replies are
    `script`'s ids, one reply a turn, through the trainer's `play_episodes`."""
    from mlx_grpo.rollout import episode_prompt, play_episodes

    steps = {"n": 0}
    task = Task("q", 1, [{"role": "user", "content": "What is 6 times 7?"}])
    envs = [StepCounting([multiply], steps) for _ in range(group_size)]
    prompt = episode_prompt(tok, _first_messages(task, envs[0]), envs[0], 4096)
    for env in envs[1:]:
        env.reset()
    cfg = RolloutConfig(max_new_tokens=max(map(len, script)), max_turns=len(script) + 1)
    sampler = _turn_scripted(script, tok.eos_token_id, group_size, steps)
    return play_episodes(model, tok, [prompt], envs, group_size, cfg, sampler)


def test_trained_ids_are_the_sampled_ids_where_their_text_would_tokenize_otherwise(tiny):
    """Two turns whose sampled ids do not survive decode and encode: a byte that is no
    UTF-8 alone (found by searching the vocabulary for ids whose round trip differs;
    its text is U+FFFD, three other bytes) before a tool call, then '<|im_end|>' spelled
    in byte tokens (its text encodes as the one special token). The tokens the update
    trains (`build_loss_inputs`, under the mask) are the ids sampled, turn by turn."""
    from mlx_grpo.update import build_loss_inputs

    model, tok = tiny

    def enc(text):
        return tok.encode(text, add_special_tokens=False)

    special = set(tok.all_special_ids)
    odd = [
        i for i in range(len(tok.get_vocab())) if i not in special and enc(tok.decode([i])) != [i]
    ]
    assert odd, "the test tokenizer has no id whose text encodes otherwise"
    spelled = [enc(ch)[0] for ch in "<|im_end|>"]
    assert enc(tok.decode(spelled)) == [tok.eos_token_id] != spelled
    eos = tok.eos_token_id
    script = [
        [*enc("Hm "), odd[0], *enc(" " + call("multiply", a=6, b=7)), eos],
        [*spelled, *enc("42"), eos],
    ]
    rollout = _play_scripted(model, tok, script)
    batch = build_loss_inputs(rollout, mx.ones(len(rollout.completions)), 64, False, fold=False)
    tokens, mask = batch.completions.tolist(), batch.mask.tolist()
    for row, c in enumerate(rollout.completions):
        assert c.episode.done and c.episode.results[0].observation == (
            "<tool_response>\n42\n</tool_response>"
        )
        for text, ids in zip(c.episode.actions, script):
            assert enc(text) != ids[:-1]  # the text alone would train other ids
        trained = [t for t, m in zip(tokens[row], mask[row]) if m > 0]
        assert trained == script[0] + script[1]
        assert [c.tokens[a:b] for a, b in turn_spans(c.loss_mask)] == script


def test_tool_calls_and_failures_reach_the_steps_metrics(tiny):
    """A scripted rollout whose episodes each call `multiply` well, with an argument it
    does not take, and a tool that does not exist, then answer: every rank's share of
    it (as JSON, as ranks exchange them) gives the step's `tools/` metrics, summed over
    ranks; a step without tools has none."""
    import numpy as np

    from mlx_grpo.credit import CompletionRecord, share_record
    from mlx_grpo.monitor import step_metrics
    from mlx_grpo.recipe import Scored

    model, tok = tiny
    eos = tok.eos_token_id

    def enc(text):
        return tok.encode(text, add_special_tokens=False)

    calls = call("multiply", a=6, b=7) + call("multiply", a=6, c=7) + call("divide", a=6)
    rollout = _play_scripted(model, tok, [[*enc(calls), eos], [*enc("42"), eos]], group_size=3)
    assert (
        rollout.tool_stats
        == [{"calls": 3, "failures": {"multiply/bad_arguments": 1, "unknown/unknown_tool": 1}}] * 3
    )
    scored = [Scored(1.0, {"correct": 1.0})] * 3

    def metrics(shares):
        shares = json.loads(json.dumps(shares))
        records = [CompletionRecord(**r) for sh in shares for r in sh["records"]]
        rewards = np.ones(len(records))
        zero_var = np.ones(len(records) // 3, dtype=bool)
        return step_metrics(1, shares, records, rewards, mx.zeros(len(records)), zero_var, [])

    share = share_record(rollout, scored, False)  # what the trainer shares
    assert share["tools"] == rollout.tool_stats
    one = {k: v for k, v in metrics([share]).items() if k.startswith("tools/")}
    assert one == {
        "tools/calls_per_episode": 3.0,
        "tools/failures": 6.0,
        "tools/fail/multiply/bad_arguments": 3.0,
        "tools/fail/unknown/unknown_tool": 3.0,
    }
    two = metrics([share, share])  # two ranks
    assert two["tools/calls_per_episode"] == 3.0 and two["tools/failures"] == 12.0
    assert two["tools/fail/unknown/unknown_tool"] == 6.0
    plain = {**share_record(rollout, scored, False), "tools": []}
    assert not [k for k in metrics([plain]) if k.startswith("tools/")]
