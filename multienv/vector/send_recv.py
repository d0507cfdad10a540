"""VECTOR API: EnvPool-style ``send``/``recv``: which envs are in flight, and collecting them.

``send`` steps some envs and returns at once; ``recv`` returns the first envs to finish.
The envs of one worker travel together, so a worker is either idle or stepping one batch.
``InFlight`` keeps, per worker, the envs it is stepping and, per env, the results collected
but not yet returned. ``SendRecvApi`` holds the two methods (``MultiEnv`` inherits them).

A vector with a data plane sends and receives whole workers on its parts plane
(``parts_plane``) first; anything else, and anything unusual there, goes the way described
here, the parts plane's workers handed over to it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from gymnasium.error import ClosedEnvironmentError

from multienv.errors import EnvStateError, WaitTimeoutError
from multienv.supervision.handles import DataPlane, PartsPlane
from multienv.vector import vector_checks
from multienv.vector.assembly import Assembly, StepBatch
from multienv.vector.batch_picker import AutoBatch, BatchPicker
from multienv.vector.fan_out import FanOut, finish
from multienv.vector.timing import CallClock, clocked
from multienv.wire.autoreset import Autoreset
from multienv.wire.protocol import Batch, StepPlan

logger = logging.getLogger(__name__)


class SendRecvApi:
    """A vector env's ``send`` and ``recv``; ``MultiEnv`` inherits them."""

    if TYPE_CHECKING:  # what they use of the vector
        closed: bool
        num_envs: int
        _pending: Any
        _pending_reset: Any
        _in_flight: InFlight
        _clock: CallClock
        _autoreset: Autoreset

        def _split_actions(self, actions: Any, env_ids: list[int] | None) -> Any: ...

    @clocked
    def send(self, actions: Any, env_ids: Sequence[int] | np.ndarray | None = None) -> None:
        """Send a step to some envs and return at once; ``recv()`` collects the first to finish.

        EnvPool-style asynchronous stepping: keep some envs stepping while you learn from
        the others, so a slow env does not hold back the batch. The envs of one worker
        travel together: an env cannot be sent while its worker steps others.

        Example:
            >>> import gymnasium as gym, numpy as np
            >>> from multienv import MultiEnv
            >>> with MultiEnv([lambda: gym.make("CartPole-v1")] * 4) as envs:
            ...     _ = envs.reset(seed=0)
            ...     envs.send(np.zeros(4, dtype=np.int64))
            ...     obs, rewards, terminations, truncations, infos = envs.recv(batch_size=2)
            ...     envs.send(np.ones(2, dtype=np.int64), infos["env_id"])
            ...     _ = envs.recv()  # the other two, then these two (all that are in flight)
            ...     obs.shape, len(infos["env_id"])
            ((2, 4), 2)

        Args:
            actions: One action per env of ``env_ids``, in that order.
            env_ids: The envs to step (distinct, none already in flight); default all.
        """
        if self.closed:
            raise ClosedEnvironmentError("MultiEnv.send() called after close().")
        if self._pending is not None:
            raise EnvStateError("MultiEnv.send() called while a step_async() is pending.")
        if self._pending_reset is None and self._in_flight.send_parts(actions, env_ids):
            return  # whole workers, in one pass (``parts_plane``)
        ids = vector_checks.env_ids_to_send(env_ids, self.num_envs, self._in_flight.env_ids())
        batch_actions = self._split_actions(actions, ids)
        self._autoreset.check_can_step(ids, "send")
        self._in_flight.send(ids, batch_actions)

    @clocked
    def recv(
        self,
        batch_size: int | Literal["auto"] | None = None,
        timeout: float | None = None,
        min_batch: int | None = None,
        *,
        take: Literal["full", "ready"] = "full",
    ) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """Collect the steps of envs in flight: a full batch, what is ready, or a picked batch.

        Three ways to form the batch, told apart by their arguments:

        - ``take="full"`` (the default): wait until ``batch_size`` envs are done and return
          them. With ``timeout`` and ``min_batch``, a deadline batch former: at the
          deadline, what is done is returned if it is ``min_batch`` envs or more.
        - ``take="ready"``: return as soon as ``min_batch`` envs (default 1) are done, with
          every env done by then, at most ``batch_size``: a policy server's loop, in which
          fast envs are never held back by a slow one.
        - ``batch_size="auto"``: a full batch whose size the vector picks, by timing whole
          and half batches in this loop (``auto_batch`` says which it picked, and why).

        Example:
            >>> import gymnasium as gym, numpy as np
            >>> from multienv import MultiEnv
            >>> with MultiEnv([lambda: gym.make("CartPole-v1")] * 4) as envs:
            ...     _ = envs.reset(seed=0)
            ...     envs.send(np.zeros(4, dtype=np.int64))
            ...     obs, *_, infos = envs.recv(batch_size=4, timeout=1.0, min_batch=2)
            ...     envs.send(np.ones(len(obs), dtype=np.int64), infos["env_id"])
            ...     obs, *_, infos = envs.recv(batch_size=4, take="ready")  # 1 to 4, at once
            ...     envs.send(np.ones(len(obs), dtype=np.int64), infos["env_id"])
            ...     obs, *_, infos = envs.recv(batch_size="auto")
            ...     1 <= len(infos["env_id"]) <= 4
            True

        Args:
            batch_size: How many envs to return at most; default all that are in flight;
                ``"auto"``: the vector picks it. Above the envs in flight when the fewest
                to return (``min_batch``, or ``take="ready"``) can be met: then at most
                what is in flight comes back.
            timeout: Seconds to wait. At the deadline, what is done is returned if it is
                ``min_batch`` envs or more; else ``TimeoutError`` is raised and every step
                stays in flight, so nothing is lost.
            min_batch: The fewest envs to return (1 to ``batch_size``, and no more than are
                in flight): at the deadline, or with ``take="ready"`` as soon as they are
                done. None: ``batch_size`` (so that a timeout raises); 1 with "ready".
            take: ``"full"``: wait for ``batch_size`` envs; ``"ready"``: return once
                ``min_batch`` are done, with every env done then.

        Returns:
            ``(obs, rewards, terminations, truncations, infos)`` for the envs returned, in
            ascending env order; ``infos["env_id"]`` holds their indices.

        Raises:
            EnvError: An env raised in its step: that env leaves flight (it did not step).
                Each env that raised gets its own, one per ``recv`` call, lowest env first;
                until then the others stay in flight, and the envs that stepped are kept
                for later calls.
        """
        if self.closed:
            raise ClosedEnvironmentError("MultiEnv.recv() called after close().")
        return self._in_flight.recv(batch_size, timeout, min_batch, take)

    @property
    def auto_batch(self) -> AutoBatch | None:
        """What ``recv(batch_size="auto")`` picks now and why; None before its first call."""
        picker = self._in_flight.picker
        return None if picker is None else picker.current()


