"""The runnable examples of the README and docs/ run, each as a script in a fresh process."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.rst"
PAGES = [README, *sorted((ROOT / "docs").glob("*.rst"))]


# What an example may need that the test run may not have: its extra, and how to add it.
OPTIONAL = {
    "stable_baselines3": 'pip install -e ".[sb3]"',
    "torch": "pip install torch (its CPU build on a machine without a GPU)",
    "ray": 'pip install -e ".[ray]"',
    "torchrl": "pip install torchrl (after a CPU build of torch on a machine without a GPU)",
}


def examples(pages: list[Path] = PAGES) -> list[str]:
    """Every ``.. code-block:: python`` block: each is a whole script, run as written."""
    text = "".join(page.read_text() for page in pages)
    blocks = re.findall(r"\.\. code-block:: python\n\n((?:    .*\n|\n)+)", text)
    return ["\n".join(line[4:] for line in block.splitlines()) for block in blocks]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("script", examples(), ids=lambda s: s.splitlines()[-1].strip()[:40])
def test_readme_example_runs(script, tmp_path):
    assert '__name__ == "__main__"' in script, "a docs example is a whole script, guarded"
    for module, install in OPTIONAL.items():
        if re.search(rf"^\s*(from|import) {module}\b", script, re.MULTILINE):
            pytest.importorskip(module, reason=f"the example needs {module}: {install}")
    if "NumpyToTorch" in script:  # what gymnasium[torch] brings beside torch, and packaging
        for module in ("array_api_compat", "packaging"):
            pytest.importorskip(
                module, reason=f'the example needs pip install "gymnasium[torch]" {module}'
            )
    if 'backend="ray"' in script:
        pytest.importorskip("ray", reason=f"the example needs ray: {OPTIONAL['ray']}")
    path = tmp_path / "example.py"
    path.write_text(script)
    done = subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, timeout=170, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for printed in re.findall(r"# prints: (.+)$", script, re.MULTILINE):  # what it says it prints
        assert printed.strip() in done.stdout, done.stdout[-3000:]


def test_the_readme_and_docs_have_runnable_examples():
    assert len(examples([README])) >= 1
    assert len(examples()) >= 10
