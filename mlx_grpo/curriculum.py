"""Task selection (unsupervised environment design).

Every curriculum samples tasks, hears back each group's rewards, reports figures for
the log, and checkpoints its whole state (`state_dict` / `load_state_dict`) so that a
resumed run draws exactly the tasks the uninterrupted run would have drawn.

`learnability` (the default) keeps GRPO supplied with groups that carry a gradient:

- A task's score is the variance of its G rewards (for 0/1 rewards p(1-p): zero exactly
  when every sample agrees and GRPO learns nothing), smoothed over its visits
  (learnability, arXiv 2408.15099).
- Scored tasks sit in a replay buffer. A share `replay_prob` of each batch is replayed
  from it with Prioritized Level Replay's rule (arXiv 2010.03934): probability
  (1 - staleness) * rank priority + staleness * steps-since-last-seen, rank priority
  (1/rank)^(1/T), among the tasks scoring above `replay_min_score` (a group whose
  rewards were all equal carries no gradient). When the buffer is full, a new task
  evicts the lowest score.
- The rest of the batch is new tasks. Their level is drawn by a bandit over the open
  levels (Self-Evolving Curriculum, arXiv 2505.14970): a level's value is a moving
  average of the mean |advantage| its groups produced, and levels are drawn by softmax,
  mixed with a uniform draw over the open levels by `level_explore`.
- Levels open from the bottom (`start_levels`) and the window moves up one level when
  the top open level's smoothed mean reward reaches `unlock_at`; at most `window`
  levels are open. A task whose whole group scores `retire_at` or more (twice running,
  if it was seen before) is retired.

`uniform` walks the train split in shuffled epochs; `filter` does the same but the
trainer over-samples groups and keeps only those with mixed rewards (DAPO).
Rewards are compared as shares of `max_reward` (the sum of the recipe's weights).
"""

from __future__ import annotations

from collections import Counter
from typing import Protocol

import numpy as np

from mlx_grpo.config import ConfigError, CurriculumConfig
from mlx_grpo.recipe import Task


class Curriculum(Protocol):
    """What the trainer asks of a task selector (the speed bench's FixedOrder is another)."""

    oversample: float  # groups rolled out per group trained (filter: > 1)

    def sample(self, n: int) -> list[Task]:
        """The next n tasks (deterministic given the state)."""

    def update(self, tasks: list[Task], group_rewards: list[list[float]]) -> None:
        """The G rewards each sampled task's group earned (the trainer may leave some
        sampled tasks out: groups that did not start at the task's start)."""

    def metrics(self) -> dict:
        """Figures for the step's log (`curriculum/...`)."""

    def state_dict(self) -> dict:
        """Everything needed to draw the same tasks after a resume (JSON-able)."""

    def load_state_dict(self, state: dict) -> None: ...


def _filter_levels(tasks: list[Task], levels: list[int] | None) -> list[Task]:
    if levels is not None:
        tasks = [t for t in tasks if t.level in set(levels)]
    if not tasks:
        raise ConfigError(f"curriculum.levels: no training tasks at levels {levels}")
    return tasks


def _rng_state(rng: np.random.Generator) -> dict:
    return rng.bit_generator.state


