"""The web_browsing recipe without a model: golden solutions reach the goal, wrong ones do
not, the parsers say what is wrong, and generation is deterministic and split-safe."""

from __future__ import annotations

import doctest
import json
import re
from collections import Counter

import pytest

import rewards.web as web_rewards
from mlx_grpo.config import build_config
from mlx_grpo.env import Episode, StepResult
from mlx_grpo.recipe import Recipe, Task, recipe_defaults
from recipes import web_agent as page
from recipes.web_agent import (
    Action,
    element_ref,
    find_action,
    parse_action,
    syntax_error,
)
from recipes.web_browsing import after_errors, browser
from recipes.web_browsing.families import NEEDED
from recipes.web_browsing.sites import site_fingerprint
from recipes.web_browsing.tasks import LEVELS, make_env, make_tasks, reward, system_prompt

PERFECT = {"success": 1.0, "progress": 1.0, "format": 1.0, "validity": 1.0, "efficiency": 1.0}


def play(task: Task, replies: list[str]) -> Episode:
    """Reset the task's env and step it with `replies` until it is done."""
    env = make_env(task)
    env.reset()
    results: list[StepResult] = []
    for reply in replies:
        results.append(env.step(reply))
        if results[-1].done:
            break
    return Episode(
        env=env,
        actions=replies[: len(results)],
        results=results,
        done=bool(results) and results[-1].done,
    )


@pytest.fixture(scope="module")
def train() -> list[Task]:
    return make_tasks("train", 600, 0)


def of(tasks: list[Task], family: str, difficulty: int | None = None) -> list[Task]:
    return [
        t
        for t in tasks
        if t.payload["family"] == family and difficulty in (None, t.payload["difficulty"])
    ]


# ---- golden solutions ----------------------------------------------------------------


def test_golden_solutions_reach_the_goal_at_every_level_and_family():
    max_turns = recipe_defaults("web_browsing")["rollout"]["max_turns"]
    seen = set()
    for seed in range(4):
        for split in ("train", "eval"):
            for task in make_tasks(split, 240, seed):
                seen.add((task.level, task.payload["family"], task.payload["difficulty"]))
                ep = play(task, task.payload["solution"])
                assert ep.done and ep.turns == len(task.payload["solution"]), task.id
                assert reward(task, ep) == PERFECT, task.id
                assert task.payload["max_steps"] <= max_turns
    assert seen == {(lv, f, d) for lv, fams in LEVELS.items() for f, d in fams}


def test_single_step_tasks_have_one_turn_and_multi_step_tasks_some_slack(train):
    for task in train:
        steps = len(task.payload["solution"])
        assert task.payload["max_steps"] == (1 if steps == 1 else steps + 2)
    assert {len(t.payload["solution"]) for t in of(train, "click")} == {1}


def test_higher_difficulties_add_distractors_and_near_labels():
    tasks = make_tasks("train", 1200, 1)
    for difficulty, (low, high) in {1: (2, 3), 2: (4, 6), 3: (8, 12)}.items():
        for task in of(tasks, "click", difficulty):
            buttons = [el["label"] for el in task.payload["site"]["pages"]["page"]["elements"]]
            target = task.payload["conditions"][0]["label"]
            assert low <= len(buttons) <= high
            assert (f'"{target}"' in task.payload["goal"]) == (difficulty < 3)
            if difficulty > 1:  # a distractor shares the target's verb, another its object
                verb, obj = target.split(" ", 1)
                assert any(b.startswith(verb + " ") for b in buttons if b != target)
                assert any(b.endswith(" " + obj) for b in buttons if b != target)
    form3 = of(tasks, "form", 3)
    near = 0
    for task in form3:
        targets = [c["label"] for c in task.payload["conditions"] if c["kind"] == "value"]
        kept = [k["label"] for k in task.payload["keep"]]
        words = {w for label in targets for w in label.lower().split()}
        near += any(words & set(k.lower().split()) for k in kept)
        assert not any(f'"{label}"' in task.payload["goal"] for label in targets)
    assert near > 0.8 * len(form3)


