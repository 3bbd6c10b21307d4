"""The BLAS that MLX gets on Linux: each candidate proven in a child process first, so that
a library that crashes, or computes wrong numbers, on this CPU is passed over with one
warning instead of killing the process."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_grpo.cpu import blas as blaslib
from mlx_grpo.cpu.lanes import EVAL_WIDTH

LINUX = sys.platform == "linux"
linux_only = pytest.mark.skipif(not LINUX, reason="the BLAS is chosen on Linux only")
CC = next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler to build a test library")

# A 96x80 @ 80x64 float32 product through MLX against numpy's in float64, and the BLAS.
SNIPPET = """
import json, mlx_grpo, mlx.core as mx, numpy as np
from mlx_grpo.cpu.blas import state
r = np.random.default_rng(1)
a, b = r.standard_normal((96, 80)).astype(np.float32), r.standard_normal((80, 64)).astype(np.float32)
err = np.abs(np.array(mx.array(a) @ mx.array(b)) - a.astype(np.float64) @ b).max()
bound = 80 * np.finfo(np.float32).eps * (np.abs(a).astype(np.float64) @ np.abs(b)).max()
blas = state["blas"]
print(json.dumps({"name": blas.name, "path": blas.path, "ok": bool(err <= bound)}))
"""


def run_snippet(tmp_path: Path, **env: str) -> tuple[dict, list[str]]:
    """Runs SNIPPET in a fresh interpreter; returns its result and its stderr lines."""
    full = {**os.environ, "MLX_GRPO_CACHE": str(tmp_path / "cache"), **env}
    full.pop("OPENBLAS_NUM_THREADS", None)
    done = subprocess.run(
        [sys.executable, "-c", SNIPPET], capture_output=True, text=True, env=full, timeout=600
    )
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr.strip().splitlines()


def build_library(tmp_path: Path, name: str, source: str) -> Path:
    (tmp_path / f"{name}.c").write_text(source)
    out = tmp_path / f"lib{name}.so"
    subprocess.run([CC, "-shared", "-fPIC", "-o", out, tmp_path / f"{name}.c"], check=True)
    return out


def default_choice(tmp_path: Path) -> dict:
    """What an unforced run chooses here (the reference for the fallback tests)."""
    result, _ = run_snippet(tmp_path, MLX_GRPO_OPENBLAS="")
    assert result["ok"]
    return result


# The other GEMMs MLX resolves, doing nothing: with them a test library is a BLAS to the
# probe, which then finds out what its cblas_sgemm does.
OTHER_GEMMS = "void cblas_dgemm(void) {}\nvoid cblas_cgemm(void) {}\n"
# A GEMM that executes an illegal instruction (ud2 on x86-64, brk on aarch64), as an
# OpenBLAS built for a newer CPU family does at its first GEMM.
CRASHING_GEMM = "void cblas_sgemm(void) { __builtin_trap(); }\n" + OTHER_GEMMS
# A GEMM that returns and writes ones: a library that computes wrong numbers.
WRONG_GEMM = (
    OTHER_GEMMS
    + """