class UniformCurriculum:
    """Tasks drawn uniformly without replacement within an epoch over the train split."""

    oversample = 1.0

    def __init__(self, tasks: list[Task], seed: int, levels: list[int] | None = None):
        self.tasks = _filter_levels(tasks, levels)
        self.rng = np.random.default_rng(seed)
        self.order: list[int] = []
        self.last: list[Task] = []
        self.scores: list[float] = []

    def sample(self, n: int) -> list[Task]:
        out, taken = [], set()
        for _ in range(n):
            if not self.order:
                order = self.rng.permutation(len(self.tasks)).tolist()
                # An epoch that ends mid-step: its successor hands out this step's tasks
                # last (pop takes from the end), so no task comes twice in one step.
                self.order = [i for i in order if i in taken] + [i for i in order if i not in taken]
            i = self.order.pop()
            taken.add(i)
            out.append(self.tasks[i])
        self.last = out
        return out

    def update(self, tasks: list[Task], group_rewards: list[list[float]]) -> None:
        self.scores = [float(np.var(r)) for r in group_rewards]

    def metrics(self) -> dict:
        return {
            "curriculum/replay_frac": 0.0,
            "curriculum/score_mean": float(np.mean(self.scores)) if self.scores else 0.0,
            "curriculum/max_level": max(t.level for t in self.tasks),
            **_level_shares(self.last),
        }

    def state_dict(self) -> dict:
        return {"rng": _rng_state(self.rng), "order": list(self.order), "n": len(self.tasks)}

    def load_state_dict(self, state: dict) -> None:
        _check_size(state["n"], len(self.tasks))
        self.rng.bit_generator.state = state["rng"]
        self.order = list(state["order"])


class FilterCurriculum(UniformCurriculum):
    """Uniform selection; the trainer rolls out `oversample` x the groups it needs and
    trains on those whose rewards are mixed (DAPO's dynamic sampling)."""

    def __init__(self, tasks: list[Task], seed: int, levels: list[int] | None, oversample: float):
        super().__init__(tasks, seed, levels)
        self.oversample = oversample


def _level_shares(tasks: list[Task]) -> dict:
    counts = Counter(t.level for t in tasks)
    return {f"curriculum/level_{lv}": c / max(len(tasks), 1) for lv, c in sorted(counts.items())}


def _check_size(saved: int, now: int) -> None:
    if saved != now:
        raise ConfigError(
            f"curriculum: checkpoint has {saved} train tasks, this run {now} "
            "(recipe params or train_size changed)"
        )