# ---- wrong solutions -----------------------------------------------------------------


def test_clicking_a_distractor_fails(train):
    for task in of(train, "click")[:60]:
        target = parse_action(task.payload["solution"][0]).target
        others = task.payload["site"]["pages"]["page"]["elements"]
        wrong = next(el for el in others if el["id"] != target)
        ep = play(task, [f"click {element_ref(wrong)}"])
        r = reward(task, ep)
        assert ep.done and r["success"] == 0 and r["progress"] == 0 and r["efficiency"] == 0
        assert r["format"] == 1 and r["validity"] == 1


def test_forms_need_the_right_values_the_submit_and_no_side_effects(train):
    for task in of(train, "form")[:60]:
        solution = task.payload["solution"]
        n = len(task.payload["conditions"])
        typed = next(i for i, a in enumerate(solution) if a.startswith("type"))
        wrong = list(solution)
        field = parse_action(solution[typed])
        wrong[typed] = f'type "{field.label}" [{field.target}] "nobody@example.com"'
        r = reward(task, play(task, wrong))  # one value wrong: its submit is no progress
        assert r["success"] == 0 and r["progress"] == pytest.approx((n - 2) / n)
        assert r["format"] == 1 and r["validity"] == 1 and r["efficiency"] == 0

        ep = play(task, solution[-1:])  # submitted before anything is filled in
        r = reward(task, ep)
        assert ep.done and r["success"] == 0 and r["progress"] == 0

        ep = play(task, solution[:-1])  # everything filled in, never submitted
        r = reward(task, ep)
        assert not ep.done and r["success"] == 0 and r["progress"] == pytest.approx((n - 1) / n)

        if task.payload["keep"]:  # the goal's fields right, but another one changed too
            env = make_env(task)
            keep = task.payload["keep"][0]
            field = env._elements["page"][keep["id"]]
            ref = element_ref(field)
            extra = {
                "textbox": f'type {ref} "changed"',
                "combobox": f'select {ref} "{field.get("options", [""])[-1]}"',
                "checkbox": f"click {ref}",
            }[field["role"]]
            if field["role"] == "combobox" and field["value"] == field["options"][-1]:
                extra = f'select {ref} "{field["options"][0]}"'
            ep = play(task, [extra, *solution])
            r = reward(task, ep)
            assert ep.env.outcome().side_effects and r["progress"] == 1 and r["success"] == 0


def test_a_wrong_button_ends_a_form_task_without_success(train):
    for task in of(train, "form")[:30]:
        env = make_env(task)
        submit = parse_action(task.payload["solution"][-1]).target
        buttons = [el for el in env.site["pages"]["page"]["elements"] if el["role"] == "button"]
        other = next(b for b in buttons if b["id"] != submit)
        ep = play(task, [*task.payload["solution"][:-1], f"click {element_ref(other)}"])
        assert ep.done and reward(task, ep)["success"] == 0


def test_answering_another_fact_fails(train):
    for task in of(train, "fact")[:80]:
        ep = play(task, task.payload["solution"][:-1])
        env = ep.env
        answer = task.payload["conditions"][-1]
        wrong = next(
            el["label"]
            for el in env.site["pages"][env.page]["elements"]
            if el["role"] == "row" or (el["role"] == "text" and " | " not in el["label"])
            if f" {answer['value']} " not in f" {el['label'].rstrip('.')} "
        )
        ep = play(task, [*task.payload["solution"][:-1], f'stop "{wrong}"'])
        r = reward(task, ep)
        assert ep.done and r["success"] == 0
        assert r["progress"] == pytest.approx(1 - 1 / len(task.payload["conditions"]))


