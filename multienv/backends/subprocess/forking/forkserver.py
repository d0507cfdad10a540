"""PARENT SIDE: multiprocessing's forkserver, for workers the module server cannot fork.

This module configures and starts it from the parent; what runs in the forkserver itself
is ``forkserver_preload``, which reads the variables defined here.

Daemon workers fork from multienv's module server (``module_server``). The others
(``daemon=False``, factories too large for one request, every worker after the server
refused or died) start from multiprocessing's forkserver, which starts only then
(``ensure_running``), with multiprocessing's resource tracker. ``forkserver_context``
configures both fork sources of a process once: the ``preload`` modules and the thread
variables they start with.

The forkserver imports numpy, gymnasium and our worker module once, so a worker is a cheap
fork. It should also import the user's main script (``"__main__"`` in the preload list),
but on CPython 3.11 and 3.12 it never does (gh-126631, fixed only in later 3.13 and 3.14
releases): the path it needs is passed under a key that was renamed long ago. Every worker
would then run the script's top level again, with all its imports: a script that imports
torch would cost each worker about 150 MiB of private memory.

So the parent passes the script's path in an environment variable while the forkserver
starts, and ``forkserver_preload``, preloaded last, imports the script there as
``__mp_main__``, the way multiprocessing would (``fork_source``). Workers find it
already imported and skip it. A script read from stdin has no file to import; workers skip
it too (its env factories travel by value with cloudpickle anyway). Scripts run with
``python -m`` are imported by name and are left as multiprocessing handles them.

The forkserver also removes the parent's ``pymp-*`` temporary directory (which holds its
socket) when it exits, as it does once the parent is gone: a parent killed by SIGKILL never
runs the clean-up that would remove it.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from collections.abc import Mapping, Sequence
from multiprocessing import forkserver, spawn, util
from multiprocessing.context import BaseContext

logger = logging.getLogger(__name__)

MAIN_PATH_VARIABLE = "MULTIENV_FORKSERVER_MAIN_PATH"
MODULES_VARIABLE = "MULTIENV_FORKSERVER_PRELOAD"  # comma-separated module names
TEMP_DIR_VARIABLE = "MULTIENV_FORKSERVER_TEMP_DIR"  # the parent's pymp-* dir, which holds
# the forkserver's socket; the forkserver removes it when it exits, since a parent killed
# by SIGKILL never runs its own clean-up.
# The last one imports the script; multienv must be fully imported by then, since the
# script imports it too (a module that multienv itself imports would run mid-import).
PRELOAD = [
    "__main__",
    "numpy",
    "gymnasium",
    "cloudpickle",
    "multienv.worker.worker",
    "multienv.backends.subprocess.forking.forkserver_preload",
]
_lock = threading.Lock()
_configured_in_pid: int | None = None  # the process whose fork sources were configured
_started_in_pid: int | None = None  # the process that started multiprocessing's forkserver
_preloaded: list[str] = []  # the preload of this process's fork sources, or told of later
_thread_env: dict[str, str] = {}  # the thread variables its fork sources start with


def forkserver_context(
    preload: Sequence[str] = (), thread_env: Mapping[str, str] | None = None
) -> BaseContext:
    """The forkserver context, with this process's fork sources configured (once).

    The first call in a process fixes what the fork sources import and start with: the
    module server (``module_server``), which the caller starts, and
    multiprocessing's forkserver, which starts only if a worker needs it
    (``ensure_running``).

    Args:
        preload: Module names the fork sources import before they fork any worker. Honoured
            by the first call; a later call naming other modules logs a warning, and each
            worker imports them itself.
        thread_env: Thread-count variables (``OMP_NUM_THREADS``, ...) the fork sources start
            with, so that the pools they preload (numpy's) are born that size and their
            workers need not resize them, which costs a forked worker about 13 ms here.
            Honoured by the first call; see ``forkserver_thread_env``.
    """
    global _configured_in_pid  # noqa: PLW0603 - one configuration per process, so one flag
    with _lock:
        if _configured_in_pid == os.getpid():
            missing = [name for name in preload if name not in _preloaded]
            if missing:
                logger.warning(
                    "preload %s: the forkserver of this process started earlier without "
                    "them, so each worker imports them itself; pass preload to the first "
                    "env this process starts",
                    missing,
                )
                _preloaded.extend(missing)  # warn once per module
        else:
            _configured_in_pid = os.getpid()
            _preloaded[:] = preload
            _thread_env.clear()
            _thread_env.update(thread_env or {})
    return multiprocessing.get_context("forkserver")


def ensure_running() -> None:
    """Start multiprocessing's forkserver, as configured, for a worker it must start.

    That is a worker the module server cannot fork (``process_launch``). Nothing
    happens if this process configured no fork sources (a context of the caller's own).
    """
    global _started_in_pid  # noqa: PLW0603 - one forkserver per process, so one flag
    with _lock:
        if _configured_in_pid != os.getpid() or _started_in_pid == os.getpid():
            return
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        variables = {
            MODULES_VARIABLE: ",".join(_preloaded),
            TEMP_DIR_VARIABLE: util.get_temp_dir(),
        }
        main_path = main_script_path()
        if main_path is not None:
            variables[MAIN_PATH_VARIABLE] = main_path
        variables.update(_thread_env)
        previous = {name: os.environ.get(name) for name in variables}
        os.environ.update(variables)
        try:
            forkserver.ensure_running()
        finally:
            for name, value in previous.items():  # the user's own values come back
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        _started_in_pid = os.getpid()


def main_script_path() -> str | None:
    """The path of the user's script, for a fork source to import; None under ``python -m``."""
    path = spawn.get_preparation_data("ignore").get("init_main_from_path")
    return None if path is None else str(path)


def forkserver_thread_env() -> dict[str, str] | None:
    """The thread variables this process's fork sources start with; None if unconfigured."""
    with _lock:
        return dict(_thread_env) if _configured_in_pid == os.getpid() else None


def configured_preload() -> tuple[str, ...]:
    """The ``preload`` this process's fork sources import (empty if unconfigured)."""
    with _lock:
        return tuple(_preloaded) if _configured_in_pid == os.getpid() else ()
