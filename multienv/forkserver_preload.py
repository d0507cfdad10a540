"""FORKSERVER ONLY: preloaded last by the forkserver; imports the user's modules and script.

Then it warms and freezes what the workers inherit (``worker.prepare_to_fork_workers``).

``multienv.forkserver`` explains why the script must be imported by hand on CPython 3.11
and 3.12. It has to happen in a module of its own, preloaded after ``multienv.worker``:
the script imports multienv, and while the multienv package is still being imported (as
it is while any of its own modules runs at import time) that import fails, so each worker
would import the script again. The modules of the ``preload`` option are imported here
too, before the script, each under a broad except: multiprocessing's own preload list stops
the forkserver on any error but ImportError, and then no worker could start.
"""

from __future__ import annotations

import atexit
import importlib
import logging
import os
import shutil
import sys
import types
from multiprocessing import process, spawn

from multienv.forkserver import MAIN_PATH_VARIABLE, MODULES_VARIABLE, TEMP_DIR_VARIABLE
from multienv.protocol import worker_module

logger = logging.getLogger(__name__)


def _import_modules_here() -> None:
    """In the forkserver: import the modules of the ``preload`` option."""
    for name in filter(None, os.environ.pop(MODULES_VARIABLE, "").split(",")):
        try:
            importlib.import_module(name)
        except BaseException:  # noqa: BLE001 - the forkserver must live; a worker reports it
            logger.debug("forkserver: preloading %s failed; workers will import it", name)


def _import_main_here() -> None:
    """In the forkserver: import the user's script as multiprocessing meant to."""
    main_path = os.environ.pop(MAIN_PATH_VARIABLE, None)
    if main_path is None or getattr(sys.modules["__main__"], "__file__", None) == main_path:
        return  # not the forkserver, or a Python that preloaded the script itself
    if not os.path.isfile(main_path):  # e.g. "<stdin>": nothing to import, and workers fail
        # trying to; a stand-in with the same __file__ tells them it is imported already.
        stand_in = types.ModuleType("__mp_main__")
        stand_in.__file__ = main_path
        sys.modules["__main__"] = sys.modules["__mp_main__"] = stand_in
        return
    current = process.current_process()
    current._inheriting = True  # type: ignore[attr-defined]
    try:
        spawn.import_main_path(main_path)
    except BaseException:  # noqa: BLE001 - each worker then imports it and reports the error
        logger.debug("forkserver: importing %s failed; workers will import it", main_path)
    finally:
        del current._inheriting  # type: ignore[attr-defined]


def _remove_temp_dir_at_exit() -> None:
    """In the forkserver: remove the parent's pymp-* dir when the forkserver exits.

    The forkserver exits (through ``SystemExit``, so ``atexit`` runs) once its parent is
    gone, however the parent died; workers forked from it leave through ``os._exit``.
    """
    temp_dir = os.environ.pop(TEMP_DIR_VARIABLE, None)
    if temp_dir is not None and os.path.basename(temp_dir).startswith("pymp-"):
        atexit.register(shutil.rmtree, temp_dir, ignore_errors=True)


_is_forkserver = TEMP_DIR_VARIABLE in os.environ  # set only for the forkserver's start
_remove_temp_dir_at_exit()
_import_modules_here()
_import_main_here()
if _is_forkserver:  # everything is imported: warm and freeze what workers inherit
    worker_module().prepare_to_fork_workers()
