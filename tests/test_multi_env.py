import os
import platform
import signal
import threading
import traceback

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.error import ClosedEnvironmentError
from gymnasium.vector import AutoresetMode, SyncVectorEnv, VectorEnv
from gymnasium.vector.utils import batch_space

from multienv import (
    EnvCrashedError,
    EnvStateError,
    MultiEnv,
    RestartPolicy,
    create_subprocess_envs,
)
from tests.conftest import live_workers, wait_until_dead
from tests.envs import (
    BoxActionEnv,
    CountingEnv,
    DictObsEnv,
    FragmentingEnv,
    FrameDictObsEnv,
    SegfaultOnceOnStep,
    SlowReset,
)

MODES = list(AutoresetMode)


def cartpole():
    return gym.make("CartPole-v1")


def assert_same_tree(a, b, where):
    if isinstance(a, tuple | list):
        assert len(a) == len(b), where
        for position, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_tree(x, y, f"{where}[{position}]")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same_tree(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, np.ndarray) and a.dtype == object:
        assert len(a) == len(b), where
        for x, y in zip(a, b, strict=True):
            assert_same_tree(x, y, where)
    else:
        np.testing.assert_array_equal(a, b, err_msg=where)


def run_side_by_side(factory, mode, steps, num_envs=4, seed=7, **options):
    """Step MultiEnv and SyncVectorEnv with the same actions; return how many episodes ended."""
    fns = [factory] * num_envs
    ours = MultiEnv(fns, autoreset_mode=mode, **options)
    ref = SyncVectorEnv(fns, autoreset_mode=mode)
    ended = 0
    try:
        assert_same_tree(ours.reset(seed=seed), ref.reset(seed=seed), "reset")
        ref.action_space.seed(seed)
        for t in range(steps):
            actions = ref.action_space.sample()
            got, want = ours.step(actions), ref.step(actions)
            assert_same_tree(list(got), list(want), f"{mode} step {t}")
            done = want[2] | want[3]
            ended += int(done.sum())
            if mode is AutoresetMode.DISABLED and done.any():
                options = {"reset_mask": done}
                assert_same_tree(
                    ours.reset(options=dict(options)), ref.reset(options=dict(options)), f"mask {t}"
                )
    finally:
        ours.close()
        ref.close()
    return ended


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_cartpole_matches_sync_vector_env_step_by_step(mode):
    assert run_side_by_side(cartpole, mode, steps=500) > 10


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_dict_observations_match_sync_vector_env_step_by_step(mode):
    assert run_side_by_side(DictObsEnv, mode, steps=500) > 10


def test_is_a_gymnasium_vector_env_with_batched_spaces():
    with MultiEnv([cartpole] * 3, autoreset_mode="SameStep") as envs:
        assert isinstance(envs, VectorEnv)
        assert envs.num_envs == 3
        assert envs.single_observation_space == cartpole().observation_space
        assert envs.observation_space.shape == (3, 4)
        assert envs.action_space.shape == (3,)
        assert envs.metadata["autoreset_mode"] is AutoresetMode.SAME_STEP
        assert len(envs.envs) == 3
        assert all(e.pid for e in envs.envs)
    assert envs.closed
    assert live_workers() == []


def test_box_bounds_are_held_once_for_all_envs_and_the_batch():
    # Atari frames would otherwise cost 400 KiB of bounds per env, and as much again per
    # env in the batched space (about 50 MiB in the parent at N=64).
    # Small Boxes (under 1,024 elements) are held per env, writable, as SyncVectorEnv's.
    with MultiEnv([FrameDictObsEnv] * 3, envs_per_worker=2) as envs:
        boxes = [proxy.observation_space["frame"] for proxy in envs.envs]
        assert all(box.low is boxes[0].low and box.high is boxes[0].high for box in boxes)
        assert all(box.bounded_below is boxes[0].bounded_below for box in boxes)
        assert envs.observation_space == batch_space(envs.single_observation_space, 3)
        batched = envs.observation_space["frame"]
        assert batched.low.shape == (3, *envs.single_observation_space["frame"].shape)
        assert np.shares_memory(batched.low, boxes[0].low)
        assert np.shares_memory(batched.bounded_above, boxes[0].bounded_above)
        with pytest.raises(ValueError, match="read-only"):
            boxes[1].low[0, 0, 0] = 1  # shared: a write would change every env's bounds
        small = [proxy.observation_space["position"] for proxy in envs.envs]
        assert small[0].low is not small[1].low
        assert envs.observation_space["position"].low.flags.writeable
        assert envs.observation_space.contains(envs.observation_space.sample())
        assert envs.observation_space.contains(envs.reset(seed=0)[0])


