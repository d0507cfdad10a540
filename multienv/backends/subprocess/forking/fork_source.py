"""FORK SOURCES: what a process that workers fork from does before it forks them.

Two kinds of process fork workers: the module server (``module_server``), and,
when it cannot, multiprocessing's forkserver (``forkserver``). Both import the
modules of the ``preload`` option and the user's script here, as multiprocessing would
import the script in a spawned child: as ``__mp_main__``, with the process marked as
still bootstrapping, so that a script which starts envs at its top level (not under
``if __name__ == "__main__":``) fails to, instead of starting workers from a fork source.

The module server also makes its objects immortal (``immortalize_and_freeze``) on CPython
3.12 and 3.13. A forked worker shares its parent's memory pages until it writes to them,
and it writes to an inherited object each time it takes or drops a reference to it: every
function it calls, every module global it reads. So each worker used to copy about 5 MiB
of pages it merely read from. CPython does not count references to immortal objects
(PEP 683: ``None``, small ints, interned strings), so neither do the workers, and those
pages stay shared: about 2.2 MiB less private memory per worker (HalfCheetah, Pong and
CartPole alike). The objects are the server's, made to live as long as the process, which
they did anyway: they are its imported modules, frozen out of the garbage collector
already. It is skipped where the interpreter's object header is not the one checked
here (``immortal_refcount``), and ``MULTIENV_IMMORTALIZE=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import importlib
import itertools
import logging
import os
import sys
import sysconfig
import traceback
import types
from collections.abc import Iterable
from multiprocessing import process, spawn

import numpy as np

from multienv.errors import MissingMainGuardError
from multienv.wire.protocol import worker_module

logger = logging.getLogger(__name__)

IMMORTALIZE_VARIABLE = "MULTIENV_IMMORTALIZE"  # "0": the module server's objects stay mortal


def import_modules(names: Iterable[str]) -> None:
    """Import each module, each under a broad except: a fork source must live.

    A module that fails here is imported by each worker, which reports the error.
    """
    for name in names:
        try:
            importlib.import_module(name)
        except BaseException:  # noqa: BLE001 - the worker reports it
            logger.debug("fork source: importing %s failed; workers will import it", name)


def import_main(main_path: str | None, *, is_raising: bool = False) -> BaseException | None:
    """Import the user's script as ``__mp_main__``, as multiprocessing would in a child.

    Args:
        main_path: The script's path (``"<stdin>"`` and the like have no file: a stand-in
            module with the same ``__file__`` tells workers it is imported already).
        is_raising: Let the script's exception out (in a worker, which then reports it),
            rather than log it (in a fork source, which must live).

    Returns:
        What the script raised; None when it is imported, or there is nothing to do.
    """
    if main_path is None or getattr(sys.modules["__main__"], "__file__", None) == main_path:
        return None
    if not os.path.isfile(main_path):  # e.g. "<stdin>": nothing to import
        stand_in = types.ModuleType("__mp_main__")
        stand_in.__file__ = main_path
        sys.modules["__main__"] = sys.modules["__mp_main__"] = stand_in
        return None
    current = process.current_process()
    current._inheriting = True  # type: ignore[attr-defined]
    try:
        spawn.import_main_path(main_path)
    except BaseException as exc:
        if is_raising:
            raise
        logger.debug("fork source: importing %s failed; workers will import it", main_path)
        return exc
    finally:
        del current._inheriting  # type: ignore[attr-defined]
    return None


def check_not_bootstrapping() -> None:
    """Refuse to start workers while a fork source (or a worker) imports the user's script.

    Raises:
        MissingMainGuardError: The script starts envs at its top level.
    """
    if getattr(process.current_process(), "_inheriting", False):
        raise guard_missing_error("run again as a process that forks workers imports it")


def starts_envs_at(failure: BaseException, main_path: str) -> str:
    """Where in the user's script a ``MissingMainGuardError`` came from: file, line, code."""
    frames = [f for f in traceback.extract_tb(failure.__traceback__) if f.filename == main_path]
    if not frames:
        return main_path
    frame = frames[0]  # the top-level statement that started the envs
    return f"{frame.filename}, line {frame.lineno}: {(frame.line or '').strip()}"


