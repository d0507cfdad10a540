"""PARENT SIDE, backend-neutral: from env factories to ready proxies.

Every backend's ``create_*_envs`` checks its options, pickles the factories, groups them
``envs_per_worker`` to a worker, then starts all workers and initializes them in parallel:
that part is the same for every backend and lives here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any, TypeVar

import cloudpickle

from multienv.errors import EnvError, EnvFnPickleError
from multienv.supervision.env_proxy import RemoteEnv
from multienv.supervision.handles import Backend, WorkerHandle
from multienv.supervision.options import SupervisorOptions
from multienv.supervision.supervisor import WorkerSupervisor
from multienv.wire.space_bounds import share_bounds

logger = logging.getLogger(__name__)

ProxyT = TypeVar("ProxyT", bound=RemoteEnv)


def pickle_env_fn(env_fn: Callable[[], Any], env_index: int) -> bytes:
    """``env_fn`` pickled with cloudpickle; a TypeError naming the env if it cannot be."""
    if not callable(env_fn):
        raise TypeError(
            f"env {env_index}: env_fn must be a zero-argument callable returning a "
            f"gymnasium.Env, got {type(env_fn).__name__}"
        )
    try:
        return bytes(cloudpickle.dumps(env_fn))
    except Exception as exc:  # noqa: BLE001 - any pickling error is the env_fn's
        raise EnvFnPickleError(  # the pickler's frames say nothing to the user: cut
            f"env {env_index}: env_fn {env_fn!r} cannot be pickled with cloudpickle ({exc}); "
            "build unpicklable resources inside env_fn instead of capturing them.",
            env_index=env_index,
        ) from exc.with_traceback(None)


def warn_unbounded_batches(envs_per_worker: int, options: dict[str, Any]) -> None:
    """Log that ``step_timeout`` has gaps when workers host several envs and resets are unbounded.

    A worker answers for its batch as a whole: its deadline is ``step_timeout`` per step plus
    ``reset_timeout`` per reset. With no ``reset_timeout``, the batch that resets one of its
    envs with the others' steps (a vector's next-step autoreset) has no deadline at all.
    """
    step_timeout, reset_timeout = options.get("step_timeout"), options.get("reset_timeout")
    if envs_per_worker > 1 and step_timeout is not None and reset_timeout is None:
        logger.warning(
            "step_timeout=%s with %d envs per worker and no reset_timeout: a worker's step that "
            "also resets one of its envs has no deadline, so a hang in it is never killed; "
            "pass reset_timeout too",
            step_timeout,
            envs_per_worker,
        )


def supervise(
    env_fns: Sequence[Callable[[], Any]],
    first_env_index: int,
    make_handle: Callable[[list[bytes]], WorkerHandle],
    backend: Backend,
    options: SupervisorOptions,
) -> WorkerSupervisor:
    """Check the options, pickle the factories, and build one worker's supervisor.

    Args:
        env_fns: The worker's env factories, by position.
        first_env_index: The vector index of its first env, for messages.
        make_handle: Builds the backend's handle from the pickled factories.
        backend: The backend the handle belongs to.
        options: The supervisor's deadlines and policies.
    """
    options.check(first_env_index)
    env_indices = list(range(first_env_index, first_env_index + len(env_fns)))
    env_fn_bytes = [
        pickle_env_fn(env_fn, env_index)
        for env_fn, env_index in zip(env_fns, env_indices, strict=True)
    ]
    return WorkerSupervisor(make_handle(env_fn_bytes), env_indices, backend, options)


def create_envs(
    env_fns: Sequence[Callable[[], Any]],
    envs_per_worker: int,
    supervise: Callable[[Sequence[Callable[[], Any]], int], WorkerSupervisor],
    proxy_class: type[ProxyT],
    name: str,
    before_start: Callable[[], None] | None = None,
) -> list[ProxyT]:
    """Start the workers, then initialize them all in parallel; return one proxy per env.

    Args:
        env_fns: The env factories; env i lives in worker ``i // envs_per_worker``.
        envs_per_worker: How many envs each worker hosts.
        supervise: Builds the supervisor of one worker from its factories and the index
            of its first env (checking and pickling them: nothing is started by it).
        proxy_class: The backend's ``RemoteEnv`` subclass.
        name: The public function's name, for messages.
        before_start: Runs once every factory is checked and pickled, before any worker
            starts (the subprocess backend's probe for the module server).
    """
    if not isinstance(envs_per_worker, int) or envs_per_worker < 1:
        raise ValueError(f"{name}(): envs_per_worker must be an int >= 1, got {envs_per_worker!r}")
    env_fns = list(env_fns)
    supervisors = [
        supervise(env_fns[first : first + envs_per_worker], first)
        for first in range(0, len(env_fns), envs_per_worker)
    ]
    envs = []
    for supervisor in supervisors:
        for position in range(len(supervisor.env_indices)):
            env = proxy_class.__new__(proxy_class)
            RemoteEnv.__init__(env, supervisor, position)
            envs.append(env)
    try:
        if before_start is not None:
            before_start()
        for supervisor in supervisors:
            supervisor.start()
        with ThreadPoolExecutor(
            max_workers=max(1, min(len(supervisors), 32)), thread_name_prefix="multienv"
        ) as pool:
            futures = [pool.submit(supervisor.initialize) for supervisor in supervisors]
            wait_futures(futures)
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            raise one_error(errors)  # type: ignore[arg-type]
        for env in envs:
            env.describe()
            share_bounds(env.observation_space, envs[0].observation_space)
            share_bounds(env.action_space, envs[0].action_space)
    except BaseException:
        for supervisor in supervisors:
            supervisor.close(timeout=1.0)
        raise
    return envs


def one_error(errors: list[BaseException]) -> BaseException:
    """The first worker's error; the others' said once in it when the same, else logged.

    An ``env_fn`` that raises usually raises the same in every worker: one message names
    the other envs, rather than repeating it per env.
    """
    first, same = errors[0], []
    for error in errors[1:]:
        if _is_same_env_error(error, first):
            same.append(str(error.env_index))  # type: ignore[attr-defined]
        else:
            logger.error("initialize() failed too: %s", error)
    if same:
        shown = ", ".join(same[:8]) + (", ..." if len(same) > 8 else "")
        first.args = (f"{first.args[0]} Env(s) {shown} raised the same.", *first.args[1:])
    return first


def _is_same_env_error(error: BaseException, first: BaseException) -> bool:
    cause, first_cause = error.__cause__, first.__cause__
    return (
        isinstance(error, EnvError)
        and isinstance(first, EnvError)
        and type(cause) is type(first_cause)
        and str(cause) == str(first_cause)
    )
