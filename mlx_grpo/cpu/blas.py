"""Give MLX a fast BLAS on Linux CPUs without ever loading one that can kill the process.

MLX's Linux CPU wheel links a reference BLAS and LAPACK (~5-7 GFLOP/s float32 GEMM).
Loading an OpenBLAS with RTLD_GLOBAL before the first `import mlx` makes MLX resolve its
BLAS and LAPACK calls there (~130-450 GFLOP/s on 2 cores, by CPU). But an OpenBLAS built
for another CPU family dies with SIGILL at its first GEMM, and a crash cannot be caught
in the process that has it. So each candidate is first loaded in a child process that
checks it exports the BLAS entry points MLX resolves (any shared library loads, and one
without them would leave MLX on its own BLAS while named as the one in use), then runs
every BLAS/LAPACK routine MLX calls and checks the numbers against numpy in float64;
the verdict is cached under the cache directory, keyed by the library file, the CPU,
the thread count and OPENBLAS_CORETYPE (which forces a kernel family). The first
candidate that passes is loaded. If none does, MLX keeps its own BLAS and one warning
line says why and what to install. A DYNAMIC_ARCH build that does not know this CPU's
model falls back to kernels older than AVX (OpenBLAS 0.3.21 takes an Emerald Rapids
Xeon for a Prescott: 34 GFLOP/s where its SkylakeX kernels give 200); there the family
the CPU's flags allow is forced with OPENBLAS_CORETYPE, once that passes its probe too,
unless OPENBLAS_CORETYPE is set already.

Candidates, in order (README "Which BLAS"):
  system            the distribution's OpenBLAS (Debian/Ubuntu `libopenblas0-pthread`,
                    Fedora `openblas-pthreads`, Arch `openblas`, conda): DYNAMIC_ARCH
                    builds that pick their kernels for the CPU at run time
  scipy-openblas32  PyPI's DYNAMIC_ARCH build (the one numpy/scipy ship); its symbols
                    carry a `scipy_` prefix, so MLX reaches it through a forwarding shim
                    compiled once with the system C compiler
  cmeel-openblas    PyPI's single-target build (SKYLAKEX kernels, MAX_THREADS=4): used
                    only where its probe passes, after the others
  builtin           MLX's own reference BLAS

MLX_GRPO_OPENBLAS=<path to a BLAS library, or one of the names above> is tried first
(`builtin` keeps MLX's own); a value without a slash that is neither a file nor a name
is said to be so, not probed as a file. A candidate whose build caps its threads below
the count wanted here is used only when no uncapped one works.

Threads: OPENBLAS_NUM_THREADS, if a whole number above 0, rules; any other value is
named in a warning line (OpenBLAS itself would quietly ignore it). Otherwise one thread
per physical core that this process may run on (affinity and cgroup quota), shared out
between the ranks of an `mlx.launch` job on the same machine: OpenBLAS threads spin
while they wait, so ranks that each ran a thread per core would slow each other down
many times over.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import sysconfig
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from mlx_grpo.cpu import skinny
from mlx_grpo.cpu.build import (
    cached_verdict,
    compile_library,
    cpu_signature,
    last_line,
    mlx_version,
    save_verdict,
    verdict_file,
)

# The BLAS and LAPACK symbols that libmlx.so (mlx 0.32) imports; the probe runs each one
# through MLX and the scipy-openblas32 shim forwards each one.
MLX_BLAS_SYMBOLS = ("cblas_sgemm", "cblas_dgemm", "cblas_cgemm")
MLX_LAPACK_SYMBOLS = tuple(
    f"{t}{r}_"
    for t, routines in (
        ("s", ("geev", "gesdd", "geqrf", "getrf", "getri", "orgqr", "potrf", "syevd", "trtri")),
        ("d", ("geev", "gesdd", "geqrf", "getrf", "getri", "orgqr", "potrf", "syevd", "trtri")),
        ("c", ("geev", "gesdd", "heevd")),
    )
    for r in routines
)
NAMES = ("system", "scipy-openblas32", "cmeel-openblas", "builtin")
INSTALL_HINT = (
    "install your distribution's OpenBLAS (Debian/Ubuntu: apt-get install libopenblas0-pthread; "
    "Fedora: dnf install openblas-pthreads), or a C compiler for the scipy-openblas32 shim"
)
PROBE_TIMEOUT_S = 300

# Runs in a child process: argv = [library or "", thread count, the BLAS symbols MLX
# resolves, comma-separated]. Loads the library; if it lacks one of those symbols, says
# which ("missing") and stops. Otherwise runs each routine through MLX on
# well-conditioned inputs and checks a residual against numpy in float64. Prints one
# JSON line, or dies trying.
PROBE = r"""
import ctypes, json, os, sys
lib, threads, symbols = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(",")
config = ""
if lib:
    handle = ctypes.CDLL(lib, mode=os.RTLD_GLOBAL)
    # MLX resolves the plain names only: a library without them changes nothing in MLX.
    missing = [s for s in symbols if not hasattr(handle, s)]
    if missing:
        prefixed = all(hasattr(handle, "scipy_" + s) for s in missing)
        print(json.dumps({"config": "", "failed": [], "missing": missing, "prefixed": prefixed}))
        sys.exit(0)
    for prefix in ("", "scipy_"):
        if hasattr(handle, prefix + "openblas_get_config"):
            get = getattr(handle, prefix + "openblas_get_config")
            get.restype = ctypes.c_char_p
            config = get().decode(errors="replace")
            getattr(handle, prefix + "openblas_set_num_threads")(threads)
            break
