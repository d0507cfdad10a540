"""PARENT SIDE, subprocess backend: ``SubprocessLink``, what a vector shares with its workers.

It allocates the vector's shared batch (``shared_memory.SharedBatch``) when the observation
space has a fixed shape, tells each ``ProcessHandle`` its place in it, waits on many workers
at once (their pipes, sentinels and done pipes in one ``poll``), and plans whole-vector
steps: every action written and every item encoded once, each worker sending its slice.
"""

from __future__ import annotations

import select
import time
from collections.abc import Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.error import CustomSpaceError
from gymnasium.vector.utils import create_shared_memory

from multienv.backends.subprocess.data_plane import DataPlane
from multienv.backends.subprocess.parts_plane import PartsPlane
from multienv.backends.subprocess.process_handle import ProcessHandle
from multienv.backends.subprocess.process_launch import poll_ms
from multienv.supervision.handles import VectorLink, VectorParts, WorkerHandle
from multienv.wire import framing
from multienv.wire.done_pipes import DoneChannels
from multienv.wire.info_columns import AddInfo
from multienv.wire.protocol import StepPlan
from multienv.wire.shared_memory import BatchLayout, SharedBatch


def open_subprocess_link(
    handles: Sequence[WorkerHandle],
    spaces: tuple[gym.Space[Any], gym.Space[Any]],
    env_indices: Sequence[Sequence[int]],
    slices: Sequence[Sequence[int]],
    shared_memory: bool | None,
) -> VectorLink:
    """Link ``handles`` into one vector: shared memory when the spaces allow it (``OpenLink``)."""
    process_handles = [handle for handle in handles if isinstance(handle, ProcessHandle)]
    if len(process_handles) != len(handles):
        raise TypeError("a vector's envs must all use the same backend")
    return SubprocessLink(process_handles, spaces, env_indices, slices, shared_memory)


