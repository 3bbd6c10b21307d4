"""`exp`, the row reductions, the gated MLP's `swiglu` and `attention`, fast on a CPU.

MLX 0.32's CPU backend evaluates `mx.exp` one element at a time: on x86 it costs about
12 ns a float, 20x NumPy's time, and an exp over [rows, 49152] logits costs more than
the matmul that made them. `exp` here is the same algorithm as MLX's own (the same
range reduction and degree-6 polynomial for 2^f, so the same accuracy), written with
arithmetic that the compiler vectorises, and compiled into one kernel: about 8x faster
on a CPU. Its gradient is the output itself, as for `mx.exp`. On a GPU both are one
kernel, and `exp` is `mx.exp`.

`swiglu` (silu(gate) * x) takes its sigmoid from `exp`: MLX's CPU sigmoid is scalar as
well.

`attention` is `mx.fast.scaled_dot_product_attention` in blocks that stay in cache,
with `exp`, and flash attention's backward (see its doc). `packed_attention` and
`decode_attention` are the native ops (`mlx_grpo.cpu.native`) where they built.

The rest of mlx-grpo reaches these through `mlx_grpo.fastmath`, which calls them where
`mlx_grpo.device` finds MLX computing on a Linux CPU.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.activations import swiglu as _mlx_lm_swiglu

from mlx_grpo.cpu import native

_LOG2E = 1.4426950408889634
_ROUND = 12582912.0  # 1.5 * 2^23: adding it rounds a float below 2^22 to an integer
_EXP_BIAS = 0x4B400000 - 127  # the bits of _ROUND, less the float32 exponent bias
# 2^f on [-1/2, 1/2], highest power first (Cephes' exp2f coefficients, as in MLX).
_POLY = (
    1.535336188319500e-4,
    1.339887440266574e-3,
    9.618437357674640e-3,
    5.550332471162809e-2,
    2.402264791363012e-1,
    6.931472028550421e-1,
    1.0,
)


def _exp_kernel(x: mx.array) -> mx.array:
    # e^x = 2^t = 2^n * 2^f with n = round(t), |f| <= 1/2. With t clipped to [-127, 128],
    # the exponent field of 2^n is 0 (the float 0) at n = -127 and 255 (inf) at n = 128:
    # e^x is 0 below about -88.0 and inf above about 88.4 (float32's limits are -87.3 for
    # normal numbers and 88.7; MLX's exp has the same kind of cut-offs). NaN stays NaN.
    t = mx.minimum(mx.maximum(x * _LOG2E, -127.0), 128.0)
    r = t + _ROUND  # its low mantissa bits hold n
    f = t - (r - _ROUND)
    p = _POLY[0]
    for c in _POLY[1:]:
        p = p * f + c
    return p * ((r.view(mx.int32) - _EXP_BIAS) << 23).view(mx.float32)


_exp_compiled = mx.compile(_exp_kernel)


@mx.custom_function
def _fast_exp(x: mx.array) -> mx.array:
    return _exp_compiled(x)


@_fast_exp.vjp
def _fast_exp_vjp(primals, cotangent, output):
    return cotangent * output


def _swiglu_kernel(gate: mx.array, x: mx.array) -> mx.array:
    # silu(gate) * x = gate * x / (1 + e^-gate); past e^-gate = inf (gate below about
    # -88) the quotient is 0, as silu's true value rounds to there.
    return gate * x / (1.0 + _exp_kernel(-gate))


def _swiglu_grad_kernel(gate: mx.array, x: mx.array, cotangent: mx.array):
    s = 1.0 / (1.0 + _exp_kernel(-gate))  # sigmoid(gate)
    gs = gate * s
    return cotangent * x * (s + gs * (1.0 - s)), cotangent * gs


_swiglu_compiled = mx.compile(_swiglu_kernel)
_swiglu_grad_compiled = mx.compile(_swiglu_grad_kernel)


@mx.custom_function
def compiled_swiglu(gate: mx.array, x: mx.array) -> mx.array:
    return _swiglu_compiled(gate, x)


@compiled_swiglu.vjp
def compiled_swiglu_vjp(primals, cotangent, output):
    return _swiglu_grad_compiled(*primals, cotangent)


def _on_cpu() -> bool:
    return mx.default_device() == mx.cpu


def exp(x: mx.array) -> mx.array:
    """e^x elementwise, float32 (see the module doc)."""
    if not _on_cpu() or x.dtype != mx.float32:
        return mx.exp(x)
    return _fast_exp(x)


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """silu(gate) * x, the gated MLP's activation (mlx_lm's `swiglu`), with `exp`: MLX's
    CPU sigmoid is scalar too (about 19 ns a float: 30 of them cost a decode step 14 ms
    at 16 rows). On a GPU, or in another dtype, it is mlx_lm's own."""
    if not _on_cpu() or gate.dtype != mx.float32 or x.dtype != mx.float32:
        return _mlx_lm_swiglu(gate, x)
    if gate.shape == x.shape and (out := native.swiglu(gate, x)) is not None:
        return out  # one op forward and one backward, where under a gradient MLX
        # runs the compiled kernels op by op (about 25 passes each)
    return compiled_swiglu(gate, x)


