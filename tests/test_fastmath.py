"""mlx_grpo.fastmath (on a Linux CPU, mlx_grpo.cpu.fastmath's ops) against float64
NumPy: exp's accuracy, its gradient, the log-softmax built on it, the distribution of
the inverse-CDF sampler, SwiGLU and the blocked attention with its gradient."""

import math
import os

import mlx.core as mx
import numpy as np
import pytest

from mlx_grpo import fastmath
from mlx_grpo.cpu import fastmath as cpu_fastmath
from mlx_grpo.logprobs import _logprobs_of

EPS32 = 2.0**-24  # float32 unit roundoff


def test_exp_is_within_float32_rounding_of_float64_exp():
    """Error budget of 2^t with t = x log2(e): rounding t costs ln2 |t| ulps of the
    result, the polynomial for 2^f about 3.4 (its minimax error, 2e-7) and Horner's six
    steps and the final product one each: (12 + ln2 |t|) unit roundoffs, relative."""
    x = np.concatenate(
        [np.linspace(-87.0, 88.0, 200_001), np.random.default_rng(0).normal(0, 4, 100_000)]
    ).astype(np.float32)
    got = np.array(fastmath.exp(mx.array(x)), dtype=np.float64)
    want = np.exp(x.astype(np.float64))
    bound = (12 + math.log(2) * np.abs(x * math.log2(math.e))) * EPS32
    rel = np.abs(got - want) / want
    assert np.all(rel <= bound), float(np.max(rel / bound))


def test_exp_limits_match_mlx():
    x = mx.array([-np.inf, -1000.0, -89.0, 0.0, 89.0, 1000.0, np.inf, np.nan])
    got = np.array(fastmath.exp(x))
    want = np.array(mx.exp(x))
    assert np.array_equal(got, want, equal_nan=True), (got, want)
    assert got[3] == 1.0


def test_exp_gradient_is_its_output():
    x = mx.array(np.linspace(-20, 20, 101, dtype=np.float32))
    w = mx.array(np.random.default_rng(1).normal(size=101).astype(np.float32))
    grad = mx.grad(lambda v: (fastmath.exp(v) * w).sum())(x)
    want = np.array(w, np.float64) * np.exp(np.array(x, np.float64))
    assert np.allclose(np.array(grad), want, rtol=(12 + math.log(2) * 29) * EPS32, atol=0)


@pytest.mark.parametrize("shape", [(3, 49152), (2, 3, 768), (4, 1001), (5, 256), (2, 151936)])
@pytest.mark.parametrize("keepdims", [False, True])
def test_row_max_and_row_sum_reduce_the_last_axis(shape, keepdims):
    """Against NumPy over the last axis: the max exactly (by runs or not, it is the
    same number), the sum within float32 rounding of V additions of |x| (either
    grouping of them), relative to the sum of |x|."""
    x = np.random.default_rng(3).normal(size=shape).astype(np.float32) * 5
    got_max = np.array(fastmath.row_max(mx.array(x), keepdims=keepdims))
    got_sum = np.array(fastmath.row_sum(mx.array(x), keepdims=keepdims), np.float64)
    assert np.array_equal(got_max, x.max(axis=-1, keepdims=keepdims))
    want = x.astype(np.float64).sum(axis=-1, keepdims=keepdims)
    scale = np.abs(x.astype(np.float64)).sum(axis=-1, keepdims=keepdims)
    assert got_sum.shape == want.shape
    assert np.all(np.abs(got_sum - want) <= shape[-1] * EPS32 * scale)


def test_log_softmax_and_entropy_match_float64():
    """_logprobs_of's normaliser and entropy run on fastmath.exp. Against float64: each
    exp term is off by at most (12 + ln2 |t|) unit roundoffs (above) and a float32 sum
    of V positive terms by at most V of them, so log Z is off by their sum; the
    entropy's sum of p x adds the same relative error times max |x|."""
    rng = np.random.default_rng(2)
    v = 4096
    scale = np.array([1.0, 3.0, 10.0])[:, None, None]  # |logits| <= ~45
    logits = (rng.normal(size=(3, 4, v)) * scale).astype(np.float32)
    targets = rng.integers(0, v, size=(3, 4))
    lp, ent = _logprobs_of(mx.array(logits), mx.array(targets))
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    log_z = np.log(np.exp(x).sum(axis=-1))
    want_lp = np.take_along_axis(x, targets[..., None], axis=-1)[..., 0] - log_z
    p = np.exp(x - log_z[..., None])
    want_ent = -(p * (x - log_z[..., None])).sum(axis=-1)
    big = np.abs(x).max()
    rel = (v + 12 + math.log(2) * big * math.log2(math.e)) * EPS32
    assert np.all(np.abs(np.array(lp) - want_lp) <= rel + big * EPS32)
    assert np.all(np.abs(np.array(ent) - want_ent) <= 2 * rel * (1 + big))


