"""The elementwise, reduction and attention ops of the passes and samplers, each the
fastest one for the device MLX computes on, and the sampling arithmetic built on them.

MLX's Linux CPU backend runs `exp`, the sigmoid and a reduction over the last axis one
element at a time, and attention unfused over the whole score array; on a Linux CPU
`exp`, `row_max`, `row_sum`, `swiglu` and `attention` are `mlx_grpo.cpu.fastmath`'s
(vectorised, blocked, or native ops), and `packed_attention` and `decode_attention`
are the native ops where they built. Which device that is, `mlx_grpo.device` decides;
on a GPU these are MLX's and mlx_lm's own ops (and the native ones None), and nothing
of `mlx_grpo.cpu` is imported.

`categorical` draws by the inverse CDF: one exp and one uniform number per row, the
running sum over the one block of the vocabulary that holds the draw, where
`mx.random.categorical` takes a uniform number and two logs per vocabulary entry
(Gumbel-max). `softmax_parts` gives a decode step the entropy and the weights to draw
from with one exp over the vocabulary, and `top_k` the k best entries of a row from
its blocks' maxima.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.activations import swiglu as _mlx_lm_swiglu

from mlx_grpo.device import cpu_kernels


def exp(x: mx.array) -> mx.array:
    """e^x elementwise."""
    fast = cpu_kernels()
    return mx.exp(x) if fast is None else fast.exp(x)


def row_max(x: mx.array, keepdims: bool = False) -> mx.array:
    """`x.max(axis=-1, keepdims=keepdims)`, the same numbers."""
    fast = cpu_kernels()
    return x.max(axis=-1, keepdims=keepdims) if fast is None else fast.row_max(x, keepdims)


def row_sum(x: mx.array, keepdims: bool = False) -> mx.array:
    """`x.sum(axis=-1, keepdims=keepdims)`, within float32 rounding (a CPU adds in
    another grouping)."""
    fast = cpu_kernels()
    return x.sum(axis=-1, keepdims=keepdims) if fast is None else fast.row_sum(x, keepdims)


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """silu(gate) * x, the gated MLP's activation (mlx_lm's `swiglu`)."""
    fast = cpu_kernels()
    return _mlx_lm_swiglu(gate, x) if fast is None else fast.swiglu(gate, x)


def attention(q, k, v, scale: float, mask=None) -> mx.array:
    """softmax(q k^T scale + mask) v, as `mx.fast.scaled_dot_product_attention(q, k, v,
    scale=scale, mask=mask)` (mask None, "causal" or an array)."""
    fast = cpu_kernels()
    if fast is None:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    return fast.attention(q, k, v, scale, mask)


def packed_attention(q: mx.array, k: mx.array, v: mx.array, meta: mx.array, scale: float):
    """The packed pass's attention in one native op (`mlx_grpo.cpu.native`), or None
    where there is none: then the caller computes it with `attention`."""
    fast = cpu_kernels()
    return None if fast is None else fast.packed_attention(q, k, v, meta, scale)


def decode_attention(q: mx.array, k: mx.array, v: mx.array, bias: mx.array):
    """One decode step's attention in one native op (`mlx_grpo.cpu.native`), or None
    where there is none: then the caller computes it with MLX's ops."""
    fast = cpu_kernels()
    return None if fast is None else fast.decode_attention(q, k, v, bias)


def entropy(logprobs: mx.array) -> mx.array:
    """-sum p log p over the last axis of log-probabilities, in
    float32, with `exp`; a masked token (log-prob -inf) adds 0."""
    lp = logprobs.astype(mx.float32)
    p = exp(lp)
    return -row_sum(mx.where(p > 0, p * lp, 0.0))


def uniform_rows(keys: mx.array) -> mx.array:
    """[n, 1] uniform numbers in [0, 1), row i drawn from keys[i] ([n, 2]): the number
    `mx.random.uniform(shape=(1,), key=keys[i])` gives, for all rows in one call."""
    return mx.vmap(lambda k: mx.random.uniform(shape=(1,), key=k))(keys)