class SubprocessLink:
    """A vector's shared memory and done pipes, and the multi-wait over its workers.

    Args:
        handles: The vector's worker handles, by worker index.
        spaces: The single-env observation and action spaces.
        env_indices: Per worker, the vector's index of each env, by position (-1: none).
        slices: The workers each collecting thread serves (one done pipe each).
        shared_memory: None: shared memory when the space allows it; True: required
            (TypeError, as AsyncVectorEnv raises it, for a space of dynamic shape); False:
            observations are pickled.
    """

    def __init__(
        self,
        handles: Sequence[ProcessHandle],
        spaces: tuple[gym.Space[Any], gym.Space[Any]],
        env_indices: Sequence[Sequence[int]],
        slices: Sequence[Sequence[int]],
        shared_memory: bool | None = None,
    ) -> None:
        """Allocate the shared memory (for fixed-shape observations) and tell each handle."""
        observation_space, action_space = spaces
        num_envs = sum(sum(1 for i in indices if i >= 0) for indices in env_indices)
        self._shared: SharedBatch | None = None
        supported = BatchLayout.supports(observation_space)
        if shared_memory and not supported:
            _explain_no_shared_memory(observation_space)  # unless Gymnasium could share it
        if supported and shared_memory is not False:
            worker_of_env = np.zeros(num_envs, dtype=np.intp)
            for worker_number, indices in enumerate(env_indices):
                worker_of_env[[i for i in indices if i >= 0]] = worker_number
            self._shared = SharedBatch(
                observation_space, action_space, num_envs, slices, worker_of_env
            )
        self.has_shared_obs = self._shared is not None
        self._handles = list(handles)
        for worker_number, handle in enumerate(handles):
            handle.set_link(self._shared, worker_number, env_indices[worker_number])
        # Planned steps need env e at position e - first of its worker, workers in order.
        flat = [i for indices in env_indices for i in indices]
        self.can_plan = (
            self._shared is not None
            and self._shared.actions is not None
            and flat == list(range(num_envs))
        )

    def wait_any(
        self,
        handles: Sequence[WorkerHandle],
        deadlines: Sequence[float | None],
        timeout: float | None,
    ) -> list[int]:
        """Wait until some of ``handles`` can be collected without blocking; see VectorLink."""
        deadline = None if timeout is None else time.monotonic() + timeout
        has_polled = False
        while True:
            now = time.monotonic()
            poller = select.poll()
            owner: dict[int, int] = {}
            channels: dict[int, DoneChannels] = {}  # done pipes, drained rather than owned
            ready = []
            wait_until = deadline
            for position, handle in enumerate(handles):
                assert isinstance(handle, ProcessHandle)
                fds = handle.wait_handles()
                if fds is None or handle.has_record():
                    ready.append(position)
                    continue
                handle_deadline = deadlines[position]
                if handle_deadline is not None:
                    if handle_deadline <= now:
                        ready.append(position)
                        continue
                    wait_until = (
                        handle_deadline if wait_until is None else min(wait_until, handle_deadline)
                    )
                for fd in fds:
                    poller.register(fd, select.POLLIN)
                    owner[fd] = position
                if self._shared is not None:
                    channels[handle.done_read] = self._shared.done
            if ready:
                return ready
            if has_polled and deadline is not None and now >= deadline:
                return []
            for fd in channels:
                poller.register(fd, select.POLLIN)
            events = poller.poll(poll_ms(wait_until, now))
            has_polled = True
            for fd, _ in events:
                if fd in channels:
                    channels[fd].drain(fd)  # the records are checked at the top
                else:
                    ready.append(owner[fd])
            if ready:
                return sorted(set(ready))

    def observations(self, env_ids: Sequence[int] | None, copy: bool) -> Any:
        """The batched observations from shared memory."""
        assert self._shared is not None
        return self._shared.observations(env_ids, copy=copy)

    def plan_step(
        self, actions: Any, is_reset: np.ndarray, autoreset: bool, is_counted: bool = False
    ) -> StepPlan | None:
        """Write every env's action and item flags at once (array spaces only).

        ``is_counted``: start a round (``done_pipes``): every worker will get its slice.
        """
        shared = self._shared
        if not self.can_plan or shared is None or shared.actions is None:
            return None
        if actions.dtype != shared.actions.dtype:  # the envs get the values as given
            return None
        if is_counted:
            shared.done.open_round()
        slots = shared.next_slots(slice(None))
        shared.actions[:] = actions  # a reset's action is not read
        shared.plan_flags[:] = framing.item_flags(is_reset, slots, autoreset, info_columns=True)
        num_resets = int(np.count_nonzero(is_reset))
        return StepPlan(actions, is_reset, autoreset, slots, num_resets, is_counted)

    def commit(
        self, plan: StepPlan, index: slice | np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Move ``index`` of a clean plan to its new slots; views of its rewards and flags."""
        shared = self._shared
        assert shared is not None
        slots = plan.wire  # the slot each env's observation goes to
        is_all = isinstance(index, slice) and index == slice(None)
        shared.move_to(index, slots if is_all else slots[index])
        flags = shared.flags
        return shared.rewards[index], flags[0, index], flags[1, index]

    def open_data_plane(self, vector: VectorParts) -> DataPlane | None:
        """The vector's healthy step in one pass (``data_plane``), if its layout allows one.

        It needs planned steps (array spaces, each worker a run of the vector's envs in
        order) and all workers in one slice. Its ``parts`` is the parts plane of the same
        workers (``parts_plane``), for ``send``/``recv``.
        """
        if not self.can_plan or self._shared is None:
            return None
        try:
            plane = DataPlane(self._shared, vector)
        except ValueError:  # several slices: the vector collects on several threads
            return None
        plane.parts = PartsPlane(plane, self._shared, vector)
        return plane

    def merge_info_columns(
        self, pickled: dict[int, dict[str, Any]], fresh: slice | np.ndarray, add_info: AddInfo
    ) -> dict[str, Any]:
        """A planned step's infos: ``pickled`` ones by env, and the rows of envs ``fresh``."""
        assert self._shared is not None
        return self._shared.infos.merge(pickled, fresh, add_info)

    def batch_times(self, worker_number: int) -> np.ndarray:
        """The worker's own time on each of its latest batches in shared memory (s)."""
        if self._shared is None:
            return np.empty(0)
        return self._shared.batch_times(worker_number)

    def row_infos(self, env_ids: np.ndarray) -> dict[int, dict[str, Any]]:
        """The infos in the rows of envs ``env_ids`` (whose workers answered), by env."""
        assert self._shared is not None
        return self._shared.infos.row_infos(env_ids)

    def finals(self, env_ids: np.ndarray) -> dict[int, dict[str, Any]]:
        """Same-step autoreset's final obs and info of ``env_ids``, by env (see VectorLink)."""
        assert self._shared is not None
        return self._shared.finals(env_ids)

    def close(self) -> None:
        """Free the shared memory; the handles forget it."""
        for handle in self._handles:
            handle.set_link(None, -1, [])
        if self._shared is not None:
            self._shared.close()


def _explain_no_shared_memory(space: gym.Space[Any]) -> None:
    """Raise what AsyncVectorEnv(shared_memory=True) raises for a space it cannot share.

    A space Gymnasium can share but multienv's layout cannot (Text, OneOf) raises nothing:
    its observations are pickled.
    """
    try:
        create_shared_memory(space, n=1)
    except CustomSpaceError as exc:
        raise ValueError(
            f"Using shared_memory=True with the custom space {space} caused an error; pass "
            "shared_memory=False or leave it None (the observations are then pickled)."
        ) from exc
    except TypeError as exc:
        raise TypeError(
            f"{space} has a dynamic shape so its not possible to make a static shared memory. "
            "Pass shared_memory=False or leave it None."
        ) from exc
    # Gymnasium lays it out in shared memory (Text, OneOf); multienv pickles it instead.