# MLX's CPU backend reduces over an array's last (contiguous) axis one entry at a time,
# at 1-2 ns a float; over an inner axis it reduces whole contiguous runs at once,
# vectorised. `row_max` and `row_sum` reduce a wide last axis as [..., V / r, r]: over
# the V / r runs first (vectorised), then over the r partial results. A 49,152-word
# vocabulary at 16 rows: max 0.16 ms instead of 0.82, sum 0.13 instead of 0.40 (2-core
# Xeon); at 1,024 rows 27 and 19 ms instead of 93 and 65.
REDUCE_RUN = 256  # r: the largest power of two up to this that divides V
MIN_REDUCE_RUN = 16  # below it (an odd vocabulary), the plain reduction


def _reduce_run(v: int) -> int | None:
    """r for a last axis of v entries, or None where the plain reduction is as good.

    >>> [_reduce_run(v) for v in (49152, 151936, 32000, 50257, 256, 64)]
    [256, 128, 256, None, None, None]
    """
    r = min(v & -v, REDUCE_RUN)  # v's largest power-of-two factor, capped
    return r if r >= MIN_REDUCE_RUN and v > r else None


def _two_stage(x: mx.array, op: str, keepdims: bool) -> mx.array:
    r = _reduce_run(x.shape[-1]) if _on_cpu() else None
    if r is None:
        return getattr(x, op)(axis=-1, keepdims=keepdims)
    runs = x.reshape(*x.shape[:-1], x.shape[-1] // r, r)
    return getattr(getattr(runs, op)(axis=-2), op)(axis=-1, keepdims=keepdims)


def row_max(x: mx.array, keepdims: bool = False) -> mx.array:
    """`x.max(axis=-1, keepdims=keepdims)`, the same numbers, faster on a CPU for wide rows."""
    return _two_stage(x, "max", keepdims)


def row_sum(x: mx.array, keepdims: bool = False) -> mx.array:
    """`x.sum(axis=-1, keepdims=keepdims)` for wide rows, faster on a CPU; the additions
    are grouped otherwise (by runs of r), so the result differs within float32 rounding."""
    return _two_stage(x, "sum", keepdims)


# ---- attention ----------------------------------------------------------------------

# Score floats per block of query rows: [B, H, rows, keys] blocks of about 4 MB stay out
# of glibc's mmap'd allocations (every fresh one of those pays its page faults), and the
# blocks of a causal pass skip the keys above their last row.
ATTENTION_BLOCK_FLOATS = 1 << 20

_exp_shifted = mx.compile(lambda s, m: _exp_kernel(s - m))
_exp_normalised = mx.compile(lambda s, m, log_total: _exp_kernel((s - m) - log_total))
# What a masked score becomes: float32's lowest number, as in MLX's own attention, so that
# a row with every key masked averages them all (finite) where -inf would give NaN.
_MASKED = mx.finfo(mx.float32).min


def _blocks(b: int, hq: int, n_q: int, n_k: int, causal: bool):
    """(batch rows, query rows, keys seen) of each block, batch-major: a block holds at
    most ATTENTION_BLOCK_FLOATS scores, whole batch rows together when their queries all
    fit. Under a causal mask the queries are the last n_q of n_k positions, so a block
    sees keys up to its own last query only."""
    per_row = hq * n_k  # score floats of one query row of one batch row
    rows = max(1, ATTENTION_BLOCK_FLOATS // per_row)
    if rows >= n_q:
        batch = max(1, ATTENTION_BLOCK_FLOATS // (per_row * n_q))
        for b0 in range(0, b, batch):
            yield slice(b0, min(b, b0 + batch)), 0, n_q, n_k
        return
    stop = causal and n_q <= n_k  # (more queries than keys: the first see none)
    for b0 in range(b):
        for i0 in range(0, n_q, rows):
            i1 = min(n_q, i0 + rows)
            yield slice(b0, b0 + 1), i0, i1, (n_k - n_q + i1) if stop else n_k


def _grouped_mask(mask: mx.array, hkv: int, rep: int) -> mx.array:
    """A mask broadcastable to [B, Hq, Lq, Lk] as one broadcastable to the grouped scores
    [B, Hkv, rep, Lq, Lk]."""
    while mask.ndim < 4:
        mask = mask[None]
    b, h = mask.shape[:2]
    if h == 1:
        return mask[:, :, None]
    return mask.reshape(b, hkv, rep, *mask.shape[2:])


def _block_scores(qg, k, mask, causal, rows, i0, i1, n_q, n_k, end):
    """The block's pre-scaled queries [b, Hkv, rep * rows, D] and masked scores
    [b, Hkv, rep, rows, end] (batch rows `rows`, query rows i0:i1)."""
    qc = qg[rows, :, :, i0:i1]
    b, hkv, rep, c, d = qc.shape
    qc = qc.reshape(b, hkv, rep * c, d)
    s = (qc @ k[rows, :, :end].swapaxes(-1, -2)).reshape(b, hkv, rep, c, end)
    if causal:
        q_pos = mx.arange(n_k - n_q + i0, n_k - n_q + i1)[:, None]
        s = mx.where(q_pos >= mx.arange(end)[None], s, _MASKED)
    elif mask is not None:
        m = mask if mask.shape[0] == 1 else mask[rows]
        m = m[..., i0:i1, :] if m.shape[-2] > 1 else m
        s = mx.where(m[..., :end] if m.shape[-1] > 1 else m, s, _MASKED)
    return qc, s


def _cat(parts: list, axis: int) -> mx.array:
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=axis)


def _attention_forward(q, k, v, scale, mask, causal):
    b, hq, n_q, d = q.shape
    hkv, n_k = k.shape[1], k.shape[2]
    rep = hq // hkv
    qg = (q * scale).reshape(b, hkv, rep, n_q, d)
    outs, maxes, logs = [], [], []  # per batch block: lists over query blocks
    for rows, i0, i1, end in _blocks(b, hq, n_q, n_k, causal):
        _, s = _block_scores(qg, k, mask, causal, rows, i0, i1, n_q, n_k, end)
        m = mx.stop_gradient(s.max(axis=-1, keepdims=True))
        e = _exp_shifted(s, m)
        total = e.sum(axis=-1, keepdims=True)
        nb, c = s.shape[0], i1 - i0
        p = (e / total).reshape(nb, hkv, rep * c, end)
        if i0 == 0:
            outs.append([]), maxes.append([]), logs.append([])
        outs[-1].append((p @ v[rows, :, :end]).reshape(nb, hkv, rep, c, d))
        # The normaliser as (max, log of the sum): where every key is masked, the max
        # is the masked value, and max + log(n) would round back to it.
        maxes[-1].append(m), logs[-1].append(mx.log(total))
    out = _cat([_cat(o, 3) for o in outs], 0)
    m = _cat([_cat(x, 3) for x in maxes], 0)
    return out.reshape(b, hq, n_q, d), m, _cat([_cat(x, 3) for x in logs], 0), p


def _attention_backward_saved(q, k, v, scale, seen, out, m, p, d_out):
    # The backward of a single-block attention from its saved probabilities p
    # [b, Hkv, rep * n_q, n_k]: no scores or exp to recompute. `seen`: whether every
    # query sees a key (else one that sees none, whose scores are constants, gets no
    # gradient).
    b, hq, n_q, d = q.shape
    hkv = k.shape[1]
    rep = hq // hkv
    qg = (q * scale).reshape(b, hkv, rep * n_q, d)
    og = out.reshape(b, hkv, rep * n_q, d)
    dog = d_out.reshape(b, hkv, rep * n_q, d)
    ds = p * (dog @ v.swapaxes(-1, -2) - (dog * og).sum(-1, keepdims=True))
    if not seen:
        ds = mx.where(m.reshape(b, hkv, rep * n_q, 1) > _MASKED, ds, 0.0)
    dk, dv = ds.swapaxes(-1, -2) @ qg, p.swapaxes(-1, -2) @ dog
    return ((ds @ k) * scale).reshape(b, hq, n_q, d), dk, dv


def _attention_backward(q, k, v, scale, mask, causal, out, m, log_total, d_out):
    # Flash attention's backward, block by block: P is recomputed from the saved
    # normaliser, dS = P (dP - rowsum(dO * O)); dK and dV sum over the query blocks of a
    # batch block.
    b, hq, n_q, d = q.shape
    hkv, n_k = k.shape[1], k.shape[2]
    rep = hq // hkv
    qg = (q * scale).reshape(b, hkv, rep, n_q, d)
    og = out.reshape(b, hkv, rep, n_q, d)
    dog = d_out.reshape(b, hkv, rep, n_q, d)
    dq, dk, dv = [], [], []
    for rows, i0, i1, end in _blocks(b, hq, n_q, n_k, causal):
        qc, s = _block_scores(qg, k, mask, causal, rows, i0, i1, n_q, n_k, end)
        nb, c = s.shape[0], i1 - i0
        m_c = m[rows, :, :, i0:i1]
        p = _exp_normalised(s, m_c, log_total[rows, :, :, i0:i1]).reshape(nb, hkv, rep * c, end)
        do_c = dog[rows, :, :, i0:i1].reshape(nb, hkv, rep * c, d)
        o_c = og[rows, :, :, i0:i1].reshape(nb, hkv, rep * c, d)
        ds = p * (do_c @ v[rows, :, :end].swapaxes(-1, -2) - (do_c * o_c).sum(-1, keepdims=True))
        # A masked score is a constant: no gradient. Elsewhere its p is 0 already; a
        # query that sees no key (its max is the masked value) has p 1/n.
        ds = mx.where(m_c.reshape(nb, hkv, rep * c, 1) > _MASKED, ds, 0.0)
        dk_c, dv_c = ds.swapaxes(-1, -2) @ qc, p.swapaxes(-1, -2) @ do_c
        if end < n_k:
            pad = [(0, 0), (0, 0), (0, n_k - end), (0, 0)]
            dk_c, dv_c = mx.pad(dk_c, pad), mx.pad(dv_c, pad)
        if i0 == 0:
            dq.append([]), dk.append(dk_c), dv.append(dv_c)
        else:
            dk[-1], dv[-1] = dk[-1] + dk_c, dv[-1] + dv_c
        dq[-1].append((ds @ k[rows, :, :end]).reshape(nb, hkv, rep, c, d))
    dq = _cat([_cat(x, 3) for x in dq], 0)
    return (dq * scale).reshape(b, hq, n_q, d), _cat(dk, 0), _cat(dv, 0)


_ATTENTION: dict[tuple, object] = {}


def _attention_fn(scale: float, kind: str, saved: bool):
    """The custom function for one scale, mask kind ('none', 'causal', 'array') and
    backward: (q, k, v[, mask]) -> (out, row max, log of the row sum[, probabilities]).
    With `saved` (a single block, at most ATTENTION_BLOCK_FLOATS scores) the forward's
    probabilities are kept for the backward, which then recomputes nothing; otherwise
    the backward recomputes each block's from the saved normaliser."""
    key = (scale, kind, saved)
    if key not in _ATTENTION:
        causal = kind == "causal"

        @mx.custom_function
        def fn(q, k, v, *mask):
            out, m, log_total, p = _attention_forward(
                q, k, v, scale, mask[0] if mask else None, causal
            )
            return (out, m, log_total, p) if saved else (out, m, log_total)

        @fn.vjp
        def fn_vjp(primals, cotangents, outputs):
            q, k, v, *mask = primals
            m = mask[0] if mask else None  # grouped already (see attention)
            if saved:
                out, row_max, _, p = outputs
                seen = kind == "none" or (causal and q.shape[2] <= k.shape[2])
                grads = _attention_backward_saved(
                    q, k, v, scale, seen, out, row_max, p, cotangents[0]
                )
            else:
                grads = _attention_backward(q, k, v, scale, m, causal, *outputs, cotangents[0])
            return (*grads, *(mx.zeros_like(x) for x in mask))

        _ATTENTION[key] = fn
    return _ATTENTION[key]


def attention(q, k, v, scale: float, mask=None) -> mx.array:
    """softmax(q k^T scale + mask) v, as `mx.fast.scaled_dot_product_attention(q, k, v,
    scale=scale, mask=mask)`: q [B, Hq, Lq, D], k and v [B, Hkv, Lk, D] (Hq a multiple
    of Hkv), mask None, "causal" (the queries are the last Lq positions) or a boolean
    array broadcastable to [B, Hq, Lq, Lk] (True attends); a query that attends to no
    key averages them all, as in MLX's. An additive (float) mask, which could carry a
    gradient, goes to MLX's own.

    MLX's CPU backend computes that attention unfused, with its scalar exp, over the
    whole [B, Hq, Lq, Lk] score array. Here the scores go in blocks of query rows, each
    small enough to stay in cache, with `exp`; a causal block stops at its last row's
    key. Where the scores fit in one block, the backward takes the forward's
    probabilities, kept; otherwise it is flash attention's: each block's probabilities
    are recomputed from its saved normaliser (row max and log-sum). On a GPU, or in another dtype, it is MLX's own."""
    if not _on_cpu() or q.dtype != mx.float32 or k.dtype != mx.float32:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    b, hq, n_q, _ = q.shape
    saved = hq * n_q * k.shape[2] * b <= ATTENTION_BLOCK_FLOATS  # one block
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"attention: mask {mask!r} (only 'causal' or an array)")
        return _attention_fn(scale, "causal", saved)(q, k, v)[0]
    if mask is None:
        return _attention_fn(scale, "none", saved)(q, k, v)[0]
    if mask.dtype != mx.bool_:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    grouped = _grouped_mask(mask, k.shape[1], q.shape[1] // k.shape[1])
    return _attention_fn(scale, "array", saved)(q, k, v, grouped)[0]


def packed_attention(q: mx.array, k: mx.array, v: mx.array, meta: mx.array, scale: float):
    """The packed pass's attention as one native op (`native.packed_attention`), or None
    where the extension is not loaded or the arrays are not float32 on the CPU."""
    return native.packed_attention(q, k, v, meta, scale)


def decode_attention(q: mx.array, k: mx.array, v: mx.array, bias: mx.array):
    """A decode step's attention as one native op (`native.decode_attention`), or None
    where the extension is not loaded or the arrays are not float32 on the CPU."""
    return native.decode_attention(q, k, v, bias)
