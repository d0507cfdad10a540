"""Finding a backend: the installed entry points, and multienv's own when those are stale."""

from __future__ import annotations

import logging
from importlib.metadata import EntryPoint

import pytest

from multienv.backends.subprocess.subprocess_env import BACKEND as SUBPROCESS
from multienv.supervision import handles


def stale(name: str, value: str):
    """``entry_points`` as an install made before the backends moved would answer."""

    def entry_points(group: str, name: str | None = None) -> list[EntryPoint]:
        point = EntryPoint(stale_name, value, group)
        return [point] if name in (None, stale_name) else []

    stale_name = name
    return entry_points


def test_a_stale_entry_point_of_a_built_in_backend_falls_back_to_it(monkeypatch, caplog):
    monkeypatch.setattr(handles, "entry_points", stale("subprocess", "multienv.subprocess_env:X"))
    with caplog.at_level(logging.WARNING, logger="multienv"):
        assert handles.find_backend.__wrapped__("subprocess") is SUBPROCESS
    assert "does not load; using multienv's own (reinstall multienv" in caplog.text


def test_no_entry_point_at_all_still_finds_the_built_in_backends(monkeypatch):
    monkeypatch.setattr(handles, "entry_points", lambda group, name=None: [])
    assert handles.find_backend.__wrapped__("subprocess") is SUBPROCESS
    assert handles.backend_names() == ["ray", "subprocess"]


def test_a_third_party_backend_that_does_not_load_raises(monkeypatch):
    monkeypatch.setattr(handles, "entry_points", stale("mine", "no_such_module:BACKEND"))
    with pytest.raises(ModuleNotFoundError, match="no_such_module"):
        handles.find_backend.__wrapped__("mine")
    with pytest.raises(ValueError, match=r"backend must be one of \['mine', 'ray', 'subprocess'\]"):
        handles.find_backend.__wrapped__("other")