@pytest.mark.parametrize("head_kind", ["frozen-linear", "frozen-embedding", "trained-linear"])
def test_output_head_in_chunks_gives_log_softmax_values_and_gradients(head_kind):
    """head_logprobs in 8 chunks (the last one short) against float64 NumPy: the
    log-probs, and the gradients of sum w * log p with respect to the hidden states
    (w_i (W[y_i] - p_i W)) and, for a head that trains, its weight. A frozen plain head
    takes the chunked path that yields each chunk's gradient with its forward
    (`_head_chunk`); a trained one, the recomputed (checkpointed) chunks. The float32
    error of each is that of a sum of d + V terms (the logits, then the softmax's
    normaliser and p W), plus the exp's (12 + |x|) unit roundoffs (above)."""
    import mlx.nn as nn
    from conftest import assert_f32_close

    from mlx_grpo.logprobs import _frozen_head_weight, head_logprobs

    rng = np.random.default_rng(4)
    v, d, m = 4096, 32, 37
    weight = (rng.normal(size=(v, d)) * 0.5).astype(np.float32)
    hidden = rng.normal(size=(m, 1, d)).astype(np.float32)
    targets = rng.integers(0, v, size=(m, 1))
    w = rng.normal(size=(m, 1)).astype(np.float32)
    module = nn.Embedding(v, d) if head_kind == "frozen-embedding" else nn.Linear(d, v, bias=False)
    module.weight = mx.array(weight)
    head = module.as_linear if head_kind == "frozen-embedding" else module
    if head_kind.startswith("frozen"):
        module.freeze()
    assert (_frozen_head_weight(head) is None) == (head_kind == "trained-linear")

    def loss(params, h):
        module.update(params)
        lp, _ = head_logprobs(head, h, mx.array(targets), 5 * v, v)
        return (lp * mx.array(w)).sum(), lp

    params = module.trainable_parameters()  # {} for a frozen head
    (_, lp), (g_params, g_h) = mx.value_and_grad(loss, argnums=(0, 1))(params, mx.array(hidden))

    x = hidden[:, 0].astype(np.float64) @ weight.T.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    log_z = np.log(np.exp(x).sum(axis=-1, keepdims=True))
    p = np.exp(x - log_z)
    want_lp = np.take_along_axis(x - log_z, targets, axis=-1)
    toward = np.eye(v)[targets[:, 0]] - p  # d log p(y) / d logits
    additions = d + v + 12 + math.ceil(np.abs(x).max())
    assert_f32_close(lp, want_lp, additions, "log-probs")
    assert_f32_close(g_h[:, 0], (w * toward) @ weight.astype(np.float64), additions, "d/dh")
    if params:
        assert_f32_close(g_params["weight"], (w * toward).T @ hidden[:, 0], additions, "d/dW")


def test_categorical_draws_softmax_frequencies_and_never_a_masked_entry():
    """40,000 draws per case; every frequency within 5 standard deviations of the
    binomial around softmax(logits) (a chance of about 6e-7 per entry to fail)."""
    n = 40_000
    wide = [-np.inf] * (2 * fastmath.CDF_BLOCK + 52)
    for i, x in zip((0, 1023, 1024, 1500, 2047, 2048, len(wide) - 1), (0.5, 1, 2, -1, 1.5, 0, 1)):
        wide[i] = x
    cases = [
        [2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0],
        [0.0, -np.inf, 3.0, -np.inf, 1.0, 2.5, -np.inf, -np.inf],  # -inf: filtered
        [-np.inf, -np.inf, 0.0, -np.inf],  # one candidate left
        list(np.linspace(-20, 5, 64)),  # a long tail
        wide,  # searched by blocks: mass on both sides of block edges and at the end
    ]
    key = mx.random.key(5)
    for logits in cases:
        row = np.array(logits, np.float64)
        want = np.exp(row - row.max())
        want /= want.sum()
        key, sub = mx.random.split(key)
        rows = mx.broadcast_to(mx.array(row.astype(np.float32)), (n, len(row)))
        draws = np.array(fastmath.categorical(rows, key=sub))
        freq = np.bincount(draws, minlength=len(row)) / n
        assert np.all(freq[want == 0] == 0), (logits, freq)
        sd = np.sqrt(want * (1 - want) / n)
        assert np.all(np.abs(freq - want) <= 5 * sd + 1 / n), (logits, freq, want)


