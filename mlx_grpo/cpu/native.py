"""Attention and SwiGLU as native MLX ops on Linux CPUs (`packed_attention.cpp`).

The update's packed pass (`logprobs._Packed`) built from MLX's ops is hundreds of small
ops a layer for its attention alone (the rows laid out into padded blocks, scores,
masks, an exp, and the gradients of each), about three quarters of the ops of the
work unit's policy pass; on a CPU each is dispatched on its own. The native op is one
primitive forward and one backward a layer, over the keys each position sees and no
others (`_Packed.attend` uses it where it loaded). A decode step's attention
(`decode.lean_logits`) and SwiGLU (`fastmath.swiglu`) are one op each too.

It is a C++ MLX extension, compiled once per machine into the cache from its source
with the system C++ compiler, against the installed MLX's headers and library and
nanobind (a dependency; its ABI must be the one MLX's own bindings use), then checked
in a child process against numpy in float64, forward and gradient (a crash there is a
verdict, as for the BLAS). Where any of that fails, or on anything but a Linux CPU,
attention stays MLX's ops, with the same results within float32 rounding.
MLX_GRPO_NATIVE=0 turns it off.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path

import mlx.core as mx

from mlx_grpo.cpu.build import (
    cached_verdict,
    compile_library,
    cpu_signature,
    mlx_version,
    save_verdict,
    verdict_file,
)

SOURCE = Path(__file__).with_name("packed_attention.cpp")
MODULE = "_packed_attention"
BUILD_TIMEOUT_S = 300
PROBE_TIMEOUT_S = 120

# Runs in a child process: argv = [module file]. Packed attention over two groups (a
# prompt, then rows of inputs, one of them empty, two of them seeing an earlier row's
# first inputs) with grouped heads, and its gradient;
# a decode step over columns some rows do not see; SwiGLU and its gradient; each against
# float64. Prints one JSON line, or dies trying.
PROBE = r"""
import importlib.util, json, sys
import numpy as np
spec = importlib.util.spec_from_file_location("_packed_attention", sys.argv[1])
lib = importlib.util.module_from_spec(spec); spec.loader.exec_module(lib)
import mlx.core as mx
mx.set_default_device(mx.cpu)
rng = np.random.default_rng(0)
# per group, a prompt length and rows of (inputs, shared): shared is None or (an earlier
# row, how many of its first inputs this row sees before its own)
meta, start = [], 0
for p, rows in ((5, ((3, None), (0, None), (4, None), (2, (0, 2)), (1, (3, 1)))),
                (4, ((2, None), (2, None)))):
    meta += [(start, 0, 0, 0, start)] * p
    prompt, start, firsts = start, start + p, []
    for m, shared in rows:
        mid = (0, 0) if shared is None else (firsts[shared[0]], shared[1])
        meta += [(prompt, p, *mid, start)] * m
        firsts.append(start)
        start += m
n, h, hk = start, 6, 2
meta = np.array(meta, np.int32)
errors = []

