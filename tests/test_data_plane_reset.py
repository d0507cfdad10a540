"""The data plane's reset: ``reset()`` without seeds or per-env options, masked or not.

Real workers throughout; ``hand_overs`` (``conftest``) counts the resets the data plane
handed over and the batches the supervisors finished, which every reset by the pool makes.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
import time

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode

from multienv import EnvError, MultiEnv
from tests.conftest import wait_until_dead
from tests.envs import (
    CountingEnv,
    DictObsEnv,
    FixedLengthEnv,
    HangOnResetOnce,
    QuietSlowReset,
    RaiseOnReset,
)
from tests.test_multi_env import assert_same_tree

pytestmark = pytest.mark.timeout(60)


@contextlib.contextmanager
def side_by_side(fns, envs_per_worker, autoreset_mode, **options):
    """A MultiEnv and a SyncVectorEnv of the same envs and options; both closed after."""
    ours = MultiEnv(fns, envs_per_worker=envs_per_worker, autoreset_mode=autoreset_mode, **options)
    ref = gym.vector.SyncVectorEnv(fns, autoreset_mode=autoreset_mode, **options)
    try:
        yield ours, ref
    finally:
        ours.close()
        ref.close()


def step_then_reset_both(ours, ref, actions, chance, mode, label) -> bool:
    """Step both vectors alike, then reset the same envs of both: whether any was reset.

    The envs reset are those in ``chance`` and, under disabled autoreset, every one that
    ended; each step and reset must give the same tree in both.
    """
    _, _, terminated, truncated, _ = step = ours.step(actions)
    assert_same_tree(list(step), list(ref.step(actions)), f"step {label}")
    mask = chance | (terminated | truncated if mode is AutoresetMode.DISABLED else False)
    if not mask.any():
        return False
    options = {"reset_mask": mask}
    assert_same_tree(ours.reset(options=options), ref.reset(options=options), f"reset {label}")
    return True


@pytest.mark.parametrize(
    ("mode", "envs_per_worker"),
    [
        (AutoresetMode.DISABLED, 1),
        (AutoresetMode.DISABLED, 2),
        (AutoresetMode.DISABLED, 3),
        (AutoresetMode.NEXT_STEP, 2),
        (AutoresetMode.SAME_STEP, 2),
    ],
)
def test_resets_without_seeds_stay_on_the_data_plane_as_sync_vector_env_gives_them(
    hand_overs, mode, envs_per_worker
):
    # Episodes of 1 to 5 steps; each reset's info ({"seed_used": -1}) goes into the info
    # columns. Under disabled autoreset every ended env is reset, with others by chance.
    fns = [lambda n=n: FixedLengthEnv(n) for n in (2, 3, 3, 5, 1, 4)]
    rng = np.random.default_rng(7)
    actions = np.ones(6, dtype=np.int64)
    with side_by_side(fns, envs_per_worker=envs_per_worker, autoreset_mode=mode) as (ours, ref):
        assert_same_tree(ours.reset(seed=3), ref.reset(seed=3), "first reset")
        assert_same_tree(list(ours.step(actions)), list(ref.step(actions)), "first step")
        # Each worker's first reset here registers its reset info's schema: a hand-over.
        assert_same_tree(ours.reset(), ref.reset(), "reset of all")
        before = dict(hand_overs)
        masked = 0
        for t in range(50):
            if t == 25:
                assert_same_tree(ours.reset(), ref.reset(), f"reset of all, step {t}")
            chance = rng.random(6) < 0.3
            masked += step_then_reset_both(ours, ref, actions, chance, mode, str(t))
        assert masked > 20
        assert hand_overs == before  # neither a hand-over nor a batch by the pool


@pytest.mark.parametrize("copy", [True, False])
def test_resets_of_dict_observations_stay_on_the_data_plane_as_sync_vector_env_gives_them(
    hand_overs, copy
):
    # Nested observations (no single array of slots); views of the vector's own arrays
    # when copy=False, which a reset writes into as Gymnasium's vector envs do.
    fns = [DictObsEnv] * 4
    mode = AutoresetMode.DISABLED
    rng = np.random.default_rng(5)
    with side_by_side(fns, envs_per_worker=2, autoreset_mode=mode, copy=copy) as (ours, ref):
        assert_same_tree(ours.reset(seed=1), ref.reset(seed=1), "first reset")
        masked = 0
        for t in range(80):
            if t == 1:  # each worker's step info registered its schema: a hand-over
                before = dict(hand_overs)
            actions = rng.uniform(-1, 1, size=(4, 2)).astype(np.float32)
            chance = rng.random(4) < 0.1
            masked += step_then_reset_both(ours, ref, actions, chance, mode, str(t))
        assert masked > 10
        assert hand_overs == before  # neither a hand-over nor a batch by the pool


def test_a_reset_of_one_worker_gives_the_others_no_deadline(hand_overs):
    # With timeouts, a worker that has nothing to reset must not be late at once.
    with MultiEnv(
        [CountingEnv] * 4, envs_per_worker=2, step_timeout=30.0, reset_timeout=30.0
    ) as envs:
        envs.reset(seed=0)
        actions = np.ones(4, dtype=np.int64)
        envs.step(actions)
        mask = np.array([False, False, True, False])
        # Worker 1's first reset here registers its reset info's schema: a hand-over of a
        # part that skips env 3, answered by a message.
        obs, infos = envs.reset(options={"reset_mask": mask})
        assert obs[:, 0].tolist() == [1.0, 1.0, 0.0, 1.0]
        assert infos["_seed_used"].tolist() == mask.tolist()
        envs.step(actions)
        before = dict(hand_overs)
        obs, infos = envs.reset(options={"reset_mask": mask})
        assert hand_overs == before
        assert obs[:, 0].tolist() == [2.0, 2.0, 0.0, 2.0]
        assert infos["_seed_used"].tolist() == mask.tolist()
        assert [env.restarts for env in envs.envs] == [0] * 4


@pytest.mark.fault
def test_a_worker_killed_in_a_reset_is_respawned_and_the_reset_replayed(hand_overs):
    with MultiEnv([lambda: QuietSlowReset(0.0)] * 4, envs_per_worker=2) as envs:
        envs.reset(seed=0)
        actions = np.ones(4, dtype=np.int64)
        envs.step(actions)
        envs.step(actions)
        envs.set_attr("delay_s", 0.5)  # the next resets take long enough to kill one
        before = hand_overs["hand_over"]
        dead = envs.envs[0].pid
        killer = threading.Timer(0.2, os.kill, (dead, signal.SIGKILL))
        killer.start()
        try:
            obs, infos = envs.reset(options={"reset_mask": np.array([True, False, True, False])})
        finally:
            killer.join()
        wait_until_dead([dead])
        assert hand_overs["hand_over"] == before + 1
        assert obs[:, 0].tolist() == [0.0, 2.0, 0.0, 2.0]  # env 0's reset replayed
        assert infos == {}
        assert envs.envs[0].pid != dead
        assert envs.envs[0].restarts == 1
        # Env 1 lost its episode to the death: its next step is the death's truncation.
        obs, _, terminated, truncated, infos = envs.step(actions)
        assert terminated.tolist() == [False] * 4
        assert truncated.tolist() == [False, True, False, False]
        assert infos["multienv"]["cause"][1] == "SIGKILL"
        assert obs[:, 0].tolist() == [1.0, 2.0, 1.0, 3.0]
        envs.step(actions)  # the fresh worker's step info registers its schema
        after = hand_overs["hand_over"]
        for _ in range(5):
            envs.step(actions)
        assert hand_overs["hand_over"] == after


@pytest.mark.fault
def test_a_worker_with_nothing_to_reset_found_dead_in_a_reset_is_respawned(hand_overs):
    with MultiEnv([lambda: CountingEnv(episode_length=100)] * 4, envs_per_worker=2) as envs:
        envs.reset(seed=0)
        actions = np.ones(4, dtype=np.int64)
        envs.step(actions)
        envs.reset()  # each worker's reset info schema, registered
        envs.step(actions)
        before = hand_overs["hand_over"]
        dead = envs.envs[2].pid
        os.kill(dead, signal.SIGKILL)
        wait_until_dead([dead])
        obs, infos = envs.reset(options={"reset_mask": np.array([True, False, False, False])})
        assert hand_overs["hand_over"] == before + 1
        assert obs[:, 0].tolist() == [0.0, 1.0, 1.0, 1.0]
        assert infos["_seed_used"].tolist() == [True, False, False, False]
        assert envs.envs[2].pid != dead
        assert [env.restarts for env in envs.envs] == [0, 0, 1, 1]
        # Envs 2 and 3 lost their episodes: the next step is the death's truncation.
        obs, _, _, truncated, infos = envs.step(actions)
        assert truncated.tolist() == [False, False, True, True]
        assert infos["multienv"]["cause"][2:].tolist() == ["SIGKILL", "SIGKILL"]
        assert obs[:, 0].tolist() == [1.0, 2.0, 1.0, 1.0]


@pytest.mark.fault
def test_a_reset_hanging_past_reset_timeout_is_killed_and_replayed(hand_overs, tmp_path):
    marker = tmp_path / "hang"
    marker.touch()  # no hang until it is removed
    with MultiEnv(
        [lambda: HangOnResetOnce(str(marker))] * 4, envs_per_worker=2, reset_timeout=1.0
    ) as envs:
        envs.reset(seed=0)
        envs.reset()  # each worker's reset info schema, registered
        before = hand_overs["hand_over"]
        hung = envs.envs[2].pid
        marker.unlink()  # the next reset anywhere hangs, once
        began = time.monotonic()
        obs, infos = envs.reset(options={"reset_mask": np.array([False, False, True, False])})
        elapsed = time.monotonic() - began
        assert 1.0 <= elapsed < 10.0
        assert hand_overs["hand_over"] == before + 1
        assert obs[:, 0].tolist() == [0.0] * 4
        assert infos["_seed_used"].tolist() == [False, False, True, False]
        assert envs.envs[2].pid != hung
        assert envs.envs[2].restarts == 1
        assert "timeout" in envs.envs[2].last_failure


def test_an_error_in_a_reset_names_the_env_and_the_others_reset(hand_overs):
    fns = [CountingEnv, lambda: RaiseOnReset(ok=2), CountingEnv, CountingEnv]
    with MultiEnv(fns, envs_per_worker=2) as envs:
        envs.reset(seed=0)
        envs.reset()  # RaiseOnReset's last good reset; the schemas registered
        actions = np.ones(4, dtype=np.int64)
        envs.step(actions)
        before = hand_overs["hand_over"]
        pids = [env.pid for env in envs.envs]
        with pytest.raises(EnvError, match="reset boom") as raised:  # env 0 left out
            envs.reset(options={"reset_mask": np.array([False, True, False, True])})
        assert raised.value.env_index == 1
        assert "env 1" in str(raised.value)
        assert hand_overs["hand_over"] == before + 1
        assert [env.pid for env in envs.envs] == pids  # an env's error kills no worker
        obs, *_ = envs.step(actions)
        assert obs[[0, 2, 3], 0].tolist() == [2.0, 2.0, 1.0]


def test_ctrl_c_in_a_reset_leaves_the_vector_stepping_on():
    def interrupt(*_):
        raise KeyboardInterrupt

    with MultiEnv([lambda: QuietSlowReset(0.0)] * 2, envs_per_worker=1) as envs:
        envs.reset(seed=0)
        actions = np.ones(2, dtype=np.int64)
        envs.step(actions)
        envs.set_attr("delay_s", 0.3)
        previous = signal.signal(signal.SIGALRM, interrupt)
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.1)
            with pytest.raises(KeyboardInterrupt):
                envs.reset(options={"reset_mask": np.array([True, False])})
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        obs, rewards, *_ = envs.step(actions)
        # The interrupted reset ran in env 0 and was dropped; this step follows it.
        assert obs[:, 0].tolist() == [1.0, 2.0]
        assert rewards.tolist() == [1.0, 1.0]


def test_reset_async_and_reset_wait_take_the_data_plane_too(hand_overs):
    fns = [lambda n=n: FixedLengthEnv(n) for n in (2, 3, 3, 5)]
    mode = AutoresetMode.DISABLED
    actions = np.ones(4, dtype=np.int64)
    with side_by_side(fns, envs_per_worker=2, autoreset_mode=mode) as (ours, ref):
        assert_same_tree(ours.reset(seed=3), ref.reset(seed=3), "first reset")
        assert_same_tree(list(ours.step(actions)), list(ref.step(actions)), "first step")
        assert_same_tree(ours.reset(), ref.reset(), "reset of all")  # schemas registered
        before = dict(hand_overs)
        for t in range(12):
            _, _, terminated, truncated, _ = step = ours.step(actions)
            assert_same_tree(list(step), list(ref.step(actions)), f"step {t}")
            mask = terminated | truncated
            if mask.any():
                ours.reset_async(options={"reset_mask": mask})
                assert ours._data_plane.is_in_flight()
                reset = ours.reset_wait(timeout=10)
                assert_same_tree(reset, ref.reset(options={"reset_mask": mask}), str(t))
        assert hand_overs == before


def test_reset_wait_timeout_keeps_the_data_plane_reset_in_flight():
    with MultiEnv([lambda: QuietSlowReset(0.0)] * 2) as envs:
        envs.reset(seed=0)
        actions = np.ones(2, dtype=np.int64)
        envs.step(actions)
        envs.set_attr("delay_s", 0.3)
        envs.reset_async(options={"reset_mask": np.array([False, True])})
        assert envs._data_plane.is_in_flight()
        with pytest.raises(multiprocessing.TimeoutError):
            envs.reset_wait(timeout=0.05)
        obs, _ = envs.reset_wait(timeout=10)
        assert obs[:, 0].tolist() == [1.0, 0.0]
        obs, *_ = envs.step(actions)
        assert obs[:, 0].tolist() == [2.0, 1.0]
