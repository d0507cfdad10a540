"""The floor of a layout: N envs in forked workers, with nothing of a library around them.

``scripts/bench.py`` runs it beside multienv in the same rounds ("bare probe" rows, and the
"x probe" column), so that the cost of multienv's own per-step path is read against what the
same layout costs on the same machine at the same time, not against an earlier run.

What it keeps of the layout: W workers of k envs each (forked, pinned one to a CPU when they
are no more than the CPUs), actions and results in shared memory, and how the two sides
wait. By default a worker sleeps on a pipe until the parent writes it one byte; with
``spin=True`` it polls a step counter in shared memory instead (with ``os.sched_yield``
between polls, as multienv's hot workers do). Either way the parent sleeps until the last
worker of a step writes it one byte: before each step the parent puts W - 1 tokens in a
pipe, and a worker that finds none left is the last.

What it leaves out is everything multienv adds: checks of actions and observations, infos,
pickling, timeouts, deaths and respawns, Gymnasium's next-step autoreset (an env that ends
an episode is reset at once, in the same step, as the sequential loop does). It runs only
envs with a Box observation space whose observations are arrays. It is a yardstick, not a
vector env: a worker that dies stops the probe with an error, and nothing is recovered.
"""

from __future__ import annotations

import mmap
import multiprocessing
import os
import select
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np

_WAKE = b"s"
_QUIT = b"q"
_STOP = -1  # the step counter's value that ends a spinning worker
_TIMEOUT_MS = 60_000  # a step this late means a worker is stuck: the probe gives up


