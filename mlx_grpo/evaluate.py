"""Held-out evaluation: a recipe's eval tasks played by a model, batched, greedy or
sampled, single- or multi-turn. Used during training (`train.eval_every`), by
`python -m mlx_grpo.compare`, and by the benchmarks."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_grpo.config import RolloutConfig
from mlx_grpo.durable import append_record
from mlx_grpo.recipe import Recipe, Task
from mlx_grpo.rollout import GreedySampler, keyed_samplers, rollout_tasks


@dataclass
class TaskResult:
    """Every sample's reward (and components) on one task."""

    id: str
    level: int
    rewards: list[float]
    components: dict[str, list[float]]
    texts: list[str]
    tokens: list[int]  # model tokens per sample
    errors: int = 0
    failures: dict[str, int] = field(default_factory=dict)  # samples per named failure

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def evaluate(
    model: nn.Module,
    tokenizer,
    recipe: Recipe,
    tasks: list[Task],
    cfg: RolloutConfig,
    samples: int = 1,
    temperature: float = 0.0,
    batch_tasks: int = 16,
    seed: int = 0,
) -> list[TaskResult]:
    """`samples` completions per task: greedy when temperature is 0 (then samples are
    identical, so use 1), else sampled with `cfg`'s top-p/top-k/min-p at `temperature`,
    each sample from its own key split from `seed`: the same seed draws the same tokens,
    however the tasks are batched (`batch_tasks`)."""
    if not tasks:
        raise ValueError("evaluate: no tasks")
    cfg = cfg.model_copy(update={"end_on_ill_formed": False})  # a training rule only
    if temperature == 0:
        sampler = GreedySampler()
    else:
        sampler = keyed_samplers(
            cfg.model_copy(update={"temperature": temperature}),
            mx.random.split(mx.random.key(seed), len(tasks) * samples),
        )
    model.eval()
    out: list[TaskResult] = []
    for lo in range(0, len(tasks), batch_tasks):
        chunk = tasks[lo : lo + batch_tasks]
        rows = (
            sampler[lo * samples : (lo + len(chunk)) * samples]
            if isinstance(sampler, list)
            else sampler
        )
        rollout = rollout_tasks(model, tokenizer, recipe, chunk, samples, cfg, rows)
        results = {t.id: TaskResult(t.id, t.level, [], {}, [], []) for t in chunk}
        for c, s in zip(rollout.completions, recipe.score_rollout(chunk, rollout)):
            task = chunk[c.prompt_index]
            r = results[task.id]
            r.rewards.append(s.reward)
            r.texts.append(c.text)
            r.tokens.append(c.model_tokens)
            r.errors += s.error is not None
            if s.failure:
                r.failures[s.failure] = r.failures.get(s.failure, 0) + 1
            for k in s.components:  # (in the reward's order: the log is the same each run)
                if k not in r.components:  # 0 for the samples before
                    r.components[k] = [0.0] * (len(r.rewards) - 1)
            for k, values in r.components.items():
                # 0 where this sample lacks it (a reward that raised gives the weighted
                # components only): a mean over the task's samples, as the reward's
                values.append(s.components.get(k, 0.0))
        out.extend(results.values())
    return out


def summarize(results: list[TaskResult], prefix: str = "eval/") -> dict:
    """Mean reward and components over tasks, overall and per level."""
    out = {f"{prefix}reward": float(np.mean([np.mean(r.rewards) for r in results]))}
    names = sorted({k for r in results for k in r.components})
    for k in names:
        out[f"{prefix}{k}"] = float(np.mean([np.mean(r.components.get(k, [0.0])) for r in results]))
    main = next((k for k in ("success", "passes") if k in names), None)
    for level in sorted({r.level for r in results}):
        at = [r for r in results if r.level == level]
        key = main or "reward"
        # .get: a task whose samples all raised has only the weighted components
        vals = [np.mean(r.components.get(key, [0.0])) if main else np.mean(r.rewards) for r in at]
        out[f"{prefix}level_{level}/{key}"] = float(np.mean(vals))
    return out


def make_eval_fn(
    model, tokenizer, recipe: Recipe, tasks: list[Task], cfg: RolloutConfig, log_path=None
):
    """A callable for the trainer: greedy eval on `tasks`, summarized; each call's
    per-task results are appended to `log_path` (JSONL) when given."""

    def run(step: int, extra: dict | None = None) -> dict:
        tic = time.perf_counter()
        results = evaluate(model, tokenizer, recipe, tasks, cfg)
        if log_path is not None:
            record = {"step": step, **(extra or {}), "results": [r.to_dict() for r in results]}
            append_record(log_path, record)
        return {**summarize(results), "time/eval_s": time.perf_counter() - tic}

    return run
