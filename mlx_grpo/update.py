"""The update: a rollout's batch in, the adapters moved.

`build_loss_inputs` lays a rollout's groups out as the loss reads them (only the
model's own tokens in the mask); `reference_pass` fills in the log-probs the loss
compares against; `policy_gradient` takes the value and gradient of the loss over
micro-batches and ranks, clipped in global norm; `update_step` runs the whole update
of one step (`grpo.num_iterations` times the gradient and an AdamW step). The warm
start and the benchmarks call the same pieces.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map

from mlx_grpo.compiled import CompiledLossAndGrad
from mlx_grpo.config import EngineConfig, GRPOConfig, OptimizerConfig, RunConfig
from mlx_grpo.credit import TrainingError, uncompared_turns, withheld_turns
from mlx_grpo.device import Lanes, update_lanes
from mlx_grpo.dist import Dist
from mlx_grpo.grpo import (
    LOSS_METRICS,
    LossInputs,
    lane_pieces,
    micro_batches,
    split_guided,
    split_reinforced,
)
from mlx_grpo.logprobs import completion_logprobs, shares_inputs
from mlx_grpo.models import adapters_disabled, adapters_set
from mlx_grpo.rollout import Rollout


def loss_and_grad_of(model: nn.Module, cfg: RunConfig, loss: Callable) -> Callable:
    """`(model, batch) -> ((loss, metrics), grads)` of `loss(model, batch, cfg.grpo)` over
    the trainable parameters; compiled under `engine.compile` (the GRPO loss only)."""
    if cfg.engine.compile:
        return CompiledLossAndGrad(model, cfg.grpo, cfg.engine.logits_chunk)
    return nn.value_and_grad(model, lambda m, batch: loss(m, batch, cfg.grpo))


def build_optimizer(cfg: OptimizerConfig, total_updates: int) -> optim.AdamW:
    """AdamW with linear warm-up then cosine decay (or constant)."""
    lr = cfg.learning_rate
    warmup = min(cfg.warmup_steps, max(total_updates - 1, 0))  # short runs still decay
    decay_steps = max(1, total_updates - warmup)
    main = (
        optim.cosine_decay(lr, decay_steps, end=lr * cfg.min_lr_ratio)
        if cfg.schedule == "cosine"
        else (lambda _: mx.array(lr))
    )
    if warmup:
        # Starts above 0 so that the first update already moves the adapters.
        warm = optim.linear_schedule(lr / (warmup + 1), lr, warmup)
        schedule = optim.join_schedules([warm, main], [warmup])
    else:
        schedule = main
    return optim.AdamW(learning_rate=schedule, weight_decay=cfg.weight_decay)


def build_loss_inputs(
    rollout: Rollout,
    advantages: mx.array,
    max_new_tokens: int,
    mask_truncated: bool,
    groups: list[int] | None = None,
    silent: frozenset[int] = frozenset(),
    reinforce_ill_formed: bool = True,
    fold: bool = True,
    blame_replies: str = "all",
) -> LossInputs:
    """The prompts of `groups` (default: all), their right-padded [N, C] completions
    and the loss mask (the model's own tokens; never the environment's). The rows in
    `silent` (indices into `rollout.completions`) keep their place with an empty mask:
    they add nothing to the loss and cost nothing in its passes (`effective_lengths`),
    but count in its divisors. Without `reinforce_ill_formed`, the replies its
    environment marked ill-formed (`ill_formed_turns`) leave the mask of an episode with
    a positive advantage; `withheld_turns` counts them. With `blame_replies="compared"`,
    the replies of a below-average episode that `uncompared_turns` finds leave its
    mask. With `fold`, a group's alike rows fold into one (`fold_alike_rows`); off where
    rows must stay apart (LoRA dropout draws a mask per row)."""
    g = rollout.group_size
    groups = list(range(len(rollout.prompts))) if groups is None else groups
    rows = [gi * g + j for gi in groups for j in range(g)]
    comps = [rollout.completions[r] for r in rows]
    adv = advantages[mx.array(rows)] if len(rows) != advantages.size else advantages
    withheld = [] if reinforce_ill_formed else withheld_turns(comps, np.array(adv))
    if blame_replies == "compared":
        withheld += uncompared_turns(comps, np.array(adv), g)
    c_max = max(len(c.tokens) for c in comps)
    tokens = np.zeros((len(comps), c_max), dtype=np.int32)
    mask = np.zeros((len(comps), c_max), dtype=np.float32)
    for i, (row, c) in enumerate(zip(rows, comps)):
        tokens[i, : len(c.tokens)] = c.tokens
        if not (mask_truncated and c.truncated) and row not in silent:
            mask[i, : len(c.tokens)] = 1.0 if c.loss_mask is None else c.loss_mask
    for i, (lo, hi) in withheld:
        mask[i, lo:hi] = 0.0
    demos = [float(c.demonstration) for c in comps]
    if fold:
        fold_alike_rows(tokens, mask, np.array(adv), demos, g)
    return LossInputs(
        prompts=[mx.array(rollout.prompts[gi]) for gi in groups],
        completions=mx.array(tokens),
        mask=mx.array(mask),
        advantages=adv,
        old_logprobs=None,
        ref_logprobs=None,
        max_new_tokens=max_new_tokens,
        guided=mx.array(demos) if any(demos) else None,
    )


def fold_alike_rows(
    tokens: np.ndarray, mask: np.ndarray, advantages: np.ndarray, demos: list, group_size: int
) -> int:
    """Rows of a group that are the same episode (the same tokens, loss mask, advantage
    and kind) add the same terms to the loss: the first of k alike rows takes a mask of
    k on its loss tokens and the others an empty one, in place. Every reduction of the
    loss and its metrics weighs a token by its mask, so loss and gradients are those of
    the k rows up to float32 rounding (without LoRA dropout, which would draw k
    masks), and the k - 1 empty rows cost nothing in the reference and policy passes
    (`effective_lengths`); they still count as rows in the divisors. A policy that has
    grown sure of itself samples most of a group alike. Returns the rows emptied.

    >>> t = np.array([[5, 6], [5, 6], [5, 7], [5, 6]]); m = np.ones((4, 2), np.float32)
    >>> fold_alike_rows(t, m, np.array([0.5, 0.5, -1.0, 0.5]), [0.0] * 4, 4), m[:, 0].tolist()
    (2, [3.0, 0.0, 1.0, 0.0])
    """
    folded = 0
    for lo in range(0, len(tokens), group_size):
        first: dict[tuple, int] = {}
        for i in range(lo, lo + group_size):
            if not mask[i].any():
                continue
            key = (tokens[i].tobytes(), mask[i].tobytes(), float(advantages[i]), demos[i])
            if key in first:
                mask[first[key]] += mask[i]
                mask[i] = 0.0
                folded += 1
            else:
                first[key] = i
    return folded


def reference_pass(
    model,
    batch: LossInputs,
    grpo: GRPOConfig,
    reference: dict[str, mx.array] | None = None,
    lanes: Lanes | None = None,
    engine: EngineConfig | None = None,
) -> None:
    """Fill in the log-probs the loss compares against: the reference policy's (the
    adapters switched off, or set to `reference`) when the KL term is on, and the
    sampling policy's when several updates reuse one rollout. Both are constants of the
    update; they are computed micro-batch by micro-batch (`engine.micro_batch_tokens`),
    each micro-batch's pieces side by side in `lanes`."""
    lanes, engine = lanes or Lanes(1), engine or EngineConfig()

    def piece_logprobs(p: LossInputs) -> mx.array:
        lp, _ = completion_logprobs(
            model, p.prompts, p.completions, p.logits_chunk, mask=p.mask, grad=False
        )
        return lp

    def logprobs() -> mx.array:
        parts = []
        share = shares_inputs(model)
        for piece in micro_batches(batch, engine.micro_batch_tokens, share):
            parts += lanes.map(piece_logprobs, lane_pieces(piece, lanes.n, share))
        return mx.stop_gradient(parts[0] if len(parts) == 1 else mx.concatenate(parts))

    if grpo.beta > 0:
        off = adapters_disabled(model) if reference is None else adapters_set(model, reference)
        with off:
            batch.ref_logprobs = logprobs()
    if grpo.num_iterations > 1:
        batch.old_logprobs = logprobs()
    mx.eval(batch.ref_logprobs, batch.old_logprobs)


