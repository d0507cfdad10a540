"""The README's runnable examples run, each as a script in a fresh process."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.rst"


def examples() -> list[str]:
    """The ``.. code-block:: python`` blocks that are whole scripts (a ``__main__`` guard)."""
    blocks = re.findall(r"\.\. code-block:: python\n\n((?:    .*\n|\n)+)", README.read_text())
    scripts = ["\n".join(line[4:] for line in block.splitlines()) for block in blocks]
    return [script for script in scripts if '__name__ == "__main__"' in script]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("script", examples(), ids=lambda s: s.splitlines()[-1].strip()[:40])
def test_readme_example_runs(script, tmp_path):
    path = tmp_path / "example.py"
    path.write_text(script)
    done = subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, timeout=110, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_readme_has_runnable_examples():
    assert len(examples()) >= 3
