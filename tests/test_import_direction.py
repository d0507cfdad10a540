"""The worker side and the wire import nothing of the parent side (read from the source);
the control plane (``supervision/``) imports neither the vector nor a backend.

One import runs by name instead, and is not seen here: ``wire.protocol.worker_module``
imports ``multienv.worker.worker`` in the processes that run workers, so that the parent
side and the worker never import each other.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "multienv"

# What each side may import of multienv: itself, what it stands on, and the error types.
ALLOWED = {
    "wire": ("multienv.wire", "multienv.errors"),
    "worker": ("multienv.worker", "multienv.wire", "multienv.errors"),
    "supervision": (
        "multienv.supervision",
        "multienv.wire",
        "multienv.errors",
        "multienv.restart",
        "multienv.recycle",
    ),
}


def multienv_imports(path: pathlib.Path) -> set[str]:
    """Every multienv module a file imports, at its top level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.split(".")[0] == "multienv"}


@pytest.mark.parametrize("side", sorted(ALLOWED))
def test_a_side_imports_only_what_it_stands_on(side):
    files = sorted((PACKAGE / side).rglob("*.py"))
    assert files
    wrong = {
        f"{path.relative_to(PACKAGE.parent)}: {name}"
        for path in files
        for name in multienv_imports(path)
        if not name.startswith(tuple(f"{allowed}." for allowed in ALLOWED[side]))
    }
    assert not wrong, sorted(wrong)
