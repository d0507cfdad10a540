"""Worker recycling (``RecyclePolicy``): fresh workers at episode boundaries, memory caps.

A recycle must be invisible in the data: the tests step a recycling MultiEnv side by side
with SyncVectorEnv (the replacement env takes over the old one's RNG, so seeded runs stay
equal) and check that nothing is truncated, that every worker was replaced, and that the
recycled resets say so in ``info["multienv"]``.
"""

import functools
import logging
import os
import signal
import time

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode, SyncVectorEnv

from multienv import MultiEnv, RecyclePolicy
from multienv.wire.procfs import resident_mb
from multienv.worker.worker import OS_NAME_PREFIX
from tests.conftest import Layout, descendant_workers, live_workers, wait_until_dead
from tests.envs import CountingEnv, FixedLengthEnv, LeakyEnv, NoisyFixedLengthEnv

MODES = list(AutoresetMode)


def cartpole():
    return gym.make("CartPole-v1")


def strip_multienv(info):
    """An info dict without multienv's own keys, nested ones included."""
    clean = {}
    for key, value in info.items():
        if key.lstrip("_") == "multienv":
            continue
        clean[key] = strip_multienv(value) if isinstance(value, dict) else value
    return clean


def assert_same(got, want, where):
    for name, a, b in zip(("obs", "reward", "terminated", "truncated"), got, want, strict=False):
        np.testing.assert_allclose(
            np.asarray(a, float), np.asarray(b, float), err_msg=f"{where} {name}"
        )
    got_info, want_info = strip_multienv(got[4]), strip_multienv(want[4])
    assert sorted(got_info) == sorted(want_info), where
    if "final_obs" in want_info:
        mask = want_info["_final_obs"]
        assert got_info["_final_obs"].tolist() == mask.tolist(), where
        for i in np.flatnonzero(mask):
            np.testing.assert_allclose(got_info["final_obs"][i], want_info["final_obs"][i])


CASES = [
    *[(Layout("subprocess", 1), mode, cartpole) for mode in MODES],
    # Several envs per worker are recycled when all of them end together: fixed lengths.
    # These envs draw from np_random on every step too, so a generator taken over at the
    # wrong moment shows in the observations.
    *[(Layout("subprocess", 3), mode, functools.partial(NoisyFixedLengthEnv, 4)) for mode in MODES],
    (Layout("ray", 3), AutoresetMode.NEXT_STEP, functools.partial(NoisyFixedLengthEnv, 4)),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("layout", "mode", "factory"),
    CASES,
    indirect=["layout"],
    ids=[f"{c[0].backend}-k{c[0].k}-{c[1].value}" for c in CASES],
)
def test_recycling_is_invisible_next_to_sync_vector_env(layout, mode, factory):
    n = 6
    fns = [factory] * n
    # k + 1 episodes: the replacement starts after the first boundary and the swap follows
    # the second, so the step that ends the budget brings the generators back itself.
    policy = RecyclePolicy(max_episodes=layout.k + 1)
    ours = MultiEnv(fns, autoreset_mode=mode, recycle=policy, **layout.options)
    ref = SyncVectorEnv(fns, autoreset_mode=mode)
    try:
        first_pids = {proxy.pid for proxy in ours.envs}
        got, want = ours.reset(seed=3), ref.reset(seed=3)
        np.testing.assert_allclose(got[0], want[0])
        ref.action_space.seed(3)
        flagged = 0
        for t in range(400):
            if min(row["recycles"] for row in ours.stats()) >= 2:
                break
            actions = ref.action_space.sample()
            got, want = ours.step(actions), ref.step(actions)
            assert_same(got, want, f"step {t}")
            assert "restarted" not in got[4].get("multienv", {})
            if "multienv" in got[4]:
                recycled = got[4]["multienv"]["_recycled"]
                assert set(got[4]["multienv"]["reason"][recycled]) == {"max_episodes"}
                flagged += int(recycled.sum())
            if mode is AutoresetMode.DISABLED and (want[2] | want[3]).any():
                mask = want[2] | want[3]
                got_reset = ours.reset(options={"reset_mask": mask})
                want_reset = ref.reset(options={"reset_mask": mask})
                np.testing.assert_allclose(got_reset[0], want_reset[0])
                if "multienv" in got_reset[1]:
                    flagged += int(got_reset[1]["multienv"]["_recycled"].sum())
        stats = ours.stats()
        assert all(row["recycles"] >= 2 for row in stats), stats
        assert all(row["restarts"] == 0 for row in stats), stats
        assert flagged == sum(row["recycles"] for row in stats)
        assert first_pids.isdisjoint({proxy.pid for proxy in ours.envs})
    finally:
        ours.close()
        ref.close()
    assert layout.live() == []


