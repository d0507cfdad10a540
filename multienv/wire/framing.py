"""BOTH SIDES: the one definition of the bytes on a worker's pipe.

Messages are framed with a 4-byte length (``frame`` / ``write_message`` / ``MessageReader``,
straight on the fd, so a small message costs one system call each way). A worker's socket
carries everything until the parent attaches it to a vector's shared memory; from then on
its requests travel on a pipe of their own, which the attach hands it (a pipe's write and
read cost two thirds of a socket's, on every wake-up), and the socket carries its replies
and the fds. Two kinds of message travel:

- a pickled ``protocol.Request`` (plain ``pickle``; multiprocessing's own ``send`` builds a
  ForkingPickler per message and reads twice, which together cost more than a CartPole
  step), answered by a pickled ``protocol.Reply``;
- a fast batch: ``bytes([FAST_BATCH, seq])`` (``FAST_BATCH_COUNTED`` for one of a round's
  batches) then one ``FAST_ITEM`` (position, flags) per env. Its actions and observations
  travel in the vector's shared memory. Its first byte is below 0x80, which no pickle of
  protocol 2 or later starts with. The worker answers with one ``DONE_RECORD`` through its
  slice's done pipes (``done_pipes``); ``DONE_REPLY`` means a pickled ``Reply`` follows on
  the worker's own pipe (infos, final observations, errors). ``seq`` (1 to 255) tells a
  late record of a killed worker from the answer to the current batch;
- a planned step: one byte, ``PLANNED_STEP`` (``PLANNED_STEP_COUNTED``), the same message
  on every step: a fast batch of every env of the worker, in position order, whose seq and
  item flags the parent wrote into the vector's shared memory (``shared_memory``). Waking a
  worker for a vector's step is one constant write. It is answered as a fast batch, and in
  the worker's status too (``done_pipes``). In a vector's data plane, ``PLANNED_ROUND``:
  counted, and a worker that has everything in shared memory answers with its status
  alone, with no record in the quiet pipe.
"""

from __future__ import annotations

import functools
import os
import pickle
import select
import struct
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

FAST_BATCH = 0x01
FAST_BATCH_COUNTED = 0x02  # a fast batch of a round: only the round's last worker wakes
PLANNED_STEP = 0x03  # every env of the worker; seq and flags in shared memory
PLANNED_STEP_COUNTED = 0x04  # the same, one of a round's
PLANNED_ROUND = 0x05  # one of a data plane's round: an answer all in shared memory is its status
PLANNED_KINDS = (PLANNED_STEP, PLANNED_STEP_COUNTED, PLANNED_ROUND)
FAST_ITEM = struct.Struct("<HB")  # position, flags
ITEM_DTYPE = np.dtype([("position", "<u2"), ("flags", "u1")])  # FAST_ITEM, as numpy
IS_RESET, IS_AUTORESET, IS_SLOT_1, IS_KEEP_NP_RANDOM = 1, 2, 4, 8  # the flags of a FAST_ITEM
IS_INFO_COLUMNS = 16  # a plain info goes into the shared info columns (``info_columns``)
IS_NEXT_STEP = 32  # reset instead of step if the env's last result ended (``autoreset``)
IS_FINALS = 64  # same-step autoreset's final obs and info go into shared memory (``planned_step``)
IS_SKIP = 128  # not in this planned step: a data plane's reset of some envs (``data_plane``)
_SLOT_SHIFT = 2  # IS_SLOT_1 == 1 << _SLOT_SHIFT
DONE_RECORD = struct.Struct("<HBB")  # worker_number, seq, DONE_OK or DONE_REPLY; atomic in a pipe
DONE_OK = 0  # everything is in shared memory
DONE_REPLY = 1  # a framed Reply follows on the worker's own pipe: {position: Outcome}

_HEADER = struct.Struct("!I")
assert ITEM_DTYPE.itemsize == FAST_ITEM.size

encode = functools.partial(pickle.dumps, protocol=pickle.HIGHEST_PROTOCOL)
decode = pickle.loads


# ---------------------------------------------------------------- the fast batch


def plane_flags(is_same_step: bool, is_next_step: bool, has_finals: bool) -> int:
    """A data plane's item flags but the slot: infos in columns, and the autoreset mode's.

    ``has_finals``: same-step autoreset's finals may go into shared memory (``IS_FINALS``).
    """
    if is_same_step:
        return IS_INFO_COLUMNS | IS_AUTORESET | (IS_FINALS if has_finals else 0)
    return IS_INFO_COLUMNS | (IS_NEXT_STEP if is_next_step else 0)


def item_flags(
    is_reset: np.ndarray,
    slots: np.ndarray,
    autoreset: bool,
    keep_np_random: bool = False,
    info_columns: bool = False,
) -> np.ndarray | list[int]:
    """The flags byte of each item: reset or step, autoreset, slot, keep rng, info columns."""
    common = (
        (IS_AUTORESET if autoreset else 0)
        | (IS_KEEP_NP_RANDOM if keep_np_random else 0)
        | (IS_INFO_COLUMNS if info_columns else 0)
    )
    if is_reset.size == 1:  # one env: Python ints are faster than numpy ops
        return [int(is_reset[0]) | common | (int(slots[0]) << _SLOT_SHIFT)]
    flags: np.ndarray = (
        is_reset.view(np.uint8) | common | (slots.astype(np.uint8, copy=False) << _SLOT_SHIFT)
    )
    return flags


