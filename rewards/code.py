"""Rewards for generated Python functions, judged by running hidden tests in the sandbox.

Components, each in [0, 1] (weights in the recipe's recipe.toml):

- `passes`: 1.0 when every hidden test returns the expected value.
- `partial`: the share of hidden tests passed beyond what the best constant answer
  would pass (chance-corrected, like Cohen's kappa, floored at 0): without the
  correction a policy learns `return True` for half the credit of a boolean task.
- `compiles`: the extracted code parses and defines the asked-for function.
- `format`: 1.0 for exactly one ```python block and nothing else, 0.5 for a fenced
  block with other text around it, 0 for bare code.

A program that breaks a sandbox rule or limit (time, memory, processes, output, files
outside its directory, network, exiting early: see mlx_grpo/sandbox.py) scores 0 on
every component, and its `failure` names the reason; the trainer counts reasons per
step as `fail/<reason>`. Ordinary failures (a syntax error, an exception in a test, a
wrong value) keep the components they earned and are named too.
"""

from __future__ import annotations

import ast
import os
import re

from mlx_grpo.sandbox import SANDBOX_REASONS, Job, Limits, Sandbox, same_value, warn_weak

# The info string's spaces are matched once (a language, or none): two adjacent
# `[ \t]*` would retry every split of a long run of spaces, quadratic in its length.
_FENCE = re.compile(r"```[ \t]*(?:([A-Za-z0-9_+-]+)[ \t]*)?\n(.*?)(?:```|\Z)", re.DOTALL)
_ONLY_FENCE = re.compile(r"\A\s*```[ \t]*(?:python|py|python3)?[ \t]*\n.*?\n```\s*\Z", re.DOTALL)
_CODE_START = re.compile(r"^(?:def |import |from |class |@)", re.MULTILINE)
# Parses tried when cutting bare code back to a prefix that parses: each cut jumps to
# the line before the reported error, so code followed by prose takes two; the bound
# keeps a completion built to fail one line at a time linear in its length.
MAX_CUTS = 16

_SANDBOX: Sandbox | None = None
_ISOLATION = "strong"


def sandbox() -> Sandbox:
    """The process-wide sandbox (workers = CPU cores, default limits, the isolation
    chosen with `use_isolation`); set MLX_GRPO_SANDBOX_WORKERS to change the pool size."""
    global _SANDBOX
    if _SANDBOX is None:
        workers = int(os.environ.get("MLX_GRPO_SANDBOX_WORKERS", "0")) or None
        _SANDBOX = Sandbox(Limits(), workers=workers, isolation=_ISOLATION)
    return _SANDBOX


def use_isolation(level: str) -> None:
    """Run programs at isolation `level` ("strong" or "weak", mlx_grpo/sandbox.py) and
    start the sandbox now, so that a level this machine cannot give is refused before
    training starts (SandboxUnavailable, one line)."""
    global _SANDBOX, _ISOLATION
    if _SANDBOX is not None and _SANDBOX.isolation != level:
        _SANDBOX.close()
        _SANDBOX = None
    _ISOLATION = level
    if sandbox().isolation == "weak":
        warn_weak()


def extract_code(text: str, func: str | None = None) -> str:
    """The program in a completion: the first fenced block that defines `func` (else the
    first fenced block; an unclosed fence runs to the end), or else bare code from the
    first `def`/`import` line on, cut back at its syntax errors to a prefix that parses.

    >>> extract_code("Here:\\n```python\\ndef f():\\n    return 1\\n```\\nDone.")
    'def f():\\n    return 1\\n'
    >>> extract_code("Sure! def is a keyword.\\ndef f(x):\\n    return x\\nThis returns x.")
    'def f(x):\\n    return x'
    """
    blocks = [body for _, body in _FENCE.findall(text)]
    if blocks:
        if func:
            # `[ \t]*`, not `\s*`: from each line start `\s*` would run over every blank
            # line below it, quadratic in a block of blank lines.
            defined = re.compile(rf"^[ \t]*def[ \t]+{re.escape(func)}[ \t]*\(", re.MULTILINE)
            for body in blocks:
                if defined.search(body):
                    return body
        return blocks[0]
    m = _CODE_START.search(text)
    if not m:
        return ""
    return _parsing_prefix(text[m.start() :].splitlines())