def private_mib(pid):
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return sum(int(line.split()[1]) for line in f if line.startswith("Private_")) / 1024


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
@pytest.mark.parametrize("seed", [0, None], ids=["pickled-batch", "fast-batch"])
def test_a_worker_gives_back_the_memory_its_envs_freed_in_a_reset(seed):
    # Each FragmentingEnv leaves 31 MiB freed in the worker's heap at each reset. Unless the
    # worker trims it after a reset, it stays resident: 42 MiB measured for the worker of
    # the two envs here, against 11-12 trimmed (CPython 3.11, two-core machine).
    with MultiEnv([FragmentingEnv] * 2, envs_per_worker=2) as envs:
        envs.reset(seed=seed)
        envs.step(np.ones(2, dtype=np.int64))  # the worker trims after a reset's reply
        assert private_mib(envs.envs[0].pid) < 25


def test_reset_seeds_int_list_and_mask():
    with MultiEnv([CountingEnv] * 3) as envs:
        _, infos = envs.reset(seed=10)
        assert infos["seed_used"].tolist() == [10, 11, 12]
        _, infos = envs.reset(seed=[5, None, 6])
        assert infos["seed_used"].tolist() == [5, -1, 6]
        envs.step(np.array([1, 1, 1]))
        obs, infos = envs.reset(options={"reset_mask": np.array([False, True, False])})
        assert obs[:, 0].tolist() == [1.0, 0.0, 1.0]
        assert infos["_seed_used"].tolist() == [False, True, False]
        with pytest.raises(ValueError, match="3 envs"):
            envs.reset(seed=[1, 2])
        with pytest.raises(TypeError, match="reset_mask"):
            envs.reset(options={"reset_mask": [True, False, True]})


def test_step_async_and_step_wait():
    with MultiEnv([CountingEnv] * 2) as envs:
        envs.reset()
        envs.step_async(np.array([1, 0]))
        with pytest.raises(EnvStateError, match="pending"):
            envs.step(np.array([1, 0]))
        obs, rewards, *_ = envs.step_wait(timeout=10)
        assert obs[:, 0].tolist() == [1.0, 1.0]
        assert rewards.tolist() == [1.0, 0.0]
        with pytest.raises(EnvStateError, match="without any prior call to `step_async`"):
            envs.step_wait()


def test_call_get_attr_set_attr_render():
    with MultiEnv([lambda: CountingEnv(render_mode="rgb_array")] * 2) as envs:
        envs.reset()
        assert envs.call("add", 1, b=2) == (3, 3)
        assert envs.get_attr("episode_length") == (5, 5)
        envs.set_attr("scale", [2.0, 3.0])
        assert envs.step(np.array([1, 1]))[1].tolist() == [2.0, 3.0]
        assert [frame.shape for frame in envs.render()] == [(2, 2, 3)] * 2
        with pytest.raises(ValueError, match="one value per env"):
            envs.set_attr("scale", [1.0])


def test_wrong_number_of_actions_raises_before_sending():
    with MultiEnv([CountingEnv] * 3) as envs:
        envs.reset()
        with pytest.raises(ValueError, match=r"expected 3 actions \(one per env"):
            envs.step(np.array([1, 1]))
        assert [e.steps for e in envs.envs] == [0, 0, 0]


def test_wrong_action_shape_names_the_env():
    with MultiEnv([BoxActionEnv] * 3) as envs:
        envs.reset()
        bad = [np.zeros(2), np.zeros(2), np.zeros(3)]
        with pytest.raises(ValueError, match=r"env 2: action has shape \(3,\); expected \(2,\)"):
            envs.step(bad)
        with pytest.raises(ValueError, match=r"expected 3 actions"):
            envs.step(np.zeros((2, 2)))
        assert [e.steps for e in envs.envs] == [0, 0, 0]
        assert envs.step(np.zeros((3, 2), dtype=np.float32))[1].tolist() == [0.0, 0.0, 0.0]


