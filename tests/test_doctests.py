"""The examples in mlx_grpo's docstrings run and give what they show."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import mlx_grpo

MODULES = sorted(
    m.name
    for m in pkgutil.walk_packages(mlx_grpo.__path__, "mlx_grpo.")
    if not m.name.endswith("__main__")  # (runs the command line)
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed"
