"""The examples in multienv's docstrings run (doctest), in the default test run."""

import doctest
import importlib
import pkgutil

import pytest

import multienv

# Modules whose import needs an optional extra are checked only when it is installed.
OPTIONAL = {"multienv.sb3": "stable_baselines3"}
MODULES = sorted(info.name for info in pkgutil.walk_packages(multienv.__path__, prefix="multienv."))


def examples_of(name: str) -> int:
    """How many doctest examples the module's docstrings hold."""
    module = importlib.import_module(name)
    return sum(len(test.examples) for test in doctest.DocTestFinder().find(module))


WITH_EXAMPLES = [name for name in MODULES if name not in OPTIONAL and examples_of(name)]


@pytest.mark.parametrize("name", WITH_EXAMPLES)
def test_docstring_examples_run(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0
    assert result.failed == 0


@pytest.mark.parametrize("name", sorted(OPTIONAL))
def test_docstring_examples_of_optional_modules_run(name):
    pytest.importorskip(OPTIONAL[name], reason=f"{name} needs {OPTIONAL[name]}")
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0


def test_the_public_modules_and_the_pure_rules_have_examples():
    # A module that loses its examples drops out of the test above: these must keep theirs.
    expected = {
        "multienv.restart",
        "multienv.evaluation",
        "multienv.vector.multi_env",
        "multienv.vector.send_recv",
        "multienv.supervision.log_limit",
    }
    assert expected <= set(WITH_EXAMPLES)
