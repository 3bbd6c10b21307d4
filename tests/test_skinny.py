"""The skinny-GEMM front (mlx_grpo/skinny.c): decode's few-row products x W^T computed by
streaming each weight row, in front of the BLAS; checked against numpy in float64 with
the float32 bound of a K-term dot product, and for every other call, that it reaches the
BLAS unchanged."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from mlx_grpo.cpu import blas as blaslib
from mlx_grpo.cpu import skinny

FRONT = blaslib.state["front"]
CPU_HAS_KERNEL = platform.machine() == "x86_64" and {"avx2", "fma"} <= blaslib.cpu_flags()
CAN_BUILD = any(shutil.which(c) for c in ("cc", "gcc", "clang"))
needs_front = pytest.mark.skipif(
    FRONT is None,
    reason=f"no skinny-GEMM front in this process: {blaslib.state['front_why'] or 'no BLAS'}",
)
U = 2.0**-24  # float32 unit roundoff


def test_the_front_is_in_use_wherever_it_can_be():
    """On Linux x86-64 with AVX2 and a C compiler, under an OpenBLAS, it must be loaded:
    the other tests would otherwise skip without saying that the speed-up is gone."""
    if not (sys.platform == "linux" and CPU_HAS_KERNEL and CAN_BUILD and blaslib.state["lib"]):
        pytest.skip("no kernel, compiler or OpenBLAS here")
    if os.environ.get("MLX_GRPO_SKINNY", "").strip().lower() in ("0", "off", "no", "false"):
        pytest.skip("turned off by MLX_GRPO_SKINNY")
    assert FRONT is not None, blaslib.state["front_why"]
    assert "skinny-GEMM front" in blaslib.blas_in_use()


def within_rounding(got: np.ndarray, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """|got - x w^T| <= K u |x| |w|^T elementwise (any summation order of K products)."""
    want = x.astype(np.float64) @ w.astype(np.float64).T
    bound = x.shape[1] * U * (np.abs(x).astype(np.float64) @ np.abs(w).T)
    return np.abs(got - want) <= bound


@needs_front
@pytest.mark.parametrize("m", [1, 3, 4, 5, 8, 15, 16, 17, 31, 32, 33, 45, 63, 64])
@pytest.mark.parametrize("k,n", [(576, 1536), (1536, 576), (67, 1029), (1, 65536), (200, 401)])
def test_skinny_products_are_within_float32_rounding_and_computed_by_the_front(m, k, n):
    if m > FRONT.max_rows:
        assert FRONT.width == 16 and m > 32  # AVX-512 takes 32 rows, AVX2 64
        pytest.skip(f"the AVX-512 kernel takes {FRONT.max_rows} rows")
    rng = np.random.default_rng(m * 1000 + k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    before = FRONT.counts()
    got = np.array(mx.array(x) @ mx.array(w).T)
    after = FRONT.counts()
    assert after[0] == before[0] + 1  # the front computed it: one product
    assert within_rounding(got, x, w).all()


@needs_front
def test_a_row_gets_the_same_bits_whatever_rows_share_its_call():
    """Each output is summed in one order whatever the row count, the blocking (rows in
    fours, and the rest) and the split between threads: a decode row's logits do not
    depend on which other rows are in its batch."""
    rng = np.random.default_rng(0)
    rows = FRONT.max_rows
    x = rng.standard_normal((rows, 576)).astype(np.float32)
    w = mx.array(rng.standard_normal((1029, 576)).astype(np.float32))
    alone = np.concatenate([np.array(mx.array(x[i : i + 1]) @ w.T) for i in range(rows)])
    for m in sorted(m for m in {2, 5, 16, 32, 45, rows} if m <= rows):
        together = np.array(mx.array(x[:m]) @ w.T)
        assert np.array_equal(together, alone[:m]), m


@needs_front
@pytest.mark.parametrize("m", [1, 3, 4, 6, 9, 32])
@pytest.mark.parametrize("k,n", [(64, 160), (160, 64), (64, 511), (5, 7), (1, 17), (250, 33)])
@pytest.mark.parametrize("transposed", [True, False], ids=["x W^T", "x W"])
def test_small_products_run_on_the_calling_thread_within_float32_rounding(m, k, n, transposed):
    """Decode's attention products ([rows, 64] x [64, keys] and [rows, keys] x [keys, 64]
    per batch row and key head), with W stored [n, k] (x W^T) or [k, n] (x W): computed
    by the front, tails of rows and columns included."""
    assert m * k * n <= skinny.MAX_DIRECT
    rng = np.random.default_rng(m * 100 + k + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    before = FRONT.counts()
    got = np.array(mx.array(x) @ (mx.array(w).T if transposed else mx.array(w.T.copy())))
    assert FRONT.counts() == (before[0] + 1, before[1])
    assert within_rounding(got, x, w).all()


@needs_front
def test_a_row_of_a_small_product_gets_the_same_bits_whatever_rows_share_its_call():
    """x W as x W^T: rows in fours (and the rest), each output summed over k in order."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((9, 160)).astype(np.float32)
    w = mx.array(rng.standard_normal((160, 61)).astype(np.float32))
    alone = np.concatenate([np.array(mx.array(x[i : i + 1]) @ w) for i in range(9)])
    for m in (2, 3, 5, 9):
        assert np.array_equal(np.array(mx.array(x[:m]) @ w), alone[:m]), m


