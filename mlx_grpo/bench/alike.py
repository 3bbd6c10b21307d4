"""A multi-turn step with and without the work done once for alike episodes.

    python -m mlx_grpo.bench.alike checkpoints/<run>@<step> [--groups 12] [--reps 1]

On a run's checkpoint (a multi-turn recipe: web_browsing, miniwob), plays `--groups`
training tasks x G episodes with the run's rollout settings and keyed samplers, then
updates on the groups with reward variance (at most the run's batch size): the reference
pass and the policy gradient. Each rep runs it twice on the same keys, first with every
episode's prefill and every row of the update computed on its own, then with
`rollout.share_tails`, `trainer.fold_alike_rows` and the update's shared inputs
(`logprobs.shared_inputs`: rows that open alike run those positions once) on, and
prints both times, the episodes' turns, the loss and the gradient norm (the same in
both, up to float32 rounding).
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
import mlx.nn as nn
import numpy as np

import mlx_grpo.logprobs as logprobs_mod
import mlx_grpo.rollout as rollout_mod
import mlx_grpo.update as update_mod
from mlx_grpo.dist import Dist
from mlx_grpo.grpo import group_advantages, grpo_loss, zero_variance_groups
from mlx_grpo.recipe import Recipe
from mlx_grpo.sides import load_side, resolve_side


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mlx_grpo.bench.alike", description=__doc__)
    ap.add_argument("run", help="a run's checkpoint: checkpoints/<run>@<step>")
    ap.add_argument("--groups", type=int, default=12, help="training tasks played")
    ap.add_argument("--reps", type=int, default=1)
    args = ap.parse_args(argv)
    side = resolve_side("run", args.run)
    cfg = side.run_config
    model, tok = load_side(side)
    model.freeze()
    model.unfreeze(keys=["lora_a", "lora_b"], strict=False)
    recipe = Recipe.from_config(cfg.recipe)
    if not recipe.multi_turn:
        raise SystemExit(f"{args.run}: recipe {recipe.name} is single-turn (nothing to share)")
    g = cfg.grpo.num_generations
    pool = recipe.tasks("train", cfg.recipe.train_size, cfg.train.seed)
    if cfg.curriculum.levels:
        pool = [t for t in pool if t.level in cfg.curriculum.levels]
    pick = np.random.default_rng(7).choice(len(pool), min(args.groups, len(pool)), replace=False)
    tasks = [pool[i] for i in pick]
    share, least = rollout_mod.share_tails, logprobs_mod.MIN_SHARED_INPUTS
    grad_fn = nn.value_and_grad(model, lambda m, b: grpo_loss(m, b, cfg.grpo))
    try:
        for rep in range(args.reps):
            for on in (False, True):
                rollout_mod.share_tails = share if on else (lambda *a: 0)
                logprobs_mod.MIN_SHARED_INPUTS = least if on else 1 << 30
                keys = mx.random.split(mx.random.key(11 + rep), len(tasks) * g)
                samplers = rollout_mod.keyed_samplers(cfg.rollout, keys)
                model.eval()
                tic = time.perf_counter()
                rollout = rollout_mod.rollout_tasks(
                    model, tok, recipe, tasks, g, cfg.rollout, samplers
                )
                rollout_s = time.perf_counter() - tic
                scored = recipe.score_rollout(tasks, rollout)
                rewards = mx.array(np.array([s.reward for s in scored], np.float32))
                advantages = group_advantages(rewards, g, cfg.grpo.scale_rewards)
                flat = np.array(zero_variance_groups(rewards, g))
                groups = [i for i, z in enumerate(flat) if not z][: cfg.train.batch_size]
                if not groups:
                    raise SystemExit("no group with reward variance: try more --groups")
                model.train()
                tic = time.perf_counter()
                batch = update_mod.build_loss_inputs(
                    rollout,
                    advantages,
                    cfg.rollout.max_new_tokens * cfg.rollout.max_turns,
                    cfg.grpo.mask_truncated_completions,
                    groups,
                    frozenset(),
                    cfg.credit.reinforce_ill_formed,
                    fold=on and cfg.lora.dropout == 0,  # as the trainer folds
                    blame_replies=cfg.credit.blame_replies,
                )
                update_mod.reference_pass(model, batch, cfg.grpo)
                loss, _, grads, norm, _ = update_mod.policy_gradient(
                    model, grad_fn, batch, Dist(), 1e9, cfg.engine.micro_batch_tokens
                )
                mx.eval(loss, grads)
                update_s = time.perf_counter() - tic
                rows = int((np.array(batch.mask).max(axis=1) > 0).sum())
                turns = np.mean([c.episode.turns for c in rollout.completions])
                print(
                    f"rep {rep} {'alike once' if on else 'each     '}  rollout {rollout_s:6.1f} s  "
                    f"update {update_s:6.1f} s  ({len(groups)} groups, {rows} rows with loss "
                    f"tokens; turns {turns:.2f}; shared tail tokens {rollout.shared_tail_tokens}; "
                    f"loss {loss.item():.5f}, gradient norm {float(norm):.4f})",
                    flush=True,
                )
    finally:
        rollout_mod.share_tails, logprobs_mod.MIN_SHARED_INPUTS = share, least
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
