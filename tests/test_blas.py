"""OpenBLAS is loaded ahead of MLX on Linux x86-64, and a broken one only warns."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

SNIPPET = (
    "import mlx_grpo, mlx.core as mx; from mlx_grpo._blas import blas_in_use; "
    "print(blas_in_use(), (mx.ones((64, 64)) @ mx.ones((64, 64)))[0, 0].item())"
)


def _run(env):
    return subprocess.run(
        [sys.executable, "-c", SNIPPET],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )


@pytest.mark.skipif(
    sys.platform != "linux" or platform.machine() != "x86_64", reason="Linux x86-64 only"
)
def test_openblas_is_used_and_a_broken_one_falls_back_with_one_warning(tmp_path):
    ok = _run({})
    assert ok.returncode == 0 and ok.stdout.split() == ["openblas", "64.0"], ok.stderr

    bogus = tmp_path / "libopenblas.so.0"
    bogus.write_bytes(b"not a shared library")
    bad = _run({"MLX_GRPO_OPENBLAS": str(bogus)})
    assert bad.returncode == 0 and bad.stdout.split() == ["builtin", "64.0"]
    lines = [line for line in bad.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "warning: OpenBLAS not usable" in lines[0]


def test_local_ranks_share_the_cores(tmp_path):
    from mlx_grpo._blas import local_ranks

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


@pytest.mark.skipif(
    sys.platform != "linux" or platform.machine() != "x86_64", reason="Linux x86-64 only"
)
def test_a_rank_of_two_on_this_machine_gets_half_the_cores(tmp_path):
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([["127.0.0.1:5000"], ["127.0.0.1:5001"]]))
    snippet = "import os, mlx_grpo; print(os.environ.get('OPENBLAS_NUM_THREADS'))"
    env = {**os.environ, "MLX_RANK": "1", "MLX_HOSTFILE": str(hostfile)}
    env.pop("OPENBLAS_NUM_THREADS", None)
    out = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, env=env)
    assert out.stdout.strip() == str(max(1, (os.cpu_count() or 1) // 2)), out.stderr
