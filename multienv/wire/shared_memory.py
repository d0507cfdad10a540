"""BOTH SIDES: a vector's shared buffers; the parent allocates and frees, workers write rows.

One anonymous memory file (``os.memfd_create``) per vector holds, for every env:

- two observation slots. A worker writes the observation of each step into the slot the
  parent names, never into the one holding the observation the caller saw last. So when a
  worker is killed halfway through a write, that observation is still intact, and the
  truncation the caller gets for the crash carries it (docs/failures.rst);
- its action, written by the parent before the step is sent (array action spaces only);
- its reward, terminated and truncated flags;
- a row of info cells and the id of the info's schema (``info_columns``);
- the final observation and a row of info cells for the final info of an episode that a
  same-step autoreset ended and reset in a planned step (``SharedBatch.finals``);
- the flags of its item in a planned step (``framing``: reset or step, slot, autoreset).

and, for every worker, the seq of its batch in flight and the seq of the last planned step
it answered with everything in shared memory (its *status*), so that a vector's step reads
whether all workers are done as one array (``data_plane``).

The file has no name, so nothing is left in ``/dev/shm`` whatever kills the parent; its fd
travels to each worker over the pipe (``multiprocessing.reduction.send_handle``), again after
every respawn, and the memory goes when the last mapping of it does.

Beside the file, the workers tell the parent that a fast batch is done through the pipes of
``done_pipes`` (``SharedBatch.done``). A worker hosting k envs writes the rows of its k envs
(``SlotWriter``), addressed by their index in the vector.

Fixed-shape spaces only: Box, Discrete, MultiBinary, MultiDiscrete, and Dict/Tuple of them.
Other spaces are pickled through the pipe as before (``BatchLayout.supports``).
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import sys
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import gymnasium as gym
import numpy as np

from multienv.wire.autoreset import add_shared_finals, resolve_next_step, shared_finals
from multienv.wire.done_pipes import DoneChannels, DoneNotifier
from multienv.wire.framing import IS_NEXT_STEP, IS_SKIP
from multienv.wire.info_columns import (
    CELL_DTYPE,
    MAX_CELLS,
    SCHEMA_DTYPE,
    AddInfo,
    ColumnReader,
    ColumnWriter,
    contiguous_slice,
)

# The spaces whose values are one fixed-shape array: they travel as one, and batch as one.
ARRAY_SPACES = (
    gym.spaces.Box,
    gym.spaces.Discrete,
    gym.spaces.MultiBinary,
    gym.spaces.MultiDiscrete,
)
_ALIGN = 64  # bytes; each array starts on its own cache line
BATCH_TIMES = 64  # the batch times each worker keeps (``SlotWriter.note_batch_time``)
_LARGE_OBS = 16 * 1024  # bytes of one env's observation; see SlotWriter.writes_each_obs
_ALL = slice(None)
Path = tuple[Any, ...]


def _leaves(space: gym.Space[Any], path: Path = ()) -> Iterator[tuple[Path, gym.Space[Any]]]:
    """Yield ``(path, space)`` for every array space in ``space``, in a fixed order."""
    if isinstance(space, gym.spaces.Dict):
        for key, sub in space.spaces.items():
            yield from _leaves(sub, (*path, key))
    elif isinstance(space, gym.spaces.Tuple):
        for position, sub in enumerate(space.spaces):
            yield from _leaves(sub, (*path, position))
    else:
        yield path, space


def _is_fixed(space: gym.Space[Any]) -> bool:
    return all(isinstance(leaf, ARRAY_SPACES) for _, leaf in _leaves(space))


def _dig(value: Any, path: Path) -> Any:
    for key in path:
        value = value[key]
    return value


def _assemble(space: gym.Space[Any], arrays: dict[Path, Any], path: Path = ()) -> Any:
    """Nest ``arrays`` (keyed by leaf path) the way ``space`` nests its leaves."""
    if isinstance(space, gym.spaces.Dict):
        return {key: _assemble(sub, arrays, (*path, key)) for key, sub in space.spaces.items()}
    if isinstance(space, gym.spaces.Tuple):
        return tuple(_assemble(sub, arrays, (*path, i)) for i, sub in enumerate(space.spaces))
    return arrays[path]


class BatchLayout:
    """Where each array of a vector's shared buffers lives; both sides build the same one.

    Args:
        observation_space: The single-env observation space (must be fixed-shape).
        action_space: The single-env action space; its actions are shared only when it is a
            plain Box, Discrete, MultiBinary or MultiDiscrete.
        num_envs: How many envs the vector has.
    """

    def __init__(
        self, observation_space: gym.Space[Any], action_space: gym.Space[Any], num_envs: int
    ) -> None:
        """Compute the offset, shape and dtype of every array."""
        self.observation_space = observation_space
        self.action_space = action_space
        self.num_envs = num_envs
        self.has_actions = isinstance(action_space, ARRAY_SPACES)
        self._arrays: dict[str, tuple[int, tuple[int, ...], np.dtype[Any]]] = {}
        self._size = 0
        self.obs_paths = [path for path, _ in _leaves(observation_space)]
        for path, leaf in _leaves(observation_space):
            self._add(("obs", *path), (2, num_envs, *(leaf.shape or ())), leaf.dtype)
        if self.has_actions:
            self._add(("action",), (num_envs, *(action_space.shape or ())), action_space.dtype)
        self._add(("reward",), (num_envs,), np.dtype(np.float64))
        self._add(("flags",), (2, num_envs), np.dtype(np.bool_))
        self._add(("info_schema",), (num_envs,), SCHEMA_DTYPE)
        self._add(("info_cells",), (num_envs, MAX_CELLS), CELL_DTYPE)
        # Same-step autoreset's final observation and info of an env whose episode ended,
        # when its worker's planned step reset it (``planned_step``); one array only.
        if self.obs_paths == [()]:
            leaf = observation_space
            self._add(("final_obs",), (num_envs, *(leaf.shape or ())), leaf.dtype)
            self._add(("final_schema",), (num_envs,), SCHEMA_DTYPE)
            self._add(("final_cells",), (num_envs, MAX_CELLS), CELL_DTYPE)
        self._add(("plan_flags",), (num_envs,), np.dtype(np.uint8))
        # By worker index (a vector has at most num_envs workers).
        self._add(("seqs",), (num_envs,), np.dtype(np.uint8))
        self._add(("status",), (num_envs,), np.dtype(np.uint8))
        # Each worker's own time per fast batch, its latest BATCH_TIMES (``MultiEnv.timing``).
        self._add(("batch_s",), (num_envs, BATCH_TIMES), np.dtype(np.float64))
        self._add(("batch_count",), (num_envs,), np.dtype(np.int64))
        self.size = max(self._size, 1)

    @staticmethod
    def supports(observation_space: gym.Space[Any]) -> bool:
        """Whether observations of this space can go through shared memory on this platform."""
        return (
            hasattr(os, "memfd_create")
            and sys.platform.startswith("linux")
            and (_is_fixed(observation_space))
        )

    def _add(self, name: Path, shape: tuple[int, ...], dtype: Any) -> None:
        dtype = np.dtype(dtype)
        offset = -(-self._size // _ALIGN) * _ALIGN
        self._arrays[repr(name)] = (offset, shape, dtype)
        self._size = offset + int(np.prod(shape)) * dtype.itemsize

    def views(self, buffer: Any) -> dict[str, np.ndarray]:
        """Map every array onto ``buffer``; keys are ``repr`` of ``("obs", *path)`` etc."""
        return {
            name: np.ndarray(shape, dtype=dtype, buffer=buffer, offset=offset)
            for name, (offset, shape, dtype) in self._arrays.items()
        }

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle as the three arguments; the worker recomputes the same offsets."""
        return BatchLayout, (self.observation_space, self.action_space, self.num_envs)


