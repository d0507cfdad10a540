"""The forkserver workers fork from: the user's script and the ``preload`` option's modules
are imported there once, not in every worker. Each test runs a script in a fresh Python,
because a process starts its forkserver only once."""

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from multienv import SubprocessEnv
from tests.conftest import live_workers
from tests.envs import CountingEnv

REPO = pathlib.Path(__file__).resolve().parents[1]


def run_python(args, *, input=None, path=(), env=None):
    """Run a fresh Python with the repo (and ``path``) importable, and ``env`` variables set.

    Returns the finished run.
    """
    return subprocess.run(
        [sys.executable, *args],
        input=input,
        capture_output=True,
        text=True,
        timeout=50,
        cwd=REPO,
        env={
            **os.environ,
            **(env or {}),
            "PYTHONPATH": os.pathsep.join([str(REPO), *map(str, path)]),
        },
    )


def write_module_that_counts_its_imports(directory, name):
    """A module whose every import appends the importing pid to ``<name>.imports``."""
    marker = directory / f"{name}.imports"
    (directory / f"{name}.py").write_text(
        f"import os\nwith open({str(marker)!r}, 'a') as f:\n    f.write(f'{{os.getpid()}}\\n')\n"
    )
    return lambda: len(marker.read_text().split()) if marker.exists() else 0


@pytest.mark.timeout(60)
def test_the_users_script_is_imported_once_in_the_forkserver_not_in_every_worker(tmp_path):
    imports = write_module_that_counts_its_imports(tmp_path, "side_effect")
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, signal
            import numpy as np
            from multienv import MultiEnv  # at the top, as scripts do: imported in mid-preload
            from tests.envs import CountingEnv
            import side_effect  # a top-level import, like `import torch`

            if __name__ == "__main__":
                with MultiEnv([CountingEnv] * 3) as envs:
                    envs.reset(seed=0)
                    os.kill(envs.envs[1].pid, signal.SIGKILL)
                    envs.step(np.zeros(3, dtype=np.int64))  # respawns env 1
                    assert envs.envs[1].restarts == 1
            """
        )
    )
    done = run_python([str(script)], path=[tmp_path])
    assert done.returncode == 0, done.stderr[-2000:]
    # The script itself, then the forkserver; before, each of the 4 workers imported it again.
    assert imports() == 2


@pytest.mark.timeout(60)
def test_a_script_read_from_stdin_can_start_workers():
    script = textwrap.dedent(
        """
        import numpy as np
        from multienv import MultiEnv
        from tests.envs import CountingEnv
        with MultiEnv([lambda: CountingEnv(episode_length=3)] * 2) as envs:
            envs.reset(seed=0)
            print(envs.step(np.ones(2, dtype=np.int64))[0].ravel().tolist())
        """
    )
    done = run_python(["-"], input=script)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[1.0, 1.0]"


_PRELOAD_SCRIPT = """
import os, signal, sys
import numpy as np
from multienv import MultiEnv
from tests.envs import CountingEnv

def make_env():
    import env_package  # what gym.make does for an env id: import the env's module
    return CountingEnv()

if __name__ == "__main__":
    n = len(os.sched_getaffinity(0)) + 1  # more workers than cores: a probe goes first
    with MultiEnv([make_env] * n, preload=sys.argv[1:]) as envs:
        envs.reset(seed=0)
        os.kill(envs.envs[1].pid, signal.SIGKILL)
        envs.step(np.zeros(n, dtype=np.int64))  # respawns env 1
        assert envs.envs[1].restarts == 1
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("preload", "expected_imports"), [([], 2), (["env_package"], 1)])
def test_the_envs_module_is_imported_by_the_probe_and_once_for_all_workers(
    tmp_path, preload, expected_imports
):
    imports = write_module_that_counts_its_imports(tmp_path, "env_package")
    script = tmp_path / "train.py"
    script.write_text(_PRELOAD_SCRIPT)
    done = run_python([str(script), *preload], path=[tmp_path])
    assert done.returncode == 0, done.stderr[-2000:]
    # Without preload: the probe worker imports it, then the module server (which every
    # worker and the respawn fork from). With it: the forkserver only.
    assert imports() == expected_imports