@pytest.mark.timeout(60)
def test_step_budget_recycles_and_logs_at_info_only(caplog):
    with caplog.at_level(logging.INFO, logger="multienv"):
        with MultiEnv(
            [functools.partial(FixedLengthEnv, 5)] * 2, recycle=RecyclePolicy(max_steps=10)
        ) as envs:
            envs.reset(seed=0)
            reasons = []
            for _ in range(24):
                infos = envs.step(np.zeros(2, dtype=np.int64))[4]
                if "multienv" in infos:
                    reasons += list(infos["multienv"]["reason"][infos["multienv"]["_recycled"]])
            assert [row["recycles"] for row in envs.stats()] == [2, 2]
    assert set(reasons) == {"max_steps"}
    recycled = [r for r in caplog.records if "recycled worker" in r.message]
    assert len(recycled) == 4
    assert all(r.levelno == logging.INFO for r in recycled)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.timeout(60)
def test_memory_cap_recycles_a_leaking_worker_at_the_boundary():
    baseline = resident_mb()
    assert baseline is not None
    policy = RecyclePolicy(max_rss_mb=60 + 20, check_every_s=0.01)
    env = functools.partial(LeakyEnv, mb_per_step=4, episode_length=5)
    with MultiEnv([env], recycle=policy) as envs:
        envs.reset(seed=0)
        start_rss = resident_mb(envs.envs[0].pid)
        assert start_rss is not None
        assert start_rss < policy.max_rss_mb, "the worker starts above the cap; raise it"
        reasons, pids = [], set()
        for _ in range(60):
            _obs, _rewards, _terminated, truncated, infos = envs.step(np.zeros(1, dtype=np.int64))
            assert not truncated.any()
            pids.add(envs.envs[0].pid)
            if "multienv" in infos:
                reasons.append(infos["multienv"]["reason"][0])
                assert infos["multienv"]["recycled"][0]
        assert set(reasons) == {"max_rss_mb"}
        assert envs.stats()[0]["recycles"] == len(reasons) >= 2
        assert len(pids) == len(reasons) + 1


@pytest.mark.timeout(60)
def test_hard_memory_cap_kills_mid_episode_as_a_death_with_cause_rss():
    policy = RecyclePolicy(hard_rss_mb=200, check_every_s=0.01)
    env = functools.partial(LeakyEnv, mb_per_step=20, episode_length=1000)
    with MultiEnv([env, CountingEnv], recycle=policy) as envs:
        envs.reset(seed=0)
        causes = []
        for _ in range(40):
            _obs, _rewards, terminated, truncated, infos = envs.step(np.zeros(2, dtype=np.int64))
            assert not terminated[0]
            assert not truncated[1]
            if truncated[0]:
                assert infos["multienv"]["restarted"][0]
                causes.append(infos["multienv"]["cause"][0])
        assert causes
        assert set(causes) == {"rss"}
        stats = envs.stats()
        assert stats[0]["restarts"] == len(causes)
        assert stats[0]["last_failure"] == "rss"
        assert stats[1]["restarts"] == 0


def test_recycle_policy_rejects_meaningless_limits():
    with pytest.raises(ValueError, match="max_episodes must be > 0"):
        RecyclePolicy(max_episodes=0)
    with pytest.raises(ValueError, match=r"hard_rss_mb .* must be above max_rss_mb"):
        RecyclePolicy(max_rss_mb=500, hard_rss_mb=400)
    with pytest.raises(ValueError, match="check_every_s"):
        RecyclePolicy(check_every_s=0)


@pytest.mark.timeout(60)
def test_a_death_while_a_replacement_waits_respawns_into_it_and_leaves_nothing_behind():
    # max_episodes=1: the replacement is started with the worker, so one always waits.
    fns = [functools.partial(FixedLengthEnv, 50)] * 2
    with MultiEnv(fns, recycle=RecyclePolicy(max_episodes=1)) as envs:
        envs.reset(seed=0)
        envs.step(np.zeros(2, dtype=np.int64))
        victim = envs.envs[0].pid
        os.kill(victim, signal.SIGKILL)
        _obs, _rewards, _terminated, truncated, infos = envs.step(np.zeros(2, dtype=np.int64))
        assert truncated.tolist() == [True, False]
        assert infos["multienv"]["cause"][0] == "SIGKILL"
        assert envs.envs[0].pid != victim
        for _ in range(120):  # episodes end, workers are recycled, the run goes on
            envs.step(np.zeros(2, dtype=np.int64))
        stats = envs.stats()
        assert [row["restarts"] for row in stats] == [1, 0]
        assert all(row["recycles"] >= 2 for row in stats), stats
    assert live_workers() == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("delay_s", [0.0, 0.002, 0.01, 0.05])
