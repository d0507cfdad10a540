"""BOTH SIDES: one copy of a Box's bound arrays for all the envs and batches that share them.

A ``Box`` keeps four arrays of its own shape: ``low``, ``high`` and where each is bounded.
Every env's space would arrive from its worker with its own copies, and Gymnasium's
``batch_space`` tiles them N times for the vector's space. For Atari frames (210x160x3)
that is 400 KiB per env and 400 KiB per env again in the batch: about 90 MiB in the parent
at N=64, and as much pickled and unpickled at start-up. So:

- a worker describes its envs with ``dumps_compact``: a large Box whose bounds are each one
  value (Atari's 0 and 255) travels as its shape, dtype and those values, and the parent
  rebuilds it (``uniform_box``) around the arrays of an equal Box it already has;
- envs whose bounds are equal otherwise share env 0's arrays (``share_bounds``);
- the vector's space holds read-only broadcast views of the single space's arrays instead
  of tiled copies (``lean_batch_space``).

Shared arrays are made read-only, so that writing into one env's bounds raises instead of
changing every env's. Only Boxes of ``_COMPACT_MIN_SIZE`` elements and more are shared or
broadcast: a smaller one (CartPole's, HalfCheetah's) costs next to nothing to hold N times,
and keeps writable bounds as in ``SyncVectorEnv``, which libraries that turn the bounds
into tensors expect (TorchRL's ``GymWrapper`` warns at a read-only array).
"""

from __future__ import annotations

import copy
import io
import pickle
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.spaces import Box, Dict, Tuple
from gymnasium.vector.utils import batch_space

_BOUNDS = ("low", "high", "bounded_below", "bounded_above")
_COMPACT_MIN_SIZE = 1024  # elements; smaller Boxes are pickled whole

# A Box already rebuilt, by (shape, dtype, low, high): the next equal one shares its arrays.
_rebuilt: weakref.WeakValueDictionary[tuple[Any, ...], Box] = weakref.WeakValueDictionary()
_rebuilt_lock = threading.Lock()  # handshakes are decoded on several threads


def dumps_compact(obj: Any) -> bytes:
    """WORKER SIDE: ``obj`` pickled, each large Box of uniform bounds as four numbers."""
    buffer = io.BytesIO()
    _CompactPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


class _CompactPickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is not Box or obj.low.size < _COMPACT_MIN_SIZE:
            return NotImplemented
        key = _uniform_key(obj)
        if key is None:
            return NotImplemented
        state = {name: value for name, value in vars(obj).items() if name not in _BOUNDS}
        return uniform_box, (key, state)


def _uniform_key(box: Box) -> tuple[Any, ...] | None:
    """(shape, dtype, low, high) if a Box built from them equals ``box``, bounds included."""
    low, high = box.low.flat[0].item(), box.high.flat[0].item()
    if not ((box.low == low).all() and (box.high == high).all()):
        return None
    key = (box.shape, box.dtype.str, low, high)
    probe = Box(low, high, (1,), box.dtype)
    for name in ("bounded_below", "bounded_above"):  # -inf made the dtype's minimum, etc.
        flags = getattr(box, name)
        if not (flags == getattr(probe, name)[0]).all():
            return None
    return key


def uniform_box(key: tuple[Any, ...], state: dict[str, Any]) -> Box:
    """PARENT SIDE: the Box ``dumps_compact`` sent, its bounds shared with an equal one's."""
    shape, dtype, low, high = key
    with _rebuilt_lock:
        like = _rebuilt.get(key)
        if like is None:
            box = Box(low, high, shape, np.dtype(dtype))
            for name in _BOUNDS:
                getattr(box, name).flags.writeable = False
        else:
            box = copy.copy(like)  # a new Box around the same (read-only) arrays
        box.__dict__.update(state)  # its own generator, as pickling would restore it
        _rebuilt[key] = box
    return box


def share_bounds(space: gym.Space[Any], like: gym.Space[Any]) -> None:
    """Give ``space`` the bound arrays of ``like`` wherever they are exactly equal (large Boxes)."""
    for box, other in _box_pairs(space, like):
        if box.low.size < _COMPACT_MIN_SIZE:  # small: not worth a read-only share
            continue
        for name in _BOUNDS:
            mine, theirs = getattr(box, name), getattr(other, name)
            if mine is theirs or mine.dtype != theirs.dtype or not np.array_equal(mine, theirs):
                continue
            theirs.flags.writeable = False
            setattr(box, name, theirs)


def lean_batch_space(space: gym.Space[Any], n: int) -> gym.Space[Any]:
    """Gymnasium's ``batch_space(space, n)``, its large Boxes' bounds broadcast from ``space``'s."""
    batched = batch_space(space, n)
    for box, single in _box_pairs(batched, space):
        if box.shape != (n, *single.shape) or single.low.size < _COMPACT_MIN_SIZE:
            continue
        for name in _BOUNDS:
            view = np.broadcast_to(getattr(single, name), box.shape)  # read-only, no copy
            setattr(box, name, view)
    return batched


def _box_pairs(space: gym.Space[Any], other: gym.Space[Any]) -> Iterator[tuple[Box, Box]]:
    """The Boxes at the same place in two spaces of the same structure, pair by pair."""
    if isinstance(space, Box) and isinstance(other, Box):
        if space.dtype == other.dtype:
            yield space, other
    elif isinstance(space, Dict) and isinstance(other, Dict):
        if space.spaces.keys() == other.spaces.keys():
            for key, subspace in space.spaces.items():
                yield from _box_pairs(subspace, other.spaces[key])
    elif isinstance(space, Tuple) and isinstance(other, Tuple):
        if len(space.spaces) == len(other.spaces):
            for subspace, other_subspace in zip(space.spaces, other.spaces, strict=True):
                yield from _box_pairs(subspace, other_subspace)
