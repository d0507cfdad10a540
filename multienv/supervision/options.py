"""PARENT SIDE, backend-neutral: a worker's supervision options, typed and checked once.

The public functions take keyword options (``SubprocessEnv(step_timeout=...)``,
``MultiEnv(..., **options)``), as Gymnasium's and SB3's do. Each backend reads them once,
where they enter it, into typed settings: ``SupervisorOptions`` here, for every backend's
``WorkerSupervisor``, inside the backend's own (``SubprocessOptions``, ``RayEnv``'s
``RayOptions``). From there on they travel as those objects, never as ``**kwargs``.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Collection, Mapping
from typing import Any

from multienv.recycle import RecyclePolicy
from multienv.restart import RestartPolicy

INIT_TIMEOUT_S = 60.0
CLOSE_TIMEOUT_S = 5.0


@dataclasses.dataclass(frozen=True)
class SupervisorOptions:
    """How one worker is supervised, whatever its backend; ``SubprocessEnv`` documents each.

    Attributes:
        restart_policy: How many respawns are allowed, and how fast (None: the default).
        step_timeout: Seconds a step may take before the worker is killed; None: forever.
        reset_timeout: Seconds a reset may take before the worker is killed; None: forever.
        init_timeout: Seconds a worker may take to build its envs before it is killed.
        restart_on_error: Treat an exception raised by env code as a death.
        close_timeout_s: Seconds ``close()`` waits for the worker before killing it.
        recycle: When to replace the worker by a fresh one; None never recycles.
    """

    restart_policy: RestartPolicy | None = None
    step_timeout: float | None = None
    reset_timeout: float | None = None
    init_timeout: float | None = INIT_TIMEOUT_S
    restart_on_error: bool = False
    close_timeout_s: float = CLOSE_TIMEOUT_S
    recycle: RecyclePolicy | None = None

    @classmethod
    def names(cls) -> frozenset[str]:
        """The keyword options these settings read."""
        return frozenset(field.name for field in dataclasses.fields(cls))

    @classmethod
    def of(cls, options: Mapping[str, Any]) -> SupervisorOptions:
        """The settings among keyword ``options`` (others are left to the caller)."""
        return cls(**{name: value for name, value in options.items() if name in cls.names()})

    def check(self, env_index: int) -> None:
        """Raise ValueError, naming the env, for a timeout that is not > 0 or None."""
        for name in ("step_timeout", "reset_timeout", "init_timeout"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"env {env_index}: {name} must be > 0 or None, got {value!r}")


def check_options(owner: str, options: Collection[str], valid: Collection[str]) -> None:
    """Refuse keyword options that ``owner`` does not take, in its own name, listing valid ones."""
    unknown = sorted(set(options) - set(valid))
    if unknown:
        guesses = [
            f"{close[0]!r} for {name!r}"
            for name in unknown
            if (close := difflib.get_close_matches(name, sorted(valid), n=1, cutoff=0.75))
        ]
        hint = f" did you mean {', '.join(guesses)}?" if guesses else ""
        raise TypeError(
            f"{owner}() got unexpected keyword argument(s) {unknown};{hint} valid options "
            f"are {sorted(valid)}."
        )
