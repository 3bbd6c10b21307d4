"""`make install`'s choice of MLX build on Linux (mlx_grpo/_backend.py): the driver's CUDA
version read from nvidia-smi, the pip steps that leave exactly one build's libmlx.so, and
the fall back to the CPU build when the GPU build cannot run a kernel."""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest

from mlx_grpo import _backend as backend

# nvidia-smi's header as driver 580 prints it (the H200 machines this was checked on)
SMI_580 = """\
Thu Nov 26 18:20:01 2026
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 580.159.03             Driver Version: 580.159.03     CUDA Version: 13.0     |
+-----------------------------------------+------------------------+----------------------+
| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |
|   0  NVIDIA H200                    On  |   00000000:00:05.0 Off |                    0 |
"""
SMI_550 = SMI_580.replace("580.159.03", "550.54.15").replace(
    "CUDA Version: 13.0", "CUDA Version: 12.4"
)
SMI_470 = SMI_580.replace("580.159.03", "470.256.02").replace(
    "CUDA Version: 13.0", "CUDA Version: 11.4"
)


def test_driver_cuda_reads_the_header():
    assert backend.driver_cuda(SMI_580) == (13, 0)
    assert backend.driver_cuda(SMI_550) == (12, 4)
    assert backend.driver_cuda("NVIDIA-SMI has failed because it couldn't communicate") is None


@pytest.mark.parametrize(
    "env, smi, build",
    [
        ({}, None, "cpu"),  # no nvidia-smi, or it failed
        ({}, SMI_580, "cuda13"),
        ({}, SMI_550, "cuda12"),
        ({}, SMI_470, "cpu"),  # MLX builds for CUDA 12 and 13 only
        ({"MLX_DEVICE": "cpu"}, SMI_580, "cpu"),
        ({"MLX_DEVICE": "cuda12"}, SMI_580, "cuda12"),
        ({"MLX_DEVICE": " "}, SMI_550, "cuda12"),
    ],
)
def test_wanted(env, smi, build):
    assert backend.wanted(env, smi) == build


def test_an_earlier_choice_holds_until_mlx_device_names_another():
    assert backend.wanted({}, SMI_580, recorded="cpu\n") == "cpu"
    assert backend.wanted({"MLX_DEVICE": "cuda13"}, SMI_580, recorded="cpu") == "cuda13"
    assert backend.wanted({"MLX_DEVICE": ""}, None, recorded="cuda12") == "cuda12"


def test_wanted_rejects_an_unknown_device_by_name():
    with pytest.raises(
        ValueError, match=r"^MLX_DEVICE='rocm': expected one of cpu, cuda12, cuda13$"
    ):
        backend.wanted({"MLX_DEVICE": "rocm"}, SMI_580)


class FakeSite:
    """pip on one site-packages, as far as MLX's builds go: each build's RECORD lists the
    same mlx/lib/libmlx.so; installing writes it, uninstalling deletes it, whoever wrote
    it last; installing a build already there does nothing."""

    LIB = "mlx/lib/libmlx.so"

    def __init__(self, installed, lib_from):
        self.installed = set(installed)
        self.files = {self.LIB: lib_from} if lib_from else {}

    def pip(self, args):
        verb, *rest = [a for a in args if a not in ("-q", "-y")]
        if verb == "uninstall":
            for dist in rest:
                build = next(b for b, d in backend.BUILDS.items() if d == dist)
                self.installed.discard(build)
                self.files.pop(self.LIB, None)
        else:
            (req,) = rest
            build = req[req.index("[") + 1 : req.index("]")]
            if build not in self.installed:
                self.installed.add(build)
                self.files[self.LIB] = build


# Every state a site can be in: some builds installed, the library written by one of
# them (or deleted by an earlier uninstall)
STATES = [
    (set(inst), lib)
    for n in range(len(backend.BUILDS) + 1)
    for inst in itertools.combinations(backend.BUILDS, n)
    for lib in [None, *inst]
    if inst or lib is None
]


# plan() trusts a lone install of the target as it is, so that state starts whole
CASES = [
    (installed, lib_from, target)
    for installed, lib_from in STATES
    for target in backend.BUILDS
    if installed != {target} or lib_from == target
]


@pytest.mark.parametrize("installed, lib_from, target", CASES)
def test_plan_leaves_exactly_the_target_library(installed, lib_from, target):
    site = FakeSite(installed, lib_from)
    for step in backend.plan(installed, target, "0.32.4"):
        site.pip(step)
    assert site.installed == {target}
    assert site.files == {FakeSite.LIB: target}


def test_the_fake_site_catches_uninstalling_after_installing():
    # the order plan() avoids: the GPU build installed, then the CPU build removed
    site = FakeSite({"cpu"}, "cpu")
    site.pip(["install", "mlx[cuda13]==0.32.4"])
    site.pip(["uninstall", "-y", "mlx-cpu"])
    assert FakeSite.LIB not in site.files