def test_answers_may_use_the_fact_s_words_but_nothing_else():
    sentence = "The API rate limit is 120 requests per minute."
    assert browser.answer_matches("120", "120", sentence)
    assert browser.answer_matches("120 requests per minute", "120", sentence)
    assert browser.answer_matches("$19", "$19", "The Pro plan costs $19 per month.")
    assert browser.answer_matches("19", "$19", "The Pro plan costs $19 per month.")
    assert browser.answer_matches(
        "9am to 5pm", "from 9am to 5pm", "Support is available from 9am to 5pm."
    )
    assert not browser.answer_matches("120 or 300", "120", sentence)
    assert not browser.answer_matches("requests per minute", "120", sentence)
    assert not browser.answer_matches("1200", "120", sentence)


def test_stopping_early_fails_with_partial_progress(train):
    for task in of(train, "nav")[:30] + of(train, "fact", 4)[:20]:
        first = task.payload["solution"][0]
        ep = play(task, [first, 'stop "done"'])
        r = reward(task, ep)
        assert ep.done and ep.turns == 2 and r["success"] == 0
        assert r["progress"] == pytest.approx(1 / len(task.payload["conditions"]))


def test_prose_with_the_answer_is_not_an_answer(train):
    for task in of(train, "fact", 1)[:20]:
        value = task.payload["conditions"][-1]["value"]
        for prose in (f"The answer is {value}.", f'The answer is "{value}"'):
            ep = play(task, [prose])
            r = reward(task, ep)
            assert ep.done and r["success"] == 0 and r["format"] == 0 and r["validity"] == 0
    task = of(train, "click", 1)[0]
    label = task.payload["conditions"][0]["label"]
    assert reward(task, play(task, [f'I would press the "{label}" button.']))["success"] == 0


def test_the_first_action_in_a_chatty_reply_is_executed_but_scores_no_format(train):
    for task in of(train, "click")[:30]:
        target = task.payload["solution"][0]
        label = task.payload["conditions"][0]["label"]
        chatty = f'{target.capitalize()} button "{label}" to do it.'
        r = reward(task, play(task, [chatty]))
        assert r["success"] == 1 and r["format"] == 0 and r["validity"] == 1


# ---- the environment -----------------------------------------------------------------


def test_invalid_actions_say_why_and_use_a_step(train):
    task = of(train, "nav", 2)[0]
    env = make_env(task)
    assert env.reset().startswith(f"Goal: {task.payload['goal']}\nPage: ")
    button = next(el for el in env.site["pages"]["home"]["elements"] if el["role"] == "button")
    link = next(el for el in env.site["pages"]["home"]["elements"] if el["role"] == "link")
    cases = [
        ("press [3]", "Invalid action: unknown verb 'press'"),
        ('click "Save" [99]', "Invalid action: there is no element [99] on this page."),
        (
            f'type {element_ref(button)} "x"',
            f"type does not apply to button {element_ref(button)}; use click {element_ref(button)}",
        ),
        (
            f'select {element_ref(link)} "x"',
            f"select does not apply to link {element_ref(link)}",
        ),
        (
            f'click "Nowhere" [{button["id"]}]',
            f'Invalid action: [{button["id"]}] is button "{button["label"]}", not "Nowhere".',
        ),
        ("back", "Invalid action: there is no previous page."),
    ]
    for reply, reason in cases:
        result = env.step(reply)
        assert result.observation.startswith(reason) or reason in result.observation.splitlines()[0]
        assert result.observation.endswith("(page unchanged)")
        assert result.info["error"] and not result.info["valid"]
    assert env.steps == len(cases) == task.payload["max_steps"]
    assert env.done and "Step limit reached." in result.observation


def test_step_limit_ends_one_turn_tasks(train):
    task = of(train, "fact", 1)[0]
    ep = play(task, ["let me think"])
    assert ep.done and ep.turns == 1 and reward(task, ep)["success"] == 0


