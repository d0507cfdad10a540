"""FORKSERVER ONLY: preloaded last by the forkserver; imports the user's modules and script.

Then it warms and freezes what the workers inherit (``fork_source.prepare_to_fork_workers``).

``forkserver`` explains why the script must be imported by hand on CPython 3.11
and 3.12. It has to happen in a module of its own, preloaded after ``multienv.worker.worker``:
the script imports multienv, and while the multienv package is still being imported (as
it is while any of its own modules runs at import time) that import fails, so each worker
would import the script again. The modules of the ``preload`` option are imported here
too, before the script, each under a broad except (``fork_source``): multiprocessing's own
preload list stops the forkserver on any error but ImportError, and then no worker could
start.
"""

from __future__ import annotations

import atexit
import os
import shutil

from multienv.backends.subprocess.forking.fork_source import (
    import_main,
    import_modules,
    prepare_to_fork_workers,
)
from multienv.backends.subprocess.forking.forkserver import (
    MAIN_PATH_VARIABLE,
    MODULES_VARIABLE,
    TEMP_DIR_VARIABLE,
)


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
import_modules(filter(None, os.environ.pop(MODULES_VARIABLE, "").split(",")))
import_main(os.environ.pop(MAIN_PATH_VARIABLE, None))
if _is_forkserver:  # everything is imported: warm and freeze what workers inherit
    prepare_to_fork_workers()
