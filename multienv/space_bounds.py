"""PARENT SIDE: one copy of a Box's bound arrays for all the envs and batches that share them.

A ``Box`` keeps four arrays of its own shape: ``low``, ``high`` and where each is bounded.
Every env's space arrives from its worker with its own copies, and Gymnasium's
``batch_space`` tiles them N times for the vector's space. For Atari frames (210x160x3)
that is 400 KiB per env and 400 KiB per env again in the batch: about 50 MiB in the parent
at N=64. Here, envs whose bounds are equal share env 0's arrays, and the vector's space
holds read-only broadcast views of the single space's arrays instead of tiled copies.

Shared arrays are made read-only, so that writing into one env's bounds raises instead of
changing every env's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.spaces import Box, Dict, Tuple
from gymnasium.vector.utils import batch_space

_BOUNDS = ("low", "high", "bounded_below", "bounded_above")


def share_bounds(space: gym.Space[Any], like: gym.Space[Any]) -> None:
    """Give ``space`` the bound arrays of ``like`` wherever they are exactly equal."""
    for box, other in _box_pairs(space, like):
        for name in _BOUNDS:
            mine, theirs = getattr(box, name), getattr(other, name)
            if mine is theirs or mine.dtype != theirs.dtype or not np.array_equal(mine, theirs):
                continue
            theirs.flags.writeable = False
            setattr(box, name, theirs)


def lean_batch_space(space: gym.Space[Any], n: int) -> gym.Space[Any]:
    """Gymnasium's ``batch_space(space, n)``, its Box bounds broadcast from ``space``'s."""
    batched = batch_space(space, n)
    for box, single in _box_pairs(batched, space):
        if box.shape != (n, *single.shape):
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