@pytest.mark.parametrize("k", [1, 20, 64])
def test_top_k_gives_the_k_largest_values_of_wide_rows(k):
    """The k values `fastmath.top_k` picks are the k largest of their row, each at its
    own id, against NumPy's sort, on rows wide enough to go by blocks and not a whole
    number of blocks: all k in one block, one in each of k blocks, ties across blocks,
    a row of ties, and rows with fewer than k entries above -inf."""
    v = 2 * k * fastmath.TOP_K_BLOCK + 77
    rng = np.random.default_rng(k)
    rows = [rng.normal(size=v) * s for s in (0.5, 3.0)]
    one_block = rng.normal(size=v) - 10
    one_block[300 : 300 + k] = rng.normal(size=k) + 5  # inside the second block
    rows.append(one_block)
    spread = rng.normal(size=v) - 10
    spread[np.arange(k) * fastmath.TOP_K_BLOCK + 7] = rng.normal(size=k) + 5
    rows.append(spread)
    ties = np.round(rng.normal(size=v), 1)  # many equal values, the k-th among them
    rows.append(ties)
    rows.append(np.zeros(v))
    sparse = np.full(v, -np.inf)
    sparse[[3, v - 1]] = [1.0, 2.0]  # the last entry, in the padded block
    rows.append(sparse)
    x = np.stack(rows).astype(np.float32)
    ids, vals = fastmath.top_k(mx.array(x), k)
    ids, vals = np.array(ids), np.array(vals)
    assert ids.shape == vals.shape == (len(rows), k)
    for r, row in enumerate(x):
        want = np.sort(row)[::-1][:k]
        assert np.array_equal(np.sort(vals[r])[::-1], want), r
        assert np.all(ids[r] < v)
        finite = vals[r] > -np.inf
        assert np.array_equal(row[ids[r][finite]], vals[r][finite]), r
        assert len(set(ids[r][finite].tolist())) == finite.sum(), r  # each at its own id


def test_categorical_is_a_function_of_its_key():
    logits = mx.array(np.random.default_rng(3).normal(size=(6, 500)).astype(np.float32))
    a = fastmath.categorical(logits, key=mx.random.key(11))
    b = fastmath.categorical(logits, key=mx.random.key(11))
    c = fastmath.categorical(logits, key=mx.random.key(12))
    assert a.tolist() == b.tolist() and a.tolist() != c.tolist()


def test_entropy_of_log_probabilities_matches_float64_and_skips_masked_tokens():
    """fastmath.entropy (each sampled token's entropy in the decoders) on float64 log-probs
    rounded to float32: each p = exp(lp) is off by (12 + ln2 |lp|) unit roundoffs (above),
    each p lp by one more, and their float32 sum of V terms by V more, relative to
    sum |p lp| <= max |lp|. A log-prob of -inf (a masked token) adds 0, not NaN."""
    rng = np.random.default_rng(5)
    v = 4096
    x = rng.normal(size=(6, v)) * np.array([1.0, 3, 10, 1, 3, 10])[:, None]
    lp = x - x.max(axis=-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(axis=-1, keepdims=True))
    lp32 = lp.astype(np.float32)
    got = np.array(fastmath.entropy(mx.array(lp32)), np.float64)
    want = -(np.exp(lp32.astype(np.float64)) * lp32).sum(axis=-1)
    big = np.abs(lp32).max()
    assert np.all(
        np.abs(got - want) <= (v + 14 + math.log(2) * big * math.log2(math.e)) * big * EPS32
    )
    masked = lp32.copy()
    masked[:, ::7] = -np.inf
    got = np.array(fastmath.entropy(mx.array(masked)), np.float64)
    keep = np.isfinite(masked)
    want = -np.where(keep, np.exp(np.where(keep, masked, 0.0)) * np.where(keep, masked, 0.0), 0.0)
    assert np.all(np.isfinite(got))
    assert np.all(
        np.abs(got - want.sum(axis=-1))
        <= (v + 14 + math.log(2) * big * math.log2(math.e)) * big * EPS32
    )