import mlx.core as mx
import numpy as np

mx.set_default_device(mx.cpu)
rng = np.random.default_rng(0)
failed = []


def rel(residual, scale):
    return float(np.linalg.norm(residual) / max(np.linalg.norm(scale), 1e-300))


def check(name, residual, scale, tol):
    err = rel(residual, scale)
    if not err <= tol:  # also catches NaN
        failed.append(f"{name} residual {err:.1e} > {tol:.0e}")


def matrix(n, m, dtype):
    a = rng.standard_normal((n, m))
    if np.dtype(dtype).kind == "c":
        a = a + 1j * rng.standard_normal((n, m))
    return a.astype(dtype)


def mlx(a):
    return mx.array(a, dtype=getattr(mx, a.dtype.name))


def spd(n, dtype):
    a = matrix(n, n, dtype)
    return (a @ a.conj().T + n * np.eye(n)).astype(dtype)


# float32: error of a K-term dot product <= K eps |a||b|; K <= 512, eps 6e-8 -> 3e-5.
TOL = {"float32": 1e-4, "complex64": 1e-4, "float64": 1e-11}
for dt, tol in TOL.items():
    # GEMM: tiny, odd-sized, large enough to use every thread, and transposed operands.
    for n, k, m in ((3, 5, 4), (67, 45, 33), (384, 512, 256)):
        a, b = matrix(n, k, dt), matrix(k, m, dt)
        want = a.astype(np.complex128) @ b.astype(np.complex128)
        got = np.array(mlx(a) @ mlx(b))
        check(f"{dt} matmul {n}x{k}x{m}", got - want, np.abs(a) @ np.abs(b), tol)
        got = np.array(mlx(a.T.copy()).T @ mlx(b.T.copy()).T)
        check(f"{dt} matmul^T {n}x{k}x{m}", got - want, np.abs(a) @ np.abs(b), tol)
    n = 48
    a = spd(n, dt)
    A = mlx(a)
    eye = np.eye(n)
    if dt != "complex64":  # MLX's LAPACK paths for real types only
        check(f"{dt} inv", a @ np.array(mx.linalg.inv(A)) - eye, eye, tol)
        low = np.array(mx.linalg.cholesky(A))
        check(f"{dt} cholesky", low @ low.T - a, a, tol)
        q, r = (np.array(x) for x in mx.linalg.qr(A))
        check(f"{dt} qr", q @ r - a, a, tol)
        tri = np.tril(a)
        check(f"{dt} tri_inv", tri @ np.array(mx.linalg.tri_inv(mlx(tri), upper=False)) - eye, eye, tol)
    u, s, vt = (np.array(x) for x in mx.linalg.svd(A))
    check(f"{dt} svd", (u * s) @ vt - a, a, tol)
    w, v = (np.array(x) for x in mx.linalg.eigh(A))
    check(f"{dt} eigh", a @ v - v * w, a, tol)
    g = matrix(n, n, dt) + n * np.eye(n, dtype=dt)
    w, v = (np.array(x) for x in mx.linalg.eig(mlx(g)))
    # eig returns complex64 whatever the input: float32 accuracy. Each eigenvalue makes
    # g - w I singular; MLX's complex eigenvectors follow another convention, so vectors
    # are checked for real inputs only.
    smallest = [np.linalg.svd(g - x * eye, compute_uv=False)[-1] for x in w]
    check(f"{dt} eig values", np.array(smallest), g, 1e-3)
    if dt != "complex64":
        check(f"{dt} eig", g @ v - v * w, g, 1e-3)
