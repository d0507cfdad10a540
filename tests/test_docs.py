"""The documentation site builds without a warning, and the calls it names work."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from multienv import MultiEnv
from tests.envs import CountingEnv

DOCS = Path(__file__).resolve().parent.parent / "docs"
README = DOCS.parent / "README.rst"


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


def test_the_docs_reach_an_envs_proxy_through_envs_envs_as_a_user_can():
    # A MultiEnv is not indexed itself (as Gymnasium's vector envs are not): ``envs[i].pid``
    # was a TypeError for whoever ran what the docs said.
    with MultiEnv([CountingEnv] * 3, envs_per_worker=2) as envs:
        with pytest.raises(TypeError, match="not subscriptable"):
            envs[0]
        pids = [envs.envs[i].pid for i in range(3)]
        assert pids[0] == pids[1] != pids[2]  # env i lives in worker i // k
    named = [
        f"{path.name}: {match.group(0)}"
        for path in [README, *DOCS.glob("*.rst")]
        for match in re.finditer(r"(?<![.\w])envs\[[^\]]+\]\.\w+", path.read_text())
    ]
    assert named == []
