"""VECTOR API: ``reset``, ``reset_async`` and ``reset_wait`` of a vector env.

A reset without seeds or per-env options, masked or not, goes on the vector's data plane
when it has one (``DataPlane.send_reset``: one planned round, the other envs skipped);
anything unusual there is handed over and collected as a reset by the pool. Seeds and
per-env options go by the pool (``fan_out.reset_batches``), one batch per worker.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from gymnasium.error import ClosedEnvironmentError

from multienv.errors import EnvError, NoPendingCallError, WaitTimeoutError
from multienv.supervision.handles import DataPlane
from multienv.vector import vector_checks
from multienv.vector.assembly import Assembly
from multienv.vector.fan_out import (
    ByWorker,
    FanOut,
    WorkerGroup,
    collect_slices,
    finish,
    raise_first,
    reset_batches,
)
from multienv.vector.timing import CallClock, clocked
from multienv.wire.protocol import StepPlan


class ResetApi:
    """A vector env's ``reset``, ``reset_async`` and ``reset_wait``; ``MultiEnv`` inherits them."""

    if TYPE_CHECKING:  # what they use of the vector
        closed: bool
        num_envs: int
        _pending_reset: Any
        _data_plane: DataPlane | None
        _fan_out: FanOut
        _assembly: Assembly
        _groups: list[WorkerGroup]
        _clock: CallClock
        _plan: StepPlan | None

        def _check_idle(self, name: str) -> None: ...

        def _collect_handed_over(self) -> ByWorker: ...

    @clocked
    def reset(
        self,
        *,
        seed: int | Sequence[int | None] | None = None,
        options: dict[str, Any] | Sequence[dict[str, Any] | None] | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        """Reset all envs, or those in ``options["reset_mask"]``.

        Args:
            seed: None, an int (env i gets ``seed + i``) or one seed per env.
            options: A dict passed to every env's ``reset``, in which ``"reset_mask"`` (a
                bool array of shape ``(num_envs,)``) selects the envs to reset; or a list
                of N dicts (or None), env i getting ``options[i]`` (the env-manager
                ``reset_param`` idea), which resets every env.
        """
        self._check_idle("reset")
        seeds, per_env, mask = self._reset_arguments(seed, options)
        plane = self._data_plane
        if plane is not None and seed is None and self._send_reset(plane, per_env, mask):
            return self._receive_reset(plane, mask, None)
        return self._finish_reset(self._fan_out.run(reset_batches(seeds, per_env, mask)), mask)

    @clocked
    def reset_async(
        self,
        seed: int | Sequence[int | None] | None = None,
        options: dict[str, Any] | Sequence[dict[str, Any] | None] | None = None,
    ) -> None:
        """Send a reset to the envs and return at once; ``reset_wait()`` collects it.

        The arguments are those of ``reset``; bad ones raise here, before anything is sent.
        """
        self._check_idle("reset_async")
        seeds, per_env, mask = self._reset_arguments(seed, options)
        plane = self._data_plane
        if plane is not None and seed is None and self._send_reset(plane, per_env, mask):
            self._pending_reset = ([], mask)  # nothing on the pool: the data plane's is in flight
            return
        make_batch = reset_batches(seeds, per_env, mask)
        self._pending_reset = (self._fan_out.submit_slices(make_batch), mask)

    @clocked
    def reset_wait(self, timeout: float | None = None) -> tuple[Any, dict[str, Any]]:
        """Wait for the reset sent by ``reset_async()``.

        Args:
            timeout: Seconds to wait; on expiry ``multiprocessing.TimeoutError`` is raised (as
                AsyncVectorEnv does) and the reset stays in flight: call ``reset_wait()``
                again.

        Raises:
            gymnasium.error.NoAsyncCallError: No ``reset_async()`` is pending.
        """
        if self.closed:
            raise ClosedEnvironmentError("MultiEnv.reset_wait() called after close().")
        if self._pending_reset is None:
            raise NoPendingCallError(
                "Calling `reset_wait` without any prior call to `reset_async`.", "reset"
            )
        futures, mask = self._pending_reset
        plane = self._data_plane
        if not futures and plane is not None and plane.is_in_flight():
            try:
                reset = self._receive_reset(plane, mask, timeout)
            except WaitTimeoutError:
                raise  # still in flight: reset_wait() again
            except BaseException:
                if self._pending_reset is not None and not self._pending_reset[0]:
                    self._pending_reset = None  # collected, or handed over (as step_wait)
                raise
            self._pending_reset = None
            return reset
        return self._wait_for_reset_pool(timeout)

    def _wait_for_reset_pool(self, timeout: float | None) -> tuple[Any, dict[str, Any]]:
        """``reset_wait`` of a reset collected on the pool; on expiry it stays in flight."""
        futures, mask = self._pending_reset
        outcome = collect_slices(futures, timeout, "reset")
        self._pending_reset = None
        plan = self._plan if self._plan is not None and self._plan.skip is not None else None
        if plan is not None:
            self._plan = None  # the data plane's reset, handed over (``_receive_reset``)
        return self._finish_reset(outcome, mask, plan)

    def _reset_arguments(
        self, seed: Any, options: Any
    ) -> tuple[list[int | None], list[Any], np.ndarray]:
        """Check a reset's arguments: each env's seed and options, and the mask of envs reset."""
        seeds = vector_checks.seeds(seed, self.num_envs)
        per_env, given_mask = vector_checks.options_per_env(options, self.num_envs)
        mask = vector_checks.reset_mask(given_mask, self.num_envs)
        return seeds, per_env, mask

    def _send_reset(self, plane: DataPlane, per_env: list[Any], mask: np.ndarray) -> bool:
        """Send a reset without per-env options on the data plane; False if it cannot go so."""
        return per_env.count(None) == self.num_envs and plane.send_reset(mask)

    def _receive_reset(
        self, plane: DataPlane, mask: np.ndarray, timeout: float | None
    ) -> tuple[Any, dict[str, Any]]:
        """The data plane's reset in flight; collected by the control plane if it hands it over.

        Raises:
            WaitTimeoutError: ``timeout`` passed first; the reset stays in flight.
        """
        until = None if timeout is None else time.monotonic() + timeout
        try:
            received = plane.receive_reset(timeout)
        except BaseException:
            plane.interrupt()  # Ctrl-C mid-wait: the supervisors collect it before the next
            raise
        if type(received) is tuple:
            return received
        if received is None:
            raise WaitTimeoutError(
                f"The call to `reset_wait` has timed out after {timeout} second(s); call "
                "reset_wait() again, or close()."
            )
        assert isinstance(received, StepPlan)
        if until is None:
            outcome = {number: finish(group) for number, group in enumerate(self._groups)}
            return self._finish_reset(outcome, mask, received)
        # reset_wait(timeout): collected on the pool, within the caller's timeout (as
        # step_wait); the plan waits in ``_plan`` (a reset's has ``skip``) till then.
        self._plan = received
        self._pending_reset = ([self._fan_out.executor.submit(self._collect_handed_over)], mask)
        return self._wait_for_reset_pool(max(0.0, until - time.monotonic()))

    def _finish_reset(
        self, outcome: ByWorker, mask: np.ndarray, plan: StepPlan | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """The reset's batched observations and infos; raises the lowest env's error, if any."""
        observations, infos, errors = self._assembly.reset_batch(outcome, self._groups, mask, plan)
        if errors:
            for error in errors.values():  # the other envs did reset: their results go along
                if isinstance(error, EnvError):
                    error.results, error.failed_env_ids = (observations, infos), sorted(errors)
            raise_first(errors)
        return observations, infos
