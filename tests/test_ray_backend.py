"""What only the Ray backend has: actors, ray.kill, placement, RayOptions, node loss.

The contract every backend shares runs in ``tests/test_layouts.py``. These tests use the
session's local Ray cluster (``ray_cluster`` in conftest) and skip, saying why, when Ray is
not installed. Node loss needs a cluster of its own: it runs in a child process, and is
opt-in (``-m slow``).
"""

import functools
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from gymnasium.vector import SyncVectorEnv

from multienv import (
    EnvCrashedError,
    EnvError,
    MultiEnv,
    RayOptions,
    RemoteTraceback,
    RestartPolicy,
    create_ray_envs,
)
from tests.conftest import STEP_RAISED, live_actors, wait_until_dead
from tests.envs import CountingEnv, RaiseOnStep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def counting_env_rgb():
    return CountingEnv(render_mode="rgb_array")


def test_import_multienv_imports_no_ray():
    code = "import sys, multienv; multienv.RayOptions(num_cpus=1); print('ray' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "False"


def test_bad_ray_options_raise_before_any_actor_starts(ray_cluster):
    with pytest.raises(ValueError, match="max_restarts"):
        MultiEnv(
            [CountingEnv],
            backend="ray",
            ray_options=RayOptions(actor_options={"max_restarts": 3}),
        )
    with pytest.raises(TypeError, match=r"env 0: ray_options must be a multienv\.RayOptions"):
        MultiEnv([CountingEnv], backend="ray", ray_options={"num_cpus": 1})
    with pytest.raises(TypeError, match="context"):
        MultiEnv([CountingEnv], backend="ray", context="fork")  # a subprocess option
    with pytest.raises(ValueError, match="backend must be one of"):
        MultiEnv([CountingEnv], backend="rya")
    assert live_actors() == []


def test_one_env_per_actor_steps_calls_and_renders_like_sync_vector_env(ray_cluster):
    fns = [counting_env_rgb] * 2
    with MultiEnv(fns, backend="ray") as envs:
        ref = SyncVectorEnv(fns)
        assert len({proxy.pid for proxy in envs.envs}) == 2
        obs, infos = envs.reset(seed=4)
        want_obs, want_infos = ref.reset(seed=4)
        np.testing.assert_array_equal(obs, want_obs)
        assert infos["seed_used"].tolist() == want_infos["seed_used"].tolist() == [4, 5]
        for _ in range(7):
            got, want = envs.step(np.ones(2, dtype=np.int64)), ref.step(np.ones(2, dtype=np.int64))
            for got_part, want_part in zip(got[:4], want[:4], strict=True):
                np.testing.assert_array_equal(got_part, want_part)
        assert envs.call("add", 1, b=2) == (3, 3)
        assert envs.get_attr("episode_length") == (5, 5)
        envs.set_attr("scale", [2.0, 3.0])
        _, rewards, *_ = envs.step(np.ones(2, dtype=np.int64))
        assert rewards.tolist() == [2.0, 3.0]
        assert [frame.shape for frame in envs.render()] == [(2, 2, 3)] * 2
        obs.setflags(write=True)  # our arrays, not Ray's read-only buffers
        assert [row["steps"] for row in envs.stats()] == [7, 7]  # one of 8 was a reset
        ref.close()
    assert live_actors() == []


@pytest.mark.fault
def test_ray_kill_of_an_actor_truncates_its_envs_and_a_new_actor_takes_over(ray_cluster):
    with MultiEnv([CountingEnv] * 4, backend="ray", envs_per_worker=2) as envs:
        envs.reset()
        envs.step(np.ones(4, dtype=np.int64))
        old_pid = envs.envs[2].pid
        ray_cluster.kill(envs.envs[2].supervisor.handle._actor, no_restart=True)
        wait_until_dead([old_pid])  # ray.kill returns before the actor is gone
        obs, rewards, _, truncations, infos = envs.step(np.ones(4, dtype=np.int64))
        assert truncations.tolist() == [False, False, True, True]
        assert infos["multienv"]["cause"][2:].tolist() == ["ray.kill", "ray.kill"]
        assert obs[:, 0].tolist() == [2.0, 2.0, 1.0, 1.0]  # the victims' last seen obs
        assert rewards.tolist() == [1.0, 1.0, 0.0, 0.0]
        obs, *_ = envs.step(np.ones(4, dtype=np.int64))  # NextStep: the victims reset
        assert obs[:, 0].tolist() == [3.0, 3.0, 0.0, 0.0]
        assert envs.envs[2].pid not in (None, old_pid)
        assert [row["restarts"] for row in envs.stats()] == [0, 0, 1, 1]
        assert envs.stats()[2]["last_failure"] == "ray.kill"
    assert live_actors() == []


@pytest.mark.fault
def test_env_error_chains_the_actor_traceback_and_the_actor_lives_on(ray_cluster):
    fns = [CountingEnv, functools.partial(RaiseOnStep, at_count=1)]
    with MultiEnv(fns, backend="ray") as envs:
        envs.reset()
        pid = envs.envs[1].pid
        with pytest.raises(EnvError, match=rf"env 1: {STEP_RAISED}: boom") as caught:
            envs.step(np.ones(2, dtype=np.int64))
        assert isinstance(caught.value.__cause__, ValueError)
        assert isinstance(caught.value.__cause__.__cause__, RemoteTraceback)
        assert "tests/envs.py" in str(caught.value.__cause__.__cause__)
        assert envs.envs[1].pid == pid


@pytest.mark.fault
def test_an_actor_no_node_can_place_fails_after_init_timeout_naming_why(ray_cluster):
    with pytest.raises(EnvCrashedError, match=r"env 0: .*init timeout: no node could place"):
        create_ray_envs(
            [CountingEnv],
            ray_options=RayOptions(num_cpus=64),  # the session cluster has 2
            init_timeout=1.0,
            restart_policy=RestartPolicy.never(),
        )
    assert live_actors() == []


@pytest.mark.fault
def test_sigkill_of_an_actor_process_under_send_recv_comes_back_flagged(ray_cluster):
    with MultiEnv([CountingEnv] * 2, backend="ray") as envs:
        envs.reset()
        envs.send(np.ones(2, dtype=np.int64))
        envs.recv()
        os.kill(envs.envs[0].pid, signal.SIGKILL)
        envs.send(np.ones(2, dtype=np.int64))
        _, _, _, truncations, infos = envs.recv()
        order = infos["env_id"].tolist()
        assert dict(zip(order, truncations.tolist(), strict=True)) == {0: True, 1: False}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_node_loss_truncates_that_nodes_envs_and_stepping_goes_on_on_the_others():
    pytest.importorskip("ray", reason='Ray is not installed: pip install -e ".[ray]"')
    out = subprocess.run(
        [sys.executable, "-m", "tests.ray_node_loss"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=220,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["lost_envs"] == result["flagged"]
    assert result["steps_after"] >= 50
