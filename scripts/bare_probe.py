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

``send``/``recv`` are the same layout's EnvPool loop, bare: ``send`` writes some workers'
actions and wakes each; a worker that is done writes its number to the parent's pipe;
``recv(m)`` takes the first workers to finish until they hold m envs (whole workers,
ascending) and returns copies of their results and their env ids. ``count_instructions.py
--side async`` counts it as "probe async": the floor of that loop on this layout.

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
import warnings
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
    each: np.ndarray

    def __init__(self, n: int, workers: int, actions: np.ndarray, space: gym.spaces.Box) -> None:
        fields = [
            ("actions", actions.dtype, actions.shape),
            ("obs", space.dtype, (n, *space.shape)),
            ("rewards", np.dtype(np.float64), (n,)),
            ("terminated", np.dtype(np.bool_), (n,)),
            ("truncated", np.dtype(np.bool_), (n,)),
            ("steps", np.dtype(np.int64), (workers,)),
            ("each", np.dtype(np.int64), (1,)),  # 1: each worker says it is done (send/recv)
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
        if len(parts) > 255:
            raise ValueError("the bare probe's workers say their number in one byte: 255 at most")
        self.sizes = [len(part) for part in parts]
        self.ids = [np.arange(part.start, part.stop) for part in parts]  # by worker
        self.ready: list[int] = []  # send/recv: the workers done and not yet returned, in order
        self.ready_envs = 0
        self.returned: tuple[np.ndarray | None, list[int]] = (None, [])  # the last recv's
        self.shared = _Shared(n, len(parts), np.asarray(action_example), space)
        self.t = 0
        self.token_read, self.token_write = os.pipe()
        os.set_blocking(self.token_read, False)  # a worker that finds no token is the last
        self.done_read, self.done_write = os.pipe()
        cpus = sorted(os.sched_getaffinity(0))
        pin = len(parts) <= len(cpus)
        jobs = [
            (_serve, (fns, part, w, cpus[w % len(cpus)] if pin else None))
            for w, part in enumerate(parts)
        ]
        self.wakes, self.processes, self.poller = _fork(self, jobs, self.done_read)
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

    def send(self, actions: Any, env_ids: np.ndarray) -> None:
        """Step the envs ``env_ids`` (whole workers, as the last ``recv`` returned them)."""
        shared = self.shared
        if not shared.each[0]:
            shared.each[0] = 1  # from now on, each worker says it is done
        shared.actions[env_ids] = actions
        ids, workers = self.returned
        if env_ids is not ids:
            k = len(self.ids[0])
            workers = sorted(set((np.asarray(env_ids) // k).tolist()))
        wakes = self.wakes
        for w in workers:
            try:
                os.write(wakes[w], _WAKE)
            except BrokenPipeError:
                pass  # a dead worker: its sentinel ends recv's wait

    def recv(self, size: int) -> tuple[np.ndarray, ...]:
        """The first workers to finish that hold ``size`` envs: copies of results, env ids."""
        ready, sizes = self.ready, self.sizes
        while self.ready_envs < size:
            events = self.poller.poll(_TIMEOUT_MS)
            if not any(fd == self.done_read for fd, _ in events):
                raise RuntimeError("a worker of the bare probe died or is stuck")
            for w in os.read(self.done_read, 4096):
                ready.append(w)
                self.ready_envs += sizes[w]
        count, filled = 0, 0
        while filled < size:
            filled += sizes[ready[count]]
            count += 1
        workers = sorted(ready[:count])
        del ready[:count]
        self.ready_envs -= filled
        if count == 1:
            ids = self.ids[workers[0]]
        else:
            ids = np.concatenate([self.ids[w] for w in workers])
        self.returned = (ids, workers)
        shared = self.shared
        return (
            shared.obs[ids],
            shared.rewards[ids],
            shared.terminated[ids],
            shared.truncated[ids],
            ids,
        )

    def close(self) -> None:
        """Stop the workers and wait for them (killed after 5 s)."""
        self.shared.steps[:] = _STOP
        _stop(self.wakes, self.processes)
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


def _fork(probe: Any, jobs: list[tuple[Any, tuple[Any, ...]]], done_read: int) -> tuple[Any, ...]:
    """Fork a worker per job: ``target(*args, probe, wake_read)``, a wake pipe of its own.

    Returns the wake pipes' write ends, the processes, and a poll of ``done_read`` and every
    worker's sentinel. The write ends forked so far are ``probe.wakes`` as each worker
    starts, for it to close, so that a dead parent reads as EOF.
    """
    wakes: list[int] = []
    processes = []
    probe.wakes = wakes
    context = multiprocessing.get_context("fork")
    for target, args in jobs:
        wake_read, wake_write = os.pipe()
        wakes.append(wake_write)
        process = context.Process(target=target, args=(*args, probe, wake_read), daemon=True)
        with warnings.catch_warnings():
            # bench.py forks these beside multienv's vectors, whose threads (a thread pool,
            # the stderr relay) run on: CPython 3.12+ warns that a lock one of them holds
            # could stay locked in the child. The child takes none of theirs: it reads and
            # writes its pipes and the shared memory and steps its envs. The GIL, the
            # import lock and logging's are made anew in a forked child, malloc's by glibc.
            warnings.filterwarnings(
                "ignore", r"This process .* is multi-threaded, use of fork\(\)", DeprecationWarning
            )
            process.start()
        os.close(wake_read)
        processes.append(process)
    poller = select.poll()
    poller.register(done_read, select.POLLIN)
    for process in processes:
        poller.register(process.sentinel, select.POLLIN)
    return wakes, processes, poller


def _stop(wakes: list[int], processes: list[Any]) -> None:
    """Tell each worker to quit, and wait for it (killed after 5 s)."""
    for wake in wakes:
        try:
            os.write(wake, _QUIT)
        except BrokenPipeError:
            pass
    for process in processes:
        process.join(5.0)
        if process.is_alive():
            process.kill()
            process.join()


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
        if shared.each[0]:  # send/recv: each worker says it is done
            os.write(probe.done_write, bytes((w,)))
            continue
        try:
            os.read(probe.token_read, 1)  # a token: another worker is still stepping
        except BlockingIOError:
            os.write(probe.done_write, _WAKE)  # none left: this one is the last


class RingProbe:
    """EnvPool's layout, bare: workers write each finished env into the next free row.

    The results of a ``send``/``recv`` loop come out of a ring of ``2 N`` rows: a worker that
    is done claims the next ``k`` rows (a counter in shared memory, under an ``flock`` that
    the kernel releases if the worker dies), writes its envs' observations, rewards, flags
    and ids there, and then its first row's number to the parent's pipe. ``recv(m)`` returns
    the next ``m`` rows once every one is written, as copies of slices (in the order the
    workers claimed them, not by env). ``send`` writes each env's action into its own row
    of the actions (by env: a slow worker's actions must outlive other workers' turns of
    the ring), as ``BareProbe`` does. ``count_instructions.py --side async`` counts it as
    "probe-ring": the floor of that design's loop here, with nothing a library adds.

    Args:
        fns: The env factories (called in the workers, after the fork).
        envs_per_worker: Envs per worker (``m`` must be a multiple of it).
        action_example: A batch of N actions, for the shape and dtype of the actions' array.
        views: ``recv`` returns views of the ring's rows, not copies (they stay as returned
            until the workers come round the ring again; "probe-ring-views").
    """

    def __init__(
        self,
        fns: list[Callable[[], gym.Env]],
        envs_per_worker: int,
        action_example: Any,
        views: bool = False,
    ) -> None:
        """Fork the workers; each builds and resets its envs, into rows ``0..N-1``."""
        import tempfile

        probe = fns[0]()
        space = probe.observation_space
        probe.close()
        n, k = len(fns), envs_per_worker
        if not isinstance(space, gym.spaces.Box) or n % k:
            raise ValueError("the ring probe needs a Box observation space and N = W * k")
        actions = np.asarray(action_example)
        rows = 2 * n
        self.shared = _Shared(rows, 1, actions, space)  # the actions by env, the rest by row
        memory = mmap.mmap(-1, 8 * (rows + 1))
        self.ids = np.ndarray((rows,), np.int64, buffer=memory)
        self.counter = np.ndarray((1,), np.int64, buffer=memory, offset=8 * rows)
        self.counter[0] = n  # rows 0..N-1: the first resets
        handle, self.lock_path = tempfile.mkstemp(prefix="ring-probe-")
        os.close(handle)
        self.num_envs, self.k, self.rows, self.views = n, k, rows, views
        self.cursor = 0  # the first row not returned yet
        self.complete = 0  # every row before it is written
        self.written: dict[int, int] = {}  # first row -> worker, written past ``complete``
        self.batch_workers: list[int] = []  # the workers of the rows complete, in row order
        self.returned: list[int] = []  # the workers of the rows the last recv returned
        self.done_read, self.done_write = os.pipe()
        jobs = [
            (_serve_ring, (fns, range(start, start + k), w))
            for w, start in enumerate(range(0, n, k))
        ]
        self.wakes, self.processes, self.poller = _fork(self, jobs, self.done_read)
        self.recv(n)  # the first resets, rows 0..N-1

    def send(self, actions: Any, env_ids: np.ndarray) -> None:
        """Step the envs the last ``recv`` returned (``env_ids``, as it returned them)."""
        self.shared.actions[env_ids] = actions
        wakes = self.wakes
        for w in self.returned:
            try:
                os.write(wakes[w], _WAKE)
            except BrokenPipeError:
                pass  # a dead worker: its sentinel ends recv's wait

    def recv(self, size: int) -> tuple[np.ndarray, ...]:
        """The next ``size`` rows, once written: copies of their results, and their env ids."""
        k, rows = self.k, self.rows
        while self.complete - self.cursor < size:
            events = self.poller.poll(_TIMEOUT_MS)
            if not any(fd == self.done_read for fd, _ in events):
                raise RuntimeError("a worker of the ring probe died or is stuck")
            written = self.written
            data = os.read(self.done_read, 8 * 4096)
            records = np.frombuffer(data, dtype=np.int32).tolist()
            for i in range(0, len(records), 2):
                written[records[i]] = records[i + 1]
            while self.complete in written:
                self.batch_workers.append(written.pop(self.complete))
                self.complete += k
        start = self.cursor % rows
        self.cursor += size
        count = size // k
        self.returned = self.batch_workers[:count]
        del self.batch_workers[:count]
        shared, stop = self.shared, start + size
        if self.views:
            return (
                shared.obs[start:stop],
                shared.rewards[start:stop],
                shared.terminated[start:stop],
                shared.truncated[start:stop],
                self.ids[start:stop],
            )
        return (
            shared.obs[start:stop].copy(),
            shared.rewards[start:stop].copy(),
            shared.terminated[start:stop].copy(),
            shared.truncated[start:stop].copy(),
            self.ids[start:stop].copy(),
        )

    def close(self) -> None:
        """Stop the workers and wait for them (killed after 5 s)."""
        _stop(self.wakes, self.processes)
        for fd in (*self.wakes, self.done_read, self.done_write):
            os.close(fd)
        os.unlink(self.lock_path)
        self.wakes = []


def _serve_ring(
    fns: list[Callable[[], gym.Env]], part: range, w: int, probe: RingProbe, wake_read: int
) -> None:
    """A ring worker: step its envs when woken, claim the next rows, write them, say so."""
    import fcntl
    import struct

    for fd in probe.wakes:
        os.close(fd)
    lock = os.open(probe.lock_path, os.O_RDWR)  # its own open file: flock excludes the others
    shared, ids, counter, rows = probe.shared, probe.ids, probe.counter, probe.rows
    envs = [fns[i]() for i in part]
    k = len(envs)
    record = struct.Struct("=ii")
    for j, env in enumerate(envs):  # the first resets: rows 0..N-1, by env
        shared.obs[part.start + j], _ = env.reset(seed=part.start + j)
        ids[part.start + j] = part.start + j
    os.write(probe.done_write, record.pack(part.start, w))
    actions = shared.actions[part.start : part.stop]
    while os.read(wake_read, 1) == _WAKE:
        results = []
        for j, env in enumerate(envs):
            obs, reward, terminated, truncated, _ = env.step(actions[j])
            if terminated or truncated:
                obs, _ = env.reset()
            results.append((obs, reward, terminated, truncated))
        fcntl.flock(lock, fcntl.LOCK_EX)
        claimed = int(counter[0])
        counter[0] = claimed + k
        fcntl.flock(lock, fcntl.LOCK_UN)
        first = claimed % rows
        for j, (obs, reward, terminated, truncated) in enumerate(results):
            row = first + j
            shared.obs[row], shared.rewards[row] = obs, reward
            shared.terminated[row], shared.truncated[row] = terminated, truncated
            ids[row] = part.start + j
        os.write(probe.done_write, record.pack(claimed, w))