class _Mapping:
    """One mapping of the memory file, with named numpy views onto it."""

    def __init__(self, layout: BatchLayout, fd: int) -> None:
        self.layout = layout
        self.memory = mmap.mmap(fd, layout.size)
        views = layout.views(self.memory)
        self.obs = {path: views[repr(("obs", *path))] for path in layout.obs_paths}
        self.actions = views[repr(("action",))] if layout.has_actions else None
        self.rewards = views[repr(("reward",))]
        self.flags = views[repr(("flags",))]
        self.info_schema = views[repr(("info_schema",))]
        self.info_cells = views[repr(("info_cells",))]
        self.final_obs = views.get(repr(("final_obs",)))
        self.final_schema = views.get(repr(("final_schema",)), np.empty(0, SCHEMA_DTYPE))
        self.final_cells = views.get(repr(("final_cells",)), np.empty((0, MAX_CELLS)))
        self.plan_flags = views[repr(("plan_flags",))]
        self.seqs = views[repr(("seqs",))]
        self.status = views[repr(("status",))]
        self.batch_s = views[repr(("batch_s",))]
        self.batch_count = views[repr(("batch_count",))]

    def release(self) -> None:
        """Drop the views and unmap, unless a caller still holds a view (then GC unmaps)."""
        self.obs, self.actions = {}, None
        self.rewards = self.flags = self.info_schema = self.info_cells = np.empty(0)
        self.final_obs, self.final_schema, self.final_cells = None, np.empty(0), np.empty(0)
        self.plan_flags = self.seqs = self.status = np.empty(0, dtype=np.uint8)
        self.batch_s, self.batch_count = np.empty((0, BATCH_TIMES)), np.empty(0, np.int64)
        try:
            self.memory.close()
        except BufferError:
            pass  # copy=False views are still alive; the mapping goes with the last of them


