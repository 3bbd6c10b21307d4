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
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

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
    """(log p(target), entropy) per position from [..., V] logits, in float32."""
    logits = logits.astype(mx.float32)
    lse = mx.logsumexp(logits, axis=-1)
    picked = mx.take_along_axis(logits, mx.stop_gradient(targets)[..., None], axis=-1).squeeze(-1)
    probs = mx.exp(logits - lse[..., None])
    entropy = lse - (probs * logits).sum(axis=-1)
    return picked - lse, mx.stop_gradient(entropy)


def completion_logprobs(
    model: nn.Module,
    tokens: mx.array,
    prompt_lens: mx.array,
    completion_len: int,
    chunk_floats: int = 1 << 24,
) -> tuple[mx.array, mx.array]:
    """Log-probs and entropies of the completion tokens, [N, C] each.

    `tokens` is [N, T]: row i holds its prompt (length prompt_lens[i]), then its
    completion, then right padding (harmless under the causal mask). Logits are
    computed only at the C positions that predict completion tokens, so no
    [N, T, V] tensor exists; rows are processed in chunks of at most `chunk_floats`
    logits, each recomputed in the backward pass (mx.checkpoint).
    """
    n, t = tokens.shape
    # Position p predicts token p + 1: completion token j of row i sits at
    # prompt_lens[i] + j and is predicted from position prompt_lens[i] + j - 1.
    offs = mx.arange(completion_len)[None, :]
    pred_pos = mx.minimum(prompt_lens[:, None] - 1 + offs, t - 2)
    targets = mx.take_along_axis(tokens, pred_pos + 1, axis=1)

    head = _output_head(model)
    if head is None:  # an architecture we cannot split: full logits, then gather
        logits = model(tokens)
        sel = mx.take_along_axis(logits, pred_pos[..., None], axis=1)
        return _logprobs_of(sel, targets)

    hidden = model.model(tokens)
    hidden = mx.take_along_axis(hidden, pred_pos[..., None], axis=1)  # [N, C, D]

    def chunk(h, y):
        return _logprobs_of(head(h), y)

    vocab = _vocab_size(model, head, hidden)
    rows = max(1, chunk_floats // max(1, completion_len * vocab))
    if rows >= n:
        return chunk(hidden, targets)
    fn = mx.checkpoint(chunk)
    parts = [fn(hidden[i : i + rows], targets[i : i + rows]) for i in range(0, n, rows)]
    return (
        mx.concatenate([p[0] for p in parts], axis=0),
        mx.concatenate([p[1] for p in parts], axis=0),
    )


def _vocab_size(model: nn.Module, head, hidden: mx.array) -> int:
    args = getattr(model, "args", None)
    if args is not None and getattr(args, "vocab_size", None):
        return int(args.vocab_size)
    return int(head(hidden[:1, :1]).shape[-1])


@dataclass
class LossInputs:
    """One update's batch: N = B*G completions, C = longest completion."""

    tokens: mx.array  # [N, T] prompt + completion + right padding
    prompt_lens: mx.array  # [N]
    mask: mx.array  # [N, C] float: 1 on completion tokens that enter the loss
    advantages: mx.array  # [N]
    old_logprobs: mx.array | None  # [N, C]; None: the current policy (num_iterations=1)
    ref_logprobs: mx.array | None  # [N, C]; None when beta == 0
    max_new_tokens: int  # dr_grpo's constant denominator


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


def aggregate(values: mx.array, mask: mx.array, loss_type: str, max_new_tokens: int) -> mx.array:
    """Reduce [N, C] per-token values to the scalar loss (see the module docstring)."""
    if loss_type == "grpo":
        per_seq = (values * mask).sum(axis=1) / mx.maximum(mask.sum(axis=1), 1.0)
        return per_seq.mean()
    if loss_type == "dr_grpo":
        return (values * mask).sum() / (mask.shape[0] * max_new_tokens)
    if loss_type == "dapo":
        return (values * mask).sum() / mx.maximum(mask.sum(), 1.0)
    raise ValueError(f"loss_type must be grpo|dr_grpo|dapo, got {loss_type!r}")


def masked_mean(x: mx.array, mask: mx.array) -> mx.array:
    return (x * mask).sum() / mx.maximum(mask.sum(), 1.0)


def grpo_loss(model: nn.Module, batch: LossInputs, cfg) -> tuple[mx.array, dict[str, mx.array]]:
    """The GRPO objective for `nn.value_and_grad`: returns (loss, metrics).

    `cfg` is a `GRPOConfig` (only epsilon, epsilon_high, beta, loss_type and
    logits_chunk are read).
    """
    c = batch.mask.shape[1]
    logp, entropy = completion_logprobs(model, batch.tokens, batch.prompt_lens, c, cfg.logits_chunk)
    old = mx.stop_gradient(logp) if batch.old_logprobs is None else batch.old_logprobs
    eps_hi = cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high
    tok_loss, kl, clipped, ratio = per_token_loss(
        logp, old, batch.ref_logprobs, batch.advantages, cfg.epsilon, eps_hi, cfg.beta
    )
    mask = batch.mask
    loss = aggregate(tok_loss, mask, cfg.loss_type, batch.max_new_tokens)
    metrics = {
        "loss/policy": aggregate(
            tok_loss - cfg.beta * kl, mask, cfg.loss_type, batch.max_new_tokens
        ),
        "kl": masked_mean(kl, mask),
        "clip/frac": masked_mean(clipped.astype(mx.float32), mask),
        "ratio/mean": masked_mean(ratio, mask),
        "entropy": masked_mean(entropy, mask),
    }
    return loss, {k: mx.stop_gradient(v) for k, v in metrics.items()}