def test_close_while_a_replacement_is_being_launched_leaves_nothing_behind(delay_s):
    # max_episodes=1: the reset already starts the replacement on a background thread, so
    # close() meets it anywhere from forking to building its envs, depending on the delay.
    fns = [functools.partial(FixedLengthEnv, 5)] * 2
    envs = MultiEnv(fns, recycle=RecyclePolicy(max_episodes=1))
    envs.reset(seed=0)
    time.sleep(delay_s)
    began = time.monotonic()
    envs.close()
    assert time.monotonic() - began < 15.0
    assert live_workers() == []


@pytest.mark.timeout(120)
def test_ray_actor_over_the_hard_memory_cap_is_killed_with_cause_rss(ray_cluster):
    policy = RecyclePolicy(hard_rss_mb=400, check_every_s=0.01)
    env = functools.partial(LeakyEnv, mb_per_step=40, episode_length=1000)
    with MultiEnv([env], backend="ray", recycle=policy) as envs:
        envs.reset(seed=0)
        causes = []
        for _ in range(30):
            truncated, infos = envs.step(np.zeros(1, dtype=np.int64))[3:]
            if truncated[0]:
                causes.append(infos["multienv"]["cause"][0])
        assert causes
        assert set(causes) == {"rss"}
        assert envs.stats()[0]["restarts"] == len(causes)


@pytest.mark.timeout(60)
def test_a_replacement_killed_while_it_waits_is_replaced_by_a_fresh_one_at_the_swap():
    # max_episodes=1: the replacement starts with the worker; kill it, then reach a boundary.
    fns = [functools.partial(FixedLengthEnv, 4)]
    with MultiEnv(fns, recycle=RecyclePolicy(max_episodes=1)) as envs:
        envs.reset(seed=0)
        envs.step(np.zeros(1, dtype=np.int64))  # the standby is started before this step
        current = envs.envs[0].pid
        standbys = wait_for_standbys(current)
        for pid in standbys:
            os.kill(pid, signal.SIGKILL)
        wait_until_dead(standbys)  # a kill takes a moment; one landing mid-swap is a death
        recycled = 0
        for _ in range(12):
            _obs, _rewards, _terminated, truncated, infos = envs.step(np.zeros(1, dtype=np.int64))
            assert not truncated.any()  # a dead standby is nobody's episode
            recycled += int(infos.get("multienv", {}).get("_recycled", [False])[0])
        stats = envs.stats()[0]
        assert stats["restarts"] == 0
        assert stats["recycles"] == recycled >= 2
        assert envs.envs[0].pid not in {current, *standbys}
    assert live_workers() == []


def wait_for_standbys(current_pid, within_s=10.0):
    """The pids of the other workers of env 0 (its standby), once one is running."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        found = [pid for pid in descendant_workers(f"{OS_NAME_PREFIX}0") if pid != current_pid]
        if found:
            return found
        time.sleep(0.02)
    raise AssertionError("no standby worker appeared")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.DISABLED])
def test_the_swap_does_not_ask_the_old_worker_anything(mode):
    """The generators come with the step that ended the episodes: a stopped old worker is
    no obstacle to the swap at the next reset (asking it would wait forever)."""
    action = np.zeros(1, dtype=np.int64)
    with MultiEnv(
        [functools.partial(NoisyFixedLengthEnv, 3)],
        autoreset_mode=mode,
        recycle=RecyclePolicy(max_episodes=2),
    ) as envs:

        def next_episode():
            if mode is AutoresetMode.NEXT_STEP:
                obs, _, _, _, infos = envs.step(action)
                return obs, infos
            return envs.reset(options={"reset_mask": np.ones(1, dtype=bool)})

        envs.reset(seed=0)
        for episode in range(2):  # the budget is spent when the second episode ends
            if episode:
                next_episode()
            for _ in range(3):
                terminated = envs.step(action)[2]
        assert terminated.all()
        old_pid = envs.envs[0].pid
        os.kill(old_pid, signal.SIGSTOP)
        try:
            began = time.monotonic()
            obs, infos = next_episode()
            elapsed = time.monotonic() - began
        finally:
            os.kill(old_pid, signal.SIGCONT)
        assert elapsed < 5.0
        assert envs.envs[0].pid != old_pid
        assert envs.stats()[0]["recycles"] == 1
        assert obs[0, 0] == 0  # the new episode's first observation
        assert infos["multienv"]["_recycled"].tolist() == [True]
    assert live_workers() == []
