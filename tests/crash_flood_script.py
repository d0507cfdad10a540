"""A crash loop of 4 workers that segfault every step; run as a script by test_stderr_relay.

With argument ``budget`` it allows that many restarts, then steps 200 times.
"""

from __future__ import annotations

import sys

import numpy as np

from multienv import EnvCrashLoopError, MultiEnv, RestartPolicy
from tests.envs import SegfaultEveryStep

if __name__ == "__main__":
    budget = int(sys.argv[1])
    policy = RestartPolicy(max_restarts=budget, window_s=600, backoff=0.0)
    with MultiEnv([SegfaultEveryStep] * 4, restart_policy=policy) as envs:
        envs.reset(seed=0)
        try:
            for _ in range(200):
                envs.step(np.zeros(4, np.int64))
        except EnvCrashLoopError as error:
            print("EnvCrashLoopError:", str(error).splitlines()[0], file=sys.stderr)
