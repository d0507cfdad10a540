"""scripts/bare_probe.py: the benchmark's yardstick steps envs as the sequential loop does."""

import functools
import importlib.util
import pathlib
import sys

import gymnasium as gym
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(60)


def load():
    spec = importlib.util.spec_from_file_location("bare_probe", ROOT / "scripts" / "bare_probe.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bare_probe"] = module
    spec.loader.exec_module(module)
    return module


def loop_results(fns, actions):
    """What bench.py's sequential loop sees: env i reset with seed i, reset when it ends."""
    envs = [fn() for fn in fns]
    first = np.stack([env.reset(seed=i)[0] for i, env in enumerate(envs)])
    steps = []
    for batch in actions:
        rows = []
        for env, action in zip(envs, batch, strict=True):
            obs, reward, terminated, truncated, _ = env.step(action)
            if terminated or truncated:
                obs, _ = env.reset()
            rows.append((obs, reward, terminated, truncated))
        steps.append([np.array(column) for column in zip(*rows, strict=True)])
    return first, steps


@pytest.mark.parametrize("spin", [False, True], ids=["sleep", "spin"])
def test_steps_as_the_loop_does(spin):
    fns = [functools.partial(gym.make, "CartPole-v1")] * 5  # workers of 2, 2 and 1 envs
    rng = np.random.default_rng(0)
    actions = [rng.integers(0, 2, size=5) for _ in range(120)]  # episodes end and reset
    first, expected = loop_results(fns, actions)
    assert any(step[2].any() for step in expected)  # some episode ended on the way
    probe = load().BareProbe(fns, 2, spin, actions[0])
    try:
        assert len(probe.processes) == 3
        np.testing.assert_array_equal(probe.reset(), first)
        for batch, (obs, rewards, terminated, truncated) in zip(actions, expected, strict=True):
            got = probe.step(batch)
            np.testing.assert_array_equal(got[0], obs)
            np.testing.assert_array_equal(got[1], rewards)
            np.testing.assert_array_equal(got[2], terminated)
            np.testing.assert_array_equal(got[3], truncated)
    finally:
        probe.close()
    assert [process.exitcode for process in probe.processes] == [0, 0, 0]


def test_a_dead_worker_stops_the_probe_with_an_error():
    probe = load().BareProbe([functools.partial(gym.make, "CartPole-v1")] * 2, 1, False, [0, 0])
    try:
        probe.processes[1].kill()
        probe.processes[1].join()
        with pytest.raises(RuntimeError, match="died or is stuck"):
            probe.step([0, 1])
    finally:
        probe.close()
    assert not any(process.is_alive() for process in probe.processes)


def one_env_per_loop(fn, seed, actions):
    """One env's own results under these actions, reset with ``seed`` and when it ends."""
    env = fn()
    env.reset(seed=seed)
    rows = []
    for action in actions:
        obs, reward, terminated, truncated, _ = env.step(action)
        if terminated or truncated:
            obs, _ = env.reset()
        rows.append((obs, reward, terminated, truncated))
    return rows


@pytest.mark.parametrize("ring", [False, True], ids=["send-recv", "ring"])
def test_send_recv_returns_whole_workers_each_env_as_its_own_loop(ring):
    """Both bare send/recv loops: whole workers per recv; each env's steps are its own."""
    module = load()
    fn = functools.partial(gym.make, "CartPole-v1")
    num_envs, k, size = 8, 2, 4
    rng = np.random.default_rng(0)
    first = rng.integers(0, 2, size=num_envs)
    sent = {env: [int(first[env])] for env in range(num_envs)}  # each env's actions
    got = {env: [] for env in range(num_envs)}  # and its results, in order
    if ring:
        probe = module.RingProbe([fn] * num_envs, k, first)
        probe.returned = list(range(len(probe.wakes)))  # the first resets: every worker
    else:
        probe = module.BareProbe([fn] * num_envs, k, False, first)
    try:
        probe.send(first, np.arange(num_envs))
        for _ in range(60):
            obs, rewards, terminated, truncated, ids = probe.recv(size)
            assert len(ids) == size
            assert len(set((ids // k).tolist())) == size // k  # whole workers
            for row, env in enumerate(ids.tolist()):
                got[env].append((obs[row], rewards[row], terminated[row], truncated[row]))
            actions = rng.integers(0, 2, size=size)
            for env, action in zip(ids.tolist(), actions.tolist(), strict=True):
                sent[env].append(action)
            probe.send(actions, ids)
        *_, left = probe.recv(num_envs - size)  # four more of the eight in flight
        assert len(set(left.tolist())) == num_envs - size
    finally:
        probe.close()
    assert not any(process.is_alive() for process in probe.processes)
    for env in range(num_envs):
        assert got[env]  # every env stepped (one worker may lag: recv takes the first done)
        expected = one_env_per_loop(fn, env, sent[env][: len(got[env])])
        for step, want in zip(got[env], expected, strict=True):
            np.testing.assert_array_equal(step[0], want[0])
            assert tuple(step[1:]) == tuple(want[1:])


def test_a_dead_worker_stops_the_ring_probe_with_an_error():
    fn = functools.partial(gym.make, "CartPole-v1")
    probe = load().RingProbe([fn] * 4, 2, np.zeros(4, dtype=np.int64))
    try:
        probe.processes[1].kill()
        probe.processes[1].join()
        probe.send(np.zeros(4, dtype=np.int64), np.arange(4))
        with pytest.raises(RuntimeError, match="died or is stuck"):
            probe.recv(4)
    finally:
        probe.close()
    assert not any(process.is_alive() for process in probe.processes)