void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, const float *a,
                 int lda, const float *b, int ldb, float beta, float *c, int ldc) {
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) c[order == 101 ? i * ldc + j : j * ldc + i] = 1.0f;
}
"""
)


@linux_only
@needs_cc
def test_a_blas_that_crashes_on_this_cpu_is_passed_over_with_one_warning(tmp_path):
    expected = default_choice(tmp_path)
    crash = build_library(tmp_path, "crashblas", CRASHING_GEMM)
    result, stderr = run_snippet(tmp_path, MLX_GRPO_OPENBLAS=str(crash))
    # survived, right product, from the candidate an unforced run would have used
    assert result == expected and result["ok"]
    assert len(stderr) == 1, stderr
    assert f"MLX_GRPO_OPENBLAS={crash}: its probe was killed by SIG" in stderr[0]
    # the verdict is cached: the next process neither probes nor crashes again
    verdicts = sorted((tmp_path / "cache" / "blas").glob("verdict-*.json"))
    assert any("killed by SIG" in p.read_text() for p in verdicts)
    again, stderr2 = run_snippet(tmp_path, MLX_GRPO_OPENBLAS=str(crash))
    assert again == expected and stderr2 == stderr
    assert sorted((tmp_path / "cache" / "blas").glob("verdict-*.json")) == verdicts


@linux_only
@needs_cc
def test_a_blas_with_wrong_results_is_passed_over(tmp_path):
    expected = default_choice(tmp_path)
    wrong = build_library(tmp_path, "wrongblas", WRONG_GEMM)
    result, stderr = run_snippet(tmp_path, MLX_GRPO_OPENBLAS=str(wrong))
    assert result == expected
    assert len(stderr) == 1 and "wrong results: float32 matmul" in stderr[0], stderr


@linux_only
def test_a_file_that_is_no_library_is_passed_over(tmp_path):
    expected = default_choice(tmp_path)
    bogus = tmp_path / "libopenblas.so.0"
    bogus.write_bytes(b"not a shared library")
    result, stderr = run_snippet(tmp_path, MLX_GRPO_OPENBLAS=str(bogus))
    assert result == expected
    assert len(stderr) == 1 and f"MLX_GRPO_OPENBLAS={bogus}: its probe failed" in stderr[0]


@linux_only
@needs_cc
@pytest.mark.parametrize(
    ("exports", "said"),
    [
        ("int deflate(void) { return 0; }", "not a BLAS: it exports no cblas_sgemm"),
        # libscipy_openblas.so itself: a BLAS, but not under the names MLX resolves
        (
            "".join(f"void scipy_{s}(void) {{}}\n" for s in blaslib.MLX_BLAS_SYMBOLS),
            "MLX_GRPO_OPENBLAS=scipy-openblas32",
        ),
    ],
    ids=["zlib-like", "scipy-prefixed"],
)
def test_a_library_without_the_blas_symbols_mlx_resolves_is_passed_over(tmp_path, exports, said):
    """Any shared library loads, and MLX then simply keeps its own BLAS: passing it
    would name a library that computes nothing, and cache that verdict."""
    expected = default_choice(tmp_path)
    lib = build_library(tmp_path, "notblas", exports)
    for _ in range(2):  # the second time from the cached verdict
        result, stderr = run_snippet(tmp_path, MLX_GRPO_OPENBLAS=str(lib))
        assert result == expected
        assert len(stderr) == 1 and f"MLX_GRPO_OPENBLAS={lib}: " in stderr[0], stderr
        assert said in stderr[0]


@linux_only
def test_builtin_forced_loads_nothing_and_warns_nothing(tmp_path):
    result, stderr = run_snippet(tmp_path, MLX_GRPO_OPENBLAS="builtin")
    assert result == {"name": "builtin", "path": None, "ok": True} and stderr == []


@linux_only
def test_mlx_imported_first_keeps_its_own_blas_and_says_so(tmp_path):
    """On a CPU the line says it; on a GPU the BLAS hardly matters, and nothing is said."""
    env = {**os.environ, "MLX_GRPO_CACHE": str(tmp_path / "cache")}
    late = (
        "import mlx.core as mx; import mlx_grpo; from mlx_grpo.cpu.blas import blas_in_use; "
        "print(blas_in_use()); print(mx.default_device() == mx.cpu)"
    )
    done = subprocess.run([sys.executable, "-c", late], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    said, on_cpu = done.stdout.strip().splitlines()
    assert said == "MLX built-in BLAS"
    warned = [line for line in done.stderr.splitlines() if "imported before mlx_grpo" in line]
    assert len(warned) == (on_cpu == "True")
    first = "import mlx_grpo; import mlx.core"
    done = subprocess.run([sys.executable, "-c", first], capture_output=True, text=True, env=env)
    assert done.returncode == 0 and "imported before mlx_grpo" not in done.stderr


@linux_only
@pytest.mark.parametrize("name", ["system", "scipy-openblas32", "cmeel-openblas"])
def test_each_installed_candidate_is_used_when_named(tmp_path, name):
    lib, why = blaslib.locate(name)
    if lib is None:
        pytest.skip(f"{name}: {why}")
    verdict = blaslib.probe(lib, 1, use_cache=False)
    if not verdict["ok"]:
        pytest.skip(f"{name} does not run on this machine: {verdict['reason']}")
    result, stderr = run_snippet(tmp_path, MLX_GRPO_OPENBLAS=name)
    assert result["name"] == name and result["ok"] and stderr == []


@linux_only
def test_no_candidate_at_all_falls_back_to_mlx_blas_with_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_GRPO_CACHE", str(tmp_path))
    monkeypatch.setattr(blaslib, "locate", lambda name: (None, "not installed"))
    blas, warning = blaslib.choose({})
    assert blas == blaslib.Blas("builtin", None)
    assert warning.startswith("no usable OpenBLAS (system: not installed;")
    assert "apt-get install libopenblas0-pthread" in warning


@linux_only
def test_a_thread_capped_build_yields_to_an_uncapped_one(monkeypatch, tmp_path):
    libs = {
        "system": tmp_path / "a.so",
        "scipy-openblas32": None,
        "cmeel-openblas": tmp_path / "b.so",
    }
    configs = {
        libs["system"]: "OpenBLAS SKYLAKEX MAX_THREADS=4",
        libs["cmeel-openblas"]: "OpenBLAS DYNAMIC_ARCH MAX_THREADS=64",
    }
    monkeypatch.setattr(blaslib, "locate", lambda n: (libs[n], "" if libs[n] else "not installed"))
    monkeypatch.setattr(
        blaslib, "probe", lambda lib, t: {"ok": True, "reason": "", "config": configs[lib]}
    )
    blas, warning = blaslib.choose({"OPENBLAS_NUM_THREADS": "8"})
    assert (blas.name, blas.threads) == ("cmeel-openblas", 8)
    assert warning.startswith("system: built for at most 4 threads; using")
    blas, warning = blaslib.choose({"OPENBLAS_NUM_THREADS": "4"})
    assert (blas.name, blas.threads, warning) == ("system", 4, None)
    libs["cmeel-openblas"] = None  # only the capped one: used, at its cap
    blas, _ = blaslib.choose({"OPENBLAS_NUM_THREADS": "8"})
    assert (blas.name, blas.threads) == ("system", 4)
    # Past 64 cores every usual build is capped at 64: no reason to pass one over.
    configs[libs["system"]] = "OpenBLAS Zen MAX_THREADS=64"
    blas, warning = blaslib.choose({"OPENBLAS_NUM_THREADS": "96"})
    assert (blas.name, blas.threads, warning) == ("system", 64, None)


def test_the_library_loads_with_the_threads_it_was_probed_with(monkeypatch):
    """Its constructor starts its threads from the environment: the count is there while
    it loads, and the environment is as it was afterwards."""
    seen = []
    monkeypatch.setattr(
        blaslib.ctypes,
        "CDLL",
        lambda path, mode: seen.append(os.environ.get("OPENBLAS_NUM_THREADS")),
    )
    monkeypatch.setattr(blaslib, "set_threads", lambda lib, n: seen.append(n))
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    blaslib.load("/x/libopenblas.so", 3)
    assert seen == ["3", 3] and "OPENBLAS_NUM_THREADS" not in os.environ
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "16")
    blaslib.load("/x/libopenblas.so", 2)
    assert seen[2:] == ["2", 2] and os.environ["OPENBLAS_NUM_THREADS"] == "16"


def test_a_probe_that_gives_no_verdict_is_not_cached(monkeypatch, tmp_path):
    """A probe whose Python failed around the library (mlx not importable mid-upgrade)
    says nothing lasting about it: probed again next time."""
    import subprocess

    monkeypatch.setattr(
        blaslib.subprocess,
        "run",
        lambda *a, **k: subprocess.CompletedProcess(
            a, 1, "", "ImportError: libmlx.so: no such file"
        ),
    )
    verdict = blaslib.run_probe(tmp_path / "libx.so", 2)
    assert verdict["transient"] and verdict["reason"].endswith(
        "ImportError: libmlx.so: no such file"
    )


def test_the_cache_lives_where_this_user_can_write(monkeypatch, tmp_path):
    import tempfile

    from mlx_grpo import _paths

    monkeypatch.delenv("MLX_GRPO_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert _paths.cache_root() == tmp_path / ".cache" / "mlx-grpo"
    own = Path(tempfile.gettempdir()) / f"mlx-grpo-{os.getuid()}"
    monkeypatch.setattr(_paths.os, "access", lambda path, mode: False)  # HOME=/, say
    assert _paths.cache_root() == own
    monkeypatch.undo()
    monkeypatch.delenv("MLX_GRPO_CACHE", raising=False)

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(_paths.Path, "home", staticmethod(no_home))
    assert _paths.cache_root() == own
    monkeypatch.setenv("MLX_GRPO_CACHE", str(tmp_path / "c"))
    assert _paths.cache_root() == tmp_path / "c"


@linux_only
def test_the_shim_forwards_every_blas_and_lapack_symbol_mlx_imports():
    import mlx.core as mx

    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm to list libmlx.so's imports")
    libmlx = next(Path(mx.__file__).parent.glob("lib/libmlx.so*"), None)
    if libmlx is None:
        pytest.skip("this mlx has no libmlx.so")
    out = subprocess.run([nm, "-D", "--undefined-only", libmlx], capture_output=True, text=True)
    names = {line.split()[-1].split("@")[0] for line in out.stdout.splitlines() if line.strip()}
    imported = {
        n
        for n in names
        if n.startswith("cblas_") or (n.endswith("_") and n[:1] in "sdcz" and n[1:-1].isalpha())
    }
    assert imported, "libmlx.so imports no BLAS symbol: how does it compute matmuls?"
    assert imported <= set(blaslib.MLX_BLAS_SYMBOLS + blaslib.MLX_LAPACK_SYMBOLS)


def test_threads_follow_the_physical_cores_and_are_shared_between_local_ranks(tmp_path):
    cores = blaslib.physical_cores()
    assert 1 <= cores <= (os.cpu_count() or 1)
    assert blaslib.blas_threads({}) == cores
    assert blaslib.blas_threads({"OPENBLAS_NUM_THREADS": "3"}) == 3
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([["127.0.0.1:5000"], ["127.0.0.1:5001"]]))
    env = {"MLX_RANK": "1", "MLX_HOSTFILE": str(hostfile)}
    assert blaslib.blas_threads(env) == max(1, cores // 2)


@pytest.mark.parametrize("given", ["abc", "0", "-2", "1.5", "\u00b2"])
def test_a_thread_count_that_is_not_one_is_said_and_the_default_used(monkeypatch, given):
    """OpenBLAS reads these as unset; the count used instead is named, not guessed at."""
    lib = Path("/lib/libx.so")
    monkeypatch.setattr(
        blaslib, "locate", lambda n: (lib, "") if n == "system" else (None, "not installed")
    )
    monkeypatch.setattr(blaslib, "probe", lambda lib, t: {"ok": True, "reason": "", "config": ""})
    default = blaslib.blas_threads({})
    assert blaslib.blas_threads({"OPENBLAS_NUM_THREADS": given}) == default
    blas, warning = blaslib.choose({"OPENBLAS_NUM_THREADS": given})
    assert blas.threads == default
    assert warning == (
        f"OPENBLAS_NUM_THREADS={given!r}: not a whole number above 0; using {default} "
        "threads (this process's share of the physical cores)"
    )
    for valid, threads in (("3", 3), (" 5 ", 5), ("", default)):  # said nothing about
        blas, warning = blaslib.choose({"OPENBLAS_NUM_THREADS": valid})
        assert (blas.threads, warning) == (threads, None)


def test_local_ranks_share_the_cores(tmp_path):
    from mlx_grpo.cpu.blas import local_ranks

    hostfile = tmp_path / "hosts.json"  # what mlx.launch --backend ring writes
    hostfile.write_text(
        json.dumps([["127.0.0.1:5000"], ["127.0.0.1:5001"], ["10.0.0.2:5002"], ["10.0.0.2:5003"]])
    )
    env = {"MLX_HOSTFILE": str(hostfile)}
    assert [local_ranks({**env, "MLX_RANK": str(r)}) for r in range(4)] == [2, 2, 2, 2]
    hostfile.write_text(json.dumps([["10.0.0.1:5000"], ["10.0.0.2:5001"]]))
    assert local_ranks({**env, "MLX_RANK": "1"}) == 1
    assert local_ranks({}) == 1 and local_ranks({"MLX_RANK": "0", "MLX_HOSTFILE": ""}) == 1
    assert local_ranks({"OMPI_COMM_WORLD_LOCAL_SIZE": "3"}) == 3


@pytest.mark.skipif(not LINUX or platform.machine() != "x86_64", reason="Linux x86-64")
def test_a_rank_of_two_on_this_machine_gets_half_the_cores(tmp_path):
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([["127.0.0.1:5000"], ["127.0.0.1:5001"]]))
    snippet = "import mlx_grpo; from mlx_grpo.cpu.blas import state; print(state['blas'].threads)"
    env = {**os.environ, "MLX_RANK": "1", "MLX_HOSTFILE": str(hostfile)}
    env.pop("OPENBLAS_NUM_THREADS", None)
    env.pop("MLX_GRPO_OPENBLAS", None)
    out = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, env=env)
    if "no usable OpenBLAS" in out.stderr or out.stdout.strip() == "None":
        pytest.skip("no OpenBLAS here")
    assert out.stdout.strip() == str(max(1, blaslib.physical_cores() // 2)), out.stderr


@linux_only
def test_a_probe_killed_from_outside_or_hung_is_not_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_GRPO_CACHE", str(tmp_path))
    lib = tmp_path / "libx.so"
    lib.write_bytes(b"x")
    calls = []

    def run(path, threads, verdict):
        calls.append(path)
        return dict(verdict)

    hung = {"ok": False, "reason": "its probe hung", "config": "", "transient": True}
    monkeypatch.setattr(blaslib, "run_probe", lambda p, t, c=None: run(p, t, hung))
    assert blaslib.probe(lib, 2)["reason"] == "its probe hung"
    assert blaslib.probe(lib, 2)["reason"] == "its probe hung"
    assert len(calls) == 2  # probed again
    crashed = {"ok": False, "reason": "its probe was killed by SIGILL", "config": ""}
    monkeypatch.setattr(blaslib, "run_probe", lambda p, t, c=None: run(p, t, crashed))
    assert blaslib.probe(lib, 2) == blaslib.probe(lib, 2) == crashed
    assert len(calls) == 3  # a crash on this CPU is remembered


@linux_only
def test_a_candidate_named_but_not_installed_is_said(monkeypatch, tmp_path):
    other = tmp_path / "b.so"
    monkeypatch.setattr(
        blaslib,
        "locate",
        lambda n: (other, "") if n == "cmeel-openblas" else (None, "not installed"),
    )
    monkeypatch.setattr(blaslib, "probe", lambda lib, t: {"ok": True, "reason": "", "config": ""})
    blas, warning = blaslib.choose({"MLX_GRPO_OPENBLAS": "system", "OPENBLAS_NUM_THREADS": "2"})
    assert blas.name == "cmeel-openblas"
    assert warning.startswith("system: not installed; using")
    blas, warning = blaslib.choose({"OPENBLAS_NUM_THREADS": "2"})  # not asked for: quiet
    assert blas.name == "cmeel-openblas" and warning is None


@linux_only
def test_a_forced_value_that_is_neither_a_file_nor_a_name_is_said_so(monkeypatch, tmp_path):
    """`fastest` is a wish, not a path in the current folder: saying 'cannot read
    /cwd/fastest' would hide that the names are a fixed list."""
    monkeypatch.chdir(tmp_path)
    system = tmp_path / "system.so"
    monkeypatch.setattr(
        blaslib, "locate", lambda n: (system, "") if n == "system" else (None, "not installed")
    )
    probed = []

    def probe(lib, threads):
        probed.append(Path(lib))
        return {"ok": True, "reason": "", "config": ""}

    monkeypatch.setattr(blaslib, "probe", probe)
    env = {"OPENBLAS_NUM_THREADS": "2"}
    blas, warning = blaslib.choose({**env, "MLX_GRPO_OPENBLAS": "fastest"})
    assert blas.name == "system" and probed == [system]
    assert warning == (
        "MLX_GRPO_OPENBLAS=fastest: neither a file nor one of system, scipy-openblas32, "
        f"cmeel-openblas, builtin; using {blas.describe()}"
    )
    (tmp_path / "libmine.so").write_bytes(b"x")  # a file here, named without a slash
    blas, warning = blaslib.choose({**env, "MLX_GRPO_OPENBLAS": "libmine.so"})
    assert (blas.name, blas.path, warning) == ("custom", str(tmp_path / "libmine.so"), None)


