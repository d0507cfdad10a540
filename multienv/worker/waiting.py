"""WORKER SIDE: a worker's envs that mostly wait step at once, each in a thread of its own.

A worker steps its envs one after the other, so an env whose step waits (I/O, a remote
simulator, a sleep) holds back every env after it, while the cores sit idle: with k such
envs a step lasts k waits. ``WaitingEnvs`` finds those envs and overlaps their waits:

- it times the envs' steps in its loop (wall time and the thread's CPU) on the first
  steps, and on one step in ``SAMPLE_EVERY`` after that, for a worker of two envs or more
  (a lone env has nothing to overlap, and is never timed);
- an env waits when its step's CPU is under ``WAITING_SHARE`` of its wall time, it waits
  ``MIN_WAIT_S`` or more (a thread hop costs tens of microseconds) and its thread blocked
  in the step (a voluntary context switch, ``getrusage``), ``CONFIRM`` timings in a row.
  A step that computes on a busy machine can take twice its CPU in wall time too, but the
  kernel preempts it (involuntary switches only): it never blocks, so it does not move;
- each step of the worker then starts those envs' steps (or resets) first, each on its own
  thread; the others step in the worker's loop meanwhile, and the loop takes each waiting
  env's result at its turn, so that everything after it (the checks, the shared memory,
  the reply) is as before. On each timed step one waiting env, in turn, steps in the loop
  instead, timed: so an env that stops waiting steps in the loop again, judged by timings
  taken in the loop (on a thread, waiting for the GIL would look like waiting).

An env's exception comes back to the loop and is raised there, so a waiting env's failure
is answered as any env's; a hang holds the loop where it waits for that env's result, and
the parent's deadline ends the worker as before. Each thread is a daemon that steps only
its env; the worker's main thread steps that env too on its timed steps.
"""

from __future__ import annotations

import itertools
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

try:
    from resource import RUSAGE_THREAD, getrusage
except ImportError:  # not Linux: every slow step counts as one that blocked
    voluntary_switches: Callable[[], int] = itertools.count().__next__
else:

    def voluntary_switches() -> int:
        """The times this thread blocked (gave up its core) since it began (``ru_nvcsw``)."""
        return getrusage(RUSAGE_THREAD).ru_nvcsw


SAMPLE_EVERY = 128  # after the first steps, one step in this many is timed
FIRST_TIMED = 3  # the worker's first steps, all timed
CONFIRM = 2  # timings in a row that an env waits (or no longer waits) before it moves
WAITING_SHARE = 0.5  # as ``layout.WAITING_SHARE``: a step with less CPU than this mostly waits
MIN_WAIT_S = 200e-6  # less waiting than this is not worth a thread hop
SWITCH_S = 100e-6  # the GIL's switch interval once threads step: a thread starts its wait soon

_thread_time = time.thread_time
_perf_counter = time.perf_counter


class WaitingEnvs:
    """Which of a worker's envs mostly wait, and their steps in flight on their threads.

    Args:
        size: The worker's envs.
    """

    __slots__ = (
        "_done",
        "_inboxes",
        "_is_timed",
        "_results",
        "_started",
        "_steps",
        "_streaks",
        "waits",
    )

    def __init__(self, size: int) -> None:
        """Nothing timed yet."""
        self._streaks = [0] * size  # by env: timings in a row that disagree with its place
        self._steps = 0  # steps of the worker since it began
        self._is_timed = False  # whether this step's calls here are timed
        self._inboxes: list[queue.SimpleQueue[Any] | None] = [None] * size
        self._done: queue.SimpleQueue[tuple[int, Any, BaseException | None]] = queue.SimpleQueue()
        self._started: set[int] = set()  # positions whose call is on its thread now
        self._results: dict[int, tuple[Any, BaseException | None]] = {}
        self.waits: list[int] = []  # the positions that wait, ascending

    def begin(self, envs: list[Any], actions: Any, ended: Any) -> Callable[..., Any] | None:
        """Count a step and start its waiting envs' calls; the loop's way to call an env.

        Each waiting env's step (its reset, where ``ended``) starts on its thread. Returns
        ``call``, or None for a plain call: no env waits and this step is not timed. A
        timed step times every env in the loop, and one waiting env (in turn) steps there
        too, timed: the timings that move an env are taken in the loop, never on a thread,
        where the GIL's turns would stretch a step that computes.
        """
        self._steps += 1
        steps, waits = self._steps, self.waits
        self._is_timed = steps <= FIRST_TIMED or not steps % SAMPLE_EVERY
        if not waits:
            return self.call if self._is_timed else None
        inline = waits[steps // SAMPLE_EVERY % len(waits)] if self._is_timed else -1
        for position in list(self._started):  # left by a step the loop left (an exception)
            self._result(position)  # ends first; that step was answered already
        for position in waits:
            if position == inline:
                continue
            env = envs[position]
            inbox = self._inboxes[position]
            if inbox is None:
                inbox = self._inboxes[position] = self._start_thread(position)
            if ended[position]:
                inbox.put((env.reset, ()))
            else:
                inbox.put((env.step, (actions[position],)))
            self._started.add(position)
        return self.call

    def call(self, position: int, function: Callable[..., Any], *args: Any) -> Any:
        """``function(*args)`` for the env at ``position``, from its thread or called here.

        Its result from its thread if it was started there (``start``); else called here,
        and timed on a timed step (``begin``).
        """
        if position in self._started:
            result, error = self._result(position)
            if error is not None:
                raise error
            return result
        if not self._is_timed:
            return function(*args)
        began, cpu, switches = _perf_counter(), _thread_time(), voluntary_switches()
        try:
            return function(*args)
        finally:
            blocked = voluntary_switches() > switches
            self._note(position, _perf_counter() - began, _thread_time() - cpu, blocked)

    def _result(self, position: int) -> tuple[Any, BaseException | None]:
        """The result of the call started on the thread of the env at ``position``."""
        self._started.discard(position)
        results = self._results
        while position not in results:
            done, result, error = self._done.get()
            results[done] = (result, error)
        return results.pop(position)

    def _note(self, position: int, wall: float, cpu: float, blocked: bool = True) -> None:
        """One timed call of the env at ``position``: it moves after ``CONFIRM`` in a row.

        ``blocked``: its thread blocked in the call (a preempted one did not).
        """
        waits = blocked and cpu < WAITING_SHARE * wall and wall - cpu >= MIN_WAIT_S
        if waits == (position in self.waits):
            self._streaks[position] = 0
            return
        self._streaks[position] += 1
        if self._streaks[position] < CONFIRM:
            return
        self._streaks[position] = 0
        self.waits = sorted({*self.waits, position} if waits else set(self.waits) - {position})
        if self.waits and sys.getswitchinterval() > SWITCH_S:
            sys.setswitchinterval(SWITCH_S)

    def _start_thread(self, position: int) -> queue.SimpleQueue[Any]:
        inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        thread = threading.Thread(
            target=self._serve,
            args=(position, inbox),
            name=f"multienv-waiting-env-{position}",
            daemon=True,
        )
        thread.start()
        return inbox

    def _serve(self, position: int, inbox: queue.SimpleQueue[Any]) -> None:
        """The thread of the env at ``position``: its calls, one at a time, to the loop."""
        done = self._done
        while True:
            function, args = inbox.get()
            try:
                result, error = function(*args), None
            except BaseException as exc:  # noqa: BLE001 - raised in the loop, at its turn
                result, error = None, exc
            done.put((position, result, error))
