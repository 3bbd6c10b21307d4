"""The UED curriculum on synthetic reward streams: it replays the tasks whose groups
disagree, follows PLR's staleness rule, steers new tasks to learnable levels, opens
levels as they are mastered, and resumes exactly."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from mlx_grpo.config import CurriculumConfig
from mlx_grpo.curriculum import LearnabilityCurriculum, UniformCurriculum, make_curriculum
from mlx_grpo.recipe import Task


def _tasks(per_level: int = 30, levels=(1, 2, 3)) -> list[Task]:
    return [
        Task(f"L{lv}-{i}", lv, [{"role": "user", "content": "x"}])
        for lv in levels
        for i in range(per_level)
    ]


def _kind(task: Task) -> str:
    """Synthetic ground truth: a task always fails, always succeeds, or is a coin flip."""
    return ("zero", "one", "mixed")[int(task.id.rsplit("-", 1)[1]) % 3]


def _group(task: Task, rng: np.random.Generator, g: int = 8) -> list[float]:
    kind = _kind(task)
    if kind == "zero":
        return [0.0] * g
    if kind == "one":
        return [1.0] * g
    return rng.integers(0, 2, g).astype(float).tolist()


def _run(cur, steps: int, b: int = 4, seed: int = 0, rewards=_group) -> list[list[Task]]:
    rng = np.random.default_rng(seed)
    drawn = []
    for _ in range(steps):
        tasks = cur.sample(b)
        drawn.append(tasks)
        cur.update(tasks, [rewards(t, rng) for t in tasks])
    return drawn


def test_replays_mixed_reward_tasks_and_retires_mastered_ones():
    cfg = CurriculumConfig(start_levels=3, buffer_size=20, staleness=0.1)
    cur = LearnabilityCurriculum(_tasks(), cfg, seed=0)
    rng, replayed = np.random.default_rng(0), Counter()
    for _ in range(150):
        tasks = cur.sample(4)
        replayed.update(_kind(t) for t in tasks if t.id in cur.replayed)
        cur.update(tasks, [_group(t, rng) for t in tasks])
    # Scores: variance of the group, smoothed; zero for the all-0 tasks.
    for tid, (score, *_rest) in cur.buffer.items():
        assert (score > 0) == (_kind(cur.by_id[tid]) == "mixed") or score < 0.05
    # All-1 tasks leave the buffer for good; mixed ones fill it.
    retired = Counter(_kind(cur.by_id[t]) for t in cur.retired)
    assert retired["one"] >= 0.9 * len(cur.retired) and not retired["zero"] and cur.retired
    kinds = Counter(_kind(cur.by_id[t]) for t in cur.buffer)
    assert kinds["mixed"] >= 0.8 * len(cur.buffer)
    # Replayed picks are mostly mixed-reward tasks; about half the batch is replayed.
    assert replayed["mixed"] > 4 * (replayed["zero"] + replayed["one"])
    assert 0.3 < sum(replayed.values()) / (150 * 4) < 0.7  # replay_prob 0.5


def test_uniform_does_not_prefer_mixed_tasks():
    drawn = _run(UniformCurriculum(_tasks(), seed=0), 150)
    kinds = Counter(_kind(t) for batch in drawn for t in batch)
    assert max(kinds.values()) < 1.3 * min(kinds.values())


@pytest.mark.parametrize("strategy", ["uniform", "filter"])
def test_an_epoch_that_ends_mid_step_repeats_no_task_in_the_step(strategy):
    """5 tasks, 4 a step: each step's epoch runs out partway; the next one hands this
    step's tasks out last. Every task still comes once an epoch."""
    tasks = _tasks(per_level=5, levels=(1,))
    cur = make_curriculum(CurriculumConfig(strategy=strategy), tasks, seed=0)
    drawn = [t.id for _ in range(25) for t in cur.sample(4)]  # (filter: the trainer asks
    # for batch x oversample at once)
    steps = [drawn[i : i + 4] for i in range(0, len(drawn), 4)]
    assert all(len(set(step)) == 4 for step in steps), steps
    assert Counter(drawn) == dict.fromkeys((t.id for t in tasks), 20)


