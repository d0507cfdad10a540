"""multienv: many Gymnasium envs in worker processes or Ray actors, one crash-proof VectorEnv.

Public API only: re-exports, ``__all__`` and ``__version__``.
"""

from multienv.backends.ray.ray_env import RayEnv, RayOptions, create_ray_envs
from multienv.backends.subprocess.subprocess_env import (
    SubprocessEnv,
    create_subprocess_envs,
    start_forkserver,
)
from multienv.errors import (
    EnvCrashedError,
    EnvCrashLoopError,
    EnvError,
    EnvStateError,
    MultiEnvError,
)
from multienv.evaluation import EvaluationResult, evaluate
from multienv.layout import Layout
from multienv.placement import WorkerPlacement
from multienv.recycle import RecyclePolicy
from multienv.registration import make_vec
from multienv.restart import RestartPolicy
from multienv.supervision.lifecycle import EnvState
from multienv.vector.batch_picker import AutoBatch
from multienv.vector.multi_env import MultiEnv
from multienv.wire.protocol import EnvSnapshot, RemoteTraceback

__version__ = "0.1.0"

__all__ = [
    "AutoBatch",
    "EnvCrashLoopError",
    "EnvCrashedError",
    "EnvError",
    "EnvSnapshot",
    "EnvState",
    "EnvStateError",
    "EvaluationResult",
    "Layout",
    "MultiEnv",
    "MultiEnvError",
    "RayEnv",
    "RayOptions",
    "RecyclePolicy",
    "RemoteTraceback",
    "RestartPolicy",
    "SubprocessEnv",
    "WorkerPlacement",
    "__version__",
    "create_ray_envs",
    "create_subprocess_envs",
    "evaluate",
    "make_vec",
    "start_forkserver",
]