@linux_only
@pytest.mark.parametrize(
    "entry",
    [
        {"ok": True, "reason": "", "config": 5},
        {"ok": "yes", "reason": "", "config": ""},
        {"ok": True, "reason": None, "config": ""},
        {"ok": True},
        ["ok"],
    ],
)
def test_a_malformed_cached_verdict_is_probed_again(monkeypatch, tmp_path, entry):
    """A verdict file with the wrong types (another version's, an edit) would otherwise
    fail the choice on every run; it is a cache miss, and the new verdict replaces it."""
    monkeypatch.setenv("MLX_GRPO_CACHE", str(tmp_path))
    lib = tmp_path / "libx.so"
    lib.write_bytes(b"x")
    good = {"ok": True, "reason": "", "config": "OpenBLAS MAX_THREADS=64"}
    calls = []
    monkeypatch.setattr(blaslib, "run_probe", lambda p, t, c=None: calls.append(p) or dict(good))
    assert blaslib.probe(lib, 2) == good
    (cached,) = (tmp_path / "blas").glob("verdict-*.json")
    cached.write_text(json.dumps(entry))
    assert blaslib.probe(lib, 2) == good and len(calls) == 2
    assert json.loads(cached.read_text()) == good
    assert blaslib.probe(lib, 2) == good and len(calls) == 2  # and that one is used
    monkeypatch.setattr(
        blaslib, "locate", lambda n: (lib, "") if n == "system" else (None, "not installed")
    )
    cached.write_text(json.dumps(entry))
    blas, warning = blaslib.choose({"OPENBLAS_NUM_THREADS": "2"})
    assert (blas.name, blas.path, warning) == ("system", str(lib), None)


