"""A reward's time belongs to each completion: programs that hang cost their own scores
(fail/timeout) and no one else's, in their step and the next; a batch reward that must
time out as a whole says so in one warning naming the recipe."""

from __future__ import annotations

import sys
import time

import pytest
from conftest import recipe_folder

import mlx_grpo.sandbox as sandbox_module
import rewards.code as code_reward
from mlx_grpo.recipe import Recipe, Task, recipe_defaults
from mlx_grpo.sandbox import Job, Limits, Sandbox, Shares

# The program: each copy hangs for its whole wall clock.
HANG = "import time\ndef f(x):\n    time.sleep(60)\n    return 2 * x"
HONEST = [  # right, half right, right but not fenced alone: three different scores
    "```python\ndef f(x):\n    return 2 * x\n```",
    "```python\ndef f(x):\n    return x + 3\n```",
    "Here:\n```python\ndef f(x):\n    return x * 2\n```\nDone.",
]
# A wall clock of 1.5 s: 13 hanging programs on 2 slots hold them ~10 s, twice the
# step's budget below, as 13 copies of 10 s outlast 120 s on one slot.
LIMITS = Limits(wall_s=1.5, cpu_s=1, memory_bytes=256 * 2**20)
BUDGET_S = 5.0
STRONG_OR_WEAK = (
    "strong" if sys.platform.startswith("linux") and sandbox_module._bwrap() else "weak"
)


@pytest.fixture
def recipe(monkeypatch):
    sb = Sandbox(LIMITS, workers=2, isolation=STRONG_OR_WEAK)
    monkeypatch.setattr(code_reward, "_SANDBOX", sb)
    yield Recipe(
        "code", recipe_defaults("code")["recipe"]["weights"], {}, reward_timeout_s=BUDGET_S
    )
    sb.close()


def _task() -> Task:
    tests = [{"args": [3], "expected": 6}, {"args": [4], "expected": 8}]
    return Task(id="t", level=1, messages=[], payload={"func": "f", "tests": tests})


def test_programs_that_hang_cost_only_their_own_scores(recipe):
    task = _task()
    alone = recipe.score_groups([task], [HONEST])[0]
    assert [s.reward for s in alone] == pytest.approx([1.7, 0.1 + 0.1, 1.65])
    tic = time.monotonic()
    step = recipe.score_groups([task], [[HANG] * 13 + HONEST])[0]
    took = time.monotonic() - tic
    assert step[13:] == alone  # rewards, components, failures: as they score alone
    hung = step[:13]
    assert [s.failure for s in hung] == ["timeout"] * 13, [s.error for s in hung]
    assert all(s.reward == 0.0 and s.error is None for s in hung)  # the sandbox's timeout
    assert took < BUDGET_S


def test_the_next_step_scores_as_if_nothing_hung(recipe):
    task = _task()
    alone = recipe.score_groups([task], [HONEST])[0]
    recipe.score_groups([task], [[HANG] * 13 + HONEST])
    # At once: no slot, process or thread of the step before is still held.
    assert recipe.score_groups([task], [HONEST])[0] == alone
    assert recipe.score_groups([task], [[HANG] + HONEST])[0][1:] == alone


def test_shares_promise_each_job_its_part_of_the_time_left():
    assert Shares(4, 1, 10.0, None).take() == 10.0  # no deadline: the wall clock
    now = time.monotonic()
    one = Shares(4, 1, 10.0, now + 8.0)
    assert one.take() == pytest.approx(2.0, abs=0.05)  # 8 s among 4 jobs on 1 slot
    one.done()  # finished at once: the rest share what it left
    assert one.take() == pytest.approx(8.0 / 3, abs=0.05)
    two = Shares(3, 2, 10.0, time.monotonic() + 6.0)
    assert two.take() == pytest.approx(4.0, abs=0.05)  # 12 slot-seconds among 3
    assert _in_thread(two.take) == pytest.approx(4.0, abs=0.05)  # (12 - 4 held) / 2
    two.done()
    # 12 less the 4 the other job may still use, all to the last job, but never past
    # the deadline.
    assert two.take() == pytest.approx(6.0, abs=0.05)
    assert Shares(2, 2, 1.5, time.monotonic() + 60).take() == 1.5  # at most the wall clock
    late = Shares(2, 1, 10.0, time.monotonic() - 1)
    assert late.take() is None  # past the deadline: not started


def _in_thread(fn):
    import threading

    box = []
    t = threading.Thread(target=lambda: box.append(fn()))
    t.start()
    t.join()
    return box[0]


def test_a_job_waits_for_a_slot_another_run_holds(monkeypatch):
    """A run its caller gave up on still holds slots: the next run waits for them (it
    failed with IndexError: pop from empty list), and never past its deadline."""
    with Sandbox(LIMITS, workers=1, isolation=STRONG_OR_WEAK) as sb:
        sb._slots.clear()  # held by a run elsewhere
        out = sb.run([Job("def f():\n    return 1", "f", [[]])], time.monotonic() + 0.3)
        assert out[0].reason == "timeout" and "slot" in out[0].detail
        sb._slots.append(0)
        assert sb.run([Job("def f():\n    return 1", "f", [[]])])[0].values == ["1"]


SLOW = (
    "import time\n"
    "from mlx_grpo.recipe import Task\n"
    "def make_tasks(split, n, seed):\n"
    "    return [Task(id=str(i), level=1, messages=[]) for i in range(n)]\n"
    "def reward(task, completion):\n"
    "    return {'r': 1.0}\n"
    "def reward_batch(tasks, groups):  # preferred to reward: one call per step\n"
    "    time.sleep(3)\n"
    "    return [[{'r': 1.0} for _ in g] for g in groups]\n"
)
SLOW_TRL = "import time\ndef slow(completions, **kwargs):\n    time.sleep(3)\n    return [1.0] * len(completions)\n"


def test_a_batch_reward_that_times_out_as_a_whole_says_so_once(tmp_path, capsys):
    folder = recipe_folder(tmp_path, "slowbatch", SLOW, **{"trl.py": SLOW_TRL})
    recipe = Recipe(
        str(folder), {"r": 1.0, "slow": 1.0}, {}, {"slow": "trl.py:slow"}, reward_timeout_s=0.3
    )
    tasks = recipe.tasks("train", 2, 0)
    scored = recipe.score_groups(tasks, [["a", "b"], ["c", "d"]])
    assert all(s.failure == "timeout" and s.reward == 0.0 for g in scored for s in g)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2, lines  # one per batch reward, not one per completion
    assert all(f"recipe {folder}" in line and "4 completions" in line for line in lines)
    assert "reward_batch" in lines[0] and "slow" in lines[1]