def test_pages_change_show_the_new_state_and_back_returns(train):
    task = of(train, "nav", 2)[0]
    env = make_env(task)
    env.reset()
    first = env.step(task.payload["solution"][0])
    assert first.observation.startswith('Clicked link "') and "\nPage: " in first.observation
    back = env.step("back")
    assert back.observation.startswith("Went back.\nPage: ") and env.page == "home"

    form = of(train, "form", 3)[0]
    env = make_env(form)
    env.reset()
    for action in form.payload["solution"][:-1]:
        obs = env.step(action).observation
        assert obs.split("\n", 1)[0].startswith(("Typed", "Selected", "Checked", "Unchecked"))
        assert "\nPage: " in obs
    typed = parse_action(next(a for a in form.payload["solution"] if a.startswith("type")))
    assert f'"{typed.text}"' in env.render().replace("value=", "")


def test_select_matches_options_case_insensitively_and_rejects_unknown_ones(train):
    task = of(train, "form", 2)[0]
    env = make_env(task)
    env.reset()
    combo = next(el for el in env.site["pages"]["page"]["elements"] if el["role"] == "combobox")
    result = env.step(f'select {element_ref(combo)} "{combo["options"][1].upper()}"')
    assert result.info["valid"] and env.values["page"][combo["id"]] == combo["options"][1]
    result = env.step(f'select {element_ref(combo)} "Platinum"')
    assert not result.info["valid"] and 'has no option "Platinum"' in result.observation


def test_every_env_builds_and_is_determined_by_its_json_payload(train):
    for task in train:
        make_env(task)
    for task in train[::25]:
        copy = Task(task.id, task.level, task.messages, json.loads(json.dumps(task.payload)))
        assert copy.payload == task.payload
        assert make_env(copy).reset() == make_env(task).reset()


def test_element_ids_are_unique_small_and_not_just_in_order(train):
    orderly = 0
    pages = [p for t in train for p in t.payload["site"]["pages"].values()]
    for p in pages:
        ids = [el["id"] for el in p["elements"] if el["role"] != "text"]
        assert len(set(ids)) == len(ids) and all(0 < i < 40 for i in ids)
        orderly += len(ids) > 2 and ids == list(range(1, len(ids) + 1))
    assert orderly < len(pages) / 100


# ---- parsing -------------------------------------------------------------------------

REJECTED = [
    ("", "the reply is empty"),
    ('Click "Save" [3]', "write the verb in lower case: click"),
    ("press [3]", "unknown verb 'press'"),
    ("[3]", "a reply starts with a verb"),
    ("click [3]", 'name the element by its quoted label before its id: click "label" [id]'),
    ('type [7] "Paris"', "name the element by its quoted label before its id"),
    ('click "Save" 3', "click needs the element's quoted label and its id in brackets"),
    ('click "Save" [x]', "click needs the element's quoted label and its id in brackets"),
    ("click Save [3]", "click needs the element's quoted label and its id in brackets"),
    ('type "City" [7] Paris', 'type needs a quoted text: type "label" [id] "text"'),
    ('type "City" [7] \u201cParis\u201d', "use straight double quotes"),
    ('select "Plan" [9]', 'select needs a quoted option: select "label" [id] "option"'),
    ("stop", 'stop needs a quoted answer: stop "answer"'),
    ('click "Save" [3] to save', "expected one action, found more text after it: 'to save'"),
    ('click "Save" [3]\nclick "Undo" [4]', "expected one action, found more text after it"),
    ('stop "30 days".', "expected one action, found more text after it: '.'"),
    ("back please", "expected one action"),
    ('click "Save"[3]', 'put one space between the parts: click "label" [id]'),
    ('type "City" [7]  "Paris"', 'put one space between the parts: type "label" [id] "text"'),
    ("backup", "unknown verb 'backup'"),
]
ACCEPTED = [
    ('click "Save" [3]', Action("click", 3, None, "Save")),
    (' type "City" [7] "Paris" \n', Action("type", 7, "Paris", "City")),
    ('type "City" [7] ""', Action("type", 7, "", "City")),
    ('select "Plan" [9] "Pro"', Action("select", 9, "Pro", "Plan")),
    ('click "" [3]', Action("click", 3, None, "")),
    ("back", Action("back")),
    ('stop "30 days"', Action("stop", None, "30 days")),
]