def softmax_parts(logits: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """(s = logits - max, e = exp(s), log Z, entropy) over the last axis, in float32, with
    Z = sum e (so log-probs are s - log Z) and entropy = log Z - sum(e s) / Z: what a
    decode step needs of a row's distribution from one exp over the vocabulary, where
    log-probs then `entropy` take two and write the log-probs in between. A logit of
    -inf adds 0 to the entropy."""
    x = logits.astype(mx.float32)
    s = x - row_max(x, keepdims=True)
    e = exp(s)
    total = row_sum(e, keepdims=True)
    log_z = mx.log(total)
    spread = row_sum(mx.where(e > 0, e * s, 0.0), keepdims=True)
    return s, e, log_z, (log_z - spread / total).squeeze(-1)


# Rows wider than this are searched by blocks: the blocks' sums first, then a running
# sum over the one block that holds the draw, instead of a running sum and two counts
# over the whole row (a 49,152-word vocabulary: three passes over the row become one).
CDF_BLOCK = 1024


def _first_above(c: mx.array, target: mx.array, last: mx.array) -> mx.array:
    """Per row, the number of running sums c_i <= target (the first i with c_i > target),
    or, where target rounds up to the row's end `last`, the first i with c_i = last,
    whose weight is above 0, instead of one past the end."""
    return mx.minimum((c <= target).sum(axis=-1), (c < last).sum(axis=-1))


def inverse_cdf(w: mx.array, u: mx.array) -> mx.array:
    """Per row of weights w >= 0 ([n, V], not all 0), the first i with w_0 + ... + w_i >
    u * sum(w), for uniform numbers u ([n, 1]): a draw of i with probability w_i / sum(w);
    an entry of weight 0 is never drawn. Int32 [n]."""
    n, v = w.shape
    if v <= 2 * CDF_BLOCK:
        c = mx.cumsum(w, axis=-1)
        return _first_above(c, u * c[:, -1:], c[:, -1:]).astype(mx.int32)
    nb = -(-v // CDF_BLOCK)
    if nb * CDF_BLOCK > v:
        w = mx.concatenate([w, mx.zeros((n, nb * CDF_BLOCK - v), w.dtype)], axis=-1)
    blocks = w.reshape(n, nb, CDF_BLOCK)
    sums = blocks.sum(axis=-1)
    ends = mx.cumsum(sums, axis=-1)
    target = u * ends[:, -1:]
    b = _first_above(ends, target, ends[:, -1:])[:, None]  # [n, 1]: the block of the draw
    before = mx.take_along_axis(ends - sums, b, axis=-1)
    inner = mx.take_along_axis(blocks, mx.broadcast_to(b[..., None], (n, 1, CDF_BLOCK)), axis=1)
    c = before + mx.cumsum(inner[:, 0], axis=-1)
    return (b[:, 0] * CDF_BLOCK + _first_above(c, target, c[:, -1:])).astype(mx.int32)


def categorical(
    logits: mx.array, key: mx.array | None = None, u: mx.array | None = None
) -> mx.array:
    """One draw per row from softmax(logits) ([..., V] -> [...], uint32), from `key`
    when given, else the global RNG, or from the uniform numbers `u` ([..., 1]) when
    given. Entries at -inf are never drawn.

    By inverse CDF (`inverse_cdf`) over the weights exp(logits - max). Where u * sum
    rounds up to the sum (about once in 2^24 draws), the draw is the last entry of
    weight above 0 instead of running off the end.
    """
    logits = logits.astype(mx.float32)
    lead, v = logits.shape[:-1], logits.shape[-1]
    w = exp(logits - row_max(logits, keepdims=True)).reshape(-1, v)
    if u is None:
        u = mx.random.uniform(shape=(*lead, 1), key=key)
    picked = inverse_cdf(w, u.reshape(-1, 1))
    return picked.reshape(lead).astype(mx.uint32)


# Rows wider than TOP_K_BLOCK * 2k are searched by blocks of this many entries: the
# blocks' maxima first, then the entries of the k best blocks, instead of a partition
# of the whole row (a 49,152-word vocabulary at k = 20: 1.7 ms instead of 9 ms a decode
# step of 16 rows on a 2-core EPYC).
TOP_K_BLOCK = 256


def top_k(x: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """(ids, values) of the k largest entries of each row of x ([n, V] -> [n, k] each),
    in no particular order: the same values as `mx.argpartition(-x, kth=k - 1)[:, :k]`
    picks (where entries tie, either id may come). Wide rows go by blocks: every block
    holding one of the k largest has a maximum at least the k-th largest, so the k
    blocks of largest maxima hold k entries that large. A row with fewer than k entries
    above -inf may fill up with -inf entries of any id below V."""
    n, v = x.shape
    k = min(k, v)
    nb = -(-v // TOP_K_BLOCK)
    if nb < 2 * k:
        ids = mx.argpartition(-x, kth=k - 1, axis=-1)[:, :k]
        return ids, mx.take_along_axis(x, ids, axis=-1)
    if nb * TOP_K_BLOCK > v:
        x = mx.concatenate([x, mx.full((n, nb * TOP_K_BLOCK - v), -mx.inf, x.dtype)], axis=-1)
    blocks = x.reshape(n, nb, TOP_K_BLOCK)
    best = mx.argpartition(-blocks.max(axis=-1), kth=k - 1, axis=-1)[:, :k]  # [n, k]
    cand = mx.take_along_axis(blocks, best[..., None], axis=1).reshape(n, k * TOP_K_BLOCK)
    pick = mx.argpartition(-cand, kth=k - 1, axis=-1)[:, :k]
    block = mx.take_along_axis(best, pick // TOP_K_BLOCK, axis=-1)
    ids = mx.minimum(block * TOP_K_BLOCK + pick % TOP_K_BLOCK, v - 1)  # padding: -inf
    return ids.astype(mx.uint32), mx.take_along_axis(cand, pick, axis=-1)
