"""OpenBLAS is loaded ahead of MLX on Linux x86-64, and a broken one only warns."""

from __future__ import annotations

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
