"""The device seam (`mlx_grpo.device`): on a Linux CPU the speed layer of `mlx_grpo.cpu`
is in use; where MLX computes on a GPU (or off Linux) not one of its modules is
imported, and the passes run on MLX's and mlx_lm's own ops."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.activations import swiglu as mlx_lm_swiglu

from mlx_grpo import device, fastmath

LINUX = sys.platform == "linux"

# Runs in a fresh interpreter with MLX's default device reported as the GPU (MLX is
# imported first and asked through `mx.default_device`, as the seam asks it): loads
# the tiny model, samples from it, scores the samples, and prints which mlx_grpo
# modules it imported and what the seam said.
ON_A_GPU = """
import json, os, sys
import mlx.core as mx
gpu = mx.Device(mx.gpu)
mx.default_device = lambda: gpu
for name in ("new_stream", "new_thread_local_stream"):  # (streams still compute on the CPU)
    setattr(mx, name, lambda device, make=getattr(mx, name): make(mx.cpu))
import mlx_grpo.device as device
import mlx_grpo.models, mlx_grpo.logprobs, mlx_grpo.decode, mlx_grpo.rollout
from mlx_grpo import fastmath
from mlx_grpo._paths import cache_root
from mlx_grpo.config import ModelConfig, RolloutConfig
from mlx_grpo.logprobs import completion_logprobs
from mlx_grpo.models import load_model
from mlx_grpo.rollout import generate_groups

model, tok = load_model(ModelConfig(path=sys.argv[1], dtype="float32", dequantize="no"))
out = generate_groups(model, tok, [[1, 2, 3, 4], [5, 6, 7]], 2, RolloutConfig(max_new_tokens=5))
tokens = [c.tokens for c in out.completions]
width = max(len(t) for t in tokens)
comp = mx.array([t + [0] * (width - len(t)) for t in tokens])
lp, ent = completion_logprobs(model, [mx.array(p) for p in out.prompts], comp,
                              lengths=[len(t) for t in tokens], grad=False)
mx.eval(lp, ent)
x = mx.random.normal((3, 300))
print(json.dumps({
    "cpu_modules": sorted(m for m in sys.modules if m.startswith("mlx_grpo.cpu")),
    "linux_cpu": device.linux_cpu(),
    "adapted": device.adapt_model(model),
    "packs_rows": device.packs_rows(model),
    "prepared": device.prepare_training(),
    "metal": mx.metal.is_available(),
    "lanes": device.update_lanes(None).n,
    "blas": device.blas_in_use(),
    "library": device.blas_library(),
    "native": device.native_in_use(),
    "exp_is_mlx": bool(mx.array_equal(fastmath.exp(x), mx.exp(x)).item()),
    "width": os.environ.get("MLX_BFS_MAX_WIDTH"),
    "libraries": sorted({
        line.split()[-1] for line in open("/proc/self/maps")
        if "libopenblas" in line or str(cache_root()) in line
    }) if sys.platform == "linux" else [],
    "finite": bool(mx.all(mx.isfinite(lp)).item()),
}))
"""

# Before MLX is loaded the seam asks the installed build: with a CUDA build, `import
# mlx_grpo` loads nothing of the CPU layer and leaves MLX's evaluation width alone.
CUDA_BUILD = """
import json, os, sys, types
fake = types.ModuleType("mlx_grpo._backend")
fake.installed_builds = lambda: {"cuda13"}
sys.modules["mlx_grpo._backend"] = fake
import mlx_grpo
print(json.dumps({
    "cpu_modules": sorted(m for m in sys.modules if m.startswith("mlx_grpo.cpu")),
    "mlx_loaded": "mlx.core" in sys.modules,
    "width": os.environ.get("MLX_BFS_MAX_WIDTH"),
}))
"""


def _child(code: str, *args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MLX_BFS_MAX_WIDTH"}
    done = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_on_a_gpu_nothing_of_the_cpu_layer_is_imported(tiny_model_dir):
    """Loading, sampling and scoring with MLX's default device a GPU: no module of
    `mlx_grpo.cpu` is imported, the model keeps mlx_lm's layers, the update one lane,
    and `fastmath`'s ops are MLX's own (no OpenBLAS or library of ours loaded, no
    evaluation width set)."""
    out = _child(ON_A_GPU, str(tiny_model_dir))
    assert out["cpu_modules"] == []
    assert out["linux_cpu"] is False
    assert out["adapted"] == 0 and out["packs_rows"] is False
    assert out["prepared"] is out["metal"] and out["lanes"] == 1  # (Metal: memory wired)
    assert out["blas"] == ("MLX built-in BLAS" if LINUX else "Accelerate")
    assert out["library"] is None and out["native"] is False
    assert out["exp_is_mlx"] and out["finite"]
    assert out["width"] is None and out["libraries"] == []  # no BLAS, front or native op


@pytest.mark.skipif(not LINUX, reason="MLX's CUDA builds are Linux builds")
def test_with_a_cuda_build_importing_mlx_grpo_prepares_nothing_of_the_cpu():
    out = _child(CUDA_BUILD)
    assert out == {"cpu_modules": [], "mlx_loaded": False, "width": None}


def test_off_a_linux_cpu_the_ops_are_mlxs_and_mlx_lms_own(monkeypatch):
    """`fastmath`'s ops where the seam finds no Linux CPU: exactly MLX's and mlx_lm's
    (the native ones None), whatever the dtype."""
    monkeypatch.setattr(device, "linux_cpu", lambda: False)
    monkeypatch.setattr(mx.metal, "is_available", lambda: False)
    assert device.cpu_kernels() is None
    rng = np.random.default_rng(0)
    x = mx.array(rng.normal(size=(4, 512)).astype(np.float32))
    g, u = x[:, :256], x[:, 256:]
    assert mx.array_equal(fastmath.exp(x), mx.exp(x)).item()
    assert mx.array_equal(fastmath.row_max(x, True), x.max(axis=-1, keepdims=True)).item()
    assert mx.array_equal(fastmath.row_sum(x), x.sum(axis=-1)).item()
    assert mx.array_equal(fastmath.swiglu(g, u), mlx_lm_swiglu(g, u)).item()
    q = mx.array(rng.normal(size=(1, 4, 6, 8)).astype(np.float32))
    kv = mx.array(rng.normal(size=(1, 2, 6, 8)).astype(np.float32))
    want = mx.fast.scaled_dot_product_attention(q, kv, kv, scale=0.3, mask="causal")
    assert mx.array_equal(fastmath.attention(q, kv, kv, 0.3, "causal"), want).item()
    meta = mx.zeros((6, 1), mx.int32)
    assert (
        fastmath.packed_attention(
            q[0].swapaxes(0, 1), kv[0].swapaxes(0, 1), kv[0].swapaxes(0, 1), meta, 0.3
        )
        is None
    )
    assert fastmath.decode_attention(q[:, :, 0], kv, kv, mx.zeros((1, 6))) is None
    assert device.update_lanes(None).n == 1
    assert device.prepare_training() is False


@pytest.mark.skipif(not LINUX or mx.default_device() != mx.cpu, reason="a Linux CPU")
def test_on_a_linux_cpu_the_cpu_layer_is_in_use(tiny):
    """Here the seam gives the CPU's ops, layers and packed pass."""
    from mlx_grpo.cpu import blas, layers
    from mlx_grpo.cpu import fastmath as cpu_fastmath

    model, _ = tiny
    assert device.linux_cpu()
    assert device.cpu_kernels() is cpu_fastmath
    assert not device.packs_rows(model)
    assert device.adapt_model(model) == 2 * len(model.layers)
    assert device.packs_rows(model)
    assert all(layers.attends_through_cache(layer.self_attn) for layer in model.layers)
    assert device.blas_in_use() == blas.blas_in_use()
    assert os.environ.get("MLX_BFS_MAX_WIDTH") is not None