def test_a_cpu_quota_is_found_under_cgroup_v1_and_v2(tmp_path):
    """`docker --cpus 2` on a cgroup v1 host writes cfs_quota_us; v2 writes cpu.max, in
    the process's own cgroup or one above it. The least quota counts."""
    v1, own = tmp_path / "v1", tmp_path / "cgroup"
    d = v1 / "cpu,cpuacct" / "docker" / "abc"
    d.mkdir(parents=True)
    (d / "cpu.cfs_quota_us").write_text("200000\n")
    (d / "cpu.cfs_period_us").write_text("100000\n")
    own.write_text("12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n")
    assert blaslib.cpu_quota(v1, own) == 2.0
    (d / "cpu.cfs_quota_us").write_text("-1\n")  # no quota
    assert blaslib.cpu_quota(v1, own) is None
    v2 = tmp_path / "v2"
    (v2 / "user.slice" / "job").mkdir(parents=True)
    (v2 / "user.slice" / "cpu.max").write_text("150000 100000\n")  # a parent's quota
    (v2 / "user.slice" / "job" / "cpu.max").write_text("max 100000\n")
    own.write_text("0::/user.slice/job\n")
    assert blaslib.cpu_quota(v2, own) == 1.5
    (v2 / "cpu.max").write_text("50000 100000\n")  # the namespace's root, tighter
    assert blaslib.cpu_quota(v2, own) == 0.5


