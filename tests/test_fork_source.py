"""What the module server does before it forks: its objects become immortal (CPython 3.12+).

The interpreter-level tests run in fresh Pythons: making objects immortal cannot be undone,
and ``immortal_refcount`` is decided once per process.
"""

import ctypes
import json
import sys
import sysconfig

import numpy as np
import pytest

from multienv.backends.subprocess.forking.fork_source import _write_words
from tests.test_forkserver import run_python

IS_SUPPORTED = (
    sys.implementation.name == "cpython"
    and (3, 12) <= sys.version_info[:2] <= (3, 13)
    and not sysconfig.get_config_var("Py_GIL_DISABLED")
    and sys.maxsize > 2**32
    and not hasattr(sys, "gettotalrefcount")
)
needs_immortal_objects = pytest.mark.skipif(
    not IS_SUPPORTED, reason="objects can be made immortal on CPython 3.12 and 3.13 only"
)

_REFCOUNT_SCRIPT = """
from multienv.backends.subprocess.forking.fork_source import immortal_refcount
print(immortal_refcount())
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("variable", [None, "0"])
def test_immortal_refcount_is_known_only_where_the_object_header_is(variable):
    env = {} if variable is None else {"MULTIENV_IMMORTALIZE": variable}
    done = run_python(["-c", _REFCOUNT_SCRIPT], env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    expected = 2**32 - 1 if IS_SUPPORTED and variable is None else None
    assert done.stdout.strip() == str(expected)


_IMMORTALIZE_SCRIPT = """
import gc, json, sys, weakref
from multienv.backends.subprocess.forking.fork_source import immortalize_and_freeze

def function():
    return "a constant of its code"

class Holder:
    pass

table = {"built at run time": "x" * 1000, "number": 10**30, "ratio": 0.5}
holder = Holder()
gc.freeze()  # frozen earlier, as the server's first objects are
count = immortalize_and_freeze(include_frozen=True)
immortal = sys.getrefcount(None)
old = [table, function, function.__code__, table["built at run time"], table["number"],
       table["ratio"], Holder, holder, sys.modules["json"]]
fresh = Holder()
alive = weakref.ref(fresh)
refs = sys.getrefcount(fresh)
del fresh
gc.collect()
again = immortalize_and_freeze()  # only what was created since: the fresh objects of here
print(json.dumps({
    "count": count,
    "old_immortal": [sys.getrefcount(obj) == immortal for obj in old],
    "fresh_refs": refs,
    "fresh_freed": alive() is None,
    "table": table["ratio"] + table["number"] % 7,
    "function": function(),
    "again": again,
    "frozen": gc.get_freeze_count() > 0,
}))
"""


@needs_immortal_objects
@pytest.mark.timeout(60)
def test_objects_become_immortal_and_those_created_after_stay_mortal():
    done = run_python(["-c", _IMMORTALIZE_SCRIPT])
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["count"] > 10_000  # numpy, gymnasium... all imported by multienv
    assert all(report["old_immortal"]), report["old_immortal"]
    assert report["fresh_refs"] == 2  # the name and getrefcount's argument
    assert report["fresh_freed"]
    assert report["table"] == 0.5 + 10**30 % 7
    assert report["function"] == "a constant of its code"
    assert 0 < report["again"] < 1000
    assert report["frozen"]


def test_words_are_written_at_the_addresses_given_and_nowhere_else():
    words = np.zeros(64, dtype=np.int64)
    base = words.ctypes.data
    _write_words(np.array([base + 8 * 3, base + 8 * 40, base + 8 * 3], dtype=np.int64), 7)
    assert np.flatnonzero(words).tolist() == [3, 40]
    assert words[3] == words[40] == 7
    # An address that is not 8-byte aligned is written one at a time, all 8 bytes of it.
    raw = bytearray(32)
    start = ctypes.addressof((ctypes.c_char * 32).from_buffer(raw))
    _write_words(np.array([start + 4], dtype=np.int64), 2**32 - 1)
    assert raw == bytes(4) + (2**32 - 1).to_bytes(8, sys.byteorder) + bytes(20)
