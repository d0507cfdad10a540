"""The documentation site builds without a warning; skips when Sphinx is not installed."""

import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"


@pytest.mark.timeout(120)
def test_sphinx_builds_the_site_without_warnings(tmp_path):
    pytest.importorskip("sphinx", reason='Sphinx is not installed: pip install -e ".[docs]"')
    done = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "-q", "-b", "html", str(DOCS), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "api.html").read_text().count("step_batch") >= 1