@pytest.mark.parametrize(("reply", "reason"), REJECTED)
def test_strict_parser_rejects_with_a_reason(reply, reason):
    assert reason in syntax_error(reply)
    with pytest.raises(page.ActionSyntaxError):
        parse_action(reply)


@pytest.mark.parametrize(("reply", "action"), ACCEPTED)
def test_strict_parser_accepts_exactly_one_action(reply, action):
    assert parse_action(reply) == action and syntax_error(reply) is None
    assert find_action(reply) == action
    assert parse_action(str(action)) == action


@pytest.mark.parametrize(
    ("reply", "action"),
    [
        ('Click [11] button "Profile" to open the profile.', Action("click", 11)),
        ('Click "Profile"  [11] to open the profile.', Action("click", 11, None, "Profile")),
        ("I will Type [ 7 ] \u201cParis\u201d now", Action("type", 7, "Paris")),
        ('I will type \u201cCity\u201d [7] "Paris"', Action("type", 7, "Paris", "City")),
        ('SELECT [9] "Pro" please', Action("select", 9, "Pro")),
        ("Back to the list", Action("back")),
        ("go back, then click [4]", Action("click", 4)),
        ('The answer: Stop "30" and then click [2]', Action("stop", None, "30")),
        ("type [7] Paris, then click [8]", Action("click", 8)),
        ("I would press the Save button.", None),
        ("", None),
    ],
)
def test_lenient_parse_finds_the_first_action_anywhere(reply, action):
    assert find_action(reply) == action


def test_docstring_examples():
    for module in (page, browser, web_rewards, after_errors):
        assert doctest.testmod(module).failed == 0, module.__name__