@pytest.mark.timeout(60)
def test_preload_after_the_forkserver_started_warns_and_workers_import_the_module(tmp_path):
    imports = write_module_that_counts_its_imports(tmp_path, "env_package")
    script = textwrap.dedent(
        """
        import logging
        from multienv import SubprocessEnv
        from tests.envs import CountingEnv

        def make_env():
            import env_package
            return CountingEnv()

        logging.basicConfig()
        for preload in ([], ["env_package"]):
            env = SubprocessEnv(make_env, preload=preload)
            env.start()
            env.initialize()
            env.close()
        """
    )
    done = run_python(["-"], input=script, path=[tmp_path])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "preload ['env_package']: the forkserver of this process started earlier" in done.stderr
    # The first worker, then the module server (started with the next launch), which the
    # second worker forks from.
    assert imports() == 2


@pytest.mark.timeout(60)
def test_a_preloaded_module_that_raises_leaves_the_forkserver_serving(tmp_path):
    (tmp_path / "broken_package.py").write_text("raise RuntimeError('broken at import')\n")
    script = textwrap.dedent(
        """
        from multienv import EnvError, SubprocessEnv
        from tests.envs import CountingEnv

        def make_broken():
            import broken_package
            return CountingEnv()

        broken = SubprocessEnv(make_broken, preload=["broken_package"])
        broken.start()
        try:
            broken.initialize()
        except EnvError as error:
            print("EnvError:", error)
        broken.close()
        healthy = SubprocessEnv(CountingEnv)
        healthy.start()
        healthy.initialize()
        print("reset:", healthy.reset(seed=0)[0].tolist())
        healthy.close()
        """
    )
    done = run_python(["-"], input=script, path=[tmp_path])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "env_fn raised RuntimeError in its worker (pid" in done.stdout
    assert "): broken at import;" in done.stdout
    assert "reset: [0.0]" in done.stdout


@pytest.mark.parametrize(
    ("preload", "error", "message"),
    [
        ("numpy", TypeError, r"env 0: preload must be a list of module names.*got 'numpy'"),
        ([1], TypeError, r"env 0: preload must be a list of module names.*got \[1\]"),
        (
            ["no_such_package.envs"],
            ModuleNotFoundError,
            r"env 0: preload names 'no_such_package.envs', but no module 'no_such_package'",
        ),
    ],
)
def test_bad_preload_is_rejected_before_anything_starts(preload, error, message):
    before = live_workers(wait_s=0)
    with pytest.raises(error, match=message):
        SubprocessEnv(CountingEnv, preload=preload)
    assert live_workers(wait_s=0) == before


@pytest.mark.timeout(60)
def test_a_script_that_starts_envs_at_its_top_level_gets_one_error_before_any_worker(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(
        textwrap.dedent(
            """
            from multienv import MultiEnv, RestartPolicy
            from tests.envs import CountingEnv
            envs = MultiEnv([CountingEnv], restart_policy=RestartPolicy(max_restarts=1))
            """
        )
    )
    done = run_python([str(script)])
    assert done.returncode == 1
    # The module server found it importing the script: no worker started, none respawned.
    assert "MissingMainGuardError: your script starts envs at its top level" in done.stderr
    assert f"({script}, line 4: envs = MultiEnv(" in done.stderr
    assert "EnvCrashLoopError" not in done.stderr
    assert "respawning" not in done.stderr
    assert 'under `if __name__ == "__main__":`' in done.stderr


_WARM_SCRIPT = """
import numpy as np
import multienv
from multienv.backends.subprocess.forking.forkserver import forkserver_thread_env
from tests.envs import CountingEnv

if __name__ == "__main__":
    assert forkserver_thread_env() is None, "started at import"
    multienv.start_forkserver(preload=["env_package"])
    assert forkserver_thread_env() is not None, "not started"
    multienv.start_forkserver(preload=["env_package"])  # idempotent: no second server
    with multienv.MultiEnv([CountingEnv] * 3) as envs:
        envs.reset()
        envs.step(np.zeros(3, dtype=np.int64))
"""


@pytest.mark.timeout(60)
def test_start_forkserver_starts_it_once_with_its_preload_and_nothing_starts_at_import(
    tmp_path,
):
    imports = write_module_that_counts_its_imports(tmp_path, "env_package")
    script = tmp_path / "train.py"
    script.write_text(_WARM_SCRIPT)
    done = run_python([str(script)], path=[tmp_path])
    assert done.returncode == 0, done.stderr[-2000:]
    assert imports() == 1  # in the forkserver only; its 3 workers fork with it loaded


def test_start_forkserver_rejects_a_missing_module_naming_itself():
    import multienv

    with pytest.raises(ModuleNotFoundError, match=r"start_forkserver\(\): preload names"):
        multienv.start_forkserver(preload=["no_such_module_here"])
