"""WorkerSupervisor against a scripted fake handle: no process is started here."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

from multienv import EnvCrashedError, EnvCrashLoopError, EnvError, RecyclePolicy, RestartPolicy
from multienv.supervision.handles import Backend, Death
from multienv.supervision.lifecycle import EnvState
from multienv.supervision.options import SupervisorOptions
from multienv.supervision.supervisor import WorkerSupervisor
from multienv.wire.protocol import (
    Batch,
    BatchResult,
    Command,
    EnvDescription,
    Outcome,
    RemoteFailure,
    Reply,
    Request,
)

_SPACE = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
_DESCRIPTION = EnvDescription(_SPACE, gym.spaces.Discrete(2), {}, None, None, "toy.Env")
_BACKEND = Backend("fake", lambda *a, **k: [], lambda *a: None, frozenset())  # type: ignore[arg-type,return-value]


class FakeHandle:
    """A worker handle whose replies are scripted: each entry is a value, a Death or a Reply."""

    def __init__(self, num_envs: int = 1) -> None:
        self.num_envs = num_envs
        self.handshakes: deque[Any] = deque()  # Reply | Death, per spawn; default: ready
        self.replies: deque[Any] = deque()  # per collect/collect_batch
        self.spawns = 0
        self.kills = 0
        self.abandons = 0
        self.retired = 0
        self.prestarts = 0
        self.quiet_spawns: list[bool] = []
        self.sent: list[Any] = []
        self.deadlines: list[float | None] = []

    @property
    def pid(self) -> int | None:
        return 1000 + self.spawns if self.spawns else None

    def spawn(self, *, is_quiet: bool = False) -> None:
        self.spawns += 1
        self.quiet_spawns.append(is_quiet)

    def handshake(self, deadline: float | None) -> Reply | Death:
        if self.handshakes:
            item: Reply | Death = self.handshakes.popleft()
            return item
        return Reply([_DESCRIPTION] * self.num_envs)

    def submit(self, request: Request) -> None:
        self.sent.append(request)

    def collect(self, deadline: float | None) -> Reply | Death:
        self.deadlines.append(deadline)
        item: Reply | Death = self.replies.popleft()
        return item

    def submit_batch(self, batch: Batch) -> None:
        self.sent.append(batch)

    def collect_batch(self, deadline: float | None) -> BatchResult | Death:
        self.deadlines.append(deadline)
        item: BatchResult | Death = self.replies.popleft()
        return item

    def kill(self) -> None:
        self.kills += 1

    def stop(self, timeout_s: float) -> None:
        pass

    def abandon(self) -> None:
        self.abandons += 1

    def prestart(self) -> None:
        self.prestarts += 1

    def retire(self) -> None:
        self.retired += 1

    def rss_mb(self) -> float | None:
        return None

    def stderr_tail(self) -> tuple[str, ...]:
        return ("boom",)


def result(size: int, done: bool = False, extras: dict[int, Outcome] | None = None) -> BatchResult:
    obs = [np.zeros(2, np.float32) + i for i in range(size)]
    flags = np.full(size, done, dtype=np.bool_)
    return BatchResult(np.ones(size), flags, np.zeros(size, np.bool_), obs, extras or {})


def steps(size: int) -> Batch:
    return Batch(list(range(size)), np.zeros(size, np.bool_), [0] * size, is_whole=True)


def resets(size: int) -> Batch:
    return Batch(list(range(size)), np.ones(size, np.bool_), [None] * size, is_whole=True)


def ready(handle: FakeHandle, **options: Any) -> WorkerSupervisor:
    options.setdefault("restart_policy", RestartPolicy(max_restarts=3, backoff=0.0))
    env_indices = list(range(handle.num_envs))
    supervisor = WorkerSupervisor(handle, env_indices, _BACKEND, SupervisorOptions(**options))
    supervisor.start()
    supervisor.initialize()
    return supervisor


def test_initialize_respawns_a_worker_that_dies_while_building() -> None:
    handle = FakeHandle()
    handle.handshakes.append(Death("SIGKILL"))
    supervisor = ready(handle)
    assert supervisor.state is EnvState.READY
    assert (handle.spawns, supervisor.stats.restarts) == (2, 1)
    assert supervisor.stats.last_failure == "SIGKILL"


def test_crash_loop_spends_the_budget_then_raises_and_stays_broken() -> None:
    handle = FakeHandle()
    handle.handshakes.extend([Death("exit code 3")] * 10)
    policy = RestartPolicy(max_restarts=2, backoff=0.0)
    supervisor = WorkerSupervisor(handle, [0], _BACKEND, SupervisorOptions(restart_policy=policy))
    supervisor.start()
    with pytest.raises(EnvCrashLoopError) as caught:
        supervisor.initialize()
    assert caught.value.restarts == 3
    assert caught.value.cause == "exit code 3"
    assert caught.value.stderr_tail == ("boom",)
    # No call ever completed: no budget would outlive it, and the error says so.
    assert "no call to it ever completed: it fails on every start" in str(caught.value)
    assert "allow more respawns" not in str(caught.value)
    assert supervisor.state is EnvState.BROKEN
    with pytest.raises(EnvCrashLoopError):
        supervisor.submit(steps(1))
    # The third worker of the loop and later ones keep their output for the error.
    assert handle.quiet_spawns == [False, False, True]


def test_a_crash_loop_after_calls_completed_advises_a_larger_budget() -> None:
    handle = FakeHandle()
    supervisor = ready(handle, restart_policy=RestartPolicy(max_restarts=2, backoff=0.0))
    handle.replies.append(result(1))
    supervisor.submit(steps(1))
    supervisor.finish()  # a call completed: the env ran
    handle.replies.append(Death("SIGSEGV"))
    handle.handshakes.extend([Death("SIGSEGV")] * 5)
    supervisor.submit(steps(1))
    with pytest.raises(EnvCrashLoopError) as caught:
        supervisor.finish()
    message = str(caught.value)
    assert "allow more respawns: restart_policy=RestartPolicy(max_restarts=20, window_s=60)" in (
        message
    )
    assert "never" not in message
    assert handle.quiet_spawns == [False, False, True]


def test_never_policy_raises_env_crashed_error() -> None:
    handle = FakeHandle()
    supervisor = ready(handle, restart_policy=RestartPolicy.never())
    handle.replies.append(Death("SIGSEGV"))
    supervisor.submit(steps(1))
    with pytest.raises(EnvCrashedError) as caught:
        supervisor.finish()
    assert not isinstance(caught.value, EnvCrashLoopError)
    assert "allow respawns: restart_policy=RestartPolicy() in MultiEnv" in str(caught.value)


def test_backoff_waits_between_respawns_in_a_loop() -> None:
    handle = FakeHandle()
    handle.handshakes.extend([Death("SIGKILL")] * 3)
    began = time.monotonic()
    ready(handle, restart_policy=RestartPolicy(max_restarts=5, backoff=0.05))
    # The second and third respawns of the loop wait 0.05 s and 0.1 s.
    assert time.monotonic() - began >= 0.15


def test_step_deadline_is_per_env_step_timeout_times_steps() -> None:
    handle = FakeHandle(num_envs=3)
    supervisor = ready(handle, step_timeout=2.0)
    handle.replies.append(result(3))
    before = time.monotonic()
    supervisor.run(steps(3))
    deadline = handle.deadlines[-1]
    assert deadline is not None
    assert before + 6.0 <= deadline <= time.monotonic() + 6.0


def test_no_timeouts_means_no_deadline() -> None:
    handle = FakeHandle()
    supervisor = ready(handle)
    handle.replies.append(result(1))
    supervisor.run(steps(1))
    assert handle.deadlines == [None]


def test_death_mid_step_returns_flagged_truncations_with_last_obs() -> None:
    handle = FakeHandle(num_envs=2)
    supervisor = ready(handle)
    handle.replies.append(result(2))
    supervisor.run(steps(2))  # the caller has seen obs [0, 0] and [1, 1]
    handle.replies.append(Death("SIGKILL"))
    got, errors = supervisor.run(steps(2))
    assert errors == {}
    assert got.truncated.tolist() == [True, True]
    assert got.terminated.tolist() == [False, False]
    assert got.rewards.tolist() == [0.0, 0.0]
    assert got.obs is not None
    assert got.obs[1].tolist() == [1.0, 1.0]
    assert got.extras[0].info == {
        "multienv": {"restarted": True, "cause": "SIGKILL", "restarts": 1}
    }
    assert handle.spawns == 2
    assert supervisor.stats.steps.tolist() == [2, 2]


def test_env_not_in_the_dying_batch_gets_its_truncation_on_its_next_step() -> None:
    handle = FakeHandle(num_envs=2)
    supervisor = ready(handle)
    handle.replies.append(Death("SIGKILL"))
    supervisor.run(Batch([0], np.zeros(1, np.bool_), [0]))
    got, _ = supervisor.run(Batch([1], np.zeros(1, np.bool_), [0]))  # nothing is sent
    assert got.truncated.tolist() == [True]
    assert [type(sent) for sent in handle.sent] == [Batch]


def test_death_during_reset_replays_the_reset_on_the_fresh_worker() -> None:
    handle = FakeHandle()
    supervisor = ready(handle)
    handle.replies.extend([Death("SIGKILL"), result(1)])
    got, errors = supervisor.run(resets(1))
    assert errors == {}
    assert not got.truncated[0]
    assert len([s for s in handle.sent if isinstance(s, Batch)]) == 2


def test_death_during_a_call_replays_it_once() -> None:
    handle = FakeHandle()
    supervisor = ready(handle)
    handle.replies.extend([Death("SIGKILL"), Reply("value")])
    assert supervisor.request(0, Command.GET_ATTR, "x") == "value"
    assert [s.command for s in handle.sent] == [Command.GET_ATTR, Command.GET_ATTR]
    assert supervisor.stats.restarts == 1


def test_env_exception_is_env_error_naming_the_env_and_worker_stays() -> None:
    handle = FakeHandle(num_envs=2)
    supervisor = ready(handle)
    failure = RemoteFailure("ValueError", "bad action", "Traceback ...", ValueError("bad"), 1)
    handle.replies.append(result(2, extras={1: Outcome(failure=failure)}))
    _, errors = supervisor.run(steps(2))
    assert isinstance(errors[1], EnvError)
    assert errors[1].env_index == 1
    assert "env 1: step() raised ValueError in its worker (pid 1001): bad action" in str(errors[1])
    assert handle.kills == 0
    assert supervisor.stats.steps.tolist() == [1, 0]


def test_restart_on_error_treats_the_exception_as_a_death() -> None:
    handle = FakeHandle()
    supervisor = ready(handle, restart_on_error=True)
    failure = RemoteFailure("ValueError", "bad", "tb", None, 0)
    handle.replies.append(result(1, extras={0: Outcome(failure=failure)}))
    got, errors = supervisor.run(steps(1))
    assert errors == {}
    assert got.truncated[0]
    assert supervisor.stats.last_failure == "error: ValueError"


def test_recycle_starts_a_standby_near_the_budget_and_swaps_at_the_boundary() -> None:
    handle = FakeHandle()
    supervisor = ready(handle, recycle=RecyclePolicy(max_episodes=1))
    handle.replies.append(result(1, done=True))
    supervisor.run(steps(1))  # the last episode of the budget: the standby starts
    assert handle.prestarts == 1
    assert handle.retired == 0
    handle.replies.append(Reply(np.random.default_rng(0)))  # the old env's np_random
    handle.replies.append(result(1))
    got, _ = supervisor.run(resets(1))  # the boundary: swap, then reset the fresh env
    assert handle.retired == 1
    assert handle.spawns == 2
    assert got.extras[0].info["multienv"] == {"recycled": True, "reason": "max_episodes"}
    assert supervisor.stats.recycles == 1
    assert supervisor.stats.restarts == 0


def test_recycle_does_not_swap_mid_episode() -> None:
    handle = FakeHandle()
    supervisor = ready(handle, recycle=RecyclePolicy(max_steps=1))
    handle.replies.extend([result(1), result(1)])
    supervisor.run(steps(1))
    supervisor.run(steps(1))  # due, but the episode goes on
    assert handle.retired == 0
    assert handle.spawns == 1


def test_close_is_idempotent_and_later_calls_raise_closed() -> None:
    handle = FakeHandle()
    supervisor = ready(handle)
    supervisor.close()
    supervisor.close()
    with pytest.raises(gym.error.ClosedEnvironmentError):
        supervisor.submit(steps(1))


def test_abandon_kills_the_worker_once_when_its_last_env_is_dropped() -> None:
    handle = FakeHandle(num_envs=2)
    supervisor = ready(handle)
    assert not supervisor.abandon_env(0)  # env 1 is still open
    assert (handle.abandons, supervisor.state) == (0, EnvState.READY)
    assert supervisor.abandon_env(1)
    assert (handle.abandons, supervisor.state) == (1, EnvState.CLOSED)
    assert not supervisor.abandon()  # idempotent, and close() after it too
    supervisor.close()
    assert handle.abandons == 1
    with pytest.raises(gym.error.ClosedEnvironmentError):
        supervisor.submit(steps(2))
