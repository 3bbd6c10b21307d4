"""The skinny-GEMM front (`skinny.c`): decode's linear layers without the BLAS's packing.

A decode step multiplies a few rows (the batch: 16 on the bench's work unit) by every
weight matrix of the model, so its time is the time to read the weights. OpenBLAS (and
MKL and BLIS, README "How fast") packs each weight into a buffer before it multiplies,
which at 16 rows reads it at about half the memory bandwidth. The front is a small C
library that defines `cblas_sgemm`: MLX resolves its BLAS calls to the first library
loaded globally, so loaded before the BLAS it sees every GEMM. Row-major x W^T products
of at most `MAX_ROWS` rows (32 with AVX-512, 64 with AVX2) it computes as dot products,
streaming each W row once against every x row (a software prefetch a block ahead), on
the BLAS's thread count.
Small products of as few rows (x W^T or x W with N x K below `MIN_WEIGHT`, such as
decode attention's per-head products, 2,880 of them a step) it computes on the calling
thread, where OpenBLAS takes longer to set each call up than to compute it. Every other
call goes on to the BLAS.

It is built once per machine from its source with the system C compiler (as
scipy-openblas32's shim is), checked in a child process against numpy in float64 (as
every BLAS is: a crash there is a verdict), and used only where both worked; otherwise
MLX calls the BLAS directly, as before. x86-64 CPUs with AVX-512 or AVX2 and FMA have a
kernel; elsewhere there is nothing to gain and the front is not loaded.
MLX_GRPO_SKINNY=0 turns it off, MLX_GRPO_SKINNY=avx2 picks the AVX2 kernel on an AVX-512
CPU (for tests).
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

from mlx_grpo.cpu.build import (
    cached_verdict,
    compile_library,
    cpu_signature,
    mlx_version,
    save_verdict,
    verdict_file,
)

SOURCE = Path(__file__).with_name("skinny.c")
# The most rows a product may have to be computed here, by the kernel's vector width:
# up to these it beat OpenBLAS's SkylakeX (AVX-512, 16 floats) and Zen (AVX2, 8) kernels
# on a decode step's products (README "Which BLAS"; `python -m mlx_grpo.bench.ops`). On
# a Zen 3, OpenBLAS is slow from 33 rows to about 64 (a prompt's prefill): a decode
# step's 211 products at 45 rows take 132.7 ms through the front against 210.6.
MAX_ROWS = {16: 32, 8: 64}
MIN_WEIGHT = 65536  # N x K below this: the pool's hand-off costs more than it saves
MAX_DIRECT = 1 << 20  # M x N x K at most, below MIN_WEIGHT: on the calling thread alone
SPIN_US = 200  # how long an idle pool thread waits awake for the next product
PROBE_TIMEOUT_S = 120

# Runs in a child process: argv = [front, BLAS library, threads, isa]. Loads both as
# use_fast_blas would, then checks skinny products through MLX (odd sizes, tails, every
# row count up to the limit, a strided operand) against numpy in float64, and that the
# front computed them. Prints one JSON line, or dies trying.
PROBE = r"""
import ctypes, json, os, sys
front, blas, threads, isa = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
max_rows, min_weight, max_direct = json.loads(sys.argv[5])
f = ctypes.CDLL(front, mode=os.RTLD_GLOBAL)
b = ctypes.CDLL(blas, mode=os.RTLD_GLOBAL)
f.skinny_init.restype = ctypes.c_int
width = f.skinny_init(ctypes.cast(b.cblas_sgemm, ctypes.c_void_p), threads, isa.encode(),
                      ctypes.c_long(0))
rows = max_rows.get(str(width), 0)
f.skinny_set_limits(rows, ctypes.c_long(min_weight), ctypes.c_long(max_direct))
import mlx.core as mx
import numpy as np

mx.set_default_device(mx.cpu)
rng = np.random.default_rng(0)
failed = []
shapes = ((1, 576, 1536), (16, 1536, 576), (7, 67, 1029), (rows, 576, 193),
          (max(rows - 19, 1), 200, 401), (3, 64, 160), (5, 13, 7))
for transposed in (True, False):
    for m, k, n in shapes if transposed else ((3, 160, 64), (6, 67, 29), (1, 5, 200), (4, 9, 16)):
        x = rng.standard_normal((m, k)).astype(np.float32)
        w = rng.standard_normal((n, k)).astype(np.float32)
        got = np.array(mx.array(x) @ (mx.array(w).T if transposed else mx.array(w.T.copy())))
        want = x.astype(np.float64) @ w.astype(np.float64).T
        bound = k * 2.0**-24 * (np.abs(x) @ np.abs(w).T) + 1e-30
        if not np.all(np.abs(got - want) <= bound):  # also catches NaN
            error = np.max(np.abs(got - want) / bound)
            failed.append(f"{m}x{k}x{n}{'' if transposed else ' (x W)'}: error {error:.2f}x its bound")
