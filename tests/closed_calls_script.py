"""Calls every public method of a closed MultiEnv; run as a script by test_closed.py.

Prints one line per call: ``name: ExceptionType: message`` or ``name: returned``. A call
that crashes the process (a segfault) ends the output there, which the test sees.
"""

from __future__ import annotations

import sys

import numpy as np

from multienv import MultiEnv
from tests.envs import CountingEnv

CALLS = {
    "step": lambda envs, actions: envs.step(actions),
    "step_async": lambda envs, actions: envs.step_async(actions),
    "step_wait": lambda envs, actions: envs.step_wait(),
    "reset": lambda envs, actions: envs.reset(),
    "reset_async": lambda envs, actions: envs.reset_async(),
    "reset_wait": lambda envs, actions: envs.reset_wait(),
    "send": lambda envs, actions: envs.send(actions),
    "recv": lambda envs, actions: envs.recv(),
    "call": lambda envs, actions: envs.call("add", 1),
    "get_attr": lambda envs, actions: envs.get_attr("count"),
    "set_attr": lambda envs, actions: envs.set_attr("scale", 2.0),
    "render": lambda envs, actions: envs.render(),
    "timing": lambda envs, actions: envs.timing(),
    "get_states": lambda envs, actions: envs.get_states(),
    "set_states": lambda envs, actions: envs.set_states([None] * envs.num_envs),
    "sync_states": lambda envs, actions: envs.sync_states(None),
    "step_batch": lambda envs, actions: envs.step_batch(actions),
    "np_random_seed": lambda envs, actions: envs.np_random_seed,
}

if __name__ == "__main__":
    envs_per_worker, as_list, in_with = int(sys.argv[1]), sys.argv[2] == "list", sys.argv[3]
    for name, call in CALLS.items():
        envs = MultiEnv([CountingEnv] * 4, envs_per_worker=envs_per_worker)
        actions = [0] * 4 if as_list else np.zeros(4, np.int64)
        envs.reset(seed=0)
        envs.step(actions)
        if in_with == "send":  # closed with steps in flight
            envs.send(np.zeros(4, np.int64))
        envs.close()
        try:
            call(envs, actions)
        except Exception as error:  # noqa: BLE001 - printed for the test to read
            print(f"{name}: {type(error).__name__}: {error}", flush=True)
        else:
            print(f"{name}: returned", flush=True)
    print("done", flush=True)