AVX512 = frozenset("sse3 avx avx2 fma avx512f avx512bw avx512vl avx512dq avx512cd".split())


@pytest.mark.parametrize("coretype_given", [False, True])
def test_a_build_that_takes_this_cpu_for_a_pre_avx_one_gets_the_kernels_its_flags_allow(
    monkeypatch, tmp_path, coretype_given
):
    """OpenBLAS 0.3.21 (DYNAMIC_ARCH) takes an Emerald Rapids Xeon (family 6, model 207)
    for a Prescott: its GEMMs then run at a sixth of their speed. The family the flags
    allow is probed and loaded instead, unless OPENBLAS_CORETYPE was given."""
    lib = tmp_path / "libopenblas.so.0"
    libs = {"system": lib, "scipy-openblas32": None, "cmeel-openblas": None}
    probed = []

    def fake_probe(path, threads, coretype=None):
        probed.append(coretype)
        core = coretype or "Prescott"
        return {
            "ok": True,
            "reason": "",
            "config": f"OpenBLAS 0.3.21 DYNAMIC_ARCH {core} MAX_THREADS=64",
        }

    monkeypatch.setattr(blaslib, "locate", lambda n: (libs[n], "" if libs[n] else "not installed"))
    monkeypatch.setattr(blaslib, "probe", fake_probe)
    monkeypatch.setattr(blaslib, "cpu_flags", lambda: AVX512)
    env = {"OPENBLAS_NUM_THREADS": "2"} | (
        {"OPENBLAS_CORETYPE": "Prescott"} if coretype_given else {}
    )
    blas, warning = blaslib.choose(env)
    assert warning is None and blas.name == "system"
    if coretype_given:  # the user's choice stands
        assert (probed, blas.coretype) == ([None], None) and "Prescott" in blas.config
    else:
        assert (probed, blas.coretype) == ([None, "SkylakeX"], "SkylakeX")
        assert "SkylakeX" in blas.config and "OPENBLAS_CORETYPE=SkylakeX" in blas.describe()