def policy_gradient(
    model,
    loss_and_grad,
    batch: LossInputs | None,
    dist: Dist,
    max_norm: float,
    micro_batch_tokens: int | None = None,
    lanes: Lanes | None = None,
):
    """(loss, metrics, clipped gradients, their norm before clipping, seconds spent
    exchanging) of one update: the value and gradient of the loss on this rank's share,
    summed over its micro-batches (each one's pieces side by side in `lanes`) and over
    ranks, clipped to `max_norm` in global norm. A rank with no share (`batch` None)
    joins with zeros."""
    if batch is not None:
        lanes = lanes or Lanes(1)
        loss, m, grads = None, None, None
        # as the pass decides; the compiled loss runs each group alone, sharing nothing
        share = shares_inputs(model) and not isinstance(loss_and_grad, CompiledLossAndGrad)
        for piece in micro_batches(batch, micro_batch_tokens, share):
            pieces = lane_pieces(piece, lanes.n, share)
            parts = lanes.map(lambda p: loss_and_grad(model, p), pieces)
            for (p_loss, p_m), p_grads in parts:
                if loss is None:
                    loss, m, grads = p_loss, p_m, p_grads
                else:
                    loss = loss + p_loss
                    m = {k: m[k] + p_m[k] for k in m}
                    grads = tree_map(mx.add, grads, p_grads)
            mx.eval(loss, m, grads)  # frees this piece's activations before the next
    else:
        loss = mx.array(0.0)
        m = {k: mx.array(0.0) for k in LOSS_METRICS}
        grads = tree_map(mx.zeros_like, model.trainable_parameters())
    sync_s = 0.0
    if dist.size > 1:
        mx.eval(loss, m, grads)
        tic = time.perf_counter()
        # One exchange per dtype for gradients, loss and metrics together.
        summed = dist.sum_tree({"grads": grads, "loss": loss, "m": m})
        mx.eval(summed)
        sync_s = time.perf_counter() - tic
        grads, loss, m = summed["grads"], summed["loss"], summed["m"]
    grads, grad_norm = optim.clip_grad_norm(grads, max_norm)
    mx.eval(loss, grad_norm, m)
    return loss, m, grads, grad_norm, sync_s


