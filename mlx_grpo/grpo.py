r"""GRPO as we optimise it: pure functions on `mx.array`s.

For each prompt q we sample a group of G completions o_1..o_G from the policy at
temperature T, score them, and minimise

    L(theta) = AGG_{i,t} [ -min(rho_it * A_i, clip(rho_it, 1 - eps_lo, 1 + eps_hi) * A_i)
                           + beta * KL_it ]

over the completion tokens t of every completion i (prompt and padding tokens are
masked out), where

    rho_it = pi_theta(o_it | q, o_i<t) / pi_old(o_it | q, o_i<t)
    A_i    = (r_i - mean(r_group)) / (std(r_group) + 1e-4)          (scale_rewards="group")
    KL_it  = exp(ref_it - logp_it) - (ref_it - logp_it) - 1          (k3, always >= 0)

and ref is the same model with its LoRA adapters switched off. Departures from paper
GRPO, each an option in `GRPOConfig`:

- `num_iterations=1` (default): pi_old is the current policy, so rho = 1 and the
  loss is the plain policy gradient with a group-mean baseline; clipping only acts
  when `num_iterations > 1` reuses a rollout for several updates.
- `scale_rewards`: "group" divides by the group std (paper); "batch" by the std of
  all rewards in the step; "none" keeps raw centred rewards (Dr. GRPO), which
  removes the up-weighting of groups that are almost all right or all wrong.
- `loss_type` (AGG): "grpo" averages each sequence's token mean (short sequences
  weigh more per token); "dr_grpo" sums tokens and divides by N * max_new_tokens
  (a constant, so no length bias); "dapo" averages over all completion tokens of
  the batch.
- `epsilon_high` (DAPO clip-higher) widens the upper clip only.
- `mask_truncated_completions` drops completions that hit the length limit.
- Log-probs are always those of the untempered model (temperature only shapes
  sampling), as in TRL.
- Groups whose rewards are all equal get A = 0 and contribute only the KL term.
- Data-parallel runs (mlx_grpo/dist.py) split the batch over ranks and sum their
  gradients. Each rank divides by the batch's *global* count (`LossInputs.total_rows`
  and `total_tokens`), so the sum is exactly the gradient of AGG over the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache, create_attention_mask, make_prompt_cache

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


def _output_head(model: nn.Module):
    """The model's vocab projection, so logits can be computed for chosen positions only."""
    if getattr(model, "lm_head", None) is not None:
        return model.lm_head
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if embed is not None and hasattr(embed, "as_linear"):
        return embed.as_linear
    return None


def _logprobs_of(logits: mx.array, targets: mx.array) -> tuple[mx.array, mx.array]:
    """(log p(target), entropy) per position from [..., V] logits, in float32.

    One `exp` over the vocabulary serves the normaliser, the entropy and (through the
    saved output of `exp`) the backward pass: on CPUs a vocabulary-wide exp costs more
    than the GEMM that made the logits, and logsumexp + softmax would take three.
    """
    shifted = logits.astype(mx.float32)
    shifted = shifted - mx.stop_gradient(shifted.max(axis=-1, keepdims=True))
    e = mx.exp(shifted)
    total = e.sum(axis=-1)
    log_total = mx.log(total)
    picked = mx.take_along_axis(shifted, mx.stop_gradient(targets)[..., None], axis=-1)
    entropy = log_total - (e * shifted).sum(axis=-1) / total
    return picked.squeeze(-1) - log_total, mx.stop_gradient(entropy)


class _PrefixCache:
    """A differentiable KV cache for one group: the prompt's keys/values, computed once,
    then shared (broadcast, not copied) by the group's G completions.

    It speaks the part of mlx_lm's cache protocol that attention layers use
    (`offset`, `update_and_fetch`, `make_mask`) and keeps everything in the graph, so
    gradients reach the LoRA weights through the prompt positions too.
    """

    def __init__(self):
        self.keys = self.values = None
        self.offset = 0

    def update_and_fetch(self, keys, values):
        if self.keys is not None:
            keys = mx.concatenate([self.keys, keys], axis=2)
            values = mx.concatenate([self.values, values], axis=2)
        self.keys, self.values = keys, values
        self.offset = keys.shape[2]
        return keys, values

    def shared(self, rows: int) -> _PrefixCache:
        """A cache for `rows` completions on top of this (prompt) cache, which stays as is."""
        out = _PrefixCache()
        out.keys = mx.broadcast_to(self.keys, (rows, *self.keys.shape[1:]))
        out.values = mx.broadcast_to(self.values, (rows, *self.values.shape[1:]))
        out.offset = self.offset
        return out

    def make_mask(self, n, return_array=False, window_size=None):
        return create_attention_mask(n, self.offset, return_array, window_size)


