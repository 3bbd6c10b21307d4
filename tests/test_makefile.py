"""`make train`'s command line: each value one shell word whatever it holds, and a value
that cannot work (no recipe, a count of ranks that is none) one line naming the make
variable before anything runs. Seen through `make -n`, which prints the commands
instead of running them; `-o .venv/.installed` takes the venv as installed, so that
nothing but train's own command is printed."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAKE = shutil.which("make")
pytestmark = pytest.mark.skipif(MAKE is None, reason="no make")

# The variables the Makefile reads; one set in this shell, or passed down by a `make test`
# (MAKEFLAGS carries its command-line variables), would change what is printed.
VARIABLES = ("RECIPE", "MODEL", "STEPS", "RUN", "ARGS", "HOSTS", "NP", "MAKEFLAGS", "MFLAGS")


def make_train(*assignments: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in VARIABLES and k != "MAKELEVEL"}
    return subprocess.run(
        [MAKE, "-s", "-n", "-o", ".venv/.installed", "train", *assignments],
        cwd=ROOT, capture_output=True, text=True, env=env, timeout=60,
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
