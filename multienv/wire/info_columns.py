"""BOTH SIDES: per-step infos of plain numbers, as columns of the vector's shared memory.

Most envs return an info of the same few numbers every step (HalfCheetah: four floats;
ALE: three ints). Pickled, such an info costs the worker a pickle, the parent an unpickle,
and the parent one ``VectorEnv._add_info`` per env, which together cost more than a MuJoCo
step. Instead, for the items of a planned step (``framing.IS_INFO_COLUMNS``):

- the worker (``ColumnWriter``) writes the values of an info whose values are all plain
  numbers into its env's row of ``cells``, and the info's *schema* (keys and dtypes) as a
  small number into ``schema_ids``. A schema is numbered per worker and sent to the parent
  once, with the reply of the step that first uses it (``Reply.schemas``); a respawned worker
  numbers afresh and sends its schemas again before it uses them;
- the parent (``ColumnReader``) turns the rows of every env that answered this step into
  Gymnasium's ``key`` + ``_key`` arrays, a few numpy operations per key for the whole vector.

An info with anything else in it (a dict, an array, a string, a ``final_obs``, an np.bool_,
which Gymnasium batches as objects), or more keys than a row has cells, is pickled as before.
The arrays are exactly what ``_add_info`` builds: dtype ``type(value)``, zeros where the
mask is False.
"""

from __future__ import annotations

import dataclasses
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

MAX_CELLS = 16  # values per env and step; an info with more keys is pickled
MAX_SCHEMAS = 255  # per worker; ids are uint8, 0 meaning "no info in the row"
SCHEMA_DTYPE = np.dtype(np.uint8)
CELL_DTYPE = np.dtype(np.float64)  # ints and bools go through an int64 view of the same cells

_ALL = slice(None)
_MAX_WHOLE = 64  # the id patterns whose schema ``ColumnReader`` remembers

_PLAIN = (int, float, bool)  # Gymnasium's own test: ``type(value) in [int, float, bool]``


@dataclasses.dataclass(frozen=True)
class InfoSchema:
    """The keys of an info and the dtype Gymnasium gives each one's array."""

    keys: tuple[Any, ...]
    dtypes: tuple[np.dtype[Any], ...]

    @property
    def is_float(self) -> tuple[bool, ...]:
        """Per key: its cell holds a float64 (else an int64)."""
        return tuple(dtype.kind == "f" for dtype in self.dtypes)


def schema_of(keys: tuple[Any, ...], types: tuple[type, ...]) -> InfoSchema | None:
    """The schema of an info with these keys and value types, or None if it is not plain.

    Plain values are those ``_add_info`` puts into a numeric array and a cell holds exactly:
    ``int``, ``float``, ``bool`` and numpy's integers and floats of up to 64 bits but uint64.
    """
    if not keys or len(keys) > MAX_CELLS or "final_obs" in keys:
        return None
    dtypes = []
    for kind in types:
        if kind not in _PLAIN and not issubclass(kind, np.number):
            return None
        dtype = np.dtype(kind)
        if dtype.kind not in "biuf" or dtype.itemsize > 8 or dtype == np.uint64:
            return None
        dtypes.append(dtype)
    return InfoSchema(keys, tuple(dtypes))


class ColumnWriter:
    """WORKER SIDE: writes infos into the rows of the worker's envs, numbering schemas.

    Args:
        schema_ids: The vector's schema id per env (uint8).
        cells: The vector's cells, shape ``(num_envs, MAX_CELLS)``, float64.
    """

    def __init__(
        self, schema_ids: np.ndarray, cells: np.ndarray, numbering: ColumnWriter | None = None
    ) -> None:
        """Start with no schema known, or with those of ``numbering``, which numbers them."""
        self._ids = schema_ids.data  # a memoryview: item assignment costs less than numpy's
        self._cells = cells
        self._buffer = cells.data
        self._row_bytes = cells.strides[0]
        # The writer whose numbers this one uses (and whose ``pending`` gets its new ones).
        self._numbering = self if numbering is None else numbering
        # (*keys, *types) -> (id, how its values pack into a row), or None: not plain
        self._known: dict[tuple[Any, ...], tuple[int, struct.Struct] | None] = (
            {} if numbering is None else numbering._known
        )
        self.pending: list[tuple[int, InfoSchema]] = []  # numbered, not yet sent

    def write(self, env_index: int, info: dict[str, Any]) -> bool:
        """Put ``info`` in the env's row; False (row cleared) if it must be pickled instead."""
        values = info.values()
        # Keys then types: the length says how many (n keys, 2n items), so no count.
        signature = (*info, *map(type, values))
        try:  # one lookup, not two: on every step of every env
            entry = self._known[signature]
        except KeyError:
            entry = self._numbering._learn(signature, len(info))
        if entry is None:
            self._ids[env_index] = 0
            return False
        try:
            entry[1].pack_into(self._buffer, env_index * self._row_bytes, *values)
        except (struct.error, OverflowError):  # a Python int beyond int64
            self._ids[env_index] = 0
            return False
        self._ids[env_index] = entry[0]
        return True

    def clear(self, env_index: int) -> None:
        """The env's info for this step is pickled, or empty: its row holds none."""
        self._ids[env_index] = 0

    def take_pending(self) -> list[tuple[int, InfoSchema]]:
        """The schemas numbered since the last call, for the parent."""
        pending, self.pending = self.pending, []
        return pending

    def _learn(self, signature: tuple[Any, ...], count: int) -> tuple[int, struct.Struct] | None:
        keys, types = signature[:count], signature[count:]
        schema = schema_of(tuple(keys), tuple(types))
        entry: tuple[int, struct.Struct] | None = None
        numbered = sum(1 for known in self._known.values() if known is not None)
        if schema is not None and numbered < MAX_SCHEMAS:
            # a float64 cell ("d") or an int64 cell ("q") per key, in the info's order
            packer = struct.Struct("=" + "".join("d" if f else "q" for f in schema.is_float))
            entry = (numbered + 1, packer)
            self.pending.append((numbered + 1, schema))
        self._known[signature] = entry
        return entry