class InFlight:
    """The envs a vector's ``send()`` stepped and ``recv()`` has not returned yet.

    Args:
        fan_out: The vector's workers and their multi-wait.
        assembly: Files collected results and assembles the returned batch.
        autoreset: The vector's autoreset state.

    Attributes:
        parts: The vector's parts plane, tried first; None if it has none.
    """

    def __init__(self, fan_out: FanOut, assembly: Assembly, autoreset: Autoreset) -> None:
        """Nothing in flight."""
        self._fan_out = fan_out
        self._assembly = assembly
        self._autoreset = autoreset
        self._worker_of = {e: n for n, group in enumerate(fan_out.groups) for e in group.env_ids}
        self._flying: dict[int, list[int]] = {}  # by worker number: the envs it steps
        self._received: dict[int, tuple[Any, ...]] = {}  # by env: collected, not returned
        self._plans: dict[int, StepPlan] = {}  # by worker number: a part handed over
        # By env: its step raised; each ``recv`` raises one (lowest env first), so that
        # every env that raised is named by an ``EnvError``. Counted in flight till then.
        self._failed: dict[int, BaseException] = {}
        self.parts: PartsPlane | None = None
        self.picker: BatchPicker | None = None  # ``recv(batch_size="auto")``'s, once called
        # The vector's data plane: while the picker takes whole batches, a send of every env
        # is its step, one pass and one wake-up of the caller, as ``step()``'s; in flight
        # until ``recv`` (``_stepping``).
        self.plane: DataPlane | None = None
        self._stepping = False
        self._all_ids = np.arange(len(self._worker_of), dtype=np.int64).tobytes()

    def is_busy(self) -> bool:
        """Whether any env is in flight, or collected and not yet returned."""
        return bool(self._flying or self._received or self._failed or self._stepping) or (
            self.parts is not None and self.parts.is_busy()
        )

    def env_ids(self) -> list[int]:
        """Every env in flight or collected and not yet returned, ascending."""
        if self._stepping:
            return list(range(len(self._worker_of)))
        ids = [*self._received, *self._failed, *(i for ids in self._flying.values() for i in ids)]
        if self.parts is not None:
            ids += self.parts.env_ids()
        return sorted(ids)

    def send_parts(self, actions: Any, env_ids: Any) -> bool:
        """Send whole workers on the parts plane; False if they go the general way.

        Only when no worker steps the general way (envs it collected and has not returned
        may wait, as long as none is sent again). Whatever the parts plane has in flight
        goes the general way too when it declines.
        """
        parts = self.parts
        if parts is None or self._flying or self._stepping:
            return False
        picker, plane = self.picker, self.plane
        if (
            picker is not None
            and picker.wants_whole()
            and plane is not None
            and not (self._received or self._failed or parts.is_busy())
            and (env_ids is None or _is_ids(env_ids, self._all_ids))
        ):
            plane.align_slots()
            if plane.send(actions):
                parts.forget_returned()
                self._stepping = True
                return True
        if self._received or self._failed:
            kept = self._received.keys() | self._failed.keys()
            if env_ids is None or not kept.isdisjoint(np.ravel(env_ids).tolist()):
                return False  # the vector's checks say which env is in flight
        if parts.send(actions, env_ids):
            return True
        self._raise_first(self._adopt(parts.hand_over()))
        return False

    def _adopt(self, handed: dict[int, Any]) -> dict[int, BaseException]:
        """Collect the parts plane's workers here; the errors of those collected already.

        Each gives its part of a planned step, or its outcome when its supervisor
        collected it already (filed at once).
        """
        errors: dict[int, BaseException] = {}
        for number, part in sorted(handed.items()):
            self._flying[number] = list(self._fan_out.groups[number].env_ids)
            if isinstance(part, StepPlan):
                self._plans[number] = part
            else:
                outcome = {number: part}
                errors.update(
                    self._assembly.receive(outcome, self._flying, self._received, self._plans)
                )
        return errors

    def _collect(self, deadline: float | None) -> dict[int, BaseException]:
        """Collect every worker stepping the general way, until none is left or the deadline.

        Their envs are filed under ``received``; returns their errors, by env.
        """
        errors: dict[int, BaseException] = {}
        groups = self._fan_out.groups
        while self._flying:
            flying = sorted(self._flying)
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = self._fan_out.wait_any(flying, left)
            if not ready:
                break
            collected = {flying[k]: finish(groups[flying[k]]) for k in ready}
            errors.update(
                self._assembly.receive(collected, self._flying, self._received, self._plans)
            )
        return errors

    def _raise_first(self, errors: dict[int, BaseException]) -> None:
        """Keep ``errors`` (by env) to raise, and raise the lowest env's kept error, if any.

        Each error is raised once: the envs of one error (a worker's crash loop) go with it.
        The others stay in flight, and the next ``recv`` calls raise them one by one.
        """
        failed = self._failed
        failed.update(errors)
        if not failed:
            return
        error = failed[min(failed)]
        for env_index in [i for i, other in failed.items() if other is error]:
            del failed[env_index]
        if failed:
            logger.debug("envs %s raised too; the next recv() raises theirs", sorted(failed))
        raise error

    def send(self, ids: list[int], actions: Any) -> None:
        """Submit each worker's share of ``ids`` (checked, none in flight) as one batch."""
        by_worker: dict[int, list[int]] = {}
        for item, env_index in enumerate(ids):
            by_worker.setdefault(self._worker_of[env_index], []).append(item)
        for number, items in by_worker.items():
            if number in self._flying:
                env_index = ids[items[0]]
                raise EnvStateError(
                    f"env {env_index}: its worker is stepping envs {self._flying[number]}; "
                    "recv() them before sending it.",
                    env_index=env_index,
                )
        for number, items in sorted(by_worker.items()):
            group = self._fan_out.groups[number]
            env_list = [ids[item] for item in items]
            batch = Batch(
                [group.position_of[env_index] for env_index in env_list],
                self._autoreset.resets(env_list),
                actions[items] if isinstance(actions, np.ndarray) else [actions[i] for i in items],
                self._autoreset.is_same_step,
            )
            group.supervisor.submit(batch)
            self._flying[number] = env_list

    def recv(
        self,
        batch_size: int | str | None,
        timeout: float | None,
        min_batch: int | None = None,
        take: str = "full",
    ) -> StepBatch:
        """The first ``batch_size`` envs to finish (all in flight when None), ascending.

        At ``timeout``, those done if they are ``min_batch`` or more; with ``take="ready"``,
        every env done once ``min_batch`` are (``MultiEnv.recv``).
        """
        if self._stepping:  # every env, on the data plane
            if batch_size == "auto" and take == "full" and min_batch is None:
                return self._recv_step(timeout)
            self._leave_step()
        parts = self.parts
        is_parts_only = not (self._received or self._failed or self._flying)
        in_flight = 0 if parts is None else parts.num_busy()
        if not is_parts_only:
            in_flight += len(self._received) + len(self._failed)
            in_flight += sum(map(len, self._flying.values()))
        if not in_flight:
            raise EnvStateError("MultiEnv.recv() called with no env in flight; call send() first.")
        if batch_size == "auto" and take == "full":
            if self.picker is None:
                self.picker = BatchPicker(len(self._fan_out.groups[0].env_ids))
            picker = self.picker
            size = picker.size(in_flight)
            min_size = size if min_batch is None else min(_min_batch(min_batch, in_flight), size)
            batch = self._recv(size, min_size, timeout, False)
            picker.returned(len(batch[1]))
            return batch
        if type(batch_size) is int and min_batch is None and take == "full":  # the usual
            if 1 <= batch_size <= in_flight:
                if is_parts_only:  # (``_recv``'s first case, inline)
                    assert parts is not None
                    until = None if timeout is None else time.monotonic() + timeout
                    received = parts.receive(batch_size, timeout, batch_size)
                    if type(received) is tuple:
                        return received
                    assert isinstance(received, dict)
                    left = None if until is None else max(0.0, until - time.monotonic())
                    return self._recv(batch_size, batch_size, left, False, received)
                return self._recv(batch_size, batch_size, timeout, False)
        size, min_size = batch_bounds(batch_size, min_batch, take, in_flight)
        return self._recv(size, min_size, timeout, take == "ready")

    def _recv_step(self, timeout: float | None) -> StepBatch:
        """``recv(batch_size="auto")`` of the data plane's step of every env (``send_parts``).

        Its batch; or, handed over (a death, a deadline, an env's error), its workers
        collected the general way, all of them.
        """
        plane, picker = self.plane, self.picker
        assert plane is not None
        assert picker is not None
        num_envs = len(self._worker_of)
        picker.size(num_envs)
        deadline = None if timeout is None else time.monotonic() + timeout
        latencies = self._assembly.counters.latencies
        in_steps_s = latencies.total_s
        try:
            received = plane.receive(timeout)
        except BaseException:
            self._leave_step()  # Ctrl-C: the envs stay in flight, for the next recv
            raise
        finally:
            latencies.total_s = in_steps_s  # recv times itself (``timing``)
        if received is None:
            raise WaitTimeoutError(
                f"recv() timed out after {timeout} s with 0 of the {num_envs} envs ready; "
                "every step is still in flight, call recv() again."
            )
        self._stepping = False
        if type(received) is tuple:
            received[4]["env_id"] = np.arange(num_envs)
            picker.returned(num_envs)
            return received
        assert isinstance(received, StepPlan)
        self._adopt(dict.fromkeys(range(len(self._fan_out.groups)), received))
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        batch = self._recv(num_envs, num_envs, left, False)
        picker.returned(len(batch[1]))
        return batch

    def _leave_step(self) -> None:
        """The data plane's step in flight goes the general way, each worker a part of it."""
        self._stepping = False
        assert self.plane is not None
        plan = self.plane.interrupt()
        if plan is not None:
            self._adopt(dict.fromkeys(range(len(self._fan_out.groups)), plan))

    def _recv(
        self,
        size: int,
        min_size: int,
        timeout: float | None,
        is_ready: bool,
        handed: dict[int, Any] | None = None,
    ) -> StepBatch:
        """``recv`` of ``size`` envs at most (checked), ``min_size`` at least.

        ``is_ready``: as soon as ``min_size`` are done, with every env done then; else
        ``size``, or at the deadline ``min_size``. ``handed``: what the parts plane's
        ``receive`` handed over when ``recv`` called it first.
        """
        parts = self.parts
        is_parts_only = not (self._received or self._failed or self._flying)
        need = min_size if is_ready else size
        if self._failed:
            self._raise_first({})  # an env's error from an earlier call, before anything else
        deadline = None if timeout is None else time.monotonic() + timeout
        if is_parts_only or (parts is not None and parts.is_busy()):
            assert parts is not None
            if not self._received and not self._flying:
                if handed is None:
                    received = parts.receive(size, timeout, min_size, is_ready)
                    if type(received) is tuple:
                        return received
                    assert isinstance(received, dict)
                    handed = received
                # Something was not as usual. Every worker in flight is collected now,
                # so that the next sends find none stepping the general way and go on the
                # parts plane again; the envs collected are returned first, in order.
                errors = self._adopt(handed)
                errors.update(self._collect(deadline))
                self._raise_first(errors)  # the others' steps are kept
            elif len(self._received) < need or self._flying:  # both ways: one way only
                errors = self._adopt(parts.hand_over())
                errors.update(self._collect(deadline))
                self._raise_first(errors)
        while len(self._received) < need:
            flying = sorted(self._flying)
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = self._fan_out.wait_any(flying, left)
            if not ready:
                if len(self._received) >= min_size:
                    break  # the deadline's batch: what is done
                raise WaitTimeoutError(
                    f"recv() timed out after {timeout} s with {len(self._received)} of the "
                    f"{need} envs ready; every step is still in flight, call recv() again."
                )
            groups = self._fan_out.groups
            collected = {flying[k]: finish(groups[flying[k]]) for k in ready}
            errors = self._assembly.receive(collected, self._flying, self._received, self._plans)
            self._raise_first(errors)
        if is_ready and self._flying and len(self._received) < size:
            self._raise_first(self._collect(time.monotonic()))  # every env done by now
        ids = sorted(list(self._received)[:size])
        rows = [self._received.pop(env_index) for env_index in ids]
        return self._assembly.partial_batch(ids, rows)


