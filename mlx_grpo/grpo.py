r"""GRPO as we optimise it: pure functions on `mx.array`s (the log-probs themselves come
from `mlx_grpo.logprobs`).

For each prompt q we sample a group of G completions o_1..o_G from the policy at
temperature T, score them, and minimise

    L(theta) = AGG_{i,t} [ -min(rho_it * A_i, clip(rho_it, 1 - eps_lo, 1 + eps_hi) * A_i)
                           + beta * KL_it ]

over the completion tokens t of every completion i (prompt, padding and, in multi-turn
episodes, the environment's tokens are masked out), where

    rho_it = pi_theta(o_it | q, o_i<t) / pi_old(o_it | q, o_i<t)
    A_i    = (r_i - mean(r_group)) / (std(r_group) + 1e-4)          (scale_rewards="group")
    KL_it  = exp(ref_it - logp_it) - (ref_it - logp_it) - 1          (k3, always >= 0)

and ref is the same model with its LoRA adapters switched off. The defaults, and how
they depart from paper GRPO (each an option in `GRPOConfig`):

- `loss_type="dapo"` (default, AGG): the token mean over all completion tokens of the
  batch. "grpo" (paper) averages each sequence's token mean, so short sequences weigh
  more per token; "dr_grpo" sums tokens and divides by N * max_new_tokens (a constant,
  so no length bias). "turn" (multi-turn episodes) gives each reply of an episode one
  unit of weight, its token mean, and sums them over the episode's turns, then takes
  the mean over episodes: a long reply weighs no more than a short one, a decision made
  at each of five turns five times one made once (for single-turn recipes it is "grpo").
  "episode" divides that sum by the episode's turns: each episode weighs one unit,
  however many turns it took, so a group's long failures weigh no more than its short
  successes (their advantages sum to 0 over the group).
- `skip_zero_variance_groups=True` (default): groups whose rewards are all equal
  (A = 0, only the KL term) are left out of the batch, so they count neither in the
  loss nor in its divisors (N, the token count); the trainer logs their share as
  `groups/zero_variance_frac`. With False they stay in and add their KL term.
- `num_iterations=1` (default): pi_old is the current policy, so rho = 1 and the
  loss is the plain policy gradient with a group-mean baseline; clipping only acts
  when `num_iterations > 1` reuses a rollout for several updates.
- `scale_rewards="group"` (default, paper) divides by the group std; "batch" by the
  std of all rewards in the step; "none" keeps raw centred rewards (Dr. GRPO), which
  removes the up-weighting of groups that are almost all right or all wrong.
- `beta=0.04` (default): the k3 KL to the adapter-free model; 0 skips the reference
  pass. On the policy's own samples the k3 term's gradient is in expectation that of
  the forward KL(ref || pi) (as TRL's), which holds the policy to every token the
  reference would sample.
- `epsilon_high` (DAPO clip-higher) widens the upper clip only.
- `importance_sampling_level="sequence"` (GSPO, TRL's option) replaces rho_it by one
  ratio per completion, s_i = exp(mean_t log(pi_theta / pi_old)) over its loss tokens,
  clipped as a whole; with num_iterations=1, s_i = 1 and the gradient is the token
  policy gradient weighted by 1 / |o_i|. GSPO's paper clips s_i at 3e-4 / 4e-4.
- `mask_truncated_completions` drops completions that hit the length limit.
- Log-probs are always those of the untempered model (temperature only shapes
  sampling), as in TRL.
- Data-parallel runs (mlx_grpo/dist.py) split the batch over ranks and sum their
  gradients. Each rank divides by the batch's *global* count (`LossInputs.total_rows`
  and `total_tokens`), so the sum is exactly the gradient of AGG over the whole batch.
  The same holds for micro-batches (`micro_batches`, `engine.micro_batch_tokens`): a
  batch too large to hold its activations at once is split, each piece divides by the
  whole batch's counts, and the pieces' gradients are summed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_grpo.config import LOGITS_CHUNK
from mlx_grpo.env import turn_spans
from mlx_grpo.logprobs import completion_logprobs, effective_lengths, shared_inputs

ADV_EPS = 1e-4


def group_advantages(rewards: mx.array, group_size: int, scale: str = "group") -> mx.array:
    """Centre rewards on their group mean and optionally scale them.

    `rewards` is [N] with N = B * G, groups contiguous. The std is the unbiased
    sample std (TRL's convention); an all-equal group gets advantage 0.

    >>> group_advantages(mx.array([1.0, 0.0, 0.0, 0.0]), 2).tolist()  # doctest: +ELLIPSIS
    [0.707..., -0.707..., 0.0, 0.0]
    """
    if rewards.ndim != 1 or rewards.size % group_size:
        raise ValueError(f"rewards must be [B*G] with G={group_size}, got {rewards.shape}")
    r = rewards.reshape(-1, group_size)
    centred = r - r.mean(axis=1, keepdims=True)
    if scale == "group":
        std = mx.sqrt((centred**2).sum(axis=1, keepdims=True) / (group_size - 1))
        centred = centred / (std + ADV_EPS)
    elif scale == "batch":
        n = rewards.size
        std = mx.sqrt(((rewards - rewards.mean()) ** 2).sum() / max(n - 1, 1))
        centred = centred / (std + ADV_EPS)
    elif scale != "none":
        raise ValueError(f"scale_rewards must be group|batch|none, got {scale!r}")
    return centred.reshape(-1)


def zero_variance_groups(rewards: mx.array, group_size: int) -> mx.array:
    """[B] bool: groups whose G rewards are all equal (no policy-gradient signal)."""
    r = rewards.reshape(-1, group_size)
    return (r.max(axis=1) - r.min(axis=1)) <= 1e-8


@dataclass
class LossInputs:
    """One update's batch: N = B*G completions, C = longest completion."""

    prompts: list[mx.array]  # B prompts, 1-D token arrays
    completions: mx.array  # [N, C] sampled tokens, groups contiguous, right-padded
    # [N, C] float: 1 on completion tokens that enter the loss; k on those of the first
    # of k alike rows of a group, 0 on the others (`trainer.fold_alike_rows`)
    mask: mx.array
    advantages: mx.array  # [N]
    old_logprobs: mx.array | None  # [N, C]; None: the current policy (num_iterations=1)
    ref_logprobs: mx.array | None  # [N, C]; None when beta == 0
    max_new_tokens: int  # dr_grpo's constant denominator
    # Data-parallel runs: completions and loss tokens in the whole step's batch, over
    # all ranks (None: this batch is the whole batch).
    total_rows: int | None = None
    total_tokens: float | None = None
    # [N] 1.0 on the rows that are demonstrations (guidance.enabled), not the policy's own
    # samples: the metrics report them apart (`GUIDED_PARTS`).
    guided: mx.array | None = None
    # Most floats in one logits tensor: log-probs in row chunks (engine.logits_chunk).
    logits_chunk: int = LOGITS_CHUNK


def micro_batches(
    batch: LossInputs, max_positions: int | None, share: bool = True
) -> list[LossInputs]:
    """`batch` in pieces that each run at most `max_positions` sequence positions (a
    group's prompt once, plus each row up to its last loss token less, with `share`,
    what it shares with an earlier row: `group_positions`), so the update's
    activations stay bounded. Whole groups go together while they fit; a group that
    does not fit alone is cut into runs of consecutive rows (one row at least). Every
    piece carries the whole batch's counts (`total_rows`, `total_tokens`), so the
    pieces' losses, metrics and gradients sum to those of the batch. A batch that fits
    (or `max_positions` None) is returned as it is.
    """
    n, b = batch.completions.shape[0], len(batch.prompts)
    g = n // b
    lengths = effective_lengths(batch.mask)
    plens = [int(p.shape[0]) for p in batch.prompts]
    group_cost = group_positions(batch, lengths, share)
    if max_positions is None or sum(group_cost) <= max_positions:
        return [batch]

    spans: list[tuple[list[int], int, int]] = []  # (groups, first row, end row)
    run: list[int] = []
    run_cost = 0
    for i in range(b):
        if run and run_cost + group_cost[i] > max_positions:
            spans.append((run, run[0] * g, (run[-1] + 1) * g))
            run, run_cost = [], 0
        if group_cost[i] <= max_positions:
            run.append(i)
            run_cost += group_cost[i]
            continue
        # each row counted whole: an upper bound where rows of one run still share
        start, cost = i * g, plens[i]
        for r in range(i * g, (i + 1) * g):
            if r > start and cost + lengths[r] > max_positions:
                spans.append(([i], start, r))
                start, cost = r, plens[i]
            cost += lengths[r]
        spans.append(([i], start, (i + 1) * g))
    if run:
        spans.append((run, run[0] * g, (run[-1] + 1) * g))

    return _pieces(batch, spans)


def lane_pieces(batch: LossInputs, lanes: int, share: bool = True) -> list[LossInputs]:
    """`batch` in at most `lanes` pieces of about equal sequence positions (`share` as
    for `micro_batches`), to run side
    by side (`device.Lanes`): runs of whole groups where there are at least `lanes`
    groups, else each group's rows in runs (each run with its group's prompt). Every
    piece carries the whole batch's counts, as `micro_batches`'s do."""
    n, b = batch.completions.shape[0], len(batch.prompts)
    if lanes < 2 or n < 2:
        return [batch]
    g = n // b
    lengths = effective_lengths(batch.mask)
    if b >= lanes:
        cuts = _balanced_cuts(group_positions(batch, lengths, share), lanes)
        spans = [(list(range(lo, hi)), lo * g, hi * g) for lo, hi in zip(cuts, cuts[1:])]
    else:
        spans = []
        for i in range(b):
            cuts = _balanced_cuts(lengths[i * g : (i + 1) * g], lanes // b)
            spans += [([i], i * g + lo, i * g + hi) for lo, hi in zip(cuts, cuts[1:])]
    return _pieces(batch, spans)


def group_positions(batch: LossInputs, lengths: list[int], share: bool = True) -> list[int]:
    """Per group, about the positions its packed pass runs (`logprobs._Packed`): its
    prompt once, then each row up to its last loss token (`lengths`), less, with
    `share`, the inputs it opens with alike an earlier row of its group
    (`logprobs.shared_inputs`; `logprobs.shares_inputs` says whether a pass does)."""
    g = len(lengths) // len(batch.prompts)
    shared = (
        shared_inputs(np.array(batch.completions), lengths, g) if share else [None] * len(lengths)
    )
    own = [n - (0 if s is None else s[1]) for n, s in zip(lengths, shared)]
    return [int(p.shape[0]) + sum(own[i * g : (i + 1) * g]) for i, p in enumerate(batch.prompts)]


def _balanced_cuts(costs: list[int], k: int) -> list[int]:
    """Boundaries [0, ..., len(costs)] of at most k non-empty runs of `costs`, each cut
    at the boundary nearest its share of the total.

    >>> _balanced_cuts([46 + 300, 46 + 250], 2), _balanced_cuts([5, 1, 1, 1, 1, 1], 2)
    ([0, 1, 2], [0, 1, 6])
    """
    k = max(1, min(k, len(costs)))
    cum = np.cumsum([0, *costs])
    cuts = [0]
    for j in range(1, k):
        nearest = int(np.argmin(np.abs(cum - cum[-1] * j / k)))
        cuts.append(min(max(nearest, cuts[-1] + 1), len(costs) - (k - j)))
    return [*cuts, len(costs)]


def _pieces(batch: LossInputs, spans: list[tuple[list[int], int, int]]) -> list[LossInputs]:
    """The pieces of `batch` that `spans` name: (groups, first row, end row) each, every
    one with the whole batch's counts."""
    n = batch.completions.shape[0]
    total_rows = n if batch.total_rows is None else batch.total_rows
    total_tokens = batch.total_tokens
    if total_tokens is None:
        total_tokens = batch.mask.sum().item()
    pieces = []
    for groups, lo, hi in spans:
        rows = slice(lo, hi)
        pieces.append(
            replace(
                batch,
                prompts=[batch.prompts[i] for i in groups],
                completions=batch.completions[rows],
                mask=batch.mask[rows],
                advantages=batch.advantages[rows],
                old_logprobs=None if batch.old_logprobs is None else batch.old_logprobs[rows],
                ref_logprobs=None if batch.ref_logprobs is None else batch.ref_logprobs[rows],
                guided=None if batch.guided is None else batch.guided[rows],
                total_rows=total_rows,
                total_tokens=total_tokens,
            )
        )
    return pieces


def per_token_loss(
    logp: mx.array,
    old_logp: mx.array,
    ref_logp: mx.array | None,
    advantages: mx.array,
    epsilon: float,
    epsilon_high: float,
    beta: float,
    mask: mx.array | None = None,
    level: str = "token",
) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """Clipped surrogate + beta * KL per token: (loss, kl, clipped, ratio).

    `kl` is the k3 estimate of KL(policy || reference), the logged value and the term
    the loss adds beta x.

    `loss` and `kl` are [N, C]. With `level="token"` the importance ratio is per token
    and `clipped` and `ratio` are [N, C]; with `level="sequence"` (GSPO) one ratio per
    completion, exp of the mean of its token log-ratios over `mask`, is clipped as a
    whole and applies to all of its tokens; `clipped` and `ratio` are then [N, 1].
    """
    log_ratio = logp - old_logp
    if level == "sequence":
        if mask is None:
            raise ValueError("importance_sampling_level='sequence' needs the loss mask")
        count = mx.maximum(mask.sum(axis=1, keepdims=True), 1.0)
        log_ratio = (log_ratio * mask).sum(axis=1, keepdims=True) / count
    elif level != "token":
        raise ValueError(f"importance_sampling_level must be token|sequence, got {level!r}")
    ratio = mx.exp(log_ratio)
    adv = advantages[:, None]
    unclipped = ratio * adv
    clipped = mx.clip(ratio, 1 - epsilon, 1 + epsilon_high) * adv
    loss = mx.broadcast_to(-mx.minimum(unclipped, clipped), logp.shape)
    is_clipped = ((ratio < 1 - epsilon) & (adv < 0)) | ((ratio > 1 + epsilon_high) & (adv > 0))
    if ref_logp is not None and beta > 0:
        d = ref_logp - logp
        kl = mx.exp(d) - d - 1
        loss = loss + beta * kl
    else:
        kl = mx.zeros_like(logp)
    return loss, kl, is_clipped, ratio


def aggregate(
    values: mx.array,
    mask: mx.array,
    loss_type: str,
    max_new_tokens: int,
    total_rows: int | None = None,
    total_tokens: float | None = None,
    weights: mx.array | None = None,
) -> mx.array:
    """Reduce [N, C] per-token values to the scalar loss (see the module docstring).

    `total_rows` / `total_tokens` replace N and the mask's token count when this batch
    is one rank's share of a larger one: the ranks' results then sum to the loss of
    the whole batch. `weights`: `turn_weights(mask)` when already computed.
    """
    if loss_type == "grpo":  # (a row's token count: a mask may weigh a row k times)
        per_seq = (values * mask).sum(axis=1) / mx.maximum((mask > 0).sum(axis=1), 1.0)
        return per_seq.mean() if total_rows is None else per_seq.sum() / total_rows
    if loss_type == "dr_grpo":
        rows = mask.shape[0] if total_rows is None else total_rows
        return (values * mask).sum() / (rows * max_new_tokens)
    if loss_type == "dapo":
        return masked_mean(values, mask, total_tokens)
    if loss_type in ("turn", "episode"):
        w = turn_weights(mask, loss_type == "episode") if weights is None else weights
        per_seq = (values * mask * w).sum(axis=1)
        return per_seq.mean() if total_rows is None else per_seq.sum() / total_rows
    raise ValueError(f"loss_type must be grpo|dr_grpo|dapo|turn|episode, got {loss_type!r}")


def turn_weights(mask: mx.array, per_episode: bool = False) -> mx.array:
    """[N, C]: 1 / (length of its turn) on each loss token, a turn being a run of
    consecutive loss tokens (one reply of a multi-turn episode; the whole completion
    of a single-turn one); `per_episode` divides a row's weights by its number of turns,
    so that they sum to 1. A constant of the update (computed from the mask).

    >>> (6 * np.array(turn_weights(mx.array([[1.0, 1, 0, 0, 1, 1, 1, 0]])))).round(2).tolist()
    [[3.0, 3.0, 0.0, 0.0, 2.0, 2.0, 2.0, 0.0]]
    >>> (6 * np.array(turn_weights(mx.array([[1.0, 1, 0, 0, 1, 1, 1, 0]]), True))).tolist()
    [[1.5, 1.5, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0]]
    """
    m = np.array(mask)
    w = np.zeros(m.shape, np.float32)
    for row in range(m.shape[0]):
        spans = turn_spans(m[row])
        for start, end in spans:
            w[row, start:end] = 1.0 / (end - start) / (len(spans) if per_episode else 1)
    return mx.array(w)


def masked_mean(x: mx.array, mask: mx.array, total_tokens: float | None = None) -> mx.array:
    count = mask.sum() if total_tokens is None else total_tokens
    return (x * mask).sum() / mx.maximum(count, 1.0)


# The metrics `grpo_loss` returns; all are sums over tokens or sequences divided by
# the batch's count, so ranks' values add up to the whole batch's.
# The demonstration rows' share of the loss tokens and of the token sums of entropy and
# log-prob (each divided by the batch's token count, so they add up over pieces and
# ranks like the rest); `split_guided` turns them into per-token means.
GUIDED_PARTS = ("guided/token_frac", "guided/entropy_frac", "guided/logp_frac", "guided/kl_frac")
# The same for the tokens the update reinforces (the policy's own samples with a positive
# advantage); `split_reinforced` turns them into `entropy/reinforced`.
REINFORCED_PARTS = ("reinforced/token_frac", "reinforced/entropy_frac")
LOSS_METRICS = (
    "loss/policy",
    "kl",
    "clip/frac",
    "ratio/mean",
    "entropy",
    *GUIDED_PARTS,
    *REINFORCED_PARTS,
)


def grpo_loss(model: nn.Module, batch: LossInputs, cfg) -> tuple[mx.array, dict[str, mx.array]]:
    """The GRPO objective for `nn.value_and_grad`: returns (loss, metrics).

    `cfg` is a `GRPOConfig` (the objective's section).
    """
    logp, entropy = completion_logprobs(
        model,
        batch.prompts,
        batch.completions,
        batch.logits_chunk,
        mask=batch.mask,
    )
    return objective(logp, entropy, batch, cfg)


def objective(
    logp: mx.array,
    entropy: mx.array,
    batch: LossInputs,
    cfg,
    weights: mx.array | None = None,
) -> tuple[mx.array, dict[str, mx.array]]:
    """(loss, metrics) from the policy's log-probs and entropies ([N, C]) of `batch`.

    The counts may be arrays (`mlx_grpo.compiled` passes them so); `weights` is
    `turn_weights(batch.mask)` when already known.
    """
    old = mx.stop_gradient(logp) if batch.old_logprobs is None else batch.old_logprobs
    eps_hi = cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high
    mask, tokens = batch.mask, batch.total_tokens
    level = cfg.importance_sampling_level
    beta = cfg.beta
    tok_loss, kl, clipped, ratio = per_token_loss(
        logp, old, batch.ref_logprobs, batch.advantages, cfg.epsilon, eps_hi, beta, mask, level
    )
    counts = (cfg.loss_type, batch.max_new_tokens, batch.total_rows, tokens, weights)
    loss = aggregate(tok_loss, mask, *counts)
    if level == "sequence":  # one ratio per completion: means over completions, as TRL's
        rows = mask.shape[0] if batch.total_rows is None else batch.total_rows
        w = mask.max(axis=1, keepdims=True)  # a row's weight (1, k for alike rows, 0)
        clip_frac = (clipped.astype(mx.float32) * w).sum() / rows
        # A row with no loss tokens has ratio 1 (as in TRL); a folded row's share is in
        # the weight of the row it folded into, so the empty rows of the batch number
        # its rows less the weights.
        ratio_mean = ((ratio * w).sum() + mask.shape[0] - w.sum()) / rows
    else:
        clip_frac = masked_mean(clipped.astype(mx.float32), mask, tokens)
        ratio_mean = masked_mean(ratio, mask, tokens)
    metrics = {
        "loss/policy": aggregate(tok_loss - beta * kl, mask, *counts),
        "kl": masked_mean(kl, mask, tokens),
        "clip/frac": clip_frac,
        "ratio/mean": ratio_mean,
        "entropy": masked_mean(entropy, mask, tokens),
    }
    count = tokens if tokens is not None else mask.sum()
    demo = mask * (0.0 if batch.guided is None else batch.guided[:, None])
    for key, x in zip(GUIDED_PARTS, (1.0, entropy, logp, kl)):
        metrics[key] = masked_mean(x, demo, count)
    up = (mask - demo) * (batch.advantages > 0)[:, None]
    for key, x in zip(REINFORCED_PARTS, (1.0, entropy)):
        metrics[key] = masked_mean(x, up, count)
    return loss, {k: mx.stop_gradient(v) for k, v in metrics.items()}


def split_guided(metrics: dict) -> dict:
    """`metrics` of an update with the demonstration rows reported apart: `entropy` and
    `kl` over the policy's own samples only (what the guards watch; on a token the
    policy did not sample, k3 is no estimate of the KL), and `guidance/entropy`,
    `guidance/kl`, `guidance/logp` (the mean log-prob of a demonstration token: it rises
    as the policy takes the demonstrations in) and `guidance/token_frac`, when
    demonstrations were in the batch; without them, `metrics` as they are. An update of
    demonstrations alone has no `entropy` or `kl`.

    >>> split_guided({"entropy": 0.5, "kl": 0.25, "guided/token_frac": 0.5,
    ...               "guided/entropy_frac": 0.125, "guided/logp_frac": -0.5,
    ...               "guided/kl_frac": 0.25})  # doctest: +NORMALIZE_WHITESPACE
    {'entropy': 0.75, 'kl': 0.0, 'guidance/entropy': 0.25, 'guidance/logp': -1.0,
     'guidance/kl': 0.5, 'guidance/token_frac': 0.5}
    """
    out = {k: v for k, v in metrics.items() if k not in GUIDED_PARTS}
    frac = metrics.get("guided/token_frac", 0.0)
    if frac <= 0:
        return out
    for key in ("entropy", "kl"):
        if frac < 1:
            out[key] = (metrics[key] - metrics[f"guided/{key}_frac"]) / (1 - frac)
        else:  # no sampled token entered the update
            del out[key]
    for key in ("entropy", "logp", "kl"):
        out[f"guidance/{key}"] = metrics[f"guided/{key}_frac"] / frac
    out["guidance/token_frac"] = frac
    return out


def split_reinforced(metrics: dict) -> dict:
    """`metrics` with `REINFORCED_PARTS` turned into `entropy/reinforced`: the mean token
    entropy of the replies the update reinforces (the policy's own samples with a
    positive advantage), absent when it reinforced none. `entropy` is over every loss
    token, and in a batch of one or two groups a few long failures that ramble carry
    most of it (the update pushes those down); this one moves when what is taught
    drifts.

    >>> split_reinforced({"entropy": 0.5, "reinforced/token_frac": 0.25,
    ...                   "reinforced/entropy_frac": 0.025})
    {'entropy': 0.5, 'entropy/reinforced': 0.1}
    """
    out = {k: v for k, v in metrics.items() if k not in REINFORCED_PARTS}
    frac = metrics.get("reinforced/token_frac", 0.0)
    if frac > 0:
        out["entropy/reinforced"] = metrics["reinforced/entropy_frac"] / frac
    return out