@pytest.mark.parametrize("forced", ["crashes", "is ignored"])
def test_a_forced_kernel_family_that_fails_its_probe_leaves_the_detected_one(
    monkeypatch, tmp_path, forced
):
    """Forced kernels that crash, or a build that does not know the family's name (it
    warns and keeps its own: the config still names Prescott), leave the library as
    detected, with a word."""
    lib = tmp_path / "libopenblas.so.0"
    libs = {"system": lib, "scipy-openblas32": None, "cmeel-openblas": None}
    detected = {"ok": True, "reason": "", "config": "OpenBLAS DYNAMIC_ARCH Prescott MAX_THREADS=64"}

    def fake_probe(path, threads, coretype=None):
        if coretype and forced == "crashes":
            return {"ok": False, "reason": "its probe was killed by SIGILL", "config": ""}
        return detected

    monkeypatch.setattr(blaslib, "locate", lambda n: (libs[n], "" if libs[n] else "not installed"))
    monkeypatch.setattr(blaslib, "probe", fake_probe)
    monkeypatch.setattr(blaslib, "cpu_flags", lambda: AVX512)
    blas, warning = blaslib.choose({"OPENBLAS_NUM_THREADS": "2"})
    assert (blas.name, blas.coretype) == ("system", None)
    why = "its probe was killed by SIGILL" if forced == "crashes" else "it keeps its own choice"
    assert warning.startswith(
        "system: runs pre-AVX kernels on this CPU, and with OPENBLAS_CORETYPE=SkylakeX "
        f"{why}; using OpenBLAS DYNAMIC_ARCH Prescott"
    )


