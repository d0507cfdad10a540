"""WORKER SIDE: tracebacks of env code that read like the user's own.

Two things stand between a user and their own traceback in a worker:

- cloudpickle (3.1 and later) names every code object it pickles by value
  ``"<dynamic-code>"``: the functions and classes of the user's script, which travel by
  value, then show no file and no source. ``restore_script_names`` gives the code of the
  script's functions and classes the script's path back, in the worker, where the script
  was imported (``fork_source.import_main``), so tracebacks show file, line and source;
- multienv's own frames (the runner that called ``env_fn``, the worker loop) sit above
  the user's. ``user_traceback`` leaves them out and says so.
"""

from __future__ import annotations

import functools
import os
import sys
import traceback
import types
from typing import Any

DYNAMIC_CODE = "<dynamic-code>"  # cloudpickle's co_filename for code pickled by value
MAIN_MODULES = ("__main__", "__mp_main__")
_WALKED = (type, types.FunctionType)  # what a script's function may use of the script
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # multienv/


def restore_script_names(obj: Any) -> Any:
    """Name the code of the user's script in ``obj`` after the script again; return ``obj``.

    Walks a function or class from ``__main__`` (pickled by value), the functions and
    classes its globals and closure hold, and their methods; through ``functools.partial``
    (its function and arguments) and bound methods to theirs. Nothing changes where the
    script has no file here (``python -c``, a notebook) or the code already has a name.
    """
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if not main_file or not os.path.isfile(main_file):
        return obj
    seen: set[int] = set()
    todo = [obj]
    while todo:
        item = todo.pop()
        if isinstance(item, functools.partial):  # troubleshooting.rst's late-binding cure
            todo += [item.func, *item.args, *item.keywords.values()]
            continue
        if isinstance(item, types.MethodType):
            todo += [item.__func__, type(item.__self__)]
            continue
        if id(item) in seen or getattr(item, "__module__", None) not in MAIN_MODULES:
            continue
        seen.add(id(item))
        if isinstance(item, types.FunctionType):
            item.__code__ = _renamed(item.__code__, main_file)
            todo += [
                v for v in item.__globals__.values() if isinstance(v, type | types.FunctionType)
            ]
            todo += [cell.cell_contents for cell in item.__closure__ or () if _has_contents(cell)]
        elif isinstance(item, type):
            for value in vars(item).values():
                todo.append(getattr(value, "__func__", value))  # staticmethod, classmethod
                if isinstance(value, property):
                    todo += [f for f in (value.fget, value.fset, value.fdel) if f is not None]
    return obj


def _has_contents(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def _renamed(code: types.CodeType, filename: str) -> types.CodeType:
    """``code`` and the code nested in it (inner functions, lambdas) named ``filename``."""
    if code.co_filename != DYNAMIC_CODE:
        return code
    consts = tuple(
        _renamed(const, filename) if isinstance(const, types.CodeType) else const
        for const in code.co_consts
    )
    return code.replace(co_filename=filename, co_consts=consts)


def user_traceback(exc: BaseException, *, with_last_line: bool = True) -> str:
    """``exc``'s traceback without multienv's own frames (said in one line), as text.

    ``with_last_line=False`` leaves out the final ``Type: message`` line, for a parent that
    shows the exception itself right after. All frames stay when every one is multienv's.
    """
    frames = traceback.extract_tb(exc.__traceback__)
    kept = traceback.StackSummary.from_list(
        [frame for frame in frames if not frame.filename.startswith(_PACKAGE_DIR)]
    )
    if not kept:
        kept = frames
    lines = ["Traceback (most recent call last):\n"]
    if len(kept) < len(frames):
        lines.append(f"  [{len(frames) - len(kept)} frame(s) of multienv's worker left out]\n")
    lines += kept.format()
    if with_last_line:
        lines += traceback.format_exception_only(type(exc), exc)
    text = "".join(lines)
    cause = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    if cause is not None and cause.__traceback__ is not None:  # the env's own chain, as Python
        link = (
            "The above exception was the direct cause of the following exception:"
            if exc.__cause__ is not None
            else "During handling of the above exception, another exception occurred:"
        )
        text = "".join(traceback.format_exception(cause)) + f"\n{link}\n\n" + text
    return text