class SharedBatch:
    """PARENT SIDE: the vector's shared buffers and which observation slot each env is on.

    Args:
        observation_space: The single-env observation space; see ``BatchLayout.supports``.
        action_space: The single-env action space.
        num_envs: How many envs the vector has.
        slices: The workers (by worker index) each parent thread collects, one set of
            done pipes per slice (``done_pipes``).
        worker_of_env: Each env's worker index (default: one worker per env).
    """

    def __init__(
        self,
        observation_space: gym.Space[Any],
        action_space: gym.Space[Any],
        num_envs: int,
        slices: Sequence[Sequence[int]],
        worker_of_env: Sequence[int] | np.ndarray | None = None,
    ) -> None:
        """Allocate the memory file and map it."""
        self.layout = BatchLayout(observation_space, action_space, num_envs)
        self.fd: int | None = os.memfd_create("multienv-batch", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.layout.size)
        self._mapping = _Mapping(self.layout, self.fd)
        self._slot = np.zeros(num_envs, dtype=np.int8)  # the slot holding each env's last obs
        self.num_envs = num_envs
        self._same_slot: int | None = 0  # the slot of every env, when they are all on one
        self._is_slot_stale = False  # _slot is not written out yet: every env is on _same_slot
        self._whole = (np.zeros(num_envs, dtype=np.int8), np.ones(num_envs, dtype=np.int8))
        for slots in self._whole:
            slots.flags.writeable = False
        self.infos = ColumnReader(
            self._mapping.info_schema,
            self._mapping.info_cells,
            np.arange(num_envs) if worker_of_env is None else np.asarray(worker_of_env),
        )
        # Same-step autoreset's final infos, numbered as the infos are (``ColumnWriter``).
        self.final_infos = self.infos.beside(self._mapping.final_schema, self._mapping.final_cells)
        # How the workers say a fast batch is done; the seq each awaits lives here.
        self.done = DoneChannels(slices, self._mapping.seqs)
        # close() runs it; so does the collector, for a vector dropped unclosed.
        self._release = weakref.finalize(self, _release, self._mapping, self.fd, self.done)
        self._release.atexit = False  # the process's end frees all of it

    def next_slots(self, env_ids: Any) -> np.ndarray:
        """The slot each env's next observation goes to: never the one the caller saw last."""
        if self._same_slot is not None and isinstance(env_ids, slice) and env_ids == _ALL:
            return self._whole[1 - self._same_slot]  # the usual step: no arithmetic
        slots: np.ndarray = 1 - self._slots()[env_ids]
        return slots

    def whole_slots(self, slot: int) -> np.ndarray:
        """Every env on ``slot``: the slots of a planned step whose observations go there."""
        return self._whole[slot]

    def has_same_slot(self) -> bool:
        """Whether every env is known to be on one slot (then ``next_slots`` is shared)."""
        return self._same_slot is not None

    @property
    def same_slot(self) -> int | None:
        """The slot every env's last observation is on, when they are all on one."""
        return self._same_slot

    def move_all_to(self, slot: int) -> None:
        """Every env's observation is in ``slot`` now: a planned step came back clean.

        The per-env slots are written only when something reads them (``_slots``).
        """
        self._same_slot = slot
        self._is_slot_stale = True

    def _slots(self) -> np.ndarray:
        """Each env's slot, written out if ``move_all_to`` left it to be."""
        if self._is_slot_stale:
            assert self._same_slot is not None  # move_all_to set it
            self._is_slot_stale = False
            self._slot[:] = self._same_slot
        return self._slot

    def move_to(self, env_ids: Any, slots: np.ndarray) -> None:
        """These envs' observations are in ``slots`` now: their batch came back clean."""
        self._slots()[env_ids] = slots
        if isinstance(env_ids, slice) and env_ids == _ALL and slots is self._whole[slots[0]]:
            self._same_slot = int(slots[0])
        else:
            self._same_slot = None  # observations() finds out again

    def loose_slots(self) -> np.ndarray:
        """Each env's slot, for a caller that writes it (``parts_plane``); none shared now."""
        slots = self._slots()
        self._same_slot = None
        return slots

    @property
    def slot(self) -> np.ndarray:
        """The slot holding each env's last observation (read-only; ``move_to`` moves)."""
        view = self._slots().view()
        view.flags.writeable = False
        return view

    @property
    def actions(self) -> np.ndarray | None:
        """The shared action array, shape ``(num_envs, *action_shape)``, or None."""
        return self._mapping.actions

    @property
    def rewards(self) -> np.ndarray:
        """The shared rewards, shape ``(num_envs,)``."""
        return self._mapping.rewards

    @property
    def flags(self) -> np.ndarray:
        """The shared terminated (row 0) and truncated (row 1) flags, shape ``(2, num_envs)``."""
        return self._mapping.flags

    @property
    def obs_slots(self) -> np.ndarray | None:
        """Both slots of every env's observation, ``(2, num_envs, ...)``; None when nested."""
        return self._mapping.obs.get(())

    @property
    def plan_flags(self) -> np.ndarray:
        """Each env's item flags in the planned step in flight (``framing``)."""
        return self._mapping.plan_flags

    def batch_times(self, worker_number: int) -> np.ndarray:
        """The worker's own time on each of its latest fast batches, in seconds (a copy)."""
        count = int(self._mapping.batch_count[worker_number])
        return self._mapping.batch_s[worker_number, : min(count, BATCH_TIMES)].copy()

    @property
    def status(self) -> np.ndarray:
        """By worker, the seq of the last planned step it answered with all in shared memory."""
        return self._mapping.status

    @property
    def has_finals(self) -> bool:
        """Whether a planned step's same-step autoresets may leave their finals here."""
        return self._mapping.final_obs is not None

    def finals(self, env_ids: np.ndarray) -> dict[int, dict[str, Any]]:
        """Same-step autoreset: the finals of ``env_ids`` left here, each as its env's info."""
        assert self._mapping.final_obs is not None
        return shared_finals(self._mapping.final_obs, self.final_infos, env_ids)

    def add_finals(
        self, infos: dict[str, Any], ended: np.ndarray, add_info: AddInfo
    ) -> dict[str, Any]:
        """A healthy step's ``infos`` with the finals of the episodes it ended.

        ``infos`` holds every env's row; ``ended`` (a new array) becomes the finals' mask.
        """
        assert self._mapping.final_obs is not None
        env_ids = ended.nonzero()[0]
        merged = add_shared_finals(
            infos, ended, env_ids, self._mapping.final_obs, self.final_infos, add_info
        )
        if merged is None:  # a key meets another: the finals first, then the rows
            return self.infos.merge(self.finals(env_ids), _ALL, add_info)
        return merged

    def read(self, env_index: int) -> Any:
        """A copy of the observation that env is on (its current slot)."""
        slot = int(self._slots()[env_index])
        arrays = {path: array[slot, env_index].copy() for path, array in self._mapping.obs.items()}
        return _assemble(self.layout.observation_space, arrays)

    def observations(self, env_ids: Sequence[int] | None = None, *, copy: bool = False) -> Any:
        """The batched observations: views of one slot for all envs, or a copy for ``env_ids``.

        For all envs, envs left on the other slot (by a masked reset, a crash or partial
        batches) are copied over first, so the result is one slot, without copying the rest.
        """
        mapping = self._mapping
        if env_ids is not None:
            slot = self._slots()
            ids = np.asarray(env_ids, dtype=np.intp)
            arrays = {path: array[slot[ids], ids] for path, array in mapping.obs.items()}
            return _assemble(self.layout.observation_space, arrays)
        target = self._same_slot
        if target is None:
            slot = self._slot  # not stale: only move_all_to leaves it so, with a same slot
            target = int(2 * int(slot.sum()) > slot.size)  # the slot most envs are on
            behind = np.flatnonzero(slot != target)
            if behind.size:
                for array in mapping.obs.values():
                    array[target, behind] = array[1 - target, behind]
                slot[behind] = target
            self._same_slot = target
        obs = mapping.obs
        if () in obs:  # not nested: one array
            return obs[()][target].copy() if copy else obs[()][target]
        if copy:
            arrays = {path: array[target].copy() for path, array in obs.items()}
        else:
            arrays = {path: array[target] for path, array in obs.items()}
        return _assemble(self.layout.observation_space, arrays)

    def close(self) -> None:
        """Close the memory file; the memory is freed once no worker or view maps it."""
        self._release()
        self.fd = None