def test_uniform_rows_are_each_keys_own_uniform():
    keys = mx.random.split(mx.random.key(5), 7)
    rows = np.array(fastmath.uniform_rows(keys))[:, 0]
    alone = [mx.random.uniform(shape=(1,), key=keys[i]).item() for i in range(7)]
    assert rows.tolist() == alone


def test_swiglu_and_its_gradient_match_float64():
    """silu(g) x = g x / (1 + e^-g). Budget, relative: e^-g as exp's (12 + ln2 |t|) unit
    roundoffs with t = -g log2(e), so 12 + |g| (1 / (1 + e) passes at most the relative
    error of e on), and one each for the add, the division and two products: 16 + |g|.
    The gradient's terms (x s (1 + g (1 - s)) and g s) take about twice that, relative
    to the sum of their terms' magnitudes (they cancel near g = -1.28). Below g = -88
    e^-g is inf and the result 0, within 1e-30 of the true value."""
    rng = np.random.default_rng(3)
    g = np.concatenate([np.linspace(-100.0, 100.0, 20_001), rng.normal(0, 4, 20_000)])
    g = g.astype(np.float32)
    x = rng.normal(size=g.shape).astype(np.float32)
    c = rng.normal(size=g.shape).astype(np.float32)
    got = np.array(fastmath.swiglu(mx.array(g), mx.array(x)), np.float64)
    g64, x64, c64 = (a.astype(np.float64) for a in (g, x, c))
    s = 1.0 / (1.0 + np.exp(-g64))
    want = g64 * s * x64
    bound = (16 + np.abs(g64)) * EPS32 * np.abs(want) + 1e-30
    assert np.all(np.abs(got - want) <= bound), float(np.max(np.abs(got - want) / bound))

    dg, dx = mx.grad(lambda a, b: (fastmath.swiglu(a, b) * mx.array(c)).sum(), argnums=(0, 1))(
        mx.array(g), mx.array(x)
    )
    want_dg = c64 * x64 * (s + g64 * s * (1 - s))
    size_dg = np.abs(c64 * x64) * (s + np.abs(g64) * s * (1 - s))
    assert np.all(
        np.abs(np.array(dg, np.float64) - want_dg)
        <= (32 + 2 * np.abs(g64)) * EPS32 * size_dg + 1e-30
    )
    want_dx = c64 * g64 * s
    assert np.all(
        np.abs(np.array(dx, np.float64) - want_dx)
        <= (16 + np.abs(g64)) * EPS32 * np.abs(want_dx) + 1e-30
    )


def test_swiglu_in_16_bits_is_mlx_lms_own():
    from mlx_lm.models.activations import swiglu

    g = mx.array(np.linspace(-8, 8, 257, dtype=np.float32)).astype(mx.bfloat16)
    x = mx.array(np.random.default_rng(4).normal(size=257).astype(np.float32)).astype(mx.bfloat16)
    got = fastmath.swiglu(g, x)
    assert got.dtype == mx.bfloat16
    assert mx.array_equal(got, swiglu(g, x)).item()