@dataclasses.dataclass(frozen=True)
class _Known:
    """A schema the parent has seen, with where each key's values are.

    For whole columns, the keys of one dtype are copied out in one block
    (``blocks``: is_float, cells, dtype); ``layout`` says, key by key in the info's order,
    the name of its mask and which row of which block holds its values.
    """

    schema: InfoSchema
    columns: tuple[tuple[Any, int, bool, np.dtype[Any]], ...]  # key, cell, is_float, dtype
    blocks: tuple[tuple[bool, slice | np.ndarray, np.dtype[Any]], ...]
    layout: tuple[tuple[Any, str, int, int], ...]  # key, "_key", block, row in the block

    @classmethod
    def of(cls, schema: InfoSchema) -> _Known:
        """Where each key of ``schema`` is, in cells and in blocks."""
        columns = _columns(schema)
        block_of: dict[tuple[bool, np.dtype[Any]], list[int]] = {}
        for _, cell, is_float, dtype in columns:
            block_of.setdefault((is_float, dtype), []).append(cell)
        kinds = list(block_of)
        layout = []
        for key, cell, is_float, dtype in columns:
            block = kinds.index((is_float, dtype))
            layout.append((key, f"_{key}", block, block_of[is_float, dtype].index(cell)))
        blocks = tuple(
            (is_float, _as_slice(cells), dtype) for (is_float, dtype), cells in block_of.items()
        )
        return cls(schema, columns, blocks, tuple(layout))

    def whole_columns(self, floats: np.ndarray, ints: np.ndarray) -> dict[str, Any]:
        """Every env's info, all of this schema: one copy per dtype, then views of it."""
        blocks = []
        for is_float, cells, dtype in self.blocks:
            source = (floats if is_float else ints)[:, cells].T
            blocks.append(source.copy() if source.dtype == dtype else source.astype(dtype, "C"))
        masks = np.empty((len(self.layout), len(floats)), dtype=np.bool_)
        masks.fill(True)  # np.ones is a Python function: twice the time, on every step
        infos: dict[str, Any] = {}
        for row, (key, mask_key, block, block_row) in enumerate(self.layout):
            infos[key] = blocks[block][block_row]
            infos[mask_key] = masks[row]
        return infos


_NO_ROWS = _Known(InfoSchema((), ()), (), (), ())  # ``_whole_schema``: no env has a row


def contiguous_slice(indices: Sequence[int]) -> slice | None:
    """A run of ascending indices that follow each other as a slice (a view, not a copy).

    None when they do not follow each other, or there are none. The one rule for every
    index list that may be a slice: env rows, a worker's envs, info cells.

    Example:
        >>> contiguous_slice([4, 5, 6]), contiguous_slice([4, 6]), contiguous_slice([])
        (slice(4, 7, None), None, None)
    """
    if not indices:
        return None
    first = indices[0]
    if list(indices) != list(range(first, first + len(indices))):
        return None
    return slice(first, first + len(indices))


def _as_slice(cells: list[int]) -> slice | np.ndarray:
    """Cells that follow each other as a slice, else an index array."""
    run = contiguous_slice(cells)
    return run if run is not None else np.array(cells, dtype=np.intp)