def _release(mapping: _Mapping, fd: int, done: DoneChannels) -> None:
    """Unmap the buffers and close the memory file and the done pipes, once."""
    mapping.release()
    os.close(fd)
    done.close()


@dataclasses.dataclass(frozen=True)
class PlannedRows:
    """WORKER SIDE: what a planned step reads and writes of the shared buffers, mapped once.

    The worker's own rows are views (its envs are a run of the vector's, ``first`` on); the
    per-env results are memoryviews of the whole vector's arrays, indexed by env index: a
    store through one costs a tenth of a numpy item's.
    """

    first: int  # the vector's index of the worker's first env
    seq: memoryview  # the worker's one byte: the seq of the planned step sent
    plan: np.ndarray  # its envs' item flags (``framing``)
    ends: tuple[np.ndarray, np.ndarray]  # its envs' last terminated and truncated flags
    actions: np.ndarray | None  # its envs' actions; None: they are not shared
    is_discrete: bool  # the actions are Discrete: each is passed as a numpy integer
    obs: tuple[np.ndarray, np.ndarray] | None  # its envs' rows of slot 0 and 1; None: nested
    final_obs: np.ndarray | None  # its envs' final observations (same-step); None: nested
    rewards: memoryview
    terminated: memoryview
    truncated: memoryview
    info_ids: memoryview  # each env's info schema id; 0: its row holds no info


