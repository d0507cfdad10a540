"""The examples in multienv's docstrings run (doctest), in the default test run."""

import doctest
import importlib
import pkgutil

import pytest

import multienv

# Modules whose import needs an optional extra are checked only when it is installed.
OPTIONAL = {"multienv.sb3": "stable_baselines3"}
MODULES = sorted(info.name for info in pkgutil.walk_packages(multienv.__path__, prefix="multienv."))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    if name in OPTIONAL:
        pytest.importorskip(OPTIONAL[name], reason=f"{name} needs {OPTIONAL[name]}")
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0


def test_some_docstrings_have_examples():
    finder = doctest.DocTestFinder()
    examples = sum(
        len(test.examples)
        for name in ("multienv.restart", "multienv.evaluation")
        for test in finder.find(importlib.import_module(name))
    )
    assert examples >= 8