print(json.dumps({"config": config, "failed": failed}))
"""


@dataclass(frozen=True)
class Blas:
    """The BLAS that MLX uses in this process."""

    name: str  # one of NAMES, or "custom" for a path given in MLX_GRPO_OPENBLAS
    path: str | None  # the library loaded (None: MLX's own)
    config: str = ""  # openblas_get_config()
    threads: int | None = None
    coretype: str | None = None  # OPENBLAS_CORETYPE forced for it (see misdetected)

    def describe(self) -> str:
        if self.path is None:
            return "MLX built-in BLAS"
        config = " ".join(w for w in self.config.split() if w != "NO_AFFINITY")
        forced = f", OPENBLAS_CORETYPE={self.coretype}" if self.coretype else ""
        return f"{config or 'BLAS'} ({self.name}, {self.threads} threads{forced})"


# The choice, the library loaded for it, and the skinny-GEMM front in front of it (or
# why there is none).
state: dict = {"blas": None, "lib": None, "front": None, "front_why": ""}


# ---------------------------------------------------------------------------- threads


def physical_cores() -> int:
    """Physical cores this process may run on: its CPU affinity counted once per core
    (hyperthreads share one), capped by a cgroup v2 CPU quota."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = list(range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        for name in ("core_cpus_list", "thread_siblings_list"):
            try:
                cores.add(topo.joinpath(name).read_text().strip())
                break
            except OSError:
                continue
        else:
            cores.add(str(cpu))
    n = len(cores)
    if (quota := cpu_quota()) is not None:
        n = min(n, math.ceil(quota))
    return max(1, n)


def cpu_quota(root: Path = Path("/sys/fs/cgroup"), own: Path = Path("/proc/self/cgroup")):
    """The CPUs' worth of time this process's cgroups allow (quota / period), the least
    of them, or None without a quota: cgroup v2's cpu.max, or v1's cpu.cfs_quota_us and
    cpu.cfs_period_us (`docker --cpus` on a v1 host), in this process's own cgroup and
    the ones above it (a cgroup namespace shows it at the root).

    >>> cpu_quota(Path("/nonexistent"), Path("/nonexistent")) is None
    True
    """
    try:
        lines = own.read_text().splitlines()
    except OSError:
        lines = []
    found = []

    def ancestors(base: Path, path: str):
        parts = [x for x in path.strip("/").split("/") if x]
        return [base.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]

    for line in lines or ["0::/"]:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # v2
            for d in ancestors(root, path):
                try:
                    quota, period = (d / "cpu.max").read_text().split()[:2]
                    if quota != "max":
                        found.append(int(quota) / int(period))
                except (OSError, ValueError):
                    continue
        elif "cpu" in controllers.split(","):  # v1
            for mount in {root / controllers, root / "cpu", root / "cpu,cpuacct"}:
                for d in ancestors(mount, path):
                    try:
                        quota = int((d / "cpu.cfs_quota_us").read_text())
                        period = int((d / "cpu.cfs_period_us").read_text())
                        if quota > 0 and period > 0:
                            found.append(quota / period)
                    except (OSError, ValueError):
                        continue
    return min(found) if found else None