def test_the_kernel_family_is_set_while_the_library_loads_only(monkeypatch):
    seen = []
    monkeypatch.setattr(
        blaslib.ctypes, "CDLL", lambda path, mode: seen.append(os.environ.get("OPENBLAS_CORETYPE"))
    )
    monkeypatch.setattr(blaslib, "set_threads", lambda lib, n: None)
    monkeypatch.delenv("OPENBLAS_CORETYPE", raising=False)
    blaslib.load("/x/libopenblas.so", 2, "SkylakeX")
    blaslib.load("/x/libopenblas.so", 2)
    assert seen == ["SkylakeX", None] and "OPENBLAS_CORETYPE" not in os.environ


@linux_only
def test_the_probe_runs_the_kernel_family_it_is_given(tmp_path, monkeypatch):
    """The re-probe reaches the library's own kernel choice: the system OpenBLAS, forced
    to the family this CPU's flags allow, reports that family and passes."""
    lib, _ = blaslib.locate("system")
    want = blaslib.best_coretype(blaslib.cpu_flags()) if platform.machine() == "x86_64" else None
    if lib is None or want is None:
        pytest.skip("needs the system OpenBLAS on an x86-64 CPU with AVX")
    verdict = blaslib.probe(lib, 1, coretype=want)
    if "DYNAMIC_ARCH" not in verdict["config"]:
        pytest.skip("the system OpenBLAS is built for one target")
    assert verdict["ok"], verdict["reason"]
    assert want.lower() in verdict["config"].lower().split()