def _attention64(q, k, v, scale, mask, d_out):
    """Float64 attention, its gradient (the textbook one, over the whole score array),
    and the same sums over absolute values, which bound float32's rounding errors."""
    b, hq, n_q, d = q.shape
    hkv, n_k = k.shape[1], k.shape[2]
    rep = hq // hkv
    kk, vv = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = q @ kk.swapaxes(-1, -2) * scale
    allowed = np.ones(s.shape, bool)
    if isinstance(mask, str):
        allowed = np.broadcast_to(
            np.arange(n_k - n_q, n_k)[:, None] >= np.arange(n_k)[None], s.shape
        )
    elif mask is not None and mask.dtype == bool:
        allowed = np.broadcast_to(mask, s.shape)
    elif mask is not None:
        s = s + mask
    s = np.where(allowed, s, np.finfo(np.float32).min)  # a row with no key averages all
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = p @ vv
    dp = d_out @ vv.swapaxes(-1, -2)
    ds = np.where(allowed, p * (dp - (d_out * out).sum(-1, keepdims=True)), 0.0)
    grads = (
        ds @ kk * scale,
        (ds.swapaxes(-1, -2) @ q * scale).reshape(b, hkv, rep, n_k, d).sum(2),
        (p.swapaxes(-1, -2) @ d_out).reshape(b, hkv, rep, n_k, d).sum(2),
    )
    # Rounding: each score is a D-term dot product (D+1 roundoffs of |q||k| scale), which
    # moves p by twice its largest error (p and its normaliser), plus exp's 12 + ln2|t|
    # (t <= 90) and the Lk-term normaliser; out and the gradients sum Lk or D terms more.
    s_err = (d + 1) * EPS32 * (np.abs(q) @ np.abs(kk).swapaxes(-1, -2)).max(-1, keepdims=True)
    rel = 2 * s_err * scale + (75 + n_k + d) * EPS32
    av, ak, ado = np.abs(vv), np.abs(kk), np.abs(d_out)
    out_mag = p @ av
    ds_mag = p * (ado @ av.swapaxes(-1, -2) + (ado * out_mag).sum(-1, keepdims=True))
    mags = (
        2 * rel * (ds_mag @ ak * scale),
        2 * (rel * ds_mag).swapaxes(-1, -2) @ np.abs(q) * scale,
        2 * (rel * p).swapaxes(-1, -2) @ ado,
    )
    mags = (mags[0], *(m.reshape(b, hkv, rep, n_k, d).sum(2) for m in mags[1:]))
    return out, rel * out_mag + (n_k + 2) * EPS32 * out_mag, grads, mags


@pytest.mark.parametrize("block", [1 << 20, 300, 40])  # one block; batch blocks; query rows
@pytest.mark.parametrize(
    "n_q, n_k, mask",
    [
        (7, 7, "causal"),
        (3, 11, "causal"),
        (6, 4, "causal"),  # more queries than keys: the first two see none
        (1, 9, None),
        (5, 9, "bool"),
        (5, 9, "bool, one query sees no key"),
        (4, 6, "additive"),  # MLX's own (a float mask could carry a gradient)
    ],
)
def test_attention_and_its_gradient_match_float64(monkeypatch, block, n_q, n_k, mask):
    """cpu_fastmath.attention against float64, in one block and in many (batch blocks, and
    blocks of query rows whose causal keys stop at their last row): grouped heads
    (6 queries, 2 keys), a causal mask over the last queries (and over more queries
    than keys), a boolean mask that broadcasts over heads (and leaves a query no key,
    which then averages them all, as MLX's does), an additive one per head; each within
    the rounding budget that the sums over absolute values give (_attention64)."""
    monkeypatch.setattr(cpu_fastmath, "ATTENTION_BLOCK_FLOATS", block)
    rng = np.random.default_rng(n_q * 100 + n_k)
    b, hq, hkv, d = 2, 6, 2, 8
    q = rng.normal(0, 2, (b, hq, n_q, d)).astype(np.float32)
    k = rng.normal(0, 2, (b, hkv, n_k, d)).astype(np.float32)
    v = rng.normal(0, 1, (b, hkv, n_k, d)).astype(np.float32)
    d_out = rng.normal(0, 1, (b, hq, n_q, d)).astype(np.float32)
    m = mask
    if mask.startswith("bool") if mask else False:
        m = rng.random((b, 1, n_q, n_k)) < 0.7
        m[..., 0] = True  # every query sees a key
        if mask != "bool":
            m[1, 0, 2] = False  # but this one
    elif mask == "additive":
        m = rng.normal(0, 1, (1, hq, n_q, n_k)).astype(np.float32)
    arr = (lambda x: x) if m is None or isinstance(m, str) else mx.array
    scale = d**-0.5

    def f(q, k, v):
        return (cpu_fastmath.attention(q, k, v, scale, arr(m)) * mx.array(d_out)).sum()

    out = np.array(cpu_fastmath.attention(mx.array(q), mx.array(k), mx.array(v), scale, arr(m)))
    grads = mx.grad(f, argnums=(0, 1, 2))(mx.array(q), mx.array(k), mx.array(v))
    f64 = [x.astype(np.float64) for x in (q, k, v)]
    m64 = m.astype(np.float64) if mask == "additive" else m
    want, bound, want_grads, grad_bounds = _attention64(*f64, scale, m64, d_out.astype(np.float64))
    assert np.all(np.abs(out - want) <= bound), float(np.max(np.abs(out - want) / bound))
    for name, got, w, bnd in zip("qkv", grads, want_grads, grad_bounds):
        err = np.abs(np.array(got) - w)
        assert np.all(err <= bnd), (name, float(np.max(err / bnd)))