def batch_bounds(
    batch_size: int | str | None, min_batch: int | None, take: str, in_flight: int
) -> tuple[int, int]:
    """The most and the fewest envs a ``recv`` returns, checked (``MultiEnv.recv``).

    A ``batch_size`` above the envs in flight is what is in flight, when the fewest it
    must return (``min_batch``; with ``take="ready"``, 1 by default) are in flight.
    """
    if take not in ("full", "ready"):
        raise ValueError(f"recv(take={take!r}): pass 'full' or 'ready'.")
    if batch_size == "auto":
        raise ValueError("recv(batch_size='auto') picks a full batch: leave take='full'.")
    if batch_size is not None and (type(batch_size) is not int or batch_size < 1):
        raise ValueError(
            f"recv(batch_size={batch_size!r}): pass an int from 1, 'auto', or None for all "
            f"{in_flight} envs in flight."
        )
    size = in_flight if batch_size is None else batch_size
    is_bounded = min_batch is not None or take == "ready"
    if size > in_flight and not is_bounded:
        raise ValueError(
            f"recv(batch_size={batch_size!r}) with {in_flight} envs in flight; pass a "
            f"batch_size from 1 to {in_flight}, None for all, or a min_batch the envs in "
            "flight can meet."
        )
    if min_batch is None:
        return min(size, in_flight), size if take == "full" else 1
    min_size = _min_batch(min_batch, in_flight)
    if min_size > size:
        raise ValueError(
            f"recv(min_batch={min_batch!r}) with batch_size {size}; pass an int from 1 to "
            f"{size}, or None."
        )
    return min(size, in_flight), min_size


def _min_batch(min_batch: Any, in_flight: int) -> int:
    """``min_batch``, checked: an int from 1 to the envs in flight."""
    if type(min_batch) is not int or not 1 <= min_batch <= in_flight:  # (bool is no int here)
        raise ValueError(
            f"recv(min_batch={min_batch!r}) with {in_flight} envs in flight; pass an int "
            f"from 1 to {in_flight}, or None."
        )
    return min_batch


def _is_ids(env_ids: Any, ids: bytes) -> bool:
    """Whether ``env_ids`` is an int64 array of exactly these ids' bytes."""
    return type(env_ids) is np.ndarray and env_ids.dtype == np.int64 and env_ids.tobytes() == ids
