"""The wire format: fast-batch items and framed messages round-trip, in one process."""

from __future__ import annotations

import os
import pickle
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from multienv.wire import framing
from multienv.wire.protocol import Command, Request


@pytest.mark.parametrize("size", [1, 2, 7])
@pytest.mark.parametrize("autoreset", [False, True])
def test_fast_batch_items_round_trip(size: int, autoreset: bool) -> None:
    rng = np.random.default_rng(size)
    positions = rng.permutation(size).tolist()
    is_reset = rng.random(size) < 0.5
    slots = rng.integers(0, 2, size).astype(np.int8)
    flags = framing.item_flags(is_reset, slots, autoreset, keep_np_random=True)
    frame = framing.fast_batch_frame(9, framing.encode_items(positions, flags))
    payload = frame[4:]
    assert int.from_bytes(frame[:4], "big") == len(payload)
    assert payload[0] == framing.FAST_BATCH
    assert payload[0] < 0x80
    seq, items = framing.decode_fast_batch(payload)
    decoded = list(items)
    assert seq == 9
    assert [position for position, _ in decoded] == positions
    for (_, got), reset, slot in zip(decoded, is_reset, slots, strict=True):
        assert bool(got & framing.IS_RESET) == bool(reset)
        assert bool(got & framing.IS_AUTORESET) == autoreset
        assert bool(got & framing.IS_KEEP_NP_RANDOM)
        assert framing.slot_of(got) == slot


def test_planned_step_frames_are_one_constant_byte_that_no_pickle_starts_with() -> None:
    for is_counted, frame in enumerate(framing.PLANNED_FRAMES):
        assert int.from_bytes(frame[:4], "big") == 1
        kind = frame[4]
        assert kind == (framing.PLANNED_STEP_COUNTED if is_counted else framing.PLANNED_STEP)
        assert kind < 0x80
        assert kind not in (framing.FAST_BATCH, framing.FAST_BATCH_COUNTED)


def test_messages_round_trip_through_a_socket_whatever_their_size() -> None:
    left, right = socket.socketpair()
    try:
        reader = framing.MessageReader(right.fileno())
        small = framing.encode(Request(Command.GET_ATTR, 3, "np_random"))
        large = pickle.dumps(np.arange(300_000))  # more than one read
        for payload in (small, large, small):
            sender = threading.Thread(target=framing.write_message, args=(left.fileno(), payload))
            sender.start()
            assert reader.read() == payload
            sender.join(5.0)
        assert framing.decode(small) == Request(Command.GET_ATTR, 3, "np_random")
    finally:
        left.close()
        with pytest.raises(EOFError):
            framing.MessageReader(right.fileno()).read()
        right.close()


def _thread_state(tid: int) -> str:
    with open(f"/proc/self/task/{tid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0]


def _states_while(wait: Callable[[], None]) -> tuple[threading.Thread, list[str]]:
    """Run ``wait`` on a thread; its state (``R``, ``S``...) sampled 20 times, 5 ms apart."""
    native_id: list[int] = []

    def run() -> None:
        native_id.append(threading.get_native_id())
        wait()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    while not native_id:
        threading.Event().wait(0.001)
    states = []
    for _ in range(20):
        threading.Event().wait(0.005)
        states.append(_thread_state(native_id[0]))
    return thread, states


@pytest.fixture
def sockets() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A connected pair: ours (read, polled) and theirs (written); both closed afterwards."""
    ours, theirs = socket.socketpair()
    yield ours, theirs
    ours.close()
    theirs.close()


@pytest.mark.parametrize(("spin_s", "expected"), [(5.0, "R"), (0.0, "S")])
def test_a_spinning_reader_stays_runnable_while_it_waits_and_a_plain_one_sleeps(
    sockets: tuple[socket.socket, socket.socket], spin_s: float, expected: str
) -> None:
    """Hot mode's wait: the reader polls (runnable, yielding) rather than blocking in read."""
    ours, theirs = sockets
    reader = framing.MessageReader(ours.fileno(), spin_s=spin_s)
    got: list[bytes] = []
    thread, states = _states_while(lambda: got.append(reader.read()))
    # A spinning thread is runnable whether or not it holds a core; a sleeping one is
    # in S. Allow a few samples of the other state (a switch caught mid-way).
    assert states.count(expected) >= 15, states
    theirs.sendall(framing.frame(b"done"))
    thread.join(5.0)
    assert got == [b"done"]


def _poller_of(sock: socket.socket) -> select.poll:
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    return poller


def test_poll_hot_returns_the_first_events_and_gives_up_empty_after_spin_s(
    sockets: tuple[socket.socket, socket.socket],
) -> None:
    """The parent's hot wait: it polls until something comes, or for spin_s at most."""
    ours, theirs = sockets
    poller = _poller_of(ours)
    began = time.perf_counter()
    assert framing.poll_hot(poller.poll, 0.05) == []
    assert time.perf_counter() - began >= 0.05
    began = time.perf_counter()
    assert framing.poll_hot(poller.poll, 0.0) == []  # 0: one look, no spin
    assert time.perf_counter() - began < 0.05
    theirs.sendall(b"x")
    assert framing.poll_hot(poller.poll, 5.0) == [(ours.fileno(), select.POLLIN)]


def test_poll_hot_stays_runnable_until_the_event_comes(
    sockets: tuple[socket.socket, socket.socket],
) -> None:
    ours, theirs = sockets
    poller = _poller_of(ours)
    got: list[list[tuple[int, int]]] = []
    thread, states = _states_while(lambda: got.append(framing.poll_hot(poller.poll, 5.0)))
    assert states.count("R") >= 15, states
    theirs.sendall(b"x")
    thread.join(5.0)
    assert got == [[(ours.fileno(), select.POLLIN)]]


def test_readable_sees_fds_past_the_1023_that_select_stops_at() -> None:
    read_fd, write_fd = os.pipe()
    high = 1500
    try:
        os.dup2(read_fd, high)
    except OSError:
        pytest.skip("this process may not open fd 1500")
    try:
        assert framing.readable([high], 0) == []
        os.write(write_fd, b"x")
        assert framing.readable([high], 1.0) == [high]
        os.close(write_fd)
        write_fd = -1
        os.read(high, 1)
        assert framing.readable([high], 1.0) == [high]  # the other end closed: EOF to read
    finally:
        for fd in (read_fd, write_fd, high):
            if fd >= 0:
                os.close(fd)
