"""A supervised warm start on the recipe's demonstrations (`train.sft_steps`).

Before the first GRPO step, the adapters take `train.sft_steps` AdamW steps that raise the
log-likelihood of the recipe's own demonstrations (`demonstrate(task)` in its tasks.py)
on training tasks. This is a cold start, as in DeepSeek-R1 (2025) before its RL. A
small model that cannot yet solve a level gives GRPO groups with no signal there, and
sampling does not find what it was never shown. After the warm start the policy has
seen every level's moves, and GRPO's groups start with mixed rewards.

The demonstrations are played through the same environment and chat template as a
sampled episode (`guidance.demonstration`), so their tokens are those that sampling
the same replies would produce. Only the model's tokens enter the loss, never the
environment's. They come from the training split only, drawn evenly across the levels,
and held-out tasks are never shown. The loss is the mean negative log-likelihood per
token of the batch. It runs in the update's micro-batches and through its gradient
clipping. The adapters then go on to GRPO with GRPO's own optimizer and schedule.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_unflatten

from mlx_grpo.config import RunConfig
from mlx_grpo.credit import TrainingError
from mlx_grpo.dist import Dist
from mlx_grpo.grpo import LossInputs
from mlx_grpo.guidance import demonstration
from mlx_grpo.logprobs import completion_logprobs
from mlx_grpo.recipe import Recipe, Task
from mlx_grpo.rollout import Completion, Rollout, close_env, encode_prompt, episode_prompt
from mlx_grpo.update import apply_update, build_loss_inputs, policy_gradient


def first_prompt(recipe: Recipe, tokenizer, task: Task, max_prompt_tokens: int) -> list[int]:
    """The prompt a group of `task` is sampled from (a multi-turn recipe's first
    messages come from a reset environment)."""
    if not recipe.multi_turn:
        return encode_prompt(tokenizer, task.messages, max_prompt_tokens)
    env = recipe.make_env(task)
    try:
        return episode_prompt(tokenizer, recipe.first_messages(task, env), env, max_prompt_tokens)
    finally:
        close_env(env)


def demonstrations(
    recipe: Recipe, tokenizer, tasks: list[Task], cfg, say: Callable[[str], None] = print
) -> tuple[list[list[int]], list[Completion], list[Task]]:
    """(prompts, completions, tasks) of the demonstrations of `tasks` that end their
    episode within the rollout's limits. Those that raise are said once each and left
    out."""
    prompts, comps, kept = [], [], []
    for task in tasks:
        try:
            prompt = first_prompt(recipe, tokenizer, task, cfg.max_prompt_tokens)
            demo = demonstration(recipe, tokenizer, task, len(prompts), prompt, cfg)
        except Exception as e:  # the recipe's script or env: this task is left out
            say(f"train.sft_steps: the demonstration of {task.id} raised, left out: {e!r}")
            continue
        if demo is None or demo.finish_reason != "stop":
            continue
        prompts.append(prompt)
        comps.append(demo)
        kept.append(task)
    return prompts, comps, kept


def by_level(tasks: list[Task], n: int, rng: np.random.Generator) -> list[Task]:
    """`n` of `tasks` (all when fewer), as evenly over their levels as they allow, in
    a random order."""
    levels: dict[int, list[Task]] = {}
    for task in tasks:
        levels.setdefault(task.level, []).append(task)
    queues = {lv: [ts[i] for i in rng.permutation(len(ts))] for lv, ts in sorted(levels.items())}
    out: list[Task] = []
    while len(out) < n and any(queues.values()):
        for queue in queues.values():
            if queue and len(out) < n:
                out.append(queue.pop())
    return [out[i] for i in rng.permutation(len(out))]


def sft_loss(
    model: nn.Module, batch: LossInputs, logits_chunk: int = 1 << 25
) -> tuple[mx.array, dict[str, mx.array]]:
    """The batch's summed negative log-likelihood of its masked tokens over
    `batch.total_tokens` (the whole batch's count, so that micro-batches add up)."""
    logp, _ = completion_logprobs(
        model, batch.prompts, batch.completions, logits_chunk, mask=batch.mask
    )
    total = batch.total_tokens if batch.total_tokens is not None else batch.mask.sum()
    nll = -(logp * batch.mask).sum() / total
    return nll, {"nll": nll}


def check_ranks(tc, dist: Dist) -> None:
    """Each rank needs at least one demonstration a step."""
    if tc.sft_steps and tc.sft_batch_size < dist.size:
        raise TrainingError(
            f"train.sft_batch_size={tc.sft_batch_size} is smaller than the {dist.size} "
            "ranks: each rank needs at least one demonstration a step"
        )


def warm_start(
    model: nn.Module,
    tokenizer,
    recipe: Recipe,
    tasks: list[Task],
    cfg: RunConfig,
    say: Callable[[str], None] = print,
    dist: Dist | None = None,
    kept: dict | None = None,
    on_step: Callable[[int, optim.Optimizer, list[float], float], None] | None = None,
) -> dict:
    """`cfg.train.sft_steps` supervised steps on demonstrations of `tasks` (the training
    split). Under `mlx.launch` every rank plays the same demonstrations and takes its
    share of each step's rows; the gradients are summed over ranks, so all take the
    same step. Returns a summary: the demonstrations used per level, the NLL of each
    step and the seconds taken.

    `on_step(k, optimizer, nll, seconds)` runs after step k (to keep it); `kept`
    (`checkpoint.load_start`'s state after step k: adapters, optimizer state, NLLs,
    seconds) continues from there, to the model and optimizer the uninterrupted warm
    start would have had."""
    tc = cfg.train
    dist = dist or Dist()
    check_ranks(tc, dist)
    tic = time.perf_counter()
    rng = np.random.default_rng([tc.seed, 7_305])  # apart from the run's other draws
    pool = by_level(tasks, tc.sft_steps * tc.sft_batch_size, rng)
    prompts, comps, shown_tasks = demonstrations(recipe, tokenizer, pool, cfg.rollout, say)
    if not comps:
        raise TrainingError(
            f"train.sft_steps: recipe {recipe.name} gave no demonstration that ends its "
            "episode within rollout.max_turns and rollout.max_new_tokens"
        )
    optimizer = optim.AdamW(
        learning_rate=tc.sft_learning_rate, weight_decay=cfg.optimizer.weight_decay
    )
    loss_and_grad = nn.value_and_grad(model, lambda m, b: sft_loss(m, b, cfg.engine.logits_chunk))
    max_new = cfg.rollout.max_new_tokens * cfg.rollout.max_turns
    order = np.concatenate(
        [
            rng.permutation(len(comps))
            for _ in range(math.ceil(tc.sft_steps * tc.sft_batch_size / len(comps)))
        ]
    )
    nll, done, before = [], 0, 0.0
    if kept and kept.get("sft_step"):
        done, nll, before = int(kept["sft_step"]), list(kept["nll"]), float(kept["seconds"])
        model.load_weights(list(kept["adapters"].items()), strict=False)
        optimizer.state = tree_unflatten(list(kept["optimizer"].items()))
        mx.eval(model.parameters(), optimizer.state)
    model.train()
    for step in range(tc.sft_steps):
        seed = int(rng.integers(2**31))  # (drawn for the steps already done too)
        if step < done:
            continue
        mx.random.seed(seed)  # LoRA dropout: the same on every rank
        rows = order[step * tc.sft_batch_size : (step + 1) * tc.sft_batch_size].tolist()
        mine = dist.share(len(rows))
        local = rows[mine.start : mine.stop]
        shown = Rollout([prompts[r] for r in local], [comps[r] for r in local], 1)
        batch = build_loss_inputs(shown, mx.ones(len(local)), max_new, mask_truncated=False)
        batch.total_tokens = float(sum(comps[r].model_tokens for r in rows))  # all ranks'
        loss, _, grads, grad_norm, _ = policy_gradient(
            model, loss_and_grad, batch, dist, cfg.optimizer.max_grad_norm,
            cfg.engine.micro_batch_tokens,
        )  # fmt: skip
        if not (math.isfinite(loss.item()) and math.isfinite(grad_norm.item())):
            raise TrainingError(
                f"train.sft_steps: non-finite loss at warm-start step {step + 1}; "
                "lower train.sft_learning_rate"
            )
        apply_update(model, optimizer, grads)
        nll.append(loss.item())
        if on_step is not None:
            on_step(step + 1, optimizer, nll, before + time.perf_counter() - tic)
    model.eval()
    return {
        "demonstrations": len(comps),
        "levels": dict(sorted(Counter(task.level for task in shown_tasks).items())),
        "nll": nll,
        "seconds": before + time.perf_counter() - tic,
    }
