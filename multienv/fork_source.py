"""FORK SOURCES: what a process that workers fork from imports before it forks them.

Two kinds of process fork workers: the module server (``multienv.module_server``), and,
when it cannot, multiprocessing's forkserver (``multienv.forkserver``). Both import the
modules of the ``preload`` option and the user's script here, as multiprocessing would
import the script in a spawned child: as ``__mp_main__``, with the process marked as
still bootstrapping, so that a script which starts envs at its top level (not under
``if __name__ == "__main__":``) fails to, instead of starting workers from a fork source.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import types
from collections.abc import Iterable
from multiprocessing import process, spawn

logger = logging.getLogger(__name__)


def import_modules(names: Iterable[str]) -> None:
    """Import each module, each under a broad except: a fork source must live.

    A module that fails here is imported by each worker, which reports the error.
    """
    for name in names:
        try:
            importlib.import_module(name)
        except BaseException:  # noqa: BLE001 - the worker reports it
            logger.debug("fork source: importing %s failed; workers will import it", name)


def import_main(main_path: str | None, *, is_raising: bool = False) -> bool:
    """Import the user's script as ``__mp_main__``, as multiprocessing would in a child.

    Args:
        main_path: The script's path (``"<stdin>"`` and the like have no file: a stand-in
            module with the same ``__file__`` tells workers it is imported already).
        is_raising: Let the script's exception out (in a worker, which then reports it),
            rather than log it (in a fork source, which must live).

    Returns:
        False when the script raised; True when it is imported, or there is nothing to do.
    """
    if main_path is None or getattr(sys.modules["__main__"], "__file__", None) == main_path:
        return True
    if not os.path.isfile(main_path):  # e.g. "<stdin>": nothing to import
        stand_in = types.ModuleType("__mp_main__")
        stand_in.__file__ = main_path
        sys.modules["__main__"] = sys.modules["__mp_main__"] = stand_in
        return True
    current = process.current_process()
    current._inheriting = True  # type: ignore[attr-defined]
    try:
        spawn.import_main_path(main_path)
    except BaseException:
        if is_raising:
            raise
        logger.debug("fork source: importing %s failed; workers will import it", main_path)
        return False
    finally:
        del current._inheriting  # type: ignore[attr-defined]
    return True


def check_not_bootstrapping() -> None:
    """Refuse to start workers while a fork source (or a worker) imports the user's script.

    Raises:
        RuntimeError: The script starts envs at its top level.
    """
    if getattr(process.current_process(), "_inheriting", False):
        raise RuntimeError(
            "multienv: your script starts envs at its top level, and that runs again in "
            "every process that imports the script to fork workers from it: move that "
            'under `if __name__ == "__main__":`.'
        )