GiB = 2**30


@pytest.fixture
def wired(monkeypatch):
    """mlx's wired-limit call recorded instead of made, on a machine described by the
    test (`metal`, `info`), as `mx.metal.is_available` and `mx.device_info` say."""
    calls: list[int] = []
    machine = {"metal": True, "info": {}}
    monkeypatch.setattr(mx.metal, "is_available", lambda: machine["metal"])
    monkeypatch.setattr(mx, "device_info", lambda: dict(machine["info"]))
    monkeypatch.setattr(mx, "set_wired_limit", lambda limit: calls.append(limit) or 0)
    return machine, calls


def test_on_metal_the_wired_limit_is_the_recommended_working_set_as_mlx_lm_sets_it(
    wired, monkeypatch
):
    """A 32 GB Mac whose GPU may keep ~21 GiB resident: that is the limit, as mlx_lm's
    `maybe_set_recommended_wired_limit` chooses, and the training step asks for it."""
    from mlx_lm.utils import maybe_set_recommended_wired_limit

    machine, calls = wired
    machine["info"] = {
        "architecture": "applegpu_g15s",
        "memory_size": 32 * GiB,
        "max_recommended_working_set_size": 22_906_503_168,
    }
    assert device.wire_memory() == 22_906_503_168
    maybe_set_recommended_wired_limit()
    assert calls == [22_906_503_168, 22_906_503_168]  # ours, then mlx_lm's: the same
    calls.clear()
    monkeypatch.setattr(device, "linux_cpu", lambda: False)  # (a Mac: the wiring alone)
    assert device.prepare_training() is True
    assert calls == [22_906_503_168]


@pytest.mark.parametrize(
    ("metal", "info"),
    [
        (False, {"architecture": "x86_64", "device_name": "AMD EPYC"}),  # a Linux CPU
        (False, {"max_recommended_working_set_size": 8 * GiB}),  # Metal absent: not asked
        (True, {"architecture": "applegpu"}),  # a Metal device naming no working set
    ],
)
def test_without_metal_or_a_recommended_size_nothing_is_wired(wired, metal, info):
    machine, calls = wired
    machine.update(metal=metal, info=info)
    assert device.wire_memory() is None
    assert calls == []