@linux_only
def test_blas_threads_are_shared_out_inside_the_block_and_restored_after(tmp_path):
    """`threads_shared(k)`: each BLAS call on 1/k of the threads inside the block (the
    update's lanes, `device.Lanes`), and all of them again after it, also when the
    block raises; read back through OpenBLAS's own getter in a fresh interpreter."""
    snippet = """
import ctypes, json, mlx_grpo
from mlx_grpo.cpu import blas as blaslib
lib, blas = blaslib.state["lib"], blaslib.state["blas"]
get_blas = getattr(lib, "openblas_get_num_threads", None) or lib.scipy_openblas_get_num_threads
front = blaslib.state["front"]  # the skinny-GEMM front shares out its threads too
get = lambda: [get_blas(), front.threads() if front else get_blas()]
seen = [get()]
with blaslib.threads_shared(2):
    seen.append(get())
try:
    with blaslib.threads_shared(4):
        seen.append(get())
        raise KeyError
except KeyError:
    pass
seen.append(get())
print(json.dumps({"threads": blas.threads, "seen": seen}))
"""
    env = {**os.environ, "MLX_GRPO_CACHE": str(tmp_path / "cache"), "OPENBLAS_NUM_THREADS": "4"}
    env.pop("MLX_GRPO_OPENBLAS", None)
    done = subprocess.run(
        [sys.executable, "-c", snippet], capture_output=True, text=True, env=env, timeout=600
    )
    if "NoneType" in done.stderr:
        pytest.skip("MLX keeps its own BLAS here: no OpenBLAS to share out")
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["threads"] == 4
    assert result["seen"] == [[4, 4], [2, 2], [1, 1], [4, 4]]


@linux_only
def test_a_cpu_build_widens_mlx_evaluation_order_before_mlx_runs_and_keeps_a_set_value():
    """`import mlx_grpo` sets MLX_BFS_MAX_WIDTH (read once by MLX) on a CPU build, so that
    the update's lanes interleave; a value the user set stays."""
    from mlx_grpo._backend import installed_builds
    from mlx_grpo.device import GPU_BUILDS

    snippet = "import os, mlx_grpo; print(os.environ.get('MLX_BFS_MAX_WIDTH'))"
    env = {k: v for k, v in os.environ.items() if k != "MLX_BFS_MAX_WIDTH"}
    fresh = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, env=env)
    kept = subprocess.run(
        [sys.executable, "-c", snippet],
        capture_output=True,
        text=True,
        env={**env, "MLX_BFS_MAX_WIDTH": "64"},
    )
    cpu_build = not installed_builds() & GPU_BUILDS  # (Linux: `device.linux_cpu`)
    assert fresh.stdout.strip() == (str(EVAL_WIDTH) if cpu_build else "None")
    assert kept.stdout.strip() == "64"