def test_after_errors_counts_each_reply_by_what_came_before_it(tmp_path):
    """A run folder's samples, played again: a wrong id then prose counts one well-formed
    first reply and one ill-formed reply after an invalid action; a golden episode's
    later replies all follow a valid action; steps fall in their blocks."""
    tasks = make_tasks("train", 40, 3)
    task = next(t for t in tasks if t.level == 4)
    golden = task.payload["solution"]
    cfg = {"recipe": {"train_size": 40, "params": {}}, "train": {"seed": 3}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    samples = [
        {"step": 3, "task": task.id, "completion": 'click "Nothing" [99]\nI am sorry.'},
        {"step": 12, "task": task.id, "completion": "\n".join(golden)},
    ]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    counts = after_errors.tabulate(tmp_path, block=10)
    first, valid, invalid = after_errors.CONTEXTS
    assert counts == {
        (0, 4): Counter({(first, True): 1, (invalid, False): 1}),
        (1, 4): Counter({(first, True): 1, (valid, True): len(golden) - 1}),
    }


# ---- generation ------------------------------------------------------------------------


def first_prompts(tasks: list[Task]) -> list[str]:
    return [t.messages[0]["content"] + "\n" + make_env(t).reset() for t in tasks]


def test_generation_is_deterministic_and_seeded():
    a, b = make_tasks("train", 120, 7), make_tasks("train", 120, 7)
    assert a == b and first_prompts(a) == first_prompts(b)
    c = make_tasks("train", 120, 8)
    assert {t.id for t in a}.isdisjoint(t.id for t in c)
    same = sum(x.payload == y.payload for x, y in zip(a, c))
    assert same < 5
    # Task k of a level depends on (split, seed, level, k) only, not on n or other levels.
    assert make_tasks("train", 30, 7) == a[:30]
    level3 = make_tasks("train", 10, 7, levels=[3])
    assert [t.payload for t in level3] == [t.payload for t in a if t.level == 3][:10]


def test_train_and_eval_never_share_a_task_a_prompt_or_a_site():
    train = make_tasks("train", 2000, 0)
    evals = make_tasks("eval", 240, 0)
    assert len({t.id for t in train}) == len(train)
    assert {t.id for t in train}.isdisjoint(t.id for t in evals)
    assert set(first_prompts(train)).isdisjoint(first_prompts(evals))
    sites = {site_fingerprint(t.payload["site"]) for t in train}
    assert sites.isdisjoint(site_fingerprint(t.payload["site"]) for t in evals)
    brands = {t.payload["site"]["brand"] for t in train}
    assert brands.isdisjoint(t.payload["site"]["brand"] for t in evals)
    keys = [(site_fingerprint(t.payload["site"]), t.payload["goal"]) for t in train]
    assert len(set(keys)) == len(keys)


def test_levels_and_families_are_balanced():
    evals = make_tasks("eval", 240, 0)
    assert Counter(t.level for t in evals) == dict.fromkeys(LEVELS, 40)
    for level, fams in LEVELS.items():
        counts = Counter(
            (t.payload["family"], t.payload["difficulty"]) for t in evals if t.level == level
        )
        assert set(counts) == set(fams) and max(counts.values()) - min(counts.values()) <= 1


def test_prompts_are_short_and_shared_within_a_level(train):
    for level in LEVELS:
        tasks = [t for t in train if t.level == level]
        assert {t.messages[0]["content"] for t in tasks} == {system_prompt(level)}
        assert len(system_prompt(level)) < 600  # ~150 tokens
        for t in tasks:
            assert len(make_env(t).reset()) < 700  # ~200 tokens
    assert "type " not in system_prompt(1) and "stop" not in system_prompt(1)
    assert 'stop "answer"' in system_prompt(2) and 'type "label" [id]' in system_prompt(3)


def test_worked_examples_show_well_formed_replies_for_the_family_s_actions(train):
    for task in train[:60]:
        demo = task.messages[1:]
        replies = [m["content"] for m in demo if m["role"] == "assistant"]
        assert replies and all(syntax_error(r) is None for r in replies)
        shown = {r.split()[0] for r in replies}
        assert shown == set(NEEDED[task.payload["family"], task.payload["difficulty"]]) - {"back"}
        for m in demo:
            if m["role"] == "user":  # in the environment's own words and layout
                assert "\nPage: Demo > " in m["content"] or m["content"].startswith("Page: ")
        for obs, reply in zip(demo[::2], demo[1::2]):  # each reply names an element shown
            ref = re.search(r'"[^"]*" \[\d+\]', reply["content"])
            page = obs["content"].split("\nPage: ", 1)[1]
            assert ref is None or f" {ref.group(0)}" in page, (task.id, reply["content"])
        if "back" in NEEDED[task.payload["family"], task.payload["difficulty"]]:
            # the goal is on another page: an example opens a link, then acts there
            opened = [i for i, m in enumerate(demo) if m["content"].startswith("Clicked link")]
            assert opened and demo[opened[-1] - 1]["content"].startswith('click "')
            assert demo[opened[-1] + 1]["content"] != demo[opened[-1] - 1]["content"]


def test_recipe_loads_and_scores_a_golden_episode_at_the_top():
    defaults = recipe_defaults("web_browsing")
    cfg = build_config(defaults)
    assert cfg.rollout.max_turns == 7 and cfg.grpo.num_generations == 8
    recipe = Recipe("web_browsing", cfg.recipe.weights, cfg.recipe.params)
    assert recipe.multi_turn
    weights = cfg.recipe.weights
    assert weights["success"] > sum(w for k, w in weights.items() if k != "success")
    for task in recipe.tasks("eval", 12, 0):
        env = recipe.make_env(task)
        messages = recipe.first_messages(task, env)
        roles = [m["role"] for m in messages]
        assert roles[0] == "system" and roles[1:] == ["user", "assistant"] * (
            len(roles) // 2 - 1
        ) + ["user"]
        results = [env.step(a) for a in task.payload["solution"]]
        episode = Episode(env, list(task.payload["solution"]), results, True)
        scored = recipe.score(task, episode)
        assert scored.error is None and scored.reward == pytest.approx(recipe.max_reward)