def test_the_waves_of_one_step_share_its_replays_and_its_staleness():
    """A step that rolls out several waves (`curriculum.max_waves`) calls sample() once
    per wave before it updates: no task comes twice in the step (the greediest replay
    would otherwise draw its top task in every wave), the replayed ones are told apart
    in update(), and staleness counts steps, not waves."""
    cfg = CurriculumConfig(start_levels=3, buffer_size=50, rank_temperature=0.05)
    cur = LearnabilityCurriculum(_tasks(), cfg, seed=0)
    rng = np.random.default_rng(0)
    _run(cur, 10)  # a buffer of scored mixed tasks
    top = max(cur.buffer, key=lambda t: cur.buffer[t][0])
    for step in range(11, 31):
        waves = [cur.sample(4) for _ in range(3)]
        ids = [t.id for wave in waves for t in wave]
        assert len(set(ids)) == len(ids), step
        assert cur.step == step
        assert [t.id for t in cur.last] == ids
        assert cur.replayed <= set(ids) and cur.replayed <= set(cur.buffer)
        tasks = [t for wave in waves for t in wave]
        cur.update(tasks, [_group(t, rng) for t in tasks])
        assert all(cur.buffer[t][1] == step for t in ids if t in cur.buffer)
    assert top  # the buffer had a top task to repeat
    metrics = cur.metrics()
    assert metrics["curriculum/replay_frac"] == len(cur.replayed) / 12


def test_replay_probability_follows_rank_and_staleness():
    cfg = CurriculumConfig(rank_temperature=1.0)
    cur = LearnabilityCurriculum(_tasks(), cfg, seed=0)
    cur.step = 10
    # id -> [score, last step seen, visits, mean reward]
    cur.buffer = {"L1-0": [0.25, 9, 1, 0.5], "L1-1": [0.10, 5, 1, 0.5], "L1-2": [0.0, 0, 1, 0]}
    ids = list(cur.buffer)
    rank = np.array([1.0, 1 / 2, 1 / 3]) / (1 + 1 / 2 + 1 / 3)
    age = np.array([1.0, 5.0, 10.0]) / 16.0
    for rho in (0.0, 0.3, 1.0):
        cur.cfg = cfg.model_copy(update={"staleness": rho})
        np.testing.assert_allclose(cur.replay_probs(ids), (1 - rho) * rank + rho * age)
    # Sharper temperature: the top score dominates.
    cur.cfg = cfg.model_copy(update={"staleness": 0.0, "rank_temperature": 0.1})
    assert cur.replay_probs(ids)[0] > 0.99


def test_a_stale_task_comes_back():
    cfg = CurriculumConfig(staleness=1.0, replay_prob=0.0, buffer_size=8, start_levels=3)
    cur = LearnabilityCurriculum(_tasks(), cfg, seed=1)
    _run(cur, 4, b=4)  # 16 new tasks scored, the buffer holds 8 (minus retired ones)
    assert 0 < len(cur.buffer) <= 8
    cur.cfg = cfg.model_copy(update={"replay_prob": 1.0})
    last_seen = {t: e[1] for t, e in cur.buffer.items()}
    oldest = min(last_seen, key=last_seen.get)
    picks = Counter(t.id for batch in _run(cur, 40, b=1, seed=2) for t in batch)
    assert picks[oldest] > 0


def test_level_bandit_and_window():
    # Level 1: always solved; level 2: coin flips; level 3: never solved.
    def by_level(task, rng):
        return {1: [1.0] * 8, 2: rng.integers(0, 2, 8).astype(float).tolist(), 3: [0.0] * 8}[
            task.level
        ]

    cfg = CurriculumConfig(start_levels=3, window=3, replay_prob=0.0)
    cur = LearnabilityCurriculum(_tasks(per_level=200), cfg, seed=0)
    drawn = _run(cur, 60, rewards=by_level)
    probs = cur.level_probs()
    assert probs[2] > 0.8 and probs[2] > probs[1] and probs[2] > probs[3]
    late = Counter(t.level for batch in drawn[30:] for t in batch)
    assert late[2] > 2 * (late[1] + late[3])

    # With exploration every open level keeps its floor; the bandit still leads.
    cur = LearnabilityCurriculum(
        _tasks(per_level=200), cfg.model_copy(update={"level_explore": 0.6}), seed=0
    )
    drawn = _run(cur, 60, rewards=by_level)
    probs = cur.level_probs()
    assert min(probs.values()) >= 0.6 / 3 - 1e-9 and probs[2] == max(probs.values())
    assert abs(sum(probs.values()) - 1) < 1e-9
    late = Counter(t.level for batch in drawn[30:] for t in batch)
    assert late[3] > 0.1 * sum(late.values()) > 0  # never solved, still a fifth of draws

    # The window opens level by level as the top level is mastered.
    cfg = CurriculumConfig(start_levels=1, window=2, unlock_at=0.6, replay_prob=0.0)
    cur = LearnabilityCurriculum(_tasks(per_level=100, levels=(1, 2, 3, 4)), cfg, seed=0)
    assert cur.open_levels() == [1]
    _run(cur, 10, rewards=lambda t, rng: [1.0] * 8 if t.level <= 2 else [0.0] * 8)
    assert cur.open_levels() == [2, 3]  # 1 and 2 mastered, 3 is not; window of 2
    assert {t.level for t in cur.sample(8)} <= {2, 3}