class SlotWriter:
    """WORKER SIDE: a worker's view of the shared buffers: its envs' actions, slots and results.

    Args:
        layout: The vector's layout, as the parent sent it.
        fd: The memory file, received from the parent; closed once mapped.
        notifier: Sends the DONE records of the worker's fast batches (``done_pipes``).
        env_indices: The vector's index of each env of the worker, by position (-1: none).
    """

    def __init__(
        self,
        layout: BatchLayout,
        fd: int,
        notifier: DoneNotifier,
        env_indices: Sequence[int],
    ) -> None:
        """Map the memory file."""
        try:
            self._mapping = _Mapping(layout, fd)
        finally:
            os.close(fd)
        self.notifier = notifier
        self.env_indices = list(env_indices)
        self._all_positions = list(range(len(self.env_indices)))
        # All of the worker's envs, when they are a run of the vector's: one slice for all
        self._whole: slice | None = contiguous_slice(self.env_indices)
        self._obs = list(self._mapping.obs.items())
        # Large observations are written one by one, each as soon as its env has stepped:
        # written after the loop, a batch of them is read back from memory, not the cache.
        # Small ones are written at once, in one numpy call (both measured, 16 envs a worker).
        self.writes_each_obs = sum(array[0, 0].nbytes for _, array in self._obs) >= _LARGE_OBS
        self._is_discrete = isinstance(layout.action_space, gym.spaces.Discrete)
        self.infos = ColumnWriter(self._mapping.info_schema, self._mapping.info_cells)
        # Same-step autoreset's final infos, numbered with the infos (one set of schemas).
        self.final_infos = ColumnWriter(
            self._mapping.final_schema, self._mapping.final_cells, numbering=self.infos
        )
        notifier.status = self._mapping.status.data  # a planned step's answer goes there too
        # Memoryviews of this worker's row: a store costs a tenth of a numpy item's.
        number = notifier.worker_number
        self._times = self._mapping.batch_s[number].data
        self._time_count = self._mapping.batch_count[number : number + 1].data

    def note_batch_time(self, elapsed_s: float) -> None:
        """Keep the time this worker spent on a fast batch, among its latest ones."""
        count = self._time_count[0]
        self._times[count % BATCH_TIMES] = elapsed_s
        self._time_count[0] = count + 1

    def planned_items(self) -> tuple[int, list[tuple[int, int]]]:
        """The seq and ``(position, flags)`` items of the planned step the parent sent.

        A planned step steps every env of the worker, in position order, but those whose
        flags say ``IS_SKIP`` (a data plane's reset of some envs); the parent wrote their
        flags and the worker's seq into shared memory before it woke the worker.
        """
        whole = self._whole
        assert whole is not None  # the parent plans only workers of a run of its envs
        mapping = self._mapping
        seq = int(mapping.seqs[self.notifier.worker_number])
        items = list(enumerate(mapping.plan_flags[whole].tolist()))
        if any(flags & IS_SKIP for _, flags in items):  # a reset of some envs
            items = [item for item in items if not item[1] & IS_SKIP]
        if items and items[0][1] & IS_NEXT_STEP:  # a step's flags are the same for all envs
            flags = mapping.flags
            items = resolve_next_step(items, (flags[0, whole] | flags[1, whole]).tolist())
        return seq, items

    def planned_rows(self) -> PlannedRows | None:
        """The worker's rows for its planned steps; None when its envs are not a run."""
        whole, mapping = self._whole, self._mapping
        if whole is None:
            return None
        number = self.notifier.worker_number
        obs = mapping.obs.get(()) if len(mapping.obs) == 1 else None
        return PlannedRows(
            first=whole.start,
            seq=mapping.seqs[number : number + 1].data,
            plan=mapping.plan_flags[whole],
            ends=(mapping.flags[0, whole], mapping.flags[1, whole]),
            actions=None if mapping.actions is None else mapping.actions[whole],
            is_discrete=self._is_discrete,
            obs=None if obs is None else (obs[0, whole], obs[1, whole]),
            final_obs=None if mapping.final_obs is None else mapping.final_obs[whole],
            rewards=mapping.rewards.data,
            terminated=mapping.flags[0].data,
            truncated=mapping.flags[1].data,
            info_ids=mapping.info_schema.data,
        )

    def read_actions(self, positions: Sequence[int]) -> list[Any]:
        """The actions of the envs at ``positions`` as the parent wrote them.

        As Gymnasium's vector envs pass them: a Discrete action is a numpy integer (which
        ``Discrete.contains`` checks faster than a Python int), other actions are arrays.
        """
        actions = self._mapping.actions
        if not positions:
            return []
        assert actions is not None
        env_indices = self.env_indices
        if len(positions) == 1:
            row = actions[env_indices[positions[0]]]
            return [row if self._is_discrete else row.copy()]
        return list(actions[self._index_of(positions)])

    def write_obs(self, position: int, slot: int, obs: Any) -> None:
        """Write ``obs`` into the slot of the env at ``position``; its shape was checked."""
        env_index = self.env_indices[position]
        for path, array in self._obs:
            array[slot, env_index] = _dig(obs, path) if path else obs

    def write_many_obs(
        self, positions: Sequence[int], slots: Sequence[int], observations: Sequence[Any]
    ) -> None:
        """Write each env's obs into its slot; all of the worker's envs on one slot at once."""
        index = self._index_of(positions)
        if isinstance(index, slice) and slots and slots.count(slots[0]) == len(slots):
            for path, array in self._obs:
                array[slots[0], index] = (
                    [_dig(obs, path) for obs in observations] if path else observations
                )
            return
        for position, slot, obs in zip(positions, slots, observations, strict=True):
            self.write_obs(position, slot, obs)

    def _index_of(self, positions: Sequence[int]) -> slice | list[int]:
        """The vector's rows of the envs at ``positions``: a slice when they are all, in order."""
        if self._whole is not None and positions == self._all_positions:
            return self._whole
        env_indices = self.env_indices
        return [env_indices[position] for position in positions]

    def write_results(
        self,
        positions: Sequence[int],
        rewards: Sequence[Any],
        terminations: Sequence[Any],
        truncations: Sequence[Any],
    ) -> None:
        """Write the rewards and the two flags of the envs at ``positions``."""
        if not positions:
            return
        mapping, env_indices = self._mapping, self.env_indices
        if len(positions) == 1:
            env_index = env_indices[positions[0]]
            mapping.rewards[env_index] = rewards[0]
            mapping.flags[0, env_index] = terminations[0]
            mapping.flags[1, env_index] = truncations[0]
            return
        index = self._index_of(positions)
        mapping.rewards[index] = rewards
        mapping.flags[0, index] = terminations
        mapping.flags[1, index] = truncations