def test_float_actions_for_discrete_space_are_rejected():
    with MultiEnv([CountingEnv] * 2) as envs:
        envs.reset()
        with pytest.raises(ValueError, match="integer actions"):
            envs.step(np.array([0.5, 1.0]))


def test_mismatched_spaces_name_the_first_differing_env_and_leave_no_worker():
    fns = [CountingEnv, CountingEnv, BoxActionEnv]
    with pytest.raises(ValueError, match=r"env 2: observation_space .* differs from env 0"):
        MultiEnv(fns)
    assert live_workers() == []


def test_unpicklable_env_fn_names_the_env_and_leaves_no_worker():
    lock = threading.Lock()
    with pytest.raises(TypeError, match="env 1: env_fn") as raised:
        MultiEnv([CountingEnv, lambda: lock and CountingEnv()])
    assert live_workers() == []
    # The caller's line and the re-raise only: none of multienv's frames, nor the pickler's.
    frames = traceback.extract_tb(raised.value.__traceback__)
    assert len(frames) <= 2, frames
    assert raised.value.__cause__.__traceback__ is None


def test_ready_proxies_are_adopted_and_options_with_them_are_rejected():
    proxies = create_subprocess_envs([CountingEnv] * 2)
    with pytest.raises(TypeError, match="options apply only"):
        MultiEnv(proxies, step_timeout=1.0)
    with MultiEnv(proxies) as envs:
        assert envs.reset()[0].shape == (2, 1)


def test_calls_after_close_raise_closed_environment_error():
    envs = MultiEnv([CountingEnv])
    envs.close()
    with pytest.raises(ClosedEnvironmentError):
        envs.reset()


@pytest.mark.fault
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_step_after_sigkill_returns_flagged_truncation_and_goes_on(mode):
    with MultiEnv([cartpole] * 4, autoreset_mode=mode) as envs:
        obs, _ = envs.reset(seed=0)
        actions = np.zeros(4, dtype=np.int64)
        for _ in range(5):
            obs, *_ = envs.step(actions)
        seen = obs[2].copy()
        old_pid = envs.envs[2].pid
        os.kill(old_pid, signal.SIGKILL)
        obs, rewards, terminations, truncations, infos = envs.step(actions)
        assert obs.shape == (4, 4)
        assert truncations.tolist() == [False, False, True, False]
        assert not terminations[2]
        assert rewards[2] == 0.0
        flag = infos["multienv"]
        assert flag["_restarted"].tolist() == [False, False, True, False]
        assert flag["cause"][2] == "SIGKILL"
        assert flag["restarts"][2] == 1
        if mode is AutoresetMode.SAME_STEP:
            np.testing.assert_array_equal(infos["final_obs"][2], seen)
        else:
            np.testing.assert_array_equal(obs[2], seen)
        if mode is AutoresetMode.DISABLED:
            envs.reset(options={"reset_mask": truncations})
        assert envs.envs[2].pid != old_pid
        for _ in range(300):
            obs, rewards, terminations, truncations, infos = envs.step(actions)
            if mode is AutoresetMode.DISABLED and (terminations | truncations).any():
                envs.reset(options={"reset_mask": terminations | truncations})
        assert envs.stats()[2]["restarts"] == 1


@pytest.mark.fault
def test_segfaulting_env_is_respawned_and_step_returns_truncation(tmp_path):
    marker = str(tmp_path / "segv")
    with MultiEnv([lambda: SegfaultOnceOnStep(marker, at_count=3)] * 2) as envs:
        envs.reset()
        for _ in range(2):
            envs.step(np.array([1, 1]))
        _, _, _, truncations, infos = envs.step(np.array([1, 1]))
        crashed = int(np.flatnonzero(truncations)[0])
        assert truncations.sum() == 1
        assert infos["multienv"]["cause"][crashed] == "SIGSEGV"
        for _ in range(200):
            envs.step(np.array([1, 1]))
        assert envs.stats()[crashed]["restarts"] == 1


@pytest.mark.fault
def test_worker_killed_during_reset_is_replayed():
    with MultiEnv([lambda: SlowReset(0.5)] * 2) as envs:
        victim = envs.envs[1].pid
        timer = threading.Timer(0.2, os.kill, (victim, signal.SIGKILL))
        timer.start()
        obs, infos = envs.reset(seed=3)
        timer.join()
        assert obs[:, 0].tolist() == [0.0, 0.0]
        assert infos["seed_used"].tolist() == [3, 4]
        assert envs.envs[1].pid != victim
        assert envs.stats()[1]["restarts"] == 1
        for _ in range(20):
            envs.step(np.array([0, 1]))


