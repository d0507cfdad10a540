"""Node loss on a two-node Ray cluster: run by tests/test_ray_backend.py in its own process.

Starts a head node and a worker node (``ray.cluster_utils.Cluster``), spreads 3 actors of
2 envs over them, removes the worker node mid-run, and checks that every env of an actor
on it comes back as a flagged truncation while stepping goes on on the head node. Prints
one JSON line of figures last; exits non-zero if a check fails.
"""

import json
import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import numpy as np
import ray
from ray.cluster_utils import Cluster

from multienv import MultiEnv, RayOptions
from tests.envs import CountingEnv

N, K = 6, 2


def main() -> None:
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="mrn", dir="/tmp")  # short AF_UNIX paths
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
    )
    worker_node = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        options = RayOptions(scheduling_strategy="SPREAD")
        with MultiEnv(
            [CountingEnv] * N, backend="ray", envs_per_worker=K, ray_options=options
        ) as envs:
            nodes = [proxy.supervisor.handle.node_id for proxy in envs.envs]
            lost = [i for i, node in enumerate(nodes) if node == worker_node.node_id]
            assert 0 < len(lost) < N, f"actors were not spread over both nodes: {nodes}"
            envs.reset()
            for _ in range(3):
                envs.step(np.ones(N, dtype=np.int64))
            removed_at = time.monotonic()
            cluster.remove_node(worker_node)
            _, _, _, truncations, infos = envs.step(np.ones(N, dtype=np.int64))
            recovered_s = time.monotonic() - removed_at
            flagged = np.flatnonzero(truncations).tolist()
            causes = sorted({infos["multienv"]["cause"][i] for i in flagged})
            nodes_after = {proxy.supervisor.handle.node_id for proxy in envs.envs}
            assert worker_node.node_id not in nodes_after
            steps_after = 0
            for _ in range(60):
                _, _, _, truncations, infos = envs.step(np.ones(N, dtype=np.int64))
                assert "multienv" not in infos, infos.get("multienv")
                steps_after += 1
            sys.stdout.write(
                json.dumps(
                    {
                        "lost_envs": lost,
                        "flagged": flagged,
                        "causes": causes,
                        "recovery_s": round(recovered_s, 2),
                        "steps_after": steps_after,
                    }
                )
                + "\n"
            )
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(os.environ["RAY_TMPDIR"], ignore_errors=True)


if __name__ == "__main__":
    main()