class ColumnReader:
    """PARENT SIDE: the schemas workers sent, and infos built from the rows of many envs.

    Args:
        schema_ids: The vector's schema id per env (uint8), as the workers wrote them.
        cells: The vector's cells, shape ``(num_envs, MAX_CELLS)``, float64.
        worker_of_env: Each env's worker index.
    """

    def __init__(
        self,
        schema_ids: np.ndarray,
        cells: np.ndarray,
        worker_of_env: np.ndarray,
        schemas: ColumnReader | None = None,
    ) -> None:
        """Start with no schema known, or sharing those of ``schemas`` (``beside``)."""
        self._ids = schema_ids
        self.schema_ids = schema_ids  # (read-only to callers: ``parts_plane`` checks its rows)
        self._floats = cells
        self._ints = cells.view(np.int64)
        self._worker_of_env = worker_of_env.astype(np.intp)
        num_workers = int(worker_of_env.max()) + 1 if worker_of_env.size else 1
        # Every attribute is set here, in this order, either way: a reader made by copying
        # one (``copy.copy``) cost each step of the vector 800 instructions more, in
        # CPython's generic attribute and dict lookups (callgrind, CPython 3.11).
        self._lock: threading.Lock = threading.Lock() if schemas is None else schemas._lock
        self._global_of: dict[InfoSchema, int] = {} if schemas is None else schemas._global_of
        # by global id; 0 is "none"
        self._known: list[_Known | None] = [None] if schemas is None else schemas._known
        # (worker, its id) -> global id; a respawned worker's ids overwrite its old ones
        self._table: np.ndarray = (
            np.zeros((num_workers, MAX_SCHEMAS + 1), dtype=np.int32)
            if schemas is None
            else schemas._table
        )
        # The schema ids of every env, as bytes -> the one schema they all name, or None
        self._whole: dict[bytes, _Known | None] = {} if schemas is None else schemas._whole
        # The same for some envs (``rows_columns``): their ids' bytes and their schema ids'
        self._some: dict[bytes, _Known | None] = {} if schemas is None else schemas._some

    def register(self, worker_number: int, schemas: Sequence[tuple[int, InfoSchema]]) -> None:
        """Note the schemas a worker numbered; it sends them before the rows that use them."""
        with self._lock:  # the collecting threads of several slices may register at once
            for schema_id, schema in schemas:
                global_id = self._global_of.get(schema)
                if global_id is None:
                    global_id = self._global_of[schema] = len(self._known)
                    self._known.append(_Known.of(schema))
                self._table[worker_number, schema_id] = global_id
            self._whole.clear()
            self._some.clear()

    def merge(
        self, pickled: dict[int, dict[str, Any]], fresh: slice | np.ndarray, add_info: AddInfo
    ) -> dict[str, Any]:
        """The step's infos: the ``pickled`` ones (by env index) and the rows of envs ``fresh``.

        ``fresh`` is ``slice(None)`` (every env) or an array of env indices; only envs whose
        workers answered this step may be in it, as other rows are stale. ``add_info`` is
        Gymnasium's ``_add_info`` for the vector's size.

        The result is what ``add_info`` makes of every env's info in env order. Each key's
        array is built at once from the rows, unless it meets the same key with another dtype
        (which env comes first then decides the dtype); then every info goes through
        ``add_info``, the rows made back into dicts. An env may have both: an episode's
        finals pickled (``SharedBatch.finals``) and its reset's info in its row, in that order.
        """
        if not pickled and isinstance(fresh, slice) and fresh == _ALL:
            # the usual step: every env, one schema; whole columns, one copy per dtype
            known = self._whole_schema()
            if known is _NO_ROWS:  # no env returned an info (CartPole): no arrays at all
                return {}
            if known is not None:
                return known.whole_columns(self._floats, self._ints)
        local = self._ids[fresh]
        if not np.count_nonzero(local):  # (a third of ``any``'s cost)
            return _merge_in_order(pickled, add_info)
        global_ids = self._table[self._worker_of_env[fresh], local]
        size = len(self._ids)
        rows_of_vector = np.arange(size)[fresh]
        present = [
            (known, rows_of_vector[global_ids == global_id])
            for global_id in np.unique(global_ids[global_ids > 0]).tolist()
            if (known := self._known[global_id]) is not None
        ]
        if _has_conflict(pickled, [known for known, _ in present]):
            everything = dict(pickled)
            for known, rows in present:
                for row in rows.tolist():  # after its finals, if it has some (``finals``)
                    everything[row] = {**everything.get(row, {}), **self._row_info(known, row)}
            return _merge_in_order(everything, add_info)
        infos = _merge_in_order(pickled, add_info)
        for known, rows in present:
            for key, cell, is_float, dtype in known.columns:
                source = self._floats if is_float else self._ints
                array = infos.get(key)
                if array is None:
                    array = infos[key] = np.zeros(size, dtype=dtype)
                    infos[f"_{key}"] = np.zeros(size, dtype=np.bool_)
                array[rows] = source[rows, cell]
                infos[f"_{key}"][rows] = True
        return infos

    def row_infos(self, env_ids: np.ndarray) -> dict[int, dict[str, Any]]:
        """The info in each row of envs ``env_ids`` as a dict, by env; envs with none left out.

        Only envs whose workers answered the step may be in ``env_ids``, as for ``merge``.
        """
        global_ids = self._table[self._worker_of_env[env_ids], self._ids[env_ids]]
        infos = {}
        for env_index, global_id in zip(env_ids.tolist(), global_ids.tolist(), strict=True):
            known = self._known[global_id] if global_id > 0 else None
            if known is not None:
                infos[env_index] = self._row_info(known, env_index)
        return infos

    def rows_columns(self, env_ids: np.ndarray) -> dict[str, Any] | None:
        """The infos of envs ``env_ids`` when their rows all hold one schema; else None.

        What ``merge`` of those envs (nothing pickled) gives, taken at the rows ``env_ids``:
        one copy per dtype, as ``whole_columns``. None: rows of several schemas, or none;
        ``merge`` then says.
        """
        local = self._ids[env_ids]
        key = env_ids.tobytes() + local.tobytes()
        known = self._some.get(key, _NO_ROWS)
        if known is _NO_ROWS:
            global_ids = self._table[self._worker_of_env[env_ids], local]
            first = int(global_ids[0])
            known = self._known[first] if first and (global_ids == first).all() else None
            if len(self._some) >= _MAX_WHOLE:
                self._some.clear()
            self._some[key] = known
        if known is None:
            return None
        cells = self._floats.take(env_ids, axis=0)  # those rows' cells, one copy
        return known.whole_columns(cells, cells.view(np.int64))

    def _whole_schema(self) -> _Known | None:
        """The schema of every env's row, if they all have the same one; else None.

        ``_NO_ROWS`` when no env's row holds an info.
        """
        ids = self._ids.tobytes()
        if ids in self._whole:
            return self._whole[ids]
        global_ids = self._table[self._worker_of_env, self._ids]
        first = int(global_ids[0])
        known: _Known | None = None
        if not global_ids.any():
            known = _NO_ROWS
        elif first and (global_ids == first).all():
            known = self._known[first]
        if len(self._whole) >= _MAX_WHOLE:
            self._whole.clear()
        self._whole[ids] = known
        return known

    def beside(self, schema_ids: np.ndarray, cells: np.ndarray) -> ColumnReader:
        """A reader of other rows whose workers number schemas as this reader's do.

        It shares this reader's schemas (``register`` on either serves both); its rows are
        ``schema_ids`` and ``cells``, written by ``ColumnWriter``s made with ``numbering``.
        """
        return ColumnReader(schema_ids, cells, self._worker_of_env, schemas=self)

    def _row_info(self, known: _Known, row: int) -> dict[str, Any]:
        """One env's info back as a dict, each value of the type the env gave."""
        info = {}
        for key, cell, is_float, dtype in known.columns:
            value = (self._floats if is_float else self._ints)[row, cell]
            info[key] = bool(value) if dtype.kind == "b" else dtype.type(value)
        return info


AddInfo = Callable[[dict[str, Any], dict[str, Any], int], dict[str, Any]]


def _merge_in_order(infos_by_env: dict[int, dict[str, Any]], add_info: AddInfo) -> dict[str, Any]:
    infos: dict[str, Any] = {}
    for env_index in sorted(infos_by_env):
        infos = add_info(infos, infos_by_env[env_index], env_index)
    return infos


def _has_conflict(pickled: dict[int, dict[str, Any]], present: Sequence[_Known]) -> bool:
    """Whether a key of the rows also comes pickled, or from two schemas in two dtypes."""
    dtype_of: dict[Any, np.dtype[Any]] = {}
    for known in present:
        for key, dtype in zip(known.schema.keys, known.schema.dtypes, strict=True):
            if dtype_of.setdefault(key, dtype) != dtype:
                return True
    return any(key in dtype_of for info in pickled.values() for key in info)


def _columns(schema: InfoSchema) -> tuple[tuple[Any, int, bool, np.dtype[Any]], ...]:
    return tuple(
        (key, cell, is_float, dtype)
        for cell, (key, is_float, dtype) in enumerate(
            zip(schema.keys, schema.is_float, schema.dtypes, strict=True)
        )
    )