def test_multi_env_imports_no_transport():
    # MultiEnv talks to workers through multienv.proxy only: no pipes, pids or signals.
    import ast
    import pathlib

    import multienv.vector.multi_env

    tree = ast.parse(pathlib.Path(multienv.vector.multi_env.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module)
    forbidden = {"os", "select", "signal", "multiprocessing", "subprocess"}
    forbidden |= {"multienv.backends.subprocess.subprocess_env", "multienv.worker.worker"}
    forbidden |= {"multienv.wire.shared_memory"}
    assert not {name for name in imported if name.split(".")[0] in forbidden or name in forbidden}


def test_unknown_backend_is_rejected_before_anything_starts():
    with pytest.raises(ValueError, match=r"backend must be one of \['ray', 'subprocess'\]"):
        MultiEnv([CountingEnv] * 2, backend="nope")
    assert live_workers() == []


@pytest.mark.fault
@pytest.mark.timeout(60)
def test_a_worker_killed_before_the_vector_links_it_is_respawned_and_linked():
    # The vector sends every worker its ATTACH before it joins them one by one
    # (FanOut.link_workers): a dead one is found at its join, respawned and linked.
    proxies = create_subprocess_envs([CountingEnv] * 3)
    killed = proxies[1].pid
    os.kill(killed, signal.SIGKILL)
    wait_until_dead([killed])
    with MultiEnv(proxies) as envs:
        assert envs.envs[1].pid != killed
        assert envs.envs[1].restarts == 1
        assert all(p.supervisor.handle.is_linked for p in proxies)
        envs.reset(seed=0)
        obs, *_ = envs.step(np.ones(3, dtype=np.int64))
        assert obs[:, 0].tolist() == [1.0, 1.0, 1.0]


@pytest.mark.fault
@pytest.mark.timeout(60)
def test_ready_envs_a_vector_failed_to_link_still_answer():
    # The vector sends every worker its ATTACH before it joins any. When one join fails (a
    # dead worker that may not be respawned), the workers after it must not be left half
    # attached: the caller still owns these envs.
    proxies = create_subprocess_envs(
        [CountingEnv] * 3, restart_policy=RestartPolicy(max_restarts=0)
    )
    try:
        killed = proxies[0].pid
        os.kill(killed, signal.SIGKILL)
        wait_until_dead([killed])
        with pytest.raises(EnvCrashedError):
            MultiEnv(proxies)
        for proxy in proxies[1:]:
            proxy.reset(seed=0)
            assert proxy.step(1)[0].tolist() == [1.0]
    finally:
        for proxy in proxies:
            proxy.close()


def test_env_fns_by_keyword_as_async_vector_env_takes_them():
    with MultiEnv(env_fns=[CountingEnv] * 2) as envs:
        obs, _ = envs.reset(seed=0)
        assert obs.shape == (2, 1)
    with pytest.raises(TypeError, match="takes its envs once"):
        MultiEnv([CountingEnv], env_fns=[CountingEnv])
    with pytest.raises(TypeError, match="takes its envs once"):
        MultiEnv()


def test_the_objects_of_the_step_keep_their_attribute_lookups_fast():
    """CPython shares at most 30 instance keys per class (``SHARED_KEYS_MAX_SIZE``): past
    that, every ``self.x`` lookup takes the slow way. A 30th attribute of the vector cost 313
    instructions per step of 64 CartPoles (``scripts/count_instructions.py``); slots on the
    data plane (53 attributes) saved 1,800. Group new state in an object, or add a slot."""
    with MultiEnv([CountingEnv] * 2) as envs:
        plane = envs._data_plane
        assert plane is not None
        assert not hasattr(plane, "__dict__")  # slots: the one-pass step's own state
        assert not hasattr(plane.parts, "__dict__")
        supervisor = envs.envs[0].supervisor
        for owner in (envs, envs._assembly, envs._link, supervisor, supervisor.handle):
            assert len(vars(owner)) < 30, (type(owner).__name__, sorted(vars(owner)))
