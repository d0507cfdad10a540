"""The error classes: each constructs on every CPython, and is Gymnasium's or the env's type too."""

from __future__ import annotations

import builtins

import pytest
from gymnasium.error import AlreadyPendingCallError, NoAsyncCallError

from multienv.errors import (
    EnvError,
    EnvStateError,
    MultiEnvError,
    NoPendingCallError,
    PendingCallError,
    env_error_class,
)


@pytest.mark.parametrize(
    ("error_class", "gymnasium_class"),
    [(NoPendingCallError, NoAsyncCallError), (PendingCallError, AlreadyPendingCallError)],
)
def test_the_pending_call_errors_are_gymnasiums_and_keep_the_calls_name(
    error_class, gymnasium_class
):
    # On CPython 3.14 RuntimeError lost its own __init__, and MultiEnvError's super() call
    # reached Gymnasium's, which needs the name: a TypeError in place of the error.
    error = error_class("Calling `step_wait` without any prior call to `step_async`.", "step")
    assert isinstance(error, gymnasium_class)
    assert isinstance(error, EnvStateError)
    assert isinstance(error, MultiEnvError)
    assert error.name == "step"
    assert error.env_index is None
    assert str(error) == "Calling `step_wait` without any prior call to `step_async`."
    with pytest.raises(gymnasium_class, match="without any prior call"):
        raise error


BUILTIN_EXCEPTIONS = sorted(
    (
        value
        for value in vars(builtins).values()
        if isinstance(value, type) and issubclass(value, Exception)
    ),
    key=lambda cls: cls.__name__,
)


@pytest.mark.parametrize("remote_type", BUILTIN_EXCEPTIONS, ids=lambda cls: cls.__name__)
def test_every_builtin_exception_an_env_raises_becomes_an_env_error_that_constructs(remote_type):
    # UnicodeDecodeError's __init__ takes five arguments and ExceptionGroup's __new__ two:
    # such a type gets the plain EnvError, not a TypeError from inside multienv.
    error_class = env_error_class(remote_type)
    error = error_class("env 2: step() raised it", env_index=2)
    assert isinstance(error, EnvError)
    assert error.env_index == 2
    assert str(error) == "env 2: step() raised it"
    if error_class is not EnvError:
        assert isinstance(error, remote_type)