class _Shared:
    """The arrays that both sides map: actions in, results out, and the spinners' counters."""

    actions: np.ndarray
    obs: np.ndarray
    rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    steps: np.ndarray

    def __init__(self, n: int, workers: int, actions: np.ndarray, space: gym.spaces.Box) -> None:
        fields = [
            ("actions", actions.dtype, actions.shape),
            ("obs", space.dtype, (n, *space.shape)),
            ("rewards", np.dtype(np.float64), (n,)),
            ("terminated", np.dtype(np.bool_), (n,)),
            ("truncated", np.dtype(np.bool_), (n,)),
            ("steps", np.dtype(np.int64), (workers,)),
        ]
        offsets, size = [], 0
        for _, dtype, shape in fields:
            size = -(-size // 64) * 64  # each array on its own cache lines
            offsets.append(size)
            size += int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        self.memory = mmap.mmap(-1, max(size, 1))  # anonymous and shared: forks inherit it
        for (name, dtype, shape), offset in zip(fields, offsets, strict=True):
            array = np.ndarray(shape, dtype=dtype, buffer=self.memory, offset=offset)
            setattr(self, name, array)


class BareProbe:
    """N envs in ``ceil(N / envs_per_worker)`` forked workers; ``step`` as the loop steps.

    Args:
        fns: The env factories (called in the workers, after the fork).
        envs_per_worker: Envs per worker (env i in worker ``i // envs_per_worker``).
        spin: Workers poll for their next step instead of sleeping on a pipe.
        action_example: A batch of N actions, for the shape and dtype of the actions' array.
    """

    def __init__(
        self,
        fns: list[Callable[[], gym.Env]],
        envs_per_worker: int,
        spin: bool,
        action_example: Any,
    ) -> None:
        """Fork the workers; each builds its envs and resets them (env i with seed i)."""
        probe = fns[0]()
        space = probe.observation_space
        probe.close()
        if not isinstance(space, gym.spaces.Box):
            raise ValueError(f"the bare probe needs a Box observation space, got {space}")
        n = len(fns)
        self.num_envs, self.spin = n, spin
        parts = [range(i, min(i + envs_per_worker, n)) for i in range(0, n, envs_per_worker)]
        self.shared = _Shared(n, len(parts), np.asarray(action_example), space)
        self.t = 0
        self.token_read, self.token_write = os.pipe()
        os.set_blocking(self.token_read, False)  # a worker that finds no token is the last
        self.done_read, self.done_write = os.pipe()
        self.wakes: list[int] = []
        self.processes = []
        cpus = sorted(os.sched_getaffinity(0))
        pin = len(parts) <= len(cpus)
        context = multiprocessing.get_context("fork")
        for w, part in enumerate(parts):
            wake_read, wake_write = os.pipe()
            self.wakes.append(wake_write)
            process = context.Process(
                target=_serve,
                args=(fns, part, w, cpus[w % len(cpus)] if pin else None, self, wake_read),
                daemon=True,
            )
            process.start()
            os.close(wake_read)
            self.processes.append(process)
        self.poller = select.poll()
        self.poller.register(self.done_read, select.POLLIN)
        for process in self.processes:
            self.poller.register(process.sentinel, select.POLLIN)
        self._round()  # every worker's first round: its envs are built and reset

    def reset(self) -> np.ndarray:
        """The observations the workers' first resets wrote (the envs are reset once only)."""
        return self.shared.obs.copy()

    def step(self, actions: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Step every env (resetting those that end an episode); copies of the results."""
        self.shared.actions[:] = actions
        self._round()
        shared = self.shared
        return (
            shared.obs.copy(),
            shared.rewards.copy(),
            shared.terminated.copy(),
            shared.truncated.copy(),
        )

    def close(self) -> None:
        """Stop the workers and wait for them (killed after 5 s)."""
        self.shared.steps[:] = _STOP
        for wake in self.wakes:
            try:
                os.write(wake, _QUIT)
            except BrokenPipeError:
                pass
        for process in self.processes:
            process.join(5.0)
            if process.is_alive():
                process.kill()
                process.join()
        for fd in (*self.wakes, self.token_read, self.token_write):
            os.close(fd)
        os.close(self.done_read)
        os.close(self.done_write)
        self.wakes = []

    def _round(self) -> None:
        """Start one step of every worker, and sleep until the last one says it is done."""
        self.t += 1
        if len(self.processes) > 1:
            os.write(self.token_write, _WAKE * (len(self.processes) - 1))
        if self.spin:
            self.shared.steps[:] = self.t
        else:
            for wake in self.wakes:
                try:
                    os.write(wake, _WAKE)
                except BrokenPipeError:
                    pass  # a dead worker: its sentinel ends the wait below
        events = self.poller.poll(_TIMEOUT_MS)
        if not any(fd == self.done_read for fd, _ in events):
            raise RuntimeError("a worker of the bare probe died or is stuck")
        os.read(self.done_read, 1)


def _serve(
    fns: list[Callable[[], gym.Env]],
    part: range,
    w: int,
    cpu: int | None,
    probe: BareProbe,
    wake_read: int,
) -> None:
    """A worker: build and reset its envs, then step them at each of the parent's rounds."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    for fd in probe.wakes:  # the write ends forked so far: a dead parent then reads as EOF
        os.close(fd)
    parent = os.getppid()
    shared = probe.shared
    envs = [fns[i]() for i in part]
    first = part.start
    rows = range(len(envs))
    obs_out, rewards, terminated, truncated = (
        shared.obs[part.start : part.stop],
        shared.rewards[part.start : part.stop],
        shared.terminated[part.start : part.stop],
        shared.truncated[part.start : part.stop],
    )
    actions = shared.actions[part.start : part.stop]
    steps, spin, t = shared.steps, probe.spin, 0
    while True:
        if spin:
            while steps[w] == t:
                os.sched_yield()
                if os.getppid() != parent:
                    return
            if steps[w] == _STOP:
                return
        elif os.read(wake_read, 1) != _WAKE:
            return
        t += 1
        if t == 1:
            for j in rows:
                obs_out[j], _ = envs[j].reset(seed=first + j)
        else:
            for j in rows:
                env = envs[j]
                obs, rewards[j], terminated[j], truncated[j], _ = env.step(actions[j])
                if terminated[j] or truncated[j]:
                    obs, _ = env.reset()
                obs_out[j] = obs
        try:
            os.read(probe.token_read, 1)  # a token: another worker is still stepping
        except BlockingIOError:
            os.write(probe.done_write, _WAKE)  # none left: this one is the last
