"""The code recipe: tasks, splits, extraction, hand-written solutions, and a training
run that keeps going while the sandbox stops hostile programs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import rewards.code as code_reward
from mlx_grpo.cli import cmd_train
from mlx_grpo.config import build_config
from mlx_grpo.recipe import Recipe, recipe_defaults
from mlx_grpo.sandbox import Limits, Sandbox, same_value
from recipes.code import families

HOSTILE = Path(__file__).parent / "data" / "hostile_code"


@pytest.fixture
def recipe():
    return Recipe.from_config(build_config(recipe_defaults("code")).recipe)


@pytest.fixture
def fast_sandbox(monkeypatch):
    # CPU time bounds these programs (none sleeps); the wall clock is only a backstop, far
    # enough out that a busy machine does not turn a CPU hog into a timeout.
    sb = Sandbox(Limits(wall_s=30.0, cpu_s=1, memory_bytes=256 * 2**20), workers=2)
    monkeypatch.setattr(code_reward, "_SANDBOX", sb)


def test_tasks_are_deterministic_and_splits_disjoint(recipe):
    a = recipe.tasks("train", 300, 0)
    assert [t.id for t in a] == [t.id for t in recipe.tasks("train", 300, 0)]
    ev = recipe.tasks("eval", 100, 0)
    other_seed = recipe.tasks("eval", 100, 1)
    keys = lambda ts: {t.id.split("-", 2)[2] for t in ts}  # noqa: E731
    assert not keys(a) & keys(ev) and not keys(a) & keys(other_seed)
    assert {t.level for t in ev} == {1, 2, 3, 4, 5}
    assert len({t.id for t in a}) == len(a)
    # Hidden tests are not shown in the prompt.
    t = a[3]
    prompt = t.messages[-1]["content"]
    assert f"def {t.payload['func']}(" in prompt
    assert all(
        repr(c["args"][0]) not in prompt for c in t.payload["tests"] if len(repr(c["args"][0])) > 4
    )


# Hand-written solutions, independent of the families' reference code.
SOLUTIONS = {
    "balanced_multi": """
def balanced(s):
    pairs = {')': '(', ']': '[', '}': '{', '>': '<'}
    stack = []
    for ch in s:
        if ch in '([{<':
            stack.append(ch)
        elif ch in pairs:
            if not stack or stack.pop() != pairs[ch]:
                return False
    return not stack
""",
    "caesar": """
def {func}(s):
    k = {k}
    return ''.join(chr((ord(c) - 97 + k) % 26 + 97) if c.islower() else c for c in s)
""",
    "fizzbuzz_one": """
def {func}(n):
    a, b, w1, w2 = {a}, {b}, {w1!r}, {w2!r}
    if n % a == 0 and n % b == 0:
        return w1 + w2
    if n % a == 0:
        return w1
    if n % b == 0:
        return w2
    return str(n)
""",
}


def _solution(task) -> str:
    fam = task.payload["family"]
    key = task.id.split("-", 2)[2]
    params = key[key.index("(") + 1 : -1].split(",")
    if fam == "caesar":
        return SOLUTIONS[fam].format(func=task.payload["func"], k=int(params[0]))
    if fam == "fizzbuzz_one":
        a, b, w1, w2 = params
        return SOLUTIONS[fam].format(func=task.payload["func"], a=a, b=b, w1=w1, w2=w2)
    return SOLUTIONS[fam]


def test_hand_written_solutions_pass_and_wrong_ones_do_not(recipe, fast_sandbox):
    tasks = [t for t in recipe.tasks("train", 400, 0) if t.payload["family"] in SOLUTIONS][:9]
    assert {t.payload["family"] for t in tasks} == set(SOLUTIONS)
    good = [[f"```python{_solution(t)}```"] for t in tasks]
    mutate = {"balanced_multi": ("return not stack", "return True"), "caesar": ("+ k", "- k"),
              "fizzbuzz_one": ("return str(n)", "return n")}  # fmt: skip
    bad = [[f"```python{_solution(t).replace(*mutate[t.payload['family']])}```"] for t in tasks]
    for [s] in recipe.score_groups(tasks, good):
        assert s.components["passes"] == 1.0 and s.failure is None, s
        assert s.reward == pytest.approx(1.7)
    for [s] in recipe.score_groups(tasks, bad):
        assert s.components["passes"] == 0.0 and s.failure in ("wrong_answer", "runtime_error")


def test_counting_brackets_fails_every_bracket_task():
    """The shortcut a small model writes most, 'as many closes as opens' (per kind),
    fails a hidden test of every bracket task: each holds a misordered string, ")(" or
    "([)]", whose counts are equal (checked here against a stack-free count)."""
    import random

    from recipes.code.tasks import _tests

    for fam in (families.balanced, families.balanced_multi):
        for i in range(40):
            spec = fam(random.Random(i))
            pairs = spec.key[spec.key.index("(") + 1 : spec.key.index(",")]
            _, hidden = _tests(spec, 8)

            def counts(s, pairs=pairs):
                return all(s.count(o) == s.count(c) for o, c in zip(pairs[::2], pairs[1::2]))

            wrong = [c for c in hidden if counts(c["args"][0]) != c["expected"]]
            assert wrong and all(counts(c["args"][0]) for c in wrong), spec.key


def test_every_family_reference_handles_its_inputs():
    """Inputs and expected values cross JSON (to the sandboxed process, into task files)
    unchanged, and the reference's own return value scores as right against them."""
    import random

    n = 0
    for fams in families.LEVELS.values():
        for fam in fams:
            for i in range(20):
                spec = fam(random.Random(i))
                rng = random.Random(i)
                for _ in range(5):
                    args = spec.inputs(rng)
                    sent = json.loads(json.dumps(args))
                    assert sent == args and _types(sent) == _types(args), (spec.key, args)
                    value = spec.reference(*args)
                    expected = json.loads(json.dumps(value))
                    assert expected == value and _types(expected) == _types(value), spec.key
                    assert spec.reference(*sent) == value, spec.key
                    assert same_value(repr(value), expected), (spec.key, value)
                    assert not same_value(repr([value]), expected), spec.key
                    n += 1
    assert n == 5 * 20 * sum(len(f) for f in families.LEVELS.values())