def encode_items(
    positions: Sequence[int] | np.ndarray | None,
    flags: np.ndarray | list[int],
    out: np.ndarray | None = None,
) -> bytes:
    """The FAST_ITEMs of a batch, one per env.

    Args:
        positions: Each env's place in its worker; None when ``out`` holds them already.
        flags: Each env's flags (``item_flags``).
        out: An ``ITEM_DTYPE`` array to encode in, reused from step to step.
    """
    if len(flags) == 1 and out is None:  # one env: struct is faster than a numpy record
        assert positions is not None
        return FAST_ITEM.pack(int(positions[0]), int(flags[0]))
    items = np.empty(len(flags), dtype=ITEM_DTYPE) if out is None else out
    if positions is not None:
        items["position"] = positions
    items["flags"] = flags
    return items.tobytes()


def fast_batch_frame(seq: int, items: bytes | memoryview, is_counted: bool = False) -> bytes:
    """The framed request for a fast batch whose items ``encode_items`` made.

    ``is_counted``: it is one of a round's batches (``done_pipes``).
    """
    kind = FAST_BATCH_COUNTED if is_counted else FAST_BATCH
    return b"".join((_HEADER.pack(len(items) + 2), bytes((kind, seq)), items))


def decode_fast_batch(request: bytes) -> tuple[int, Iterator[tuple[int, int]]]:
    """``seq`` and the ``(position, flags)`` items of a fast batch's payload."""
    return request[1], FAST_ITEM.iter_unpack(memoryview(request)[2:])


def slot_of(flags: int) -> int:
    """The observation slot an item's flags name."""
    return (flags & IS_SLOT_1) >> _SLOT_SHIFT


# ---------------------------------------------------------------- framing


def frame(payload: bytes) -> bytes:
    """The bytes that carry ``payload`` on the wire: its length, then itself."""
    return _HEADER.pack(len(payload)) + payload


PLANNED_FRAMES = (frame(bytes([PLANNED_STEP])), frame(bytes([PLANNED_STEP_COUNTED])))
"""The framed planned step, uncounted and counted: what wakes a worker for a vector's step."""
ROUND_FRAME = frame(bytes([PLANNED_ROUND]))
"""The framed planned step of a data plane's round (``data_plane``, ``done_pipes``)."""


def write_message(fd: int, payload: bytes) -> None:
    """Write one message, however many writes it takes."""
    write_frame(fd, frame(payload))


def write_frame(fd: int, data: bytes) -> None:
    """Write bytes that ``frame()`` made; a small message takes one write."""
    written = os.write(fd, data)
    if written < len(data):
        view = memoryview(data)[written:]
        while view:
            view = view[os.write(fd, view) :]


def readable(fds: list[int], timeout_s: float | None) -> list[int]:
    """The ``fds`` readable (or closed at the other end) within ``timeout_s``; None: wait.

    ``select.select`` in its place fails on fds past 1023, which a vector of hundreds of
    workers opens.
    """
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    timeout_ms = None if timeout_s is None else max(0.0, timeout_s) * 1000
    return [fd for fd, _ in poller.poll(timeout_ms)]


def hot_poll(fd: int, spin_s: float) -> Callable[[int], list[tuple[int, int]]] | None:
    """A poll of ``fd`` for ``poll_hot`` when reads of it spin (``spin_s`` > 0), else None."""
    if spin_s <= 0:
        return None
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return poller.poll


def poll_hot(poll: Callable[[int], list[tuple[int, int]]], spin_s: float) -> list[tuple[int, int]]:
    """Poll without sleeping for up to ``spin_s``, yielding the core between polls.

    Args:
        poll: A ``select.poll`` object's ``poll``.
        spin_s: How long to keep polling; the caller sleeps in a blocking wait after that.

    Returns:
        The events of the first poll that had any; empty when none came in time.
    """
    events = poll(0)
    if events or spin_s <= 0:
        return events
    give_up = time.perf_counter() + spin_s
    while not events and time.perf_counter() < give_up:
        os.sched_yield()
        events = poll(0)
    return events


class MessageReader:
    """Reads framed messages from a socket or pipe fd; EOFError when the other end is gone.

    Args:
        fd: The socket to read; its owner closes it.
        spin_s: Before sleeping on an empty socket, poll it this long, yielding the core
            between polls (``wait="spin"``); 0 sleeps at once.
    """

    def __init__(self, fd: int, spin_s: float = 0.0) -> None:
        """Start with nothing buffered."""
        self.fd = fd  # (read by the worker, which closes a link's pipe)
        self._buffer = b""
        self._spin_s = spin_s
        self._poll = hot_poll(fd, spin_s)

    def read(self) -> bytes:
        """Block until one whole message is in, and return its payload."""
        buffer = self._buffer
        while len(buffer) < _HEADER.size:
            buffer += self._read_some(65536)
        end = _HEADER.size + _HEADER.unpack_from(buffer)[0]
        if len(buffer) < end:
            parts, have = [buffer], len(buffer)
            while have < end:
                parts.append(self._read_some(end - have))
                have += len(parts[-1])
            buffer = b"".join(parts)
        self._buffer = buffer[end:]
        return buffer[_HEADER.size : end]

    @property
    def is_empty(self) -> bool:
        """Whether nothing read from the socket waits in the buffer."""
        return not self._buffer

    def push(self, data: bytes) -> None:
        """Take bytes read from the socket by someone else, before those buffered."""
        self._buffer = data + self._buffer

    def _read_some(self, size: int) -> bytes:
        if self._poll is not None:  # hot: keep the core awake for the next request
            poll_hot(self._poll, self._spin_s)
        chunk = os.read(self.fd, size)
        if not chunk:
            raise EOFError("the other end of the pipe closed")
        return chunk