def local_ranks(env=os.environ) -> int:
    """How many ranks of this `mlx.launch` job run on this machine (1 outside one):
    the ranks whose ring address has the same IP as ours (MLX_HOSTFILE), or MPI's
    local size."""
    if mpi := _positive(env.get("OMPI_COMM_WORLD_LOCAL_SIZE", "")):
        return mpi
    rank, path = env.get("MLX_RANK"), env.get("MLX_HOSTFILE")
    if rank is None or not path:
        return 1
    try:
        hosts = json.loads(Path(path).read_text())
        ips = [h[0].rsplit(":", 1)[0] for h in hosts]
        return ips.count(ips[int(rank)])
    except (OSError, ValueError, IndexError, KeyError, TypeError, AttributeError):
        return 1


def _positive(text: str) -> int | None:
    """`text` as a whole number above 0 (ASCII digits; `"²".isdigit()` is true too), or None."""
    text = text.strip()
    return int(text) if text.isascii() and text.isdigit() and int(text) > 0 else None


def blas_threads(env=os.environ) -> int:
    """OPENBLAS_NUM_THREADS if a whole number above 0, else this rank's share of the
    physical cores."""
    if given := _positive(env.get("OPENBLAS_NUM_THREADS", "")):
        return given
    return max(1, physical_cores() // local_ranks(env))


def _threads_warning(env=os.environ) -> str | None:
    """The line for an OPENBLAS_NUM_THREADS that is set but not a thread count: OpenBLAS
    reads 0, `abc` or `-2` as unset, so without a word the count asked for would be
    silently replaced by another one. Empty counts as unset, as for OpenBLAS."""
    given = env.get("OPENBLAS_NUM_THREADS", "")
    if not given.strip() or _positive(given):
        return None
    return (
        f"OPENBLAS_NUM_THREADS={given!r}: not a whole number above 0; using "
        f"{blas_threads(env)} threads (this process's share of the physical cores)"
    )


# ------------------------------------------------------------------------- candidates


def _system_paths() -> list[Path]:
    arch = sysconfig.get_config_var("MULTIARCH") or f"{platform.machine()}-linux-gnu"
    paths = (
        [Path(os.environ["CONDA_PREFIX"]) / "lib/libopenblas.so.0"]
        if "CONDA_PREFIX" in os.environ
        else []
    )
    return paths + [
        Path(f"/usr/lib/{arch}/libopenblas.so.0"),  # Debian/Ubuntu (alternatives link)
        Path("/usr/lib64/libopenblasp.so.0"),  # Fedora/RHEL, pthreads build
        Path("/usr/lib64/libopenblas.so.0"),
        Path("/usr/lib/libopenblas.so.0"),  # Arch, Alpine
    ]


def _site_file(*parts: str) -> Path | None:
    """A file installed by a wheel into this environment's site-packages."""
    for base in dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib")):
        if (path := Path(base, *parts)).exists():
            return path
    return None


def _shim_source() -> str:
    """A library that defines each symbol MLX imports as a jump to its `scipy_` twin:
    a tail jump forwards every argument (Fortran's hidden string lengths included)
    without restating any signature."""
    jump = {"x86_64": "jmp scipy_{0}@PLT", "aarch64": "b scipy_{0}"}[platform.machine()]
    lines = [
        f'__asm__(".globl {s}\\n.type {s}, @function\\n{s}:\\n    {jump.format(s)}\\n");'
        for s in MLX_BLAS_SYMBOLS
        + MLX_LAPACK_SYMBOLS
        + ("openblas_get_config", "openblas_set_num_threads")
    ]
    return "\n".join(lines) + '\n__asm__(".section .note.GNU-stack,\\"\\",@progbits");\n'


def _build_shim(lib: Path) -> tuple[Path | None, str]:
    """The compiled forwarding shim for scipy-openblas32 (built once into the cache)."""
    if platform.machine() not in ("x86_64", "aarch64"):
        return None, f"no shim for {platform.machine()}"
    st = lib.stat()
    out, why = compile_library(
        _shim_source(),
        "scipy-openblas32-shim",
        [str(lib), f"-Wl,-rpath,{lib.parent}"],
        key=f"{lib}{st.st_size}{st.st_mtime_ns}",
    )
    return out, why and f"its shim {why}"


def locate(name: str) -> tuple[Path | None, str]:
    """The library file of a named candidate, or None and why not."""
    if name == "system":
        found = next((p for p in _system_paths() if p.exists()), None)
        return found, "" if found else "not installed"
    if name == "scipy-openblas32":
        lib = _site_file("scipy_openblas32", "lib", "libscipy_openblas.so")
        return _build_shim(lib) if lib else (None, "not installed")
    if name == "cmeel-openblas":
        found = _site_file("cmeel.prefix", "lib", "libopenblas.so.0")
        return found, "" if found else "not installed"
    raise ValueError(name)


# --------------------------------------------------------------------- kernel family

# OpenBLAS's x86-64 kernel families without AVX (the corename table of its dynamic.c):
# what a DYNAMIC_ARCH build falls back to on a CPU model newer than the build.
PRE_AVX_CORES = frozenset(
    "unknown katmai coppermine northwood prescott banias atom core2 penryn dunnington "
    "nehalem athlon opteron opteron_sse3 barcelona nano bobcat".split()
)


def cpu_flags() -> frozenset[str]:
    """The first processor's feature flags (/proc/cpuinfo)."""
    for line in cpu_signature().splitlines():
        if line.split(":")[0].strip().lower() in ("flags", "features"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def best_coretype(flags: frozenset[str]) -> str | None:
    """The newest OpenBLAS x86-64 kernel family these CPU flags run, or None below AVX.

    >>> best_coretype(frozenset("avx avx2 fma avx512f avx512bw avx512vl avx512dq avx512cd".split()))
    'SkylakeX'
    >>> best_coretype(frozenset("sse4_2 avx avx2 fma".split())), best_coretype(frozenset(["sse3"]))
    ('Haswell', None)
    """
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"} <= flags:
        return "SkylakeX"
    if {"avx2", "fma"} <= flags:
        return "Haswell"
    return "Sandybridge" if "avx" in flags else None


def misdetected(config: str, flags: frozenset[str], machine: str | None = None) -> str | None:
    """The kernel family to force (OPENBLAS_CORETYPE) for a DYNAMIC_ARCH OpenBLAS whose
    config names kernels older than AVX on a CPU whose flags allow AVX or newer; None
    where it chose well, or is built for one target (which OPENBLAS_CORETYPE does not move).

    >>> avx512 = frozenset("avx avx2 fma avx512f avx512bw avx512vl avx512dq avx512cd".split())
    >>> misdetected("OpenBLAS 0.3.21 NO_LAPACKE DYNAMIC_ARCH NO_AFFINITY Prescott MAX_THREADS=64", avx512, "x86_64")
    'SkylakeX'
    >>> misdetected("OpenBLAS 0.3.21 DYNAMIC_ARCH NO_AFFINITY Cooperlake MAX_THREADS=64", avx512, "x86_64")
    >>> misdetected("OpenBLAS 0.3.21 DYNAMIC_ARCH Prescott MAX_THREADS=64", frozenset(["sse3"]), "x86_64")
    """
    words = config.lower().split()
    if (machine or platform.machine()) != "x86_64" or "dynamic_arch" not in words:
        return None
    if not any(w in PRE_AVX_CORES for w in words):
        return None
    return best_coretype(flags)


# ----------------------------------------------------------------------------- probe


def probe(lib: Path, threads: int, use_cache: bool = True, coretype: str | None = None) -> dict:
    """Whether `lib` runs every BLAS/LAPACK routine MLX calls correctly on this CPU, found
    in a child process (a crash there is a verdict, not a crash here), with
    OPENBLAS_CORETYPE=`coretype` when given. Returns {"ok": bool, "reason": str,
    "config": str}; cached by file, CPU, MLX, threads and kernel family."""
    lib = Path(lib)
    try:
        real = lib.resolve()
        st = real.stat()
    except OSError as e:
        return {"ok": False, "reason": f"cannot read it ({e.strerror})", "config": ""}
    ident = [
        PROBE,
        MLX_BLAS_SYMBOLS,
        str(real),
        st.st_size,
        st.st_mtime_ns,
        cpu_signature(),
        mlx_version(),
        threads,
        sys.executable,
        coretype or os.environ.get("OPENBLAS_CORETYPE"),
    ]
    cached = verdict_file("blas", "verdict", ident)
    if use_cache:
        verdict = cached_verdict(cached)
        # A wrong type here would fail the choice itself on every run: a miss.
        if (
            verdict is not None
            and isinstance(verdict.get("reason"), str)
            and isinstance(verdict.get("config"), str)
        ):
            return {k: verdict[k] for k in ("ok", "reason", "config")}
    verdict = run_probe(lib, threads, coretype)
    if use_cache and not verdict.pop("transient", False):
        save_verdict(cached, verdict)
    return verdict


def run_probe(lib: Path, threads: int, coretype: str | None = None) -> dict:
    env = {**os.environ, "OPENBLAS_NUM_THREADS": str(threads)}
    if coretype is not None:
        env["OPENBLAS_CORETYPE"] = coretype
    try:
        done = subprocess.run(
            [sys.executable, "-c", PROBE, str(lib), str(threads), ",".join(MLX_BLAS_SYMBOLS)],
            capture_output=True, text=True, env=env, timeout=PROBE_TIMEOUT_S,
        )  # fmt: skip
    except subprocess.TimeoutExpired:  # a loaded machine, maybe: not cached
        why = f"its probe hung (> {PROBE_TIMEOUT_S} s)"
        return {"ok": False, "reason": why, "config": "", "transient": True}
    if done.returncode < 0:
        try:
            sig = signal.Signals(-done.returncode).name
        except ValueError:
            sig = f"signal {-done.returncode}"
        why = " (code for another CPU)" if sig == "SIGILL" else ""
        # Killed from outside (out of memory, a shutdown): say so, but probe again next time.
        transient = sig in ("SIGKILL", "SIGTERM", "SIGHUP", "SIGINT")
        reason = f"its probe was killed by {sig}{why}"
        return {"ok": False, "reason": reason, "config": "", "transient": transient}
    try:
        out = json.loads(done.stdout.strip().splitlines()[-1])
        config, failed = str(out["config"]), list(out["failed"])
        missing, prefixed = list(out.get("missing", [])), bool(out.get("prefixed"))
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        # No verdict: the probe's Python failed around the library (mlx or numpy not
        # importable mid-upgrade, no memory), which says nothing lasting about it.
        why = last_line(done.stderr) or f"exit status {done.returncode}"
        return {"ok": False, "reason": f"its probe failed: {why}", "config": "", "transient": True}
    if missing and prefixed:  # libscipy_openblas.so itself, say
        why = (
            f"its symbols carry a scipy_ prefix (scipy_{missing[0]}), which MLX does not "
            "resolve; MLX_GRPO_OPENBLAS=scipy-openblas32 reaches it through a shim"
        )
        return {"ok": False, "reason": why, "config": ""}
    if missing:
        why = f"not a BLAS: it exports no {', '.join(missing)}, which MLX calls"
        return {"ok": False, "reason": why, "config": ""}
    if failed:
        return {"ok": False, "reason": "wrong results: " + "; ".join(failed[:3]), "config": config}
    return {"ok": True, "reason": "", "config": config}


def max_threads(config: str) -> int | None:
    """The thread cap an OpenBLAS build was compiled with (MAX_THREADS=n in its config)."""
    m = re.search(r"MAX_THREADS=(\d+)", config)
    return int(m.group(1)) if m else None


# ---------------------------------------------------------------------------- choice


def set_threads(handle: ctypes.CDLL, threads: int) -> None:
    for prefix in ("", "scipy_"):
        if hasattr(handle, prefix + "openblas_set_num_threads"):
            getattr(handle, prefix + "openblas_set_num_threads")(threads)
            return


def choose(env=os.environ) -> tuple[Blas, str | None]:
    """The first candidate that passes its probe (see the module doc), and the warning
    to print, if any: one line per problem (the thread count, the BLAS). Loads nothing
    into this process."""
    threads = blas_threads(env)
    forced = env.get("MLX_GRPO_OPENBLAS", "").strip()
    problems: list[str] = []  # "<candidate>: why", for candidates that exist but failed
    if forced and forced not in NAMES:
        path = Path(forced).expanduser()
        if "/" not in forced and not path.is_file():  # a name misspelt, not a path
            names = ", ".join(NAMES)
            problems.append(f"MLX_GRPO_OPENBLAS={forced}: neither a file nor one of {names}")
            forced = ""
        else:
            forced = str(path.absolute())  # probe and load the same file
    order = [n for n in NAMES if n != "builtin"]
    if forced == "builtin" or env.get("MLX_GRPO_NO_OPENBLAS"):  # the latter: older name
        return Blas("builtin", None), None
    blas, warning = _first_that_works(
        forced, order, threads, problems, coretype_given=bool(env.get("OPENBLAS_CORETYPE"))
    )
    lines = [w for w in (_threads_warning(env), warning) if w]
    return blas, "\n".join(lines) or None


def _first_that_works(
    forced: str, order: list[str], threads: int, problems: list[str], coretype_given=False
) -> tuple[Blas, str | None]:
    """`choose`'s walk through the candidates, the forced one first, and its one warning
    line; `problems` may already hold one (a misspelt name), said on the same line.
    Unless OPENBLAS_CORETYPE is given, a candidate that took this CPU for one without
    AVX is probed again with the family its flags allow, and used so if that passes."""
    if forced in order:
        order.remove(forced)
        order.insert(0, forced)
    missing: list[str] = []
    capped: Blas | None = None
    tries = (["custom"] if forced and forced not in NAMES else []) + order
    for name in tries:
        lib, why = (Path(forced), "") if name == "custom" else locate(name)
        label = f"MLX_GRPO_OPENBLAS={forced}" if name == "custom" else name
        if lib is None:  # a candidate asked for by name counts as a problem
            quiet = why == "not installed" and name != forced
            (missing if quiet else problems).append(f"{label}: {why}")
            continue
        verdict = probe(lib, threads)
        if not verdict["ok"]:
            problems.append(f"{label}: {verdict['reason']}")
            continue
        coretype = None if coretype_given else misdetected(verdict["config"], cpu_flags())
        if coretype is not None:
            again = probe(lib, threads, coretype=coretype)
            took = coretype.lower() in again["config"].lower().split()
            if again["ok"] and took:
                verdict = again
            else:  # still correct, only slow: used as detected, with a word
                why = again["reason"] if not again["ok"] else "it keeps its own choice"
                problems.append(
                    f"{label}: runs pre-AVX kernels on this CPU, and with "
                    f"OPENBLAS_CORETYPE={coretype} {why}"
                )
                coretype = None
        cap = max_threads(verdict["config"])
        # (64 is the usual builds' cap: past 64 cores every candidate has it, and it is
        # no reason to pass one over)
        if cap is not None and cap < min(threads, 64) and name not in ("custom", forced):
            capped = capped or Blas(name, str(lib), verdict["config"], cap, coretype)
            problems.append(f"{label}: built for at most {cap} threads")
            continue
        blas = Blas(name, str(lib), verdict["config"], min(threads, cap or threads), coretype)
        break
    else:
        blas = capped or Blas("builtin", None)
    if blas.path is None:
        why = "; ".join(problems + missing)
        return blas, (
            f"no usable OpenBLAS ({why}); MLX's built-in BLAS is ~30x slower on matmuls: "
            f"{INSTALL_HINT}"
        )
    if problems:
        return blas, f"{'; '.join(problems)}; using {blas.describe()}"
    return blas, None


def load(path: str, threads: int, coretype: str | None = None) -> ctypes.CDLL:
    """Load the library globally with `threads` threads (and OPENBLAS_CORETYPE=`coretype`
    when given). The environment holds them only while it loads, so that its constructor
    starts the threads the probe ran with, not one per core (too many under a pids
    limit), and picks the kernels the probe checked."""
    wanted = {"OPENBLAS_NUM_THREADS": str(threads)}
    if coretype is not None:
        wanted["OPENBLAS_CORETYPE"] = coretype
    before = {k: os.environ.get(k) for k in wanted}
    os.environ.update(wanted)
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_GLOBAL)
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    set_threads(lib, threads)
    return lib


def use_fast_blas() -> Blas | None:
    """On Linux, before the first `import mlx`: choose a BLAS (module doc) and load it
    globally. Returns the choice, or None where there is nothing to choose (another
    OS, or mlx not installed). Where mlx was imported first, it is too late: MLX keeps
    its own BLAS, and on a CPU one warning line says so."""
    if state["blas"] is not None or sys.platform != "linux":
        return state["blas"]
    if "mlx.core" in sys.modules:
        state["blas"] = Blas("builtin", None)
        if sys.modules["mlx.core"].default_device() == sys.modules["mlx.core"].cpu:
            print(
                "mlx-grpo: warning: mlx was imported before mlx_grpo, so MLX keeps its own "
                "reference BLAS (matmuls tens of times slower on a CPU); import mlx_grpo first",
                file=sys.stderr,
            )
        return state["blas"]
    if importlib.util.find_spec("mlx") is None:  # e.g. the bench's PyTorch peer
        return None
    try:
        blas, warning = choose()
    except Exception as e:  # noqa: BLE001  (a fast BLAS is never worth failing the import)
        blas, warning = Blas("builtin", None), f"choosing a BLAS failed ({e!r}); using MLX's own"
    if blas.path is not None:
        front, state["front_why"], isa = skinny.prepare(blas.path, blas.threads or 1)
        try:
            # Before the BLAS: MLX's cblas_sgemm is then the front's (mlx_grpo.cpu.skinny).
            front_lib = skinny.load(front) if front is not None else None
            # Set through the library, not the environment: processes this one starts
            # (an `mlx.launch` job, say) choose their own share.
            state["lib"] = load(blas.path, blas.threads or 1, blas.coretype)
            if front_lib is not None:
                state["front"] = skinny.start(front_lib, state["lib"], blas.threads or 1, isa)
        except OSError as e:  # removed between the probe and now
            warning, blas = (
                f"{blas.path} could not be loaded ({e}); using MLX's built-in BLAS",
                Blas("builtin", None),
            )
    for line in (warning or "").splitlines():
        print(f"mlx-grpo: warning: {line}", file=sys.stderr)
    state["blas"] = blas
    return blas


@contextmanager
def threads_shared(ways: int):
    """Inside this block, each BLAS call runs on 1/`ways` of the threads (at least one),
    so that `ways` calls made at once, from MLX streams side by side, share the cores
    (`mlx_grpo.device.Lanes`). Nothing changes where MLX keeps its own BLAS."""
    lib, blas = state["lib"], state["blas"]
    if lib is None or ways < 2 or not blas.threads:
        yield
        return
    share = max(1, blas.threads // ways)
    set_threads(lib, share)
    if (front := state["front"]) is not None:
        front.set_threads(share)
    try:
        yield
    finally:
        set_threads(lib, blas.threads)
        if front is not None:
            front.set_threads(blas.threads)


def blas_in_use() -> str:
    """What MLX computes its matmuls with in this process, for the first line of a run."""
    if (blas := state["blas"]) is not None:
        front = state["front"]
        return blas.describe() + (f" + {front.describe()}" if front is not None else "")
    return "MLX built-in BLAS" if sys.platform == "linux" else "Accelerate"