fast, fwd = ctypes.c_long(), ctypes.c_long()
f.skinny_counts(ctypes.byref(fast), ctypes.byref(fwd))
print(json.dumps({"width": width, "fast": fast.value, "failed": failed}))
"""


def wanted() -> str | None:
    """The kernel asked for: "" (the best this CPU runs), "256" (AVX2), or None (off)."""
    value = os.environ.get("MLX_GRPO_SKINNY", "").strip().lower()
    if value in ("0", "off", "no", "false"):
        return None
    return "256" if value == "avx2" else ""


def build() -> tuple[Path | None, str]:
    """The compiled front (built once into the cache), or None and why not."""
    if platform.machine() != "x86_64":
        return None, f"no kernel for {platform.machine()}"
    return compile_library(SOURCE.read_text(), "skinny", ["-O3", "-pthread", "-ldl"])


def _probe_limits() -> str:
    """The limits the probe sets, as `Front` will: rows by vector width, MIN_WEIGHT,
    MAX_DIRECT."""
    return json.dumps([{str(w): r for w, r in MAX_ROWS.items()}, MIN_WEIGHT, MAX_DIRECT])


def probe(front: Path, blas: str, threads: int, isa: str) -> dict:
    """Whether the front computes skinny products right through MLX in front of `blas`
    on this CPU, found in a child process and cached: {"ok", "reason", "width"}."""
    ids = [str(p) + f":{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in (front, Path(blas))]
    ident = [PROBE, _probe_limits(), ids, cpu_signature(), mlx_version(), threads, isa]
    cached = verdict_file("blas", "skinny-verdict", ident)
    if (verdict := cached_verdict(cached)) is not None:
        return verdict
    try:
        done = subprocess.run(
            [sys.executable, "-c", PROBE, str(front), blas, str(threads), isa, _probe_limits()],
            capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"ok": False, "reason": f"its probe hung (> {PROBE_TIMEOUT_S} s)", "width": 0}
    try:
        out = json.loads(done.stdout.strip().splitlines()[-1])
        width, fast, failed = int(out["width"]), int(out["fast"]), list(out["failed"])
    except (ValueError, KeyError, TypeError, IndexError):
        tail = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return {"ok": False, "reason": f"its probe failed: {tail[:200]}", "width": 0}
    if width == 0:
        verdict = {"ok": False, "reason": "no kernel for this CPU", "width": 0}
    elif failed:
        verdict = {"ok": False, "reason": "wrong results: " + "; ".join(failed[:3]), "width": 0}
    elif fast == 0:
        verdict = {"ok": False, "reason": "MLX did not call it", "width": 0}
    else:
        verdict = {"ok": True, "reason": "", "width": width}
    save_verdict(cached, verdict)
    return verdict


class Front:
    """The loaded front: its library, and the vector width of its kernel."""

    def __init__(self, lib: ctypes.CDLL, width: int):
        self.lib, self.width = lib, width
        self.max_rows = MAX_ROWS.get(width, 0)
        self.limits(self.max_rows, MAX_DIRECT)

    def describe(self) -> str:
        return f"skinny-GEMM front ({'AVX-512' if self.width == 16 else 'AVX2'})"

    def set_threads(self, threads: int) -> None:
        self.lib.skinny_set_threads(threads)

    def threads(self) -> int:
        return self.lib.skinny_threads()

    @contextmanager
    def bypassed(self):
        """Inside this block every call goes to the BLAS (for side-by-side timings)."""
        self.limits(0, 0)
        try:
            yield
        finally:
            self.limits(self.max_rows, MAX_DIRECT)

    def limits(self, rows: int, direct: int) -> None:
        """Take products of at most `rows` rows, and small ones of at most `direct`
        multiply-adds on the calling thread (0: none; see skinny.c)."""
        self.lib.skinny_set_limits(rows, ctypes.c_long(MIN_WEIGHT), ctypes.c_long(direct))

    def counts(self) -> tuple[int, int]:
        """(products it computed, calls it passed on to the BLAS) so far."""
        fast, forwarded = ctypes.c_long(), ctypes.c_long()
        self.lib.skinny_counts(ctypes.byref(fast), ctypes.byref(forwarded))
        return fast.value, forwarded.value


def prepare(blas: str, threads: int) -> tuple[Path | None, str, str]:
    """(the front to load before `blas`, or None; why not; the kernel asked for)."""
    isa = wanted()
    if isa is None:
        return None, "off (MLX_GRPO_SKINNY)", ""
    front, why = build()
    if front is None:
        return None, why, isa
    verdict = probe(front, blas, threads, isa)
    return (front, "", isa) if verdict["ok"] else (None, verdict["reason"], isa)


def load(front: Path) -> ctypes.CDLL:
    """Load the front globally: before the BLAS, so that MLX's `cblas_sgemm` is its."""
    return ctypes.CDLL(str(front), mode=os.RTLD_GLOBAL)


def start(lib: ctypes.CDLL, blas: ctypes.CDLL, threads: int, isa: str) -> Front:
    """Point the loaded front at the loaded BLAS's `cblas_sgemm`, with `threads` threads."""
    lib.skinny_init.restype = ctypes.c_int
    width = lib.skinny_init(
        ctypes.cast(blas.cblas_sgemm, ctypes.c_void_p),
        threads,
        isa.encode(),
        ctypes.c_long(SPIN_US),
    )
    return Front(lib, width)