def _splittable(model: nn.Module) -> bool:
    """True for mlx_lm models with an inner `.model`, an output head we can call on
    chosen positions, and plain KV caches (no sliding windows or SSM state)."""
    inner = getattr(model, "model", None)
    return (
        inner is not None
        and _output_head(model) is not None
        and all(isinstance(c, KVCache) for c in make_prompt_cache(model))
    )


# A separate pass for a bucket of completions costs about as much as this many more
# padded positions (dispatch and Python work per layer); it sets how finely rows are
# bucketed by length.
BUCKET_OVERHEAD_POSITIONS = 24


def length_buckets(lengths: list[int], overhead: int | None = None) -> list[list[int]]:
    """Rows grouped so that padding each group to its own longest row costs least.

    Rows of length 0 are left out (nothing of them enters the loss). Sorted by length,
    the best split into contiguous runs is found exactly (cost: rows x longest +
    `overhead` per run).

    >>> length_buckets([64, 3, 60, 2, 0])
    [[0, 2], [1, 3]]
    >>> length_buckets([64, 60, 62])
    [[0, 2, 1]]
    """
    overhead = BUCKET_OVERHEAD_POSITIONS if overhead is None else overhead
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: -lengths[i])
    n = len(order)
    best, cut = [0] + [float("inf")] * n, [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):
            cost = best[i] + (j - i) * lengths[order[i]] + overhead
            if cost < best[j]:
                best[j], cut[j] = cost, i
    out, j = [], n
    while j > 0:
        out.append(order[cut[j] : j])
        j = cut[j]
    return out[::-1]


def _group_logprobs(model, head, prompt, completions, lengths, chunk_floats, vocab, mask=None):
    """(log-probs, entropies) [G, C] of one group's completions.

    The prompt runs once ([1, P]); its keys and values are shared (broadcast) by the
    completions, which run in length buckets, each padded only to its own longest
    row. Completion token j is predicted from position P - 1 + j: the prompt's last
    position for j = 0, then the completion's own positions. Positions at or past a
    row's length are returned as 0, and so are positions off `mask` (numpy [G, C] bool,
    or None for all) when the head skips them (see _head_logprobs_at).
    """
    g, c = completions.shape
    cache = [_PrefixCache() for _ in model.layers]
    h_last = model.model(prompt[None], cache=cache)[:, -1:]
    parts, rows = [], []
    for bucket in length_buckets(lengths):
        n, cb = len(bucket), max(lengths[i] for i in bucket)
        if n == g:
            bucket = list(range(g))  # the whole group, in order: no gather
        tokens = completions[mx.array(bucket)] if n < g else completions
        first = mx.broadcast_to(h_last, (n, 1, h_last.shape[-1]))
        if cb > 1:
            h = model.model(tokens[:, : cb - 1], cache=[pc.shared(n) for pc in cache])
            first = mx.concatenate([first, h], axis=1)
        on = None if mask is None else mask[bucket, :cb]
        if on is not None and on.mean() < SPARSE_HEAD_SHARE:
            lp, ent = _head_logprobs_at(head, first, tokens[:, :cb], on, chunk_floats, vocab)
        else:
            lp, ent = _head_logprobs(head, first, tokens[:, :cb], chunk_floats, vocab)
        if cb < c:
            lp, ent = mx.pad(lp, [(0, 0), (0, c - cb)]), mx.pad(ent, [(0, 0), (0, c - cb)])
        parts.append((lp, ent))
        rows += bucket
    if len(rows) < g:  # rows with nothing in the loss
        parts.append((mx.zeros((g - len(rows), c)), mx.zeros((g - len(rows), c))))
        done = set(rows)
        rows += [i for i in range(g) if i not in done]
    lp = mx.concatenate([p[0] for p in parts], axis=0)
    ent = mx.concatenate([p[1] for p in parts], axis=0)
    if rows != list(range(g)):
        back = mx.array(np.argsort(rows))
        lp, ent = lp[back], ent[back]
    return lp, ent


