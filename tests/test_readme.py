"""The runnable examples of the README and docs/ run, each as a script in a fresh process."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.rst"
PAGES = [README, *sorted((ROOT / "docs").glob("*.rst"))]


def examples(pages: list[Path] = PAGES) -> list[str]:
    """The ``.. code-block:: python`` blocks that are whole scripts (a ``__main__`` guard)."""
    text = "".join(page.read_text() for page in pages)
    blocks = re.findall(r"\.\. code-block:: python\n\n((?:    .*\n|\n)+)", text)
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


def test_the_readme_and_docs_have_runnable_examples():
    assert len(examples([README])) >= 1
    assert len(examples()) >= 3