def test_plan_names_the_installed_version():
    assert backend.plan({"cpu"}, "cuda13", "0.32.4") == [
        ["uninstall", "-q", "-y", "mlx-cpu"],
        ["install", "-q", "mlx[cuda13]==0.32.4"],
    ]
    assert backend.plan({"cpu"}, "cpu", "0.32.4") == []


def run_setup(smi, installed, probe_result, env=None, fail_on=None):
    calls, said = [], []

    def probe():
        calls.append(["probe"])
        return probe_result

    def pip(args):
        calls.append(args)
        if fail_on and fail_on in args:
            raise subprocess.CalledProcessError(1, ["python", "-m", "pip", *args])

    build = backend.setup(
        env or {}, smi, installed, "0.32.4", run_pip=pip, run_probe=probe, say=said.append
    )
    return build, calls, said


def test_setup_on_a_cpu_machine_touches_nothing():
    build, calls, said = run_setup(None, {"cpu"}, (False, "never called"))
    assert (build, calls, said) == ("cpu", [], [])


def test_setup_keeps_a_gpu_build_that_runs():
    build, calls, said = run_setup(SMI_580, {"cpu"}, (True, "Device(gpu, 0)"))
    assert build == "cuda13"
    assert calls == [
        ["uninstall", "-q", "-y", "mlx-cpu"],
        ["install", "-q", "mlx[cuda13]==0.32.4"],
        ["probe"],
    ]
    assert said == ["MLX: mlx-cuda-13 0.32.4, computing on the GPU"]


def test_setup_falls_back_to_the_cpu_build_with_one_line():
    err = "RuntimeError: [cuda] cudaGetDeviceCount failed: CUDA driver version is insufficient"
    build, calls, said = run_setup(SMI_550, {"cpu"}, (False, err))
    assert build == "cpu"
    assert calls == [
        ["uninstall", "-q", "-y", "mlx-cpu"],
        ["install", "-q", "mlx[cuda12]==0.32.4"],
        ["probe"],
        ["uninstall", "-q", "-y", "mlx-cuda-12"],
        ["install", "-q", "mlx[cpu]==0.32.4"],
    ]
    assert len(said) == 1 and said[0].startswith("warning: MLX's cuda12 build did not run")
    assert err in said[0] and "\n" not in said[0]


def test_probe_does_not_take_this_cpu_build_for_a_gpu():
    # a real child interpreter with the MLX installed here (the CPU build in CI)
    import mlx.core as mx

    ok, last = backend.probe()
    if mx.default_device() == mx.gpu:  # a Mac, or a CUDA build
        assert ok and "gpu" in last
    else:
        assert not ok and last == "Device(cpu, 0)"


def test_a_gpu_build_that_pip_cannot_install_leaves_the_cpu_build():
    # offline, or no wheel for this platform: nothing of it may stay half-installed
    build, calls, said = run_setup(SMI_580, {"cpu"}, (True, "never"), fail_on="mlx[cuda13]==0.32.4")
    assert build == "cpu"
    assert calls == [
        ["uninstall", "-q", "-y", "mlx-cpu"],
        ["install", "-q", "mlx[cuda13]==0.32.4"],
        ["uninstall", "-q", "-y", "mlx-cpu", "mlx-cuda-12", "mlx-cuda-13"],
        ["install", "-q", "mlx[cpu]==0.32.4"],
    ]
    assert said == [
        "warning: installing MLX's cuda13 build failed (pip exit status 1); keeping its CPU build"
    ]
    site = FakeSite({"cpu"}, "cpu")  # pip skips builds that are not installed
    for step in calls:
        if step == ["install", "-q", "mlx[cuda13]==0.32.4"]:
            continue  # the install that failed wrote nothing
        site.pip([a for a in step if a not in ("mlx-cuda-12", "mlx-cuda-13")])
    assert site.files == {FakeSite.LIB: "cpu"}


def test_a_cpu_build_that_pip_cannot_install_is_an_error():
    with pytest.raises(subprocess.CalledProcessError):
        run_setup(None, {"cuda13"}, (False, "never"), fail_on="mlx[cpu]==0.32.4")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MLX's builds are Linux's")
def test_an_explicit_choice_is_remembered_by_later_installs(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(backend.sys, "prefix", str(tmp_path))
    monkeypatch.setattr(backend, "setup", lambda env, *a, recorded="": seen.append(recorded))
    monkeypatch.setenv("MLX_DEVICE", "cpu")
    assert backend.main() == 0
    assert (tmp_path / ".mlx-device").read_text() == "cpu\n"
    monkeypatch.setenv("MLX_DEVICE", "")
    assert backend.main() == 0 and seen[-1] == "cpu\n"
    monkeypatch.setenv("MLX_DEVICE", "rocm")
    assert backend.main() == 2  # said on stderr, nothing recorded
    assert (tmp_path / ".mlx-device").read_text() == "cpu\n"