def test_attention_in_16_bits_is_mlxs_own():
    rng = np.random.default_rng(3)
    q, k, v = (mx.array(rng.normal(size=(1, 4, 5, 8)), dtype=mx.bfloat16) for _ in range(3))
    got = fastmath.attention(q, k, v, 0.35, "causal")
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.35, mask="causal")
    assert got.dtype == mx.bfloat16 and mx.array_equal(got, want).item()


def test_the_native_packed_attention_builds_where_it_can():
    """On a Linux CPU with a C++ compiler and nanobind, the extension builds, passes its
    probe and loads: a kernel that computes wrong results fails here instead of falling
    back unseen."""
    import sys

    from mlx_grpo.cpu import native
    from mlx_grpo.cpu.build import compiler

    if not sys.platform.startswith("linux") or compiler("c++") is None:
        pytest.skip("the native op is built on Linux, with a C++ compiler")
    assert native.module() is not None, native.why()


def test_python_m_native_says_whether_the_ops_are_in_use():
    """`python -m mlx_grpo.cpu.native` (run by `make install` on Linux) loads the extension
    and says so in one line, exit status 0; turned off, it says why, exit status 1."""
    import subprocess
    import sys

    from mlx_grpo.cpu import native
    from mlx_grpo.cpu.build import compiler

    if not sys.platform.startswith("linux") or compiler("c++") is None:
        pytest.skip("the native op is built on Linux, with a C++ compiler")
    native.module()  # built in this process's cache already, if not before
    cmd = [sys.executable, "-m", "mlx_grpo.cpu.native"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.startswith("native ops: in use ("), done
    assert "building" not in done.stderr  # built once, then taken from the cache
    env = {**os.environ, "MLX_GRPO_NATIVE": "0"}
    off = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert off.returncode == 1
    assert off.stdout == "native ops: not in use: off (MLX_GRPO_NATIVE); MLX's ops instead\n"


def test_a_library_build_is_announced_once_on_stderr(tmp_path, monkeypatch, capfd):
    """The first build of a compiled library says so on stderr before the compiler
    runs (the native ops take a while); a second call finds it in the cache, silently."""
    from mlx_grpo.cpu.build import compile_library, compiler

    if compiler("c") is None:
        pytest.skip("needs a C compiler")
    monkeypatch.setenv("MLX_GRPO_CACHE", str(tmp_path))
    source = "int answer(void) { return 42; }\n"
    first, why = compile_library(source, "answer", [], announce="building answer")
    assert first is not None and first.exists(), why
    assert capfd.readouterr().err == "building answer\n"
    again, _ = compile_library(source, "answer", [], announce="building answer")
    assert again == first and capfd.readouterr().err == ""


def _packed_layout(groups):
    """(meta [N, 5], N) for groups of (prompt length, rows): a row is its count of
    positions, or (that count, (an earlier row of the group, how many of its first
    positions this row sees between its prompt and its own))."""
    meta, start = [], 0
    for p, rows in groups:
        meta += [(start, 0, 0, 0, start)] * p
        prompt, start, firsts = start, start + p, []
        for row in rows:
            m, (i, s) = (row, (0, 0)) if isinstance(row, int) else row
            meta += [(prompt, p, firsts[i] if s else 0, s, start)] * m
            firsts.append(start)
            start += m
    return np.array(meta, np.int32), start


@pytest.mark.parametrize("d", [8, 64, 128])  # 64 and 128 take the vector loops
def test_native_packed_attention_and_its_gradient_match_float64(d):
    """Each position attends to its prompt and its own sequence up to itself: the same
    as dense attention of that one query over every position with the others masked
    (_attention64, one batch row per query), values and gradients within the rounding
    budget of those sums; keys and values gather their gradient from every query that
    sees them. Two groups, grouped heads, an empty row, rows that see an earlier row's
    first positions between their prompt and their own, and a prompt of one token; up
    to 11 keys a query (the four-at-a-time loop and its tail)."""
    from mlx_grpo.cpu import native

    if native.module() is None:
        pytest.skip(f"no native packed attention here: {native.why()}")
    meta, n = _packed_layout([(5, [4, 0, 6, (2, (0, 3))]), (1, [3, 1, (2, (0, 2))]), (3, [])])
    hq, hkv, scale = 6, 2, d**-0.5
    rng = np.random.default_rng(11)
    q = rng.normal(0, 2, (n, hq, d)).astype(np.float32)
    k = rng.normal(0, 2, (n, hkv, d)).astype(np.float32)
    v = rng.normal(0, 1, (n, hkv, d)).astype(np.float32)
    d_out = rng.normal(0, 1, (n, hq, d)).astype(np.float32)
    sees = np.zeros((n, 1, 1, n), bool)
    for i, (start, plen, first, shared, own) in enumerate(meta):
        sees[i, 0, 0, start : start + plen] = True
        sees[i, 0, 0, first : first + shared] = True
        sees[i, 0, 0, own : i + 1] = True

    def f(q, k, v):
        return native.packed_attention(q, k, v, mx.array(meta), scale)

    args = [mx.array(x) for x in (q, k, v)]
    out = np.array(f(*args))
    grads = mx.grad(lambda *a: (f(*a) * mx.array(d_out)).sum(), argnums=(0, 1, 2))(*args)
    # query i as batch row i: [N, H, 1, D] against every position's keys [N, Hkv, N, D]
    every = [
        np.broadcast_to(x.astype(np.float64).transpose(1, 0, 2)[None], (n, hkv, n, d))
        for x in (k, v)
    ]
    want, bound, want_grads, grad_bounds = _attention64(
        q.astype(np.float64)[:, :, None], *every, scale, sees, d_out.astype(np.float64)[:, :, None]
    )
    assert np.all(np.abs(out - want[:, :, 0]) <= bound[:, :, 0])
    packed = [lambda x: x[:, :, 0], *(lambda x: x.sum(0).transpose(1, 0, 2),) * 2]
    for name, got, w, bnd, back in zip("qkv", grads, want_grads, grad_bounds, packed):
        err = np.abs(np.array(got) - back(w))
        assert np.all(err <= back(bnd)), (name, float(np.max(err / back(bnd))))
    # strided inputs (views of [H, N, D] arrays) are read in row order: the same results
    strided = [mx.array(x.transpose(1, 0, 2).copy()).transpose(1, 0, 2) for x in (q, k, v)]
    assert mx.array_equal(f(*strided), f(*args)).item()


def test_native_packed_attention_rejects_a_wrong_dtype_in_one_line():
    from mlx_grpo.cpu import native

    if native.module() is None:
        pytest.skip(f"no native packed attention here: {native.why()}")
    meta, n = _packed_layout([(2, [2])])
    q, kv = mx.zeros((n, 2, 4)), mx.zeros((n, 1, 4))
    with pytest.raises(ValueError, match="int32 meta"):
        native.module().packed_attention(q, kv, kv, mx.array(meta.astype(np.float32)), 1.0)


@pytest.mark.parametrize("d", [8, 64, 128])  # 64 and 128 take the vector loops
def test_native_decode_attention_matches_float64(d):
    """A decode step's attention (pre-scaled queries, a cache of columns of which a
    row sees some, given as a bias of 0 or -inf) against dense float64 attention with
    those columns masked (_attention64), within its rounding budget."""
    from mlx_grpo.cpu import native

    if native.module() is None:
        pytest.skip(f"no native decode attention here: {native.why()}")
    b, hq, hkv, c = 4, 6, 2, 23
    rng = np.random.default_rng(12)
    q = rng.normal(0, 2 * d**-0.5, (b, hq, d)).astype(np.float32)
    k = rng.normal(0, 2, (b, hkv, c, d)).astype(np.float32)
    v = rng.normal(0, 1, (b, hkv, c, d)).astype(np.float32)
    sees = rng.random((b, c)) < 0.5
    sees[:, 5] = True  # each row sees a column at least
    bias = np.where(sees, 0.0, -np.inf).astype(np.float32)
    got = np.array(native.decode_attention(*(mx.array(x) for x in (q, k, v, bias))))
    strided_q = mx.array(q.transpose(1, 0, 2).copy()).transpose(1, 0, 2)
    again = native.decode_attention(strided_q, *(mx.array(x) for x in (k, v, bias)))
    assert np.array_equal(np.array(again), got)
    want, bound, _, _ = _attention64(
        q.astype(np.float64)[:, :, None], k.astype(np.float64), v.astype(np.float64), 1.0,
        sees[:, None, None], np.zeros((b, hq, 1, d)),
    )  # fmt: skip
    assert np.all(np.abs(got - want[:, :, 0]) <= bound[:, :, 0])


def test_native_swiglu_and_its_gradient_match_float64():
    """silu(g) x and its gradient in one op each, against float64 across exp's range
    (where e^-g overflows the activation is 0, as the true value rounds to), within the
    few roundings of each (exp's 12 ulp, a division, three products)."""
    from mlx_grpo.cpu import native

    if native.module() is None:
        pytest.skip(f"no native swiglu here: {native.why()}")
    rng = np.random.default_rng(13)
    g = np.concatenate([np.linspace(-100, 100, 401), rng.normal(0, 3, 300)]).astype(np.float32)
    x, c = (rng.normal(0, 1, g.shape).astype(np.float32) for _ in range(2))
    args = [mx.array(g), mx.array(x)]
    out = np.array(native.swiglu(*args))
    grads = mx.grad(lambda g, x: (native.swiglu(g, x) * mx.array(c)).sum(), argnums=(0, 1))(*args)
    g64, x64, c64 = (a.astype(np.float64) for a in (g, x, c))
    s = 1 / (1 + np.exp(-g64))
    want = (g64 * s * x64, c64 * x64 * (s + g64 * s * (1 - s)), c64 * g64 * s)
    # every term's size, at 20 + |g| roundings of float32 (exp's 12 ulp, |g| more from
    # rounding g log2(e), and 8 operations); where e^-g overflows (g under about -88) the
    # result is 0 and off by its whole size
    mags = (np.abs(g64 * s * x64), np.abs(c64 * x64) * (s + np.abs(g64) * s), np.abs(c64 * g64) * s)
    for got, w, m in zip((out, *grads), want, mags):
        rel = np.where(g64 < -88, 1.0, (20 + np.abs(g64)) * EPS32)
        bound = rel * m + np.finfo(np.float32).tiny
        assert np.all(np.abs(np.array(got, np.float64) - w) <= bound)
    assert mx.array_equal(fastmath.swiglu(*args), native.swiglu(*args)).item()  # its route
    mine = np.array(cpu_fastmath.compiled_swiglu(*args), np.float64)  # MLX's ops, the same formula
    assert np.all(np.abs(out - mine) <= 2 * (20 + np.abs(g64)) * EPS32 * mags[0] + 1e-37)


def test_native_packed_attention_refuses_keys_outside_the_batch():
    """A layout whose keys fall outside the batch is an error on evaluation, not a read
    or write past the arrays; the op then runs on a right one."""
    from mlx_grpo.cpu import native

    if native.module() is None:
        pytest.skip(f"no native packed attention here: {native.why()}")
    q, kv = mx.zeros((4, 2, 8)), mx.zeros((4, 1, 8))
    bad = mx.array(np.array([[0, 0, 0], [0, 0, 0], [0, 2, 2], [0, 9, 2]], np.int32))
    with pytest.raises(RuntimeError, match="meta row 3 names keys outside the batch"):
        mx.eval(native.packed_attention(q, kv, kv, bad, 1.0))
    good = mx.array(np.array([[0, 0, 0], [0, 0, 0], [0, 2, 2], [0, 2, 2]], np.int32))
    assert mx.array_equal(native.packed_attention(q, kv, kv, good, 1.0), q).item()
    # runs that each lie inside the batch but name more keys than it holds, in all
    overlapping = np.array([[0, 0, 0, 0, 0]] * 3 + [[0, 3, 0, 3, 3]], np.int32)
    with pytest.raises(RuntimeError, match="meta row 3 names keys outside the batch"):
        mx.eval(native.packed_attention(q, kv, kv, mx.array(overlapping), 1.0))
    with pytest.raises(ValueError, match=r"meta \[N, 2R \+ 1\]"):
        native.packed_attention(q, kv, kv, mx.array(np.zeros((4, 2), np.int32)), 1.0)