def guard_missing_error(where: str) -> MissingMainGuardError:
    """The parent's error for a script whose top level starts envs: one message, the fix."""
    return MissingMainGuardError(
        f"your script starts envs at its top level ({where}). Every worker process "
        "imports the script to find the env factories it defines, and would start envs "
        "again. Put the code that creates and uses the envs under "
        '`if __name__ == "__main__":` (as multiprocessing needs for its "spawn" and '
        '"forkserver" start methods).'
    )


def prepare_to_fork_workers(*, immortalize: bool = False) -> None:
    """In a process that workers fork from (the module server, the forkserver), before forking.

    Runs the worker's first-time code paths here (``worker.warm_up``) so that workers
    inherit them warm, and moves every object into the garbage collector's permanent
    generation: a full collection in a worker then never writes to the inherited objects,
    which would make each worker copy them (about 13 MiB with Gymnasium's MuJoCo modules).
    Then it gives the heap's free pages back (``worker.release_free_memory``).
    ``immortalize``: make the objects created since the last call immortal first
    (``immortalize_and_freeze``).
    """
    worker = worker_module()
    worker.warm_up()
    # No collection first: it would cost the server's start about 12 ms.
    if immortalize:
        immortalize_and_freeze()
    else:
        gc.freeze()
    worker.release_free_memory()


def immortalize_and_freeze(*, include_frozen: bool = False) -> int:
    """Make this process's objects immortal, then freeze them (``gc.freeze()``).

    That is every object the garbage collector tracks (modules' dicts, functions, classes,
    containers), and every untracked object they refer to directly (code objects, strings,
    numbers). Call it in a single-threaded fork source, before it forks the workers that
    are to share them.

    Args:
        include_frozen: Also the objects frozen earlier; else only those created since.

    Returns:
        How many references to objects were rewritten (an object may count more than once):
        0 where it is unsupported or turned off, and then it only freezes.
    """
    value = immortal_refcount()
    if value is None:
        gc.freeze()
        return 0
    was_enabled = gc.isenabled()
    gc.disable()  # a collection now would walk all the objects unfrozen here
    try:
        if include_frozen:
            gc.unfreeze()
        objects = gc.get_objects()
        leaves = itertools.filterfalse(gc.is_tracked, gc.get_referents(*objects))
        addresses = np.fromiter(map(id, itertools.chain(leaves, objects)), dtype=np.int64)
        _write_words(addresses, value)  # each object is alive: ``objects`` holds it or its holder
        del objects
        gc.freeze()
    finally:
        if was_enabled:
            gc.enable()
    return len(addresses)


def _write_words(addresses: np.ndarray, value: int) -> None:
    """Write ``value`` into the machine word at each of ``addresses`` (8-byte aligned).

    Through one NumPy view that spans them all, unmapped gaps included (it reads and writes
    only the words it is given): about 2 ms where a ctypes write per object takes 13 (74,000
    objects); one at a time if an address is not aligned.
    """
    if not len(addresses):
        return
    if (addresses & 7).any():
        for address in addresses.tolist():
            ctypes.c_ssize_t.from_address(address).value = value
        return
    base = int(addresses.min())
    count = (int(addresses.max()) - base) // 8 + 1
    words = np.ctypeslib.as_array((ctypes.c_int64 * count).from_address(base))
    words[(addresses - base) >> 3] = value


@functools.cache
def immortal_refcount() -> int | None:
    """The reference count that marks an object immortal here, or None to leave objects be.

    Only on CPython 3.12 and 3.13 with the GIL, 64-bit, release builds: there the count is
    the object's first word, and an object is immortal when its low 32 bits are all set, as
    ``sys.getrefcount(None)`` shows. A trial object must then keep that count while
    references to it come and go; otherwise (or with ``MULTIENV_IMMORTALIZE=0``) None.
    """
    if (
        os.environ.get(IMMORTALIZE_VARIABLE, "1") == "0"
        or sys.implementation.name != "cpython"
        or not (3, 12) <= sys.version_info[:2] <= (3, 13)
        or sysconfig.get_config_var("Py_GIL_DISABLED")
        or sys.maxsize <= 2**32
        or hasattr(sys, "gettotalrefcount")  # a debug build keeps a total of all counts
    ):
        return None
    value = sys.getrefcount(None)
    if value != 2**32 - 1:
        return None
    trial: list[object] = []
    ctypes.c_ssize_t.from_address(id(trial)).value = value  # it lives on, as others will
    holders = [trial] * 3
    is_immortal = sys.getrefcount(trial) == value
    del holders
    return value if is_immortal and sys.getrefcount(trial) == value else None