def _types(x):
    """The structure of a value's types (JSON turns tuples into lists, keys into str)."""
    if isinstance(x, (list, tuple)):
        return (type(x), [_types(v) for v in x])
    if isinstance(x, dict):
        return (dict, {k: _types(v) for k, v in x.items()}, [type(k) for k in x])
    return type(x)


def test_extraction_and_format():
    text = "Sure:\n```python\ndef g():\n    pass\n```\nand\n```python\ndef f(x):\n    return x\n```"
    assert code_reward.extract_code(text, "f") == "def f(x):\n    return x\n"
    assert code_reward.extract_code("```python\ndef f(x):\n    return x", "f").startswith("def f")
    assert code_reward.code_format(text) == 0.5
    assert code_reward.extract_code("no code here") == ""


SHAPES = {  # completion shapes that cost seconds at 8,000 lines when extraction was quadratic
    "prose after code": lambda n: "def f(x):\n    return x\n" + "That's all, it returns x.\n" * n,
    "indented prose": lambda n: "def f(x):\n    return x\n" + "  so it works\n" * n,
    "brackets never closed": lambda n: "def f(x):\n    return x\n" + "(\n" * n,
    "blank lines in a fence": lambda n: "```python\n" + "  \n" * (4 * n) + "```",
    "spaces after a fence": lambda n: "```" + " " * (10 * n) + "x",
}


@pytest.mark.parametrize("shape", SHAPES)
def test_extraction_is_linear_in_the_completion(shape, monkeypatch):
    """Bare code is cut back at its syntax errors, parsing a bounded number of times
    (a line at a time, 8,000 lines of prose took seconds), and the fence patterns do not
    backtrack over runs of blanks; the code after the cut is still found."""
    import ast

    parsed = []
    real = ast.parse
    monkeypatch.setattr(
        ast, "parse", lambda src, *a, **k: parsed.append(len(src)) or real(src, *a, **k)
    )
    text = SHAPES[shape](8000)
    code = code_reward.extract_code(text, "f")
    assert sum(parsed) <= (code_reward.MAX_CUTS + 1) * len(text)
    if shape in ("prose after code", "indented prose"):
        assert code == "def f(x):\n    return x" and len(parsed) == 2


@pytest.mark.skipif(
    sys.platform == "darwin",
    reason="macOS does not enforce RLIMIT_AS: no memory bound in the sandbox there, so the 10 GB program is not failed as `memory`",
)
def test_training_continues_through_hostile_programs(tiny_model_dir, tmp_path, fast_sandbox):
    args = ["--recipe", str(HOSTILE), f"--model.path={tiny_model_dir}", f"--output.dir={tmp_path}",
            "--output.run=h"]  # fmt: skip
    assert cmd_train(args) == 0
    rows = [json.loads(x) for x in (tmp_path / "h" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    samples = [json.loads(x) for x in (tmp_path / "h" / "samples.jsonl").read_text().splitlines()]
    # 8 completions a step, programs in turn: one of each per step.
    for r in rows:
        seen = [s.get("failure") for s in samples if s["step"] == r["step"]]  # (to read)
        for reason in ("cpu_time", "process", "memory", "exited", "forbidden_file", "network",
                       "output_limit"):  # fmt: skip
            assert r[f"fail/{reason}"] == 1, (reason, r["step"], seen)
        assert r["reward/passes"] == pytest.approx(1 / 8)
        assert r["reward/errors"] == 0
    assert {s.get("failure") for s in samples} >= {"cpu_time", "process", None}