def _head_logprobs(head, hidden, targets, chunk_floats, vocab):
    """Log-probs and entropies from hidden states, in row chunks of at most
    `chunk_floats` logits that are recomputed in the backward pass (mx.checkpoint)."""
    n, c = targets.shape

    def chunk(h, y):
        return _logprobs_of(head(h), y)

    rows = max(1, chunk_floats // max(1, c * vocab))
    if rows >= n:
        return chunk(hidden, targets)
    fn = mx.checkpoint(chunk)
    parts = [fn(hidden[i : i + rows], targets[i : i + rows]) for i in range(0, n, rows)]
    return (
        mx.concatenate([p[0] for p in parts], axis=0),
        mx.concatenate([p[1] for p in parts], axis=0),
    )


# Below this share of loss positions in a bucket, the output head runs only on those
# positions: in a multi-turn episode most positions are the environment's observations,
# and the head (a vocab-sized matmul and log-softmax per position) would dominate.
SPARSE_HEAD_SHARE = 0.5


def _head_logprobs_at(head, hidden, targets, on, chunk_floats, vocab):
    """_head_logprobs at the positions where `on` ([n, c] numpy bool) is set, 0 elsewhere:
    the hidden states there are gathered into one [M, 1] batch, and the results are
    gathered back (the backward pass scatters their gradients to the same positions)."""
    n, c = targets.shape
    flat = np.flatnonzero(on.reshape(-1))
    m = len(flat)
    if m == 0:
        return mx.zeros((n, c)), mx.zeros((n, c))
    pick = mx.array(flat)
    h = hidden.reshape(n * c, -1)[pick][:, None]
    lp, ent = _head_logprobs(head, h, targets.reshape(-1)[pick][:, None], chunk_floats, vocab)
    back = np.full(n * c, m)  # off-mask positions read the trailing 0
    back[flat] = np.arange(m)
    back = mx.array(back)
    zero = mx.zeros((1,))
    return (
        mx.concatenate([lp[:, 0], zero])[back].reshape(n, c),
        mx.concatenate([ent[:, 0], zero])[back].reshape(n, c),
    )


def effective_lengths(mask: mx.array) -> list[int]:
    """Per row, one past the last position whose mask is set (0 for an empty row):
    later positions cannot affect the loss (the attention is causal)."""
    m = np.array(mask) > 0
    last = m.shape[1] - np.argmax(m[:, ::-1], axis=1)
    return np.where(m.any(axis=1), last, 0).tolist()


def completion_logprobs(
    model: nn.Module,
    prompts: list[mx.array],
    completions: mx.array,
    chunk_floats: int = 1 << 24,
    lengths: list[int] | None = None,
    mask: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """Log-probs and entropies of the completion tokens, [N, C] each.

    `prompts` holds the B prompts (1-D token arrays); `completions` is [N, C] with
    N = B * G, group b in rows b*G..(b+1)*G-1, right-padded (padding sits after the
    tokens it could affect, so the causal mask keeps it out). `lengths` (default: C
    for every row) says how many leading positions of each row are needed; the rest
    are returned as 0 and cost nothing. Each prompt is run once for its whole group,
    completions run in buckets of similar length, and logits are computed only at the
    positions that predict completion tokens, in row chunks of at most `chunk_floats`
    logits that are recomputed in the backward pass (mx.checkpoint). With `mask` ([N, C],
    the loss mask), the lengths come from it and, where the mask is sparse (the
    environment's tokens of a multi-turn episode), logits are computed only at its
    positions; log-probs and entropies off the mask are then 0.
    """
    n, c = completions.shape
    g = n // len(prompts)
    if g * len(prompts) != n:
        raise ValueError(f"{n} completions do not split into {len(prompts)} groups")

    if not _splittable(model):  # any other architecture: full sequences, full logits
        return _full_sequence_logprobs(model, prompts, completions, g)

    head = _output_head(model)
    on = None if mask is None else np.array(mask) > 0
    if lengths is None:
        lengths = [c] * n if mask is None else effective_lengths(mask)
    lengths = [min(int(x), c) for x in lengths]
    vocab = _vocab_size(model, head, completions)
    parts = [
        _group_logprobs(
            model,
            head,
            p,
            completions[b * g : (b + 1) * g],
            lengths[b * g : (b + 1) * g],
            chunk_floats,
            vocab,
            None if on is None else on[b * g : (b + 1) * g],
        )
        for b, p in enumerate(prompts)
    ]
    if len(parts) == 1:
        return parts[0]
    return (
        mx.concatenate([p[0] for p in parts], axis=0),
        mx.concatenate([p[1] for p in parts], axis=0),
    )


def _full_sequence_logprobs(model, prompts, completions, g):
    n, c = completions.shape
    rows = [mx.concatenate([prompts[i // g], completions[i]]) for i in range(n)]
    t = max(r.shape[0] for r in rows)
    tokens = mx.stack([mx.pad(r, (0, t - r.shape[0])) for r in rows])
    starts = mx.array([prompts[i // g].shape[0] - 1 for i in range(n)])
    pos = starts[:, None] + mx.arange(c)[None, :]
    logits = mx.take_along_axis(model(tokens), pos[..., None], axis=1)
    return _logprobs_of(logits, completions)


def _vocab_size(model: nn.Module, head, completions: mx.array) -> int:
    args = getattr(model, "args", None)
    if args is not None and getattr(args, "vocab_size", None):
        return int(args.vocab_size)
    return int(model(completions[:1, :1]).shape[-1])


@dataclass
class LossInputs:
    """One update's batch: N = B*G completions, C = longest completion."""

    prompts: list[mx.array]  # B prompts, 1-D token arrays
    completions: mx.array  # [N, C] sampled tokens, groups contiguous, right-padded
    mask: mx.array  # [N, C] float: 1 on completion tokens that enter the loss
    advantages: mx.array  # [N]
    old_logprobs: mx.array | None  # [N, C]; None: the current policy (num_iterations=1)
    ref_logprobs: mx.array | None  # [N, C]; None when beta == 0
    max_new_tokens: int  # dr_grpo's constant denominator
    # Data-parallel runs: completions and loss tokens in the whole step's batch, over
    # all ranks (None: this batch is the whole batch).
    total_rows: int | None = None
    total_tokens: float | None = None


def per_token_loss(
    logp: mx.array,
    old_logp: mx.array,
    ref_logp: mx.array | None,
    advantages: mx.array,
    epsilon: float,
    epsilon_high: float,
    beta: float,
) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """Clipped surrogate + beta * k3 KL per token: (loss, kl, clipped, ratio), [N, C]."""
    ratio = mx.exp(logp - old_logp)
    adv = advantages[:, None]
    unclipped = ratio * adv
    clipped = mx.clip(ratio, 1 - epsilon, 1 + epsilon_high) * adv
    loss = -mx.minimum(unclipped, clipped)
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
) -> mx.array:
    """Reduce [N, C] per-token values to the scalar loss (see the module docstring).

    `total_rows` / `total_tokens` replace N and the mask's token count when this batch
    is one rank's share of a larger one: the ranks' results then sum to the loss of
    the whole batch.
    """
    if loss_type == "grpo":
        per_seq = (values * mask).sum(axis=1) / mx.maximum(mask.sum(axis=1), 1.0)
        return per_seq.mean() if total_rows is None else per_seq.sum() / total_rows
    if loss_type == "dr_grpo":
        rows = mask.shape[0] if total_rows is None else total_rows
        return (values * mask).sum() / (rows * max_new_tokens)
    if loss_type == "dapo":
        return masked_mean(values, mask, total_tokens)
    raise ValueError(f"loss_type must be grpo|dr_grpo|dapo, got {loss_type!r}")


def masked_mean(x: mx.array, mask: mx.array, total_tokens: float | None = None) -> mx.array:
    count = mask.sum() if total_tokens is None else total_tokens
    return (x * mask).sum() / mx.maximum(count, 1.0)


# The metrics `grpo_loss` returns; all are sums over tokens or sequences divided by
# the batch's count, so ranks' values add up to the whole batch's.
LOSS_METRICS = ("loss/policy", "kl", "clip/frac", "ratio/mean", "entropy")


def grpo_loss(model: nn.Module, batch: LossInputs, cfg) -> tuple[mx.array, dict[str, mx.array]]:
    """The GRPO objective for `nn.value_and_grad`: returns (loss, metrics).

    `cfg` is a `GRPOConfig` (only epsilon, epsilon_high, beta, loss_type and
    logits_chunk are read).
    """
    logp, entropy = completion_logprobs(
        model, batch.prompts, batch.completions, cfg.logits_chunk, mask=batch.mask
    )
    old = mx.stop_gradient(logp) if batch.old_logprobs is None else batch.old_logprobs
    eps_hi = cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high
    tok_loss, kl, clipped, ratio = per_token_loss(
        logp, old, batch.ref_logprobs, batch.advantages, cfg.epsilon, eps_hi, cfg.beta
    )
    mask, tokens = batch.mask, batch.total_tokens
    counts = (cfg.loss_type, batch.max_new_tokens, batch.total_rows, tokens)
    loss = aggregate(tok_loss, mask, *counts)
    metrics = {
        "loss/policy": aggregate(tok_loss - cfg.beta * kl, mask, *counts),
        "kl": masked_mean(kl, mask, tokens),
        "clip/frac": masked_mean(clipped.astype(mx.float32), mask, tokens),
        "ratio/mean": masked_mean(ratio, mask, tokens),
        "entropy": masked_mean(entropy, mask, tokens),
    }
    return loss, {k: mx.stop_gradient(v) for k, v in metrics.items()}