class LearnabilityCurriculum:
    """Prioritised replay of learnable tasks + a level bandit for new ones (see top)."""

    oversample = 1.0

    def __init__(
        self, tasks: list[Task], cfg: CurriculumConfig, seed: int, max_reward: float = 1.0
    ):
        tasks = _filter_levels(tasks, cfg.levels)
        self.cfg = cfg
        self.max_reward = max_reward if max_reward > 0 else 1.0
        self.by_id = {t.id: t for t in tasks}
        if len(self.by_id) != len(tasks):
            seen = Counter(t.id for t in tasks).most_common(1)[0][0]
            raise ConfigError(f"recipe: the train tasks' ids are not unique ('{seen}' repeats)")
        self.levels = sorted({t.level for t in tasks})
        self.ids_by_level = {lv: [t.id for t in tasks if t.level == lv] for lv in self.levels}
        self.rng = np.random.default_rng(seed)
        self.step = 0
        self.top = min(cfg.start_levels, len(self.levels)) - 1  # index of the top open level
        self.pools: dict[int, list[str]] = {lv: [] for lv in self.levels}  # unseen, shuffled
        self.buffer: dict[str, list[float]] = {}  # id -> [score, last step, visits, mean]
        self.retired: set[str] = set()
        self.value = dict.fromkeys(self.levels, 0.5)  # optimistic: every level gets tried
        self.level_mean: dict[int, float] = {}
        self.last: list[Task] = []  # this step's tasks, over all its waves
        self.replayed: set[str] = set()  # the ids of those that were replayed
        self.heard = True  # update() came after the last sample(): the next starts a step
        self.last_flat = (0.0, 0.0)  # share of replayed / new groups whose rewards were equal

    # -- selection --------------------------------------------------------------------

    def open_levels(self) -> list[int]:
        lo = max(0, self.top - self.cfg.window + 1)
        return self.levels[lo : self.top + 1]

    def sample(self, n: int) -> list[Task]:
        """`n` tasks. The calls between two `update`s are one step's waves
        (`curriculum.max_waves`): no task comes twice in a step, and staleness counts
        steps."""
        if self.heard:
            self.step += 1
            self.heard, self.last, self.replayed = False, [], set()
        taken = {t.id for t in self.last}
        floor = self.cfg.replay_min_score
        replayable = [t for t, e in self.buffer.items() if e[0] > floor and t not in taken]
        k = int(self.rng.binomial(n, self.cfg.replay_prob))
        k = min(k, len(replayable))
        picked = self._replay(replayable, k) if k else []
        chosen = set(picked) | taken
        for _ in range(n - k):
            tid = self._new_task(chosen)
            if tid is None:  # every open task is in the buffer, retired, or taken
                rest = [t for t in self.buffer if t not in chosen]
                if not rest:
                    raise ConfigError(
                        f"curriculum: no task left to sample ({n} a step from "
                        f"{len(self.by_id)} train tasks): raise recipe.train_size or lower "
                        "train.batch_size"
                    )
                tid = self._replay(rest, 1)[0]
            chosen.add(tid)
            picked.append(tid)
        self.replayed.update(picked[:k])
        wave = [self.by_id[t] for t in picked]
        self.last += wave
        return wave

    def replay_probs(self, ids: list[str]) -> np.ndarray:
        """PLR: (1 - staleness) * rank priority of the score + staleness * age."""
        scores = np.array([self.buffer[t][0] for t in ids])
        ranks = np.empty(len(ids))
        ranks[np.argsort(-scores, kind="stable")] = np.arange(1, len(ids) + 1)
        p_score = (1.0 / ranks) ** (1.0 / self.cfg.rank_temperature)
        p_score /= p_score.sum()
        age = np.array([self.step - self.buffer[t][1] for t in ids], dtype=np.float64)
        p_age = age / age.sum() if age.sum() > 0 else np.full(len(ids), 1.0 / len(ids))
        rho = self.cfg.staleness
        return (1 - rho) * p_score + rho * p_age

    def _replay(self, ids: list[str], k: int) -> list[str]:
        p = self.replay_probs(ids)
        idx = self.rng.choice(len(ids), size=k, replace=False, p=p)
        return [ids[i] for i in idx]

    def level_probs(self) -> dict[int, float]:
        levels = self.open_levels()
        v = np.array([self.value[lv] for lv in levels]) / self.cfg.bandit_temperature
        p = np.exp(v - v.max())
        eps = self.cfg.level_explore
        p = (1 - eps) * p / p.sum() + eps / len(levels)
        return dict(zip(levels, (p / p.sum()).tolist()))

    def _new_task(self, taken: set[str]) -> str | None:
        probs = self.level_probs()
        levels = list(probs)
        p = np.array(list(probs.values()))
        for lv in self.rng.choice(levels, size=len(levels), replace=False, p=p).tolist():
            pool = self.pools[lv]
            if not pool:  # refill: unseen first, then everything not retired or buffered
                fresh = [
                    t
                    for t in self.ids_by_level[lv]
                    if t not in self.retired and t not in self.buffer and t not in taken
                ]
                pool.extend(fresh[i] for i in self.rng.permutation(len(fresh)))
            while pool:
                tid = pool.pop()
                if tid not in self.retired and tid not in self.buffer and tid not in taken:
                    return tid
        return None

    # -- feedback ---------------------------------------------------------------------

    def update(self, tasks: list[Task], group_rewards: list[list[float]]) -> None:
        a = self.cfg.score_ema
        flat = [float(np.ptp(rewards)) <= 1e-8 for rewards in group_rewards]
        self.heard = True
        was = [t.id in self.replayed for t in tasks]
        old = [f for f, w in zip(flat, was) if w]
        new = [f for f, w in zip(flat, was) if not w]
        self.last_flat = (
            float(np.mean(old)) if old else 0.0,
            float(np.mean(new)) if new else 0.0,
        )
        for task, rewards in zip(tasks, group_rewards):
            r = np.asarray(rewards, dtype=np.float64) / self.max_reward
            score, mean = float(r.var()), float(r.mean())
            adv = float(np.abs(r - mean).mean()) * 2.0  # in [0, 1] for rewards in [0, 1]
            lv = task.level
            self.value[lv] = (1 - self.cfg.bandit_lr) * self.value[lv] + self.cfg.bandit_lr * adv
            prev = self.level_mean.get(lv)
            self.level_mean[lv] = mean if prev is None else 0.7 * prev + 0.3 * mean
            entry = self.buffer.get(task.id)
            if entry is not None:
                score = (1 - a) * entry[0] + a * score
            # Retired: the whole group scored high, and its last visit's mean did too.
            if r.min() >= self.cfg.retire_at and (entry is None or entry[3] >= self.cfg.retire_at):
                self.buffer.pop(task.id, None)
                self.retired.add(task.id)
                continue
            visits = entry[2] + 1 if entry else 1
            new = [score, self.step, visits, mean]
            if entry is not None or len(self.buffer) < self.cfg.buffer_size:
                self.buffer[task.id] = new
            else:
                worst = min(self.buffer, key=lambda t: (self.buffer[t][0], self.buffer[t][1]))
                if self.buffer[worst][0] < score:
                    del self.buffer[worst]
                    self.buffer[task.id] = new
        top = self.levels[self.top]
        if self.top < len(self.levels) - 1 and self.level_mean.get(top, 0) >= self.cfg.unlock_at:
            self.top += 1

    def metrics(self) -> dict:
        scores = [e[0] for e in self.buffer.values()]
        return {
            "curriculum/replay_frac": len(self.replayed) / max(len(self.last), 1),
            # Where the groups without signal come from: tasks replayed for their
            # variance that came back all-equal, or new tasks.
            "curriculum/replay_zero_variance_frac": self.last_flat[0],
            "curriculum/new_zero_variance_frac": self.last_flat[1],
            "curriculum/score_mean": float(np.mean(scores)) if scores else 0.0,
            "curriculum/max_level": self.levels[self.top],
            "curriculum/buffer": len(self.buffer),
            "curriculum/retired": len(self.retired),
            **_level_shares(self.last),
        }

    # -- checkpoint -------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {
            "n": len(self.by_id),
            "rng": _rng_state(self.rng),
            "step": self.step,
            "top": self.top,
            "pools": {str(k): list(v) for k, v in self.pools.items()},
            "buffer": {k: list(v) for k, v in self.buffer.items()},
            "retired": sorted(self.retired),
            "value": {str(k): v for k, v in self.value.items()},
            "level_mean": {str(k): v for k, v in self.level_mean.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        _check_size(state["n"], len(self.by_id))
        unknown = [t for t in state["buffer"] if t not in self.by_id]
        if unknown:
            raise ConfigError(f"curriculum: checkpoint names unknown tasks, e.g. {unknown[0]}")
        self.rng.bit_generator.state = state["rng"]
        self.step, self.top = state["step"], state["top"]
        self.pools = {int(k): list(v) for k, v in state["pools"].items()}
        self.buffer = {k: list(v) for k, v in state["buffer"].items()}
        self.retired = set(state["retired"])
        self.value = {int(k): v for k, v in state["value"].items()}
        self.level_mean = {int(k): v for k, v in state["level_mean"].items()}


def make_curriculum(
    cfg: CurriculumConfig, tasks: list[Task], seed: int, max_reward: float = 1.0
) -> Curriculum:
    if cfg.strategy == "uniform":
        return UniformCurriculum(tasks, seed, cfg.levels)
    if cfg.strategy == "filter":
        return FilterCurriculum(tasks, seed, cfg.levels, cfg.filter_oversample)
    return LearnabilityCurriculum(tasks, cfg, seed, max_reward)