def _parsing_prefix(lines: list[str]) -> str:
    """The longest run of `lines` from the first that parses, found by cutting at the
    line before each syntax error (at most MAX_CUTS parses); all of them when none is
    found. Linear in the length: a line-by-line search was quadratic (8,000 lines of
    prose after a function took seconds).

    >>> _parsing_prefix(["def f(x):", "    return x", "That's all.", "Bye"])
    'def f(x):\\n    return x'
    """
    end = len(lines)
    for _ in range(MAX_CUTS):
        if end <= 0:
            break
        candidate = "\n".join(lines[:end])
        try:
            ast.parse(candidate)
            return candidate
        except SyntaxError as e:
            at = e.lineno or end  # None: no line to blame (a null byte)
        except (ValueError, MemoryError, RecursionError):
            at = end
        # Lines from the error on cannot be in a prefix that parses, with the exception
        # of errors found only at the end ("never closed", a missing block), which
        # blame the last line or the opening one: cut at least one line.
        end = min(end - 1, at - 1)
    return "\n".join(lines)


def _parses(code: str) -> bool:
    try:
        ast.parse(code)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return False
    return True


def defines(code: str, func: str) -> bool:
    """Whether `code` parses and defines `func` at top level.

    >>> defines("def f(x):\\n    return x", "f"), defines("def g(): pass", "f")
    (True, False)
    """
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return False
    return any(isinstance(n, ast.FunctionDef) and n.name == func for n in tree.body)


def code_format(text: str) -> float:
    """1.0 for one ```python block alone, 0.5 for a fence with text around it, else 0.

    >>> [code_format(t) for t in ("```python\\nx = 1\\n```", "See:\\n```\\nx = 1\\n```", "x = 1")]
    [1.0, 0.5, 0.0]
    """
    if _ONLY_FENCE.match(text) and text.count("```") == 2:
        return 1.0
    return 0.5 if "```" in text else 0.0


def _components(task, text: str, outcome) -> dict:
    tests = task.payload["tests"]
    func = task.payload["func"]
    code = extract_code(text, func)
    comps = {"passes": 0.0, "partial": 0.0, "compiles": 0.0, "format": code_format(text)}
    if outcome is None:  # nothing to run
        return {**comps, "failure": "no_code" if not code.strip() else "syntax"}
    if outcome.reason in SANDBOX_REASONS:
        return {k: 0.0 for k in comps} | {"failure": outcome.reason}
    comps["compiles"] = float(defines(code, func))
    passed = sum(same_value(v, t["expected"]) for v, t in zip(outcome.values, tests))
    comps["partial"] = chance_corrected(passed, [t["expected"] for t in tests])
    comps["passes"] = float(passed == len(tests))
    if passed < len(tests):
        comps["failure"] = outcome.reason or (
            "runtime_error" if None in outcome.values else "wrong_answer"
        )
    return comps


def chance_corrected(passed: int, expected: list) -> float:
    """(share passed - share a constant answer passes) / (1 - the latter), floored at 0.

    >>> chance_corrected(4, [True, False, True, False]), chance_corrected(2, [True, False, True, False])
    (1.0, 0.0)
    >>> chance_corrected(2, [1, 2, 3, 4])  # a constant passes 1 in 4
    0.3333333333333333
    """
    n = len(expected)
    reprs = [repr(e) for e in expected]
    best_constant = max(reprs.count(r) for r in set(reprs)) / n
    if best_constant >= 1.0:
        return float(passed == n)
    return max(0.0, (passed / n - best_constant) / (1.0 - best_constant))


def _job(task, text: str) -> Job | None:
    code = extract_code(text, task.payload["func"])
    if not code.strip() or not _parses(code):
        return None
    return Job(code, task.payload["func"], [t["args"] for t in task.payload["tests"]])


def reward_batch(
    tasks: list, groups: list[list[str]], deadline: float | None = None
) -> list[list[dict]]:
    """Components for every completion of every group, the programs run in parallel.
    With `deadline` (time.monotonic(), from recipe.reward_timeout_s) the batch returns
    by then: each program gets its share of the time (Sandbox.run), so a program that
    hangs fails as `timeout` alone and the others score as they would alone."""
    flat = [(task, text) for task, group in zip(tasks, groups) for text in group]
    jobs = [_job(task, text) for task, text in flat]
    runnable = [j for j in jobs if j is not None]
    outcomes = iter(sandbox().run(runnable, deadline))
    results = [
        _components(t, x, next(outcomes) if j is not None else None)
        for (t, x), j in zip(flat, jobs)
    ]
    out, i = [], 0
    for group in groups:
        out.append(results[i : i + len(group)])
        i += len(group)
    return out


def reward(task, completion: str) -> dict:
    """Components for one completion (runs one sandboxed process)."""
    return reward_batch([task], [[completion]])[0][0]