@needs_front
def test_every_other_call_reaches_the_blas():
    """More rows than the front takes, a transposed x, a small product with more work
    than one thread should do, x W with a large W, and x W^T + C (beta 1): forwarded,
    with the BLAS's correct results."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((600, 576)).astype(np.float32)
    cases = {
        "too many rows": rng.standard_normal((FRONT.max_rows + 1, 576)).astype(np.float32),
        "transposed x": rng.standard_normal((576, 8)).astype(np.float32).T,
    }
    for name, x in cases.items():
        fast, fwd = FRONT.counts()
        got = np.array(mx.array(x) @ mx.array(w).T)
        assert FRONT.counts() == (fast, fwd + 1), name
        assert within_rounding(got, x, w).all(), name
    x, small = rng.standard_normal((32, 64)).astype(np.float32), w[:, :64]  # N K < 65536
    assert 32 * small.size > skinny.MAX_DIRECT
    fast, fwd = FRONT.counts()
    got = np.array(mx.array(x) @ mx.array(small).T)
    assert FRONT.counts() == (fast, fwd + 1) and within_rounding(got, x, small).all()
    x = rng.standard_normal((4, 600)).astype(np.float32)
    fast, fwd = FRONT.counts()
    got = np.array(mx.array(x) @ mx.array(w))  # x W, W [600, 576]
    assert FRONT.counts() == (fast, fwd + 1) and within_rounding(got, x, w.T).all()
    c = rng.standard_normal((4, 600)).astype(np.float32)
    x = rng.standard_normal((4, 576)).astype(np.float32)
    fast, fwd = FRONT.counts()
    got = np.array(mx.addmm(mx.array(c), mx.array(x), mx.array(w).T))
    assert FRONT.counts() == (fast, fwd + 1)
    want = c + x.astype(np.float64) @ w.T.astype(np.float64)
    assert np.abs(got - want).max() <= 576 * U * (np.abs(x) @ np.abs(w).T + np.abs(c)).max() * 2


@needs_front
def test_two_streams_computing_skinny_products_at_once_both_get_theirs():
    """Two MLX streams call the BLAS from two threads at once (as the update's lanes do):
    one product has the pool, the other runs on its caller's thread alone; both right."""
    rng = np.random.default_rng(2)
    ws = [rng.standard_normal((1536, 576)).astype(np.float32) for _ in range(2)]
    xs = [rng.standard_normal((16, 576)).astype(np.float32) for _ in range(2)]
    streams = [mx.new_stream(mx.cpu) for _ in range(2)]
    for _ in range(5):
        fast = FRONT.counts()[0]
        outs = []
        for stream, x, w in zip(streams, xs, ws):
            with mx.stream(stream):
                outs.append([mx.array(x) @ mx.array(w).T for _ in range(20)])
        mx.eval(outs)
        assert FRONT.counts()[0] == fast + 40
        for out, x, w in zip(outs, xs, ws):
            assert all(within_rounding(np.array(o), x, w).all() for o in out)


def run_child(tmp_path, code: str, **env: str) -> dict:
    full = {**os.environ, "MLX_GRPO_CACHE": str(tmp_path / "cache"), **env}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


CHILD = """
import ctypes, json, os, time, mlx_grpo, mlx.core as mx, numpy as np
from mlx_grpo.cpu import blas as blaslib
front = blaslib.state["front"]
r = np.random.default_rng(3)
x, w = r.standard_normal((16, 197)).astype(np.float32), r.standard_normal((1029, 197)).astype(np.float32)
got = np.array(mx.array(x) @ mx.array(w).T)
want = x.astype(np.float64) @ w.T.astype(np.float64)
ok = bool((np.abs(got - want) <= 197 * 2.0**-24 * (np.abs(x) @ np.abs(w).T)).all())
alone = np.concatenate([np.array(mx.array(x[i:i + 1]) @ mx.array(w).T) for i in range(16)])
forked_ok = None
if front is not None:
    # A forked child (MLX itself does not run after fork) calling the front directly
    # starts pool threads of its own, where the parent's would never answer.
    gemm = front.lib.cblas_sgemm
    gemm.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int,
                     ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
    y = np.zeros((16, 1029), np.float32)
    pid = os.fork()
    if pid == 0:
        gemm(101, 111, 112, 16, 1029, 197, 1.0, x.ctypes.data, 197, w.ctypes.data, 197, 0.0,
             y.ctypes.data, 1029)
        os._exit(0 if np.array_equal(y, got) else 1)
    for _ in range(600):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            forked_ok = status == 0
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        forked_ok = False
print(json.dumps({"front": front.describe() if front else None, "counts": front.counts() if front else None,
                  "ok": ok, "invariant": bool(np.array_equal(got, alone)), "forked_ok": forked_ok,
                  "said": blaslib.blas_in_use()}))
"""


@needs_front
def test_the_avx2_kernel_is_right_too(tmp_path):
    """CPUs without AVX-512 (AMD Zen 3, say) run the 8-wide kernel: run here on purpose."""
    out = run_child(tmp_path, CHILD, MLX_GRPO_SKINNY="avx2")
    assert out["front"] == "skinny-GEMM front (AVX2)" and out["counts"][0] == 17
    assert out["ok"] and out["invariant"] and out["forked_ok"]


@needs_front
def test_turned_off_mlx_calls_the_blas_itself(tmp_path):
    out = run_child(tmp_path, CHILD, MLX_GRPO_SKINNY="0")
    assert out["front"] is None and out["ok"] and "skinny" not in out["said"]


@pytest.mark.skipif(not CAN_BUILD or platform.machine() != "x86_64", reason="no C compiler")
def test_a_front_with_wrong_numbers_is_not_used(tmp_path, monkeypatch):
    """The child-process check is what stands between a broken kernel and training: a
    front that sums one product too few is rejected with the reason, and not loaded."""
    if blaslib.state["lib"] is None or not CPU_HAS_KERNEL:
        pytest.skip("no OpenBLAS or no kernel for this CPU")
    monkeypatch.setenv("MLX_GRPO_CACHE", str(tmp_path / "cache"))
    broken = tmp_path / "skinny.c"
    source = skinny.SOURCE.read_text()
    for width in (16, 8):  # each kernel skips its first vector of products
        loop = f"for (; k + {width} <= p->k; k += {width})"
        assert source.count(loop) == 1
        source = source.replace(loop, loop.replace("(;", f"(k = {width};"))
    broken.write_text(source)
    monkeypatch.setattr(skinny, "SOURCE", broken)
    blas = blaslib.state["blas"]
    front, why, _ = skinny.prepare(blas.path, 2)
    assert front is None and why.startswith("wrong results: "), why


def test_without_a_compiler_there_is_no_front_and_the_reason_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_GRPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    if platform.machine() != "x86_64":
        assert skinny.prepare("/nonexistent", 2)[0] is None
        return
    assert skinny.prepare("/nonexistent", 2)[:2] == (None, "needs a C compiler (cc) to be built")
