"""Which MLX build a Linux machine gets: `make install` runs this after installing the
project.

MLX ships its Linux builds as separate packages: `mlx-cpu`, `mlx-cuda-12` and
`mlx-cuda-13`, each holding its own `libmlx.so` for the same `mlx` package. The project
depends on `mlx[cpu]`. When `nvidia-smi` reports a driver that runs CUDA 13 (or 12), this
swaps the CPU build for `mlx[cuda13]` (or `mlx[cuda12]`) at the installed MLX version.
It then runs a kernel on the GPU in a child process. If that fails, the CPU build comes
back with a one-line warning, so a machine whose GPU MLX cannot use still trains on its
CPU. `MLX_DEVICE=cpu|cuda12|cuda13` overrides the detection and is remembered in the
environment (`.mlx-device` under `sys.prefix`) for later installs.

Run it as a file (`python mlx_grpo/_backend.py`), not as a module: importing the package
loads MLX, whose library this replaces.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path

# The extra of the `mlx` package -> the distribution that holds its libmlx.so
BUILDS = {"cpu": "mlx-cpu", "cuda12": "mlx-cuda-12", "cuda13": "mlx-cuda-13"}

# Runs in a fresh interpreter: which device MLX computes on, after a kernel ran there
PROBE = (
    "import mlx.core as mx; x = mx.arange(8) * 2; mx.eval(x); "
    "assert x.tolist() == list(range(0, 16, 2)); print(mx.default_device())"
)


def driver_cuda(smi_output: str) -> tuple[int, int] | None:
    """The highest CUDA version the driver runs, from `nvidia-smi`'s header."""
    m = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", smi_output)
    return (int(m[1]), int(m[2])) if m else None


def wanted(env: dict, smi_output: str | None, recorded: str = "") -> str:
    """The build this machine should have: MLX_DEVICE, else the one an earlier
    MLX_DEVICE chose (`recorded`), else the driver's CUDA version."""
    choice = env.get("MLX_DEVICE", "").strip() or recorded.strip()
    if choice:
        if choice not in BUILDS:
            raise ValueError(f"MLX_DEVICE={choice!r}: expected one of {', '.join(BUILDS)}")
        return choice
    version = driver_cuda(smi_output) if smi_output else None
    if version is None:
        return "cpu"
    if version >= (13, 0):
        return "cuda13"
    if version >= (12, 0):
        return "cuda12"
    return "cpu"


def plan(installed: set[str], target: str, version: str) -> list[list[str]]:
    """The pip commands (arguments after `pip`) that leave exactly `target` installed.

    Every build writes the same `mlx/lib/libmlx.so`, so whatever else is there (say
    `mlx-cpu`, put back by a later `pip install -e .`) goes first, the target too, and
    the target is installed fresh; uninstalling a build afterwards would delete the
    library that the other one wrote.
    """
    if installed == {target}:
        return []
    steps = []
    if installed:
        steps.append(["uninstall", "-q", "-y", *sorted(BUILDS[b] for b in installed)])
    steps.append(["install", "-q", f"mlx[{target}]=={version}"])
    return steps


def installed_builds() -> set[str]:
    found = set()
    for build, dist in BUILDS.items():
        try:
            metadata.version(dist)
            found.add(build)
        except metadata.PackageNotFoundError:
            pass
    return found


def nvidia_smi() -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        r = subprocess.run([exe], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout if r.returncode == 0 else None


def probe(python: str = sys.executable) -> tuple[bool, str]:
    """(MLX ran a kernel on the GPU, the child's last line of output)."""
    try:
        r = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return False, "the probe ran for 10 minutes"
    lines = (r.stdout if r.returncode == 0 else r.stdout + r.stderr).strip().splitlines()
    last = lines[-1] if lines else f"exit status {r.returncode}"
    return r.returncode == 0 and "gpu" in r.stdout, last


def pip(args: Sequence[str]) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def setup(
    env: dict,
    smi_output: str | None,
    installed: set[str],
    version: str,
    run_pip: Callable[[Sequence[str]], None] = pip,
    run_probe: Callable[[], tuple[bool, str]] = probe,
    say: Callable[[str], None] = print,
    recorded: str = "",
) -> str:
    """Install the wanted build, prove a GPU build on the GPU, fall back to the CPU
    build when either fails. Returns the build left installed.
    """
    target = wanted(env, smi_output, recorded)
    try:
        for step in plan(installed, target, version):
            run_pip(step)
    except subprocess.CalledProcessError as e:
        if target == "cpu":
            raise
        say(
            f"warning: installing MLX's {target} build failed (pip exit status "
            f"{e.returncode}); keeping its CPU build"
        )
        for step in plan(set(BUILDS), "cpu", version):  # whatever the failure left
            run_pip(step)
        return "cpu"
    if target == "cpu":
        return "cpu"
    ok, last = run_probe()
    if ok:
        say(f"MLX: {BUILDS[target]} {version}, computing on the GPU")
        return target
    say(
        f"warning: MLX's {target} build did not run on this GPU ({last}); "
        "keeping its CPU build (MLX_DEVICE=cpu skips this check)"
    )
    for step in plan({target}, "cpu", version):
        run_pip(step)
    return "cpu"


def main() -> int:
    if not sys.platform.startswith("linux"):
        return 0
    # An explicit MLX_DEVICE is kept in the environment, so that a later install
    # without it (`make test` installing its extras, say) keeps that choice.
    record = Path(sys.prefix) / ".mlx-device"
    recorded = record.read_text() if record.exists() else ""
    try:
        if choice := os.environ.get("MLX_DEVICE", "").strip():
            wanted({"MLX_DEVICE": choice}, None)  # a wrong name stops here
            record.write_text(choice + "\n")
        setup(
            dict(os.environ), nvidia_smi(), installed_builds(), metadata.version("mlx"),
            recorded=recorded,
        )  # fmt: skip
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as e:
        print(
            f"error: pip {' '.join(e.cmd[3:])} failed (exit status {e.returncode})", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