def apply_update(model, optimizer, grads) -> None:
    """One AdamW step on the adapters."""
    optimizer.update(model, grads)
    mx.eval(model.trainable_parameters(), optimizer.state)


def update_step(
    model,
    optimizer,
    loss_and_grad,
    batch: LossInputs | None,
    cfg: RunConfig,
    counters,
    step,
    say,
    dist: Dist,
    total_rows: int,
    reference: dict[str, mx.array] | None = None,
):
    """One update of the adapters on a rollout's batch: the reference pass, then
    `grpo.num_iterations` times the clipped policy gradient and an AdamW step (skipped,
    and counted, when non-finite). Returns (metrics per iteration, |delta| of the
    adapters, seconds spent exchanging gradients).

    `batch` is this rank's share (None when all its groups were left out: it still
    joins every exchange, with zero gradients)."""
    lanes = update_lanes(cfg.engine.update_lanes, cfg.engine.compile)
    if batch is not None:
        reference_pass(model, batch, cfg.grpo, reference, lanes, cfg.engine)
    if dist.size > 1:
        # Every rank divides by the whole batch's counts (see grpo.aggregate).
        tokens = dist.all_sum(batch.mask.sum() if batch is not None else mx.array(0.0)).item()
        if batch is not None:
            batch.total_rows, batch.total_tokens = total_rows, tokens

    model.train()
    before = adapters(model)
    it_metrics: list[dict] = []
    sync_s = 0.0
    for _ in range(cfg.grpo.num_iterations):
        loss, m, grads, grad_norm, exchange_s = policy_gradient(
            model,
            loss_and_grad,
            batch,
            dist,
            cfg.optimizer.max_grad_norm,
            cfg.engine.micro_batch_tokens,
            lanes,
        )
        sync_s += exchange_s
        finite = math.isfinite(loss.item()) and math.isfinite(grad_norm.item())
        if finite:
            apply_update(model, optimizer, grads)
            counters.nonfinite_streak = 0
        else:
            counters.nonfinite_skipped += 1
            counters.nonfinite_streak += 1
            say(f"step {step}: non-finite loss or gradient, update skipped")
            if counters.nonfinite_streak >= cfg.train.max_nonfinite_steps:
                raise TrainingError(
                    f"{counters.nonfinite_streak} non-finite updates in a row at step "
                    f"{step}; lower optimizer.learning_rate or check the reward"
                )
        it_metrics.append(
            split_reinforced(
                split_guided(
                    {
                        "loss/total": loss.item(),
                        "grad_norm": grad_norm.item(),
                        **{k: v.item() for k, v in m.items()},
                    }
                )
            )
        )
    model.eval()
    after = adapters(model)
    delta = math.sqrt(sum(float(((after[k] - before[k]) ** 2).sum()) for k in after))
    return it_metrics, delta, sync_s


def adapters(model: nn.Module) -> dict[str, mx.array]:
    return dict(tree_flatten(model.trainable_parameters()))