def test_state_round_trip_continues_exactly():
    cfg = CurriculumConfig(start_levels=2)
    a = LearnabilityCurriculum(_tasks(), cfg, seed=5)
    _run(a, 20)
    state = json.loads(json.dumps(a.state_dict()))  # what a checkpoint stores
    b = LearnabilityCurriculum(_tasks(), cfg, seed=999)
    b.load_state_dict(state)
    ids_a = [[t.id for t in batch] for batch in _run(a, 20, seed=7)]
    ids_b = [[t.id for t in batch] for batch in _run(b, 20, seed=7)]
    assert ids_a == ids_b
    assert a.metrics() == b.metrics()
    with pytest.raises(ValueError, match="train tasks"):
        LearnabilityCurriculum(_tasks(per_level=10), cfg, seed=0).load_state_dict(state)


@pytest.mark.parametrize("strategy", ["uniform", "filter", "learnability"])
def test_every_strategy_reports_its_figures(strategy):
    cur = make_curriculum(CurriculumConfig(strategy=strategy, start_levels=3), _tasks(), 0)
    _run(cur, 3)
    m = cur.metrics()
    for key in ("curriculum/replay_frac", "curriculum/score_mean", "curriculum/max_level"):
        assert key in m
    assert abs(sum(v for k, v in m.items() if k.startswith("curriculum/level_")) - 1) < 1e-9
    assert cur.oversample == (2.0 if strategy == "filter" else 1.0)


def test_tasks_that_gave_no_gradient_are_not_replayed():
    """When every group so far had equal rewards, the batch is all new tasks."""
    cfg = CurriculumConfig(start_levels=3, replay_prob=1.0)
    cur = LearnabilityCurriculum(_tasks(), cfg, seed=0)
    zeros = _run(cur, 5, rewards=lambda t, rng: [0.0] * 8)
    assert len(cur.buffer) == 20 and not cur.replayed
    assert len({t.id for batch in zeros for t in batch}) == 20  # nothing drawn twice
    tasks = cur.sample(4)  # one learnable group: from now on it is replayed
    cur.update(tasks, [[0.0, 1.0] * 4] + [[0.0] * 8] * 3)
    again = cur.sample(4)
    assert again[0].id == tasks[0].id and cur.replayed == {tasks[0].id}
    # The replayed task comes back all-equal, one of the three new ones mixed: the log
    # tells the two sources of groups without signal apart.
    cur.update(again, [[1.0] * 8, [0.0, 1.0] * 4, [0.0] * 8, [0.5] * 8])
    m = cur.metrics()
    assert m["curriculum/replay_zero_variance_frac"] == 1.0
    assert m["curriculum/new_zero_variance_frac"] == pytest.approx(2 / 3)


def test_the_in_training_eval_covers_every_level_alike():
    """spread: a split that cycles through 15 levels, cut to 30 tasks, holds each level
    twice (every 10th task would have held three levels only)."""
    from collections import Counter

    from mlx_grpo.cli import spread
    from mlx_grpo.recipe import Task

    tasks = [Task(id=str(i), level=1 + i % 15, messages=[]) for i in range(300)]
    picked = spread(tasks, 30)
    assert Counter(t.level for t in picked) == {lv: 2 for lv in range(1, 16)}
    assert [t.id for t in picked[:15]] == [str(i) for i in range(15)]
    assert spread(tasks[:20], 30) == tasks[:20]
