"""Write a Python function from its signature and docstring; hidden tests decide.

Levels 1-5 (families.py): one-line arithmetic and string slicing; FizzBuzz of one number
and simple counting; FizzBuzz lists, Caesar shifts, running sums; balanced brackets,
run-length encoding, digit sums, primes; several bracket kinds, longest runs,
three-rule FizzBuzz, run-length decoding, sorting words.

A task is one family with its parameters (e.g. FizzBuzz with 3/'Foo' and 7/'Bar'). Its
split is a function of that key (a hash), so train and eval never share a task; its
hidden tests are drawn from the key alone, so a task is the same whatever the seed.
The completions run in the sandbox (mlx_grpo/sandbox.py), a step's completions in
parallel; see rewards/code.py for the reward components.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence

import rewards.code as code_reward
from mlx_grpo.config import ConfigError
from mlx_grpo.recipe import Task
from mlx_grpo.sandbox import ISOLATION, SandboxUnavailable
from recipes.code.families import LEVELS, Spec
from rewards.code import reward, reward_batch  # noqa: F401  (the recipe's reward)

EVAL_SHARE = 5  # one task key in 5 belongs to the eval split
INSTRUCTION = "Reply with the complete function in one ```python code block."

EXAMPLE = [
    {
        "role": "user",
        "content": "Write this Python function:\n\n```python\ndef double(x: int) -> int:\n"
        '    """Return x multiplied by 2.\n\n    >>> double(4)\n    8\n    """\n```\n\n'
        + INSTRUCTION,
    },
    {
        "role": "assistant",
        "content": "```python\ndef double(x: int) -> int:\n    return x * 2\n```",
    },
]


def split_of(key: str) -> str:
    h = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16)
    return "eval" if h % EVAL_SHARE == 0 else "train"


def _tests(spec: Spec, n: int) -> tuple[list, list]:
    """(two docstring examples, `n` hidden tests): distinct inputs drawn from the task
    key, the hidden ones chosen to cover as many different expected values as they can
    (both True and False, each FizzBuzz word...), so that a half-right program fails."""
    rng = random.Random(f"code-tests-{spec.key}")
    seen: set[str] = set()
    cases = []
    for _ in range(30 * (n + 2)):
        args = spec.inputs(rng)
        if repr(args) not in seen:
            seen.add(repr(args))
            cases.append({"args": args, "expected": spec.reference(*args)})
    examples, rest = cases[:2], cases[2:]
    hidden, kinds = [], set()
    for c in rest:  # one case per distinct expected value first, then the rest in order
        if spec.kind is not None:
            kind = spec.kind(*c["args"])
        elif isinstance(c["expected"], list):
            kind = len(c["expected"])
        else:
            kind = repr(c["expected"])
        if kind not in kinds and len(hidden) < n:
            kinds.add(kind)
            hidden.append(c)
    hidden += [c for c in rest if c not in hidden][: n - len(hidden)]
    return examples, hidden


def prompt(spec: Spec, examples: list) -> str:
    lines = [spec.signature, f'    """{spec.doc}', ""]
    for ex in examples:
        call = ", ".join(repr(a) for a in ex["args"])
        lines += [f"    >>> {spec.func}({call})", f"    {ex['expected']!r}"]
    lines.append('    """')
    body = "\n".join(lines)
    return f"Write this Python function:\n\n```python\n{body}\n```\n\n{INSTRUCTION}"


def make_tasks(
    split: str,
    n: int,
    seed: int,
    levels: Sequence[int] = (1, 2, 3, 4, 5),
    shots: int = 1,
    tests: int = 8,
    isolation: str = "strong",
) -> list[Task]:
    """`n` distinct tasks of `split`, cycling through `levels` and their families, from
    `seed`; `shots` (0 or 1) worked examples precede the task; `tests` hidden tests each.
    Stops early when the levels have no new tasks of this split left. `isolation` is the
    sandbox's level ("weak" must be asked for); the sandbox starts here, so a level this
    machine cannot give is refused, in one line, before anything runs."""
    if isolation not in ISOLATION:
        raise ValueError(f"isolation must be one of {ISOLATION}, got {isolation!r}")
    try:
        code_reward.use_isolation(isolation)
    except SandboxUnavailable as e:
        raise ConfigError(str(e)) from None
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if shots not in (0, 1):
        raise ValueError(f"shots must be 0 or 1, got {shots}")
    bad = [lv for lv in levels if lv not in LEVELS]
    if bad:
        raise ValueError(f"unknown levels {bad}; levels are {sorted(LEVELS)}")
    rng = random.Random(f"code-{seed}")
    active = [(lv, fam) for lv in levels for fam in LEVELS[lv]]
    by_level = {lv: [f for f in active if f[0] == lv] for lv in levels}
    misses = dict.fromkeys(active, 0)
    seen: set[str] = set()
    tasks: list[Task] = []
    turn = 0
    while len(tasks) < n and any(by_level.values()):
        open_levels = [lv for lv in levels if by_level[lv]]
        lv = open_levels[turn % len(open_levels)]
        fams = by_level[lv]
        lv, fam = fams[(turn // len(open_levels)) % len(fams)]
        turn += 1
        spec = fam(rng)
        if spec.key in seen or split_of(spec.key) != split:
            misses[(lv, fam)] += 1
            if misses[(lv, fam)] > 300:  # this family has no new tasks of this split left
                fams.remove((lv, fam))
            continue
        misses[(lv, fam)] = 0
        seen.add(spec.key)
        examples, hidden = _tests(spec, tests)
        tasks.append(
            Task(
                id=f"{split}-L{lv}-{spec.key}",
                level=lv,
                messages=EXAMPLE[: 2 * shots]
                + [{"role": "user", "content": prompt(spec, examples)}],
                payload={"func": spec.func, "tests": hidden, "family": fam.__name__},
            )
        )
    return tasks