def ref(q, k, v):
    out, grads = np.zeros((n, h, d)), [np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)]
    for i in range(n):
        keys = [j for r in (0, 2) for j in range(meta[i, r], meta[i, r] + meta[i, r + 1])]
        keys += list(range(meta[i, 4], i + 1))
        for a in range(h):
            kk, vv = k[keys, a // (h // hk)], v[keys, a // (h // hk)]
            s = kk @ q[i, a] * scale
            p = np.exp(s - s.max()); p /= p.sum()
            out[i, a] = p @ vv
            dp = vv @ dout[i, a]
            ds = p * (dp - p @ dp) * scale
            grads[0][i, a] = ds @ kk
            np.add.at(grads[1], (keys, a // (h // hk)), np.outer(ds, q[i, a]))
            np.add.at(grads[2], (keys, a // (h // hk)), np.outer(p, dout[i, a]))
    return out, grads

# head widths of 64 and 128 take the kernels' vector loops, 16 the plain ones
for d in (16, 64, 128):
    scale = d ** -0.5
    q, dout = (rng.standard_normal((n, h, d)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((n, hk, d)).astype(np.float32) for _ in range(2))
    f = lambda q, k, v: lib.packed_attention(q, k, v, mx.array(meta), scale)
    args = [mx.array(x) for x in (q, k, v)]
    got = np.array(f(*args))
    grads = mx.grad(lambda q, k, v: (f(q, k, v) * mx.array(dout)).sum(), argnums=(0, 1, 2))(*args)
    want, want_grads = ref(*(x.astype(np.float64) for x in (q, k, v)))
    errors.append(float(np.abs(got - want).max()))
    errors += [float(np.abs(np.array(g) - w).max()) for g, w in zip(grads, want_grads)]

    # a decode step: 3 rows, 9 cache columns, some not seen
    q = (rng.standard_normal((3, h, d)) * scale).astype(np.float32)
    k, v = (rng.standard_normal((3, hk, 9, d)).astype(np.float32) for _ in range(2))
    bias = np.where(rng.random((3, 9)) < 0.6, 0.0, -np.inf).astype(np.float32)
    bias[:, 2] = 0.0
    kk, vv = (np.repeat(x.astype(np.float64), h // hk, axis=1) for x in (k, v))
    s = np.einsum("bhd,bhcd->bhc", q.astype(np.float64), kk) + bias[:, None]
    p = np.exp(s - s.max(-1, keepdims=True)); p /= p.sum(-1, keepdims=True)
    got = np.array(lib.decode_attention(*(mx.array(x) for x in (q, k, v, bias))))
    errors.append(float(np.abs(got - np.einsum("bhc,bhcd->bhd", p, vv)).max()))

# SwiGLU and its gradient, across exp's range (e^-g overflows below about -88)
g = np.concatenate([np.linspace(-95, 95, 191), rng.standard_normal(65)]).astype(np.float32)
x, c = (rng.standard_normal(g.shape).astype(np.float32) for _ in range(2))
s = 1 / (1 + np.exp(-g.astype(np.float64)))
f = lambda g, x: lib.swiglu(g, x)
got = np.array(f(mx.array(g), mx.array(x)))
grads = mx.grad(lambda g, x: (f(g, x) * mx.array(c)).sum(), argnums=(0, 1))(mx.array(g), mx.array(x))
want = (g * s * x, c * x * (s + g * s * (1 - s)), c * g * s)
scale = np.abs(want[0]) + np.abs(want[1]) + np.abs(want[2]) + 1
errors += [float((np.abs(np.array(a) - w) / scale).max()) for a, w in zip((got, *grads), want)]
print(json.dumps({"errors": errors}))
"""
# Every attention value above is a sum of a few dozen terms (a gradient of a key gathers
# over the queries that see it; scores are sums of d products) of size at most a few
# units, in float32 (a relative 6e-8 a term), and SwiGLU's errors are relative to their
# terms' size: anything past 1e-3 is a wrong result, not rounding.
PROBE_TOLERANCE = 1e-3

_state: dict = {"module": None, "why": None}
_LOCK = threading.Lock()


def wanted() -> bool:
    value = os.environ.get("MLX_GRPO_NATIVE", "").strip().lower()
    return value not in ("0", "off", "no", "false")


def _flags() -> list[str]:
    import nanobind

    mlx_dir = Path(mx.__file__).parent
    nb = Path(nanobind.source_dir()).parent
    flags = [
        "-O3", "-std=c++20", "-fvisibility=hidden", "-fopenmp-simd",
        "-DNDEBUG", "-DNB_COMPACT_ASSERTIONS", "-DNB_DOMAIN=mlx",  # MLX's bindings' domain
        f"-I{nanobind.include_dir()}", f"-I{nb / 'ext' / 'robin_map' / 'include'}",
        f"-I{sysconfig.get_paths()['include']}", f"-I{mlx_dir / 'include'}",
    ]  # fmt: skip
    if sys.version_info >= (3, 12):  # MLX's bindings use the stable ABI there
        flags.append("-DPy_LIMITED_API=0x030C0000")
    if platform.machine() in ("x86_64", "aarch64"):
        flags.append("-march=native")  # built on the machine that runs it (key: the CPU)
    return flags + [
        str(Path(nanobind.source_dir()) / "nb_combined.cpp"),
        f"-L{mlx_dir / 'lib'}", "-lmlx", f"-Wl,-rpath,{mlx_dir / 'lib'}",
    ]  # fmt: skip


def build() -> tuple[Path | None, str]:
    """The compiled extension (built once into the cache), or None and why not."""
    try:
        import nanobind
    except ImportError:
        return None, "needs nanobind (pip install nanobind)"
    key = json.dumps([mlx_version(), nanobind.__version__, cpu_signature()])
    return compile_library(
        SOURCE.read_text(), MODULE, _flags(), key, "c++", "native", BUILD_TIMEOUT_S,
        announce="mlx-grpo: building the native attention and SwiGLU ops for this CPU "
        "(once per machine and MLX version)",
    )  # fmt: skip


def probe(lib: Path) -> dict:
    """Whether the extension loads into this MLX and computes packed attention and its
    gradient right, found in a child process and cached: {"ok", "reason"}."""
    stat = lib.stat()
    ident = [str(lib), stat.st_size, stat.st_mtime_ns, PROBE, cpu_signature(), mlx_version()]
    cached = verdict_file("native", "verdict", ident)
    if (verdict := cached_verdict(cached)) is not None:
        return verdict
    try:
        done = subprocess.run(
            [sys.executable, "-c", PROBE, str(lib)],
            capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"ok": False, "reason": f"its probe hung (> {PROBE_TIMEOUT_S} s)"}
    try:
        errors = [float(e) for e in json.loads(done.stdout.strip().splitlines()[-1])["errors"]]
    except (ValueError, KeyError, TypeError, IndexError):
        tail = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return {"ok": False, "reason": f"its probe failed: {tail[:200]}"}
    if not all(e <= PROBE_TOLERANCE for e in errors):  # (NaN fails too)
        verdict = {"ok": False, "reason": f"wrong results (errors {errors})"}
    else:
        verdict = {"ok": True, "reason": ""}
    save_verdict(cached, verdict)
    return verdict


def module():
    """The loaded extension, or None (then `why()` says why); built, probed and loaded
    on first call, once per process."""
    with _LOCK:
        if _state["why"] is None:
            _state["module"], _state["why"] = _load()
    return _state["module"]


def _load():
    """(the extension, "") or (None, why not); one warning line where it was wanted on
    Linux but did not build, load or pass its probe."""
    if not wanted():
        return None, "off (MLX_GRPO_NATIVE)"
    if not sys.platform.startswith("linux"):
        return None, f"not built on {sys.platform}"
    if sysconfig.get_config_var("Py_GIL_DISABLED"):
        return None, "not built for a free-threaded Python"
    try:
        lib, why = build()
        if lib is not None:
            verdict = probe(lib)
            why = "" if verdict["ok"] else (verdict.get("reason") or "it failed its probe")
        if lib is not None and not why:
            spec = importlib.util.spec_from_file_location(MODULE, lib)
            loaded = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(loaded)
            return loaded, ""
    except Exception as e:  # any failure here leaves MLX's ops, never a dead run
        why = f"could not be loaded: {type(e).__name__}: {e}"
    print(
        f"mlx-grpo: warning: native attention not in use ({why}); MLX's ops instead, "
        "slower on a CPU (MLX_GRPO_NATIVE=0 hides this)",
        file=sys.stderr,
    )
    return None, why


def loaded() -> bool:
    """Whether this process has loaded the extension (at its first use, where it ran)."""
    return _state["module"] is not None


def why() -> str:
    """Why the extension is not in use ("" where it is, or before the first `module()`)."""
    return _state["why"] or ""


def _runs(*arrays: mx.array) -> bool:
    """Whether the ops take these: float32 arrays on the CPU, the extension loaded."""
    on_cpu = mx.default_device() == mx.cpu and all(a.dtype == mx.float32 for a in arrays)
    return on_cpu and module() is not None


def packed_attention(q: mx.array, k: mx.array, v: mx.array, meta: mx.array, scale: float):
    """softmax(q k^T scale) v over the keys each position sees: q [N, H, D], k and v
    [N, Hkv, D], meta [N, 2R + 1] int32 (per position: R runs of rows it sees, each as
    its first row and length, 0 for none; then its own run's first row: it sees the R
    runs and its own run up to itself). None where the extension is not loaded or the
    arrays are not float32 on the CPU."""
    if not _runs(q, k, v) or meta.dtype != mx.int32:
        return None
    return module().packed_attention(q, k, v, meta, scale)


def decode_attention(q: mx.array, k: mx.array, v: mx.array, bias: mx.array):
    """One decode step's attention: softmax(q k^T + bias) v per row, q [B, H, D]
    (scaled already), k and v a cache [B, Hkv, C, D], bias [B, C] (0 where a column is
    seen, -inf where not; every row sees one at least). None where the extension is not
    loaded or the arrays are not float32 on the CPU."""
    if not _runs(q, k, v, bias):
        return None
    return module().decode_attention(q, k, v, bias)


def swiglu(gate: mx.array, x: mx.array):
    """silu(gate) * x in one pass, and its gradient in one: None where the extension is
    not loaded or the arrays are not float32 on the CPU."""
    if not _runs(gate, x):
        return None
    return module().swiglu(gate, x)


def main() -> int:
    """`python -m mlx_grpo.cpu.native`: build, probe and load the extension now (as `make
    install` does on Linux, so that a first run does not wait for the compiler) and say
    in one line whether it is in use; exit status 1 where it is not."""
    if mx.default_device() != mx.cpu:
        print(f"native ops: not needed (MLX runs on {mx.default_device()})")
        return 0
    lib = module()
    if lib is None:
        print(f"native ops: not in use: {why()}; MLX's ops instead")
        return 1
    print(f"native ops: in use ({lib.__file__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
