"""WorkerLife: one worker's states and its way to ready, against a scripted handle."""

from __future__ import annotations

import pytest
from gymnasium.error import ClosedEnvironmentError

from multienv import EnvCrashLoopError, RestartPolicy
from multienv.errors import EnvError, EnvStateError
from multienv.supervision.failures import RestartLedger
from multienv.supervision.handles import Death
from multienv.supervision.lifecycle import EnvState, WorkerLife
from multienv.supervision.worker_stats import WorkerStats
from multienv.wire.protocol import RemoteFailure, Reply
from tests.test_supervisor import FakeHandle


def life_of(handle: FakeHandle, *, restart_on_error: bool = False, max_restarts: int = 2):
    spawned: list[int] = []
    life = WorkerLife(
        handle,
        [4],
        RestartLedger(RestartPolicy(max_restarts=max_restarts, backoff=0.0), [4]),
        WorkerStats(1),
        init_timeout=None,
        restart_on_error=restart_on_error,
        on_spawn=lambda: spawned.append(handle.spawns),
    )
    return life, spawned


def build_failure() -> Reply:
    error = ValueError("bad level")
    return Reply(failure=RemoteFailure("ValueError", "bad level", "Traceback ...\n", error, 0))


def test_spawn_then_handshake_reaches_ready_and_every_spawn_is_told():
    handle = FakeHandle()
    handle.handshakes.append(Death("SIGKILL"))
    life, spawned = life_of(handle)
    life.spawn()
    assert life.state is EnvState.STARTED
    life.become_ready()  # the first worker died building: respawned once
    assert life.state is EnvState.READY
    assert spawned == [1, 2]
    assert len(life.descriptions) == 1


def test_a_crash_loop_while_building_ends_broken_and_the_error_stays():
    handle = FakeHandle()
    handle.handshakes.extend([Death("exit code 3")] * 5)
    life, _ = life_of(handle, max_restarts=1)
    life.spawn()
    with pytest.raises(EnvCrashLoopError):
        life.become_ready()
    assert life.state is EnvState.BROKEN
    with pytest.raises(EnvCrashLoopError):  # every later call raises the same
        life.require(EnvState.READY, "step", 4)


def test_an_env_fn_that_raises_is_an_env_error_unless_restart_on_error():
    handle = FakeHandle()
    handle.handshakes.append(build_failure())
    life, _ = life_of(handle)
    life.spawn()
    with pytest.raises(EnvError, match=r"env 4: env_fn raised ValueError .*fix env_fn") as caught:
        life.become_ready()
    assert isinstance(caught.value.__cause__, ValueError)

    handle = FakeHandle()
    handle.handshakes.append(build_failure())
    life, spawned = life_of(handle, restart_on_error=True)
    life.spawn()
    life.become_ready()  # a death instead: respawned, and the second worker is ready
    assert life.state is EnvState.READY
    assert spawned == [1, 2]


def test_calls_in_the_wrong_state_say_what_to_do():
    life, _ = life_of(FakeHandle())
    with pytest.raises(EnvStateError, match=r"env 4: step\(\) called in state CREATED; call start"):
        life.require(EnvState.READY, "step", 4)
    with pytest.raises(EnvStateError, match="illegal state move CREATED -> READY"):
        life.set_state(EnvState.READY)
    life.set_state(EnvState.CLOSED)
    with pytest.raises(ClosedEnvironmentError, match=r"env 4: step\(\) called after close\(\)"):
        life.require(EnvState.READY, "step", 4)


def test_abandon_closes_at_once_and_only_once():
    handle = FakeHandle()
    life, _ = life_of(handle)
    life.spawn()
    assert life.abandon() is True
    assert life.state is EnvState.CLOSED
    assert life.abandon() is False
    assert handle.abandons == 1
    with pytest.raises(ClosedEnvironmentError, match="closed during a respawn"):
        life.spawn()
