"""PARENT SIDE: the seam between the backend-neutral parent and a backend.

A backend brings three things, and the rest of the parent side knows it by these alone:

- a ``WorkerHandle`` per worker: the transport to one worker process or actor hosting k
  envs (spawn, handshake, one call or batch in flight, kill, stop, standby, memory). Every
  backend fills all of it;
- a ``VectorLink`` per vector: the multi-wait over the vector's workers;
- a ``Backend``: its name, how it builds ready proxies from factories, and how it links
  handles into a vector.

A backend whose workers share memory with the vector (the subprocess backend) also fills
the optional ``SharedMemoryHandle`` and ``SharedMemoryLink`` parts: observations and results
in a shared batch, and planned steps (one encoding of the whole vector's step). The
supervisor and the vector ask ``isinstance`` once, when they are built.

Backends are found by name among the ``multienv.backends`` entry points (setup.cfg lists the
two that ship); a new backend is a new module and one entry point, not an edit here.

Words: a *worker* hosts k envs, each at a *position* (0 to k-1) in it; ``env_index`` is an
env's place in its vector. A *batch* is the steps and resets of some envs of one worker; a
*planned step* is one step of a whole vector, encoded once.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import logging
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import gymnasium as gym
import numpy as np

from multienv.wire.info_columns import AddInfo
from multienv.wire.protocol import Batch, BatchResult, Reply, Request, StepPlan

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from multienv.supervision.worker_stats import VectorCounters
    from multienv.wire.autoreset import Autoreset

StepBatch = tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]

ENTRY_POINT_GROUP = "multienv.backends"


@dataclasses.dataclass(frozen=True)
class Death:
    """The worker is gone (or was killed for a timeout); ``cause`` says how."""

    cause: str


class WorkerHandle(Protocol):
    """The transport to one worker hosting k envs; one call in flight at a time."""

    @property
    def pid(self) -> int | None:
        """Process id of the current worker (on its node); None before ``spawn()``."""

    def spawn(self, *, is_quiet: bool = False) -> None:
        """Start a new worker (or take the standby), which builds its envs; returns at once.

        ``is_quiet``: the worker replaces one of a crash loop, whose output was seen already:
        what it writes is kept for the crash report, not forwarded (where the backend
        forwards it).
        """

    def handshake(self, deadline: float | None) -> Reply | Death:
        """Wait for the worker's envs: ``Reply(list[EnvDescription])`` or a failure, or death."""

    def submit(self, request: Request) -> None:
        """Send one call; a dead worker is noticed by ``collect``."""

    def collect(self, deadline: float | None) -> Reply | Death:
        """Wait for the call's reply, the worker's death or the deadline (then kill it)."""

    def submit_batch(self, batch: Batch) -> None:
        """Send the steps and resets of some of the worker's envs, as one request."""

    def collect_batch(self, deadline: float | None) -> BatchResult | Death:
        """Wait for the batch's result (``obs`` None when in shared memory), or the death."""

    def kill(self) -> None:
        """Kill the worker at once and reap it."""

    def stop(self, timeout_s: float) -> None:
        """Ask the worker to close its envs and exit; kill it after ``timeout_s``. Idempotent."""

    def abandon(self) -> None:
        """Kill the worker (and a standby) now, for a vector or proxy dropped without ``close()``.

        It may run in any thread, from the garbage collector or at exit: it takes no lock,
        starts no thread and waits for nothing, not even the worker's end. A thread waiting on
        the worker then raises ``ClosedEnvironmentError``. What the handle holds (pipes,
        sentinels) is released with the handle. Idempotent.
        """

    def prestart(self) -> None:
        """Start a standby worker, which the next ``spawn()`` takes over; idempotent."""

    def retire(self) -> None:
        """Ask the current worker to close its envs and exit, without waiting for it."""

    def rss_mb(self) -> float | None:
        """Resident memory of the current worker in MiB; None if it cannot be read."""

    def stderr_tail(self) -> tuple[str, ...]:
        """The last lines the current (or last) worker wrote to stderr."""


@runtime_checkable
class SharedMemoryHandle(WorkerHandle, Protocol):
    """The optional part of a handle whose worker shares a batch buffer with its vector."""

    @property
    def is_linked(self) -> bool:
        """Whether the handle is linked into a vector's shared memory now."""

    def begin_link(self) -> None:
        """Send the current worker what needs no answer yet; ``join_link`` does the rest."""

    def join_link(self, deadline: float | None) -> Death | None:
        """Give the current worker what its vector's link shares; None when done."""

    def read_obs(self, position: int) -> Any:
        """The observation the env at ``position`` is on in shared memory; None if unlinked."""

    def submit_planned(self, plan: StepPlan, env_slice: slice, deadline: float | None) -> None:
        """Send this worker's part (its envs are ``env_slice`` of the vector) of a plan.

        ``deadline``: when it is late, as ``collect_planned`` gets it.
        """

    def collect_planned(self, deadline: float | None) -> BatchResult | Death | None:
        """Wait for this worker's part of a plan: None when everything is in shared memory."""

    def leave_round(self) -> None:
        """This worker's part of a counted plan goes as a general batch, or not at all."""


class VectorLink(Protocol):
    """What a vector shares with its workers: at least a multi-wait."""

    def wait_any(
        self,
        handles: Sequence[WorkerHandle],
        deadlines: Sequence[float | None],
        timeout: float | None,
    ) -> list[int]:
        """Wait until some of ``handles`` can be collected without blocking.

        A handle counts as ready when its reply is in, its worker died, its deadline passed
        (collecting it then kills the worker) or it has nothing in flight. Returns their
        positions in ``handles``, ascending; empty if ``timeout`` passed first.
        """

    def close(self) -> None:
        """Release what the link holds (shared memory, pipes)."""


@runtime_checkable
class SharedMemoryLink(VectorLink, Protocol):
    """The optional part of a link whose vector's observations live in shared memory."""

    @property
    def has_shared_obs(self) -> bool:
        """Whether observations come from ``observations()`` rather than from results."""

    def observations(self, env_ids: Sequence[int] | None, copy: bool) -> Any:
        """The batched observations of ``env_ids`` (all envs when None)."""

    def plan_step(
        self, actions: Any, is_reset: np.ndarray, autoreset: bool, is_counted: bool = False
    ) -> StepPlan | None:
        """Prepare a whole step for every env at once, or None if this link cannot.

        ``is_counted``: every worker will get its slice and be collected before the vector
        returns (``StepPlan.is_counted``).
        """

    def commit(
        self, plan: StepPlan, index: slice | np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Finish ``index`` of a plan whose workers all came back clean.

        Returns:
            Those envs' rewards, terminated and truncated flags: views that the next step
            overwrites, so read them at once.
        """

    def merge_info_columns(
        self, pickled: dict[int, dict[str, Any]], fresh: slice | np.ndarray, add_info: AddInfo
    ) -> dict[str, Any]:
        """A planned step's infos: the ``pickled`` ones, by env, and the rows of envs ``fresh``.

        ``fresh`` is ``slice(None)`` or env indices, of envs whose workers answered the step;
        see ``info_columns.ColumnReader.merge``.
        """

    def row_infos(self, env_ids: np.ndarray) -> dict[int, dict[str, Any]]:
        """The infos in the rows of envs ``env_ids`` (whose workers answered), by env."""

    def finals(self, env_ids: np.ndarray) -> dict[int, dict[str, Any]]:
        """Same-step autoreset's final obs and info of ``env_ids``, by env.

        From a planned step whose workers left them in shared memory (``StepPlan.has_finals``).
        """

    def batch_times(self, worker_number: int) -> np.ndarray:
        """The worker's own time on each of its latest batches in shared memory (s)."""

    def open_data_plane(self, vector: VectorParts) -> DataPlane | None:
        """The vector's healthy step in one pass, or None if the link has none for it."""


class PlannedWorker(Protocol):
    """What a data plane uses of one worker's supervisor (``WorkerSupervisor`` is one).

    Attributes:
        handle: The transport to the worker.
        changes: The change counter a vector's workers share (``data_plane``).
        stats: The worker's counters (``WorkerStats``).
    """

    handle: WorkerHandle
    changes: list[int]
    stats: Any

    @property
    def is_recycling(self) -> bool:
        """Whether the worker has a recycle policy."""

    @property
    def timeouts(self) -> tuple[float | None, float | None]:
        """Its step and reset timeouts, in seconds."""

    def can_take_planned(self) -> bool:
        """Whether its part of a planned step can go as is."""

    def note_success(self) -> None:
        """A planned step the data plane collected came back clean."""

    def take_planned(self, plan: StepPlan, env_slice: slice, sent_at: float) -> float | None:
        """Its part of a planned step is in flight; returns its deadline."""

    def finish(self) -> tuple[BatchResult | None, dict[int, Exception]]:
        """Collect its batch or part: the result, and errors by item."""


@dataclasses.dataclass(frozen=True)
class VectorParts:
    """What a vector gives its link's data plane: its workers, and the state it keeps.

    Attributes:
        supervisors: The vector's workers, by worker index.
        env_slices: Each worker's envs, a slice of the vector's.
        autoreset: The vector's autoreset state; the data plane keeps ``needs_reset``.
        counters: The vector's steps, episodes and latencies; the data plane keeps them.
        copy: Return a copy of the observations rather than the shared buffer.
        add_info: Gymnasium's ``_add_info`` for the vector's size.
    """

    supervisors: Sequence[PlannedWorker]
    env_slices: Sequence[slice]
    autoreset: Autoreset
    counters: VectorCounters
    copy: bool
    add_info: AddInfo


class DataPlane(Protocol):
    """A vector's healthy step: send it to every worker, then receive it as arrays.

    Attributes:
        parts: ``send``/``recv`` of whole workers the same way, if the link has it.
    """

    parts: PartsPlane | None

    def send(self, actions: Any) -> bool:
        """Send a step of every env; False, sending nothing, if it cannot go this way now."""

    def receive(self, timeout: float | None = None) -> StepBatch | StepPlan | None:
        """Wait for the step: its batch, the plan handed over, or None if ``timeout`` passed.

        The ``StepPlan`` in flight is handed over to the supervisors when anything was not
        as usual; on a timeout the step stays in flight.
        """

    def send_reset(self, mask: np.ndarray) -> bool:
        """Send a reset of the envs in ``mask``; False, sending nothing, if it cannot go so."""

    def receive_reset(
        self, timeout: float | None = None
    ) -> tuple[Any, dict[str, Any]] | StepPlan | None:
        """Wait for the reset: its observations and infos, the plan handed over, or None."""

    def is_in_flight(self) -> bool:
        """Whether a step was sent and not yet received."""

    def align_slots(self) -> None:
        """Put every env's last observation on one slot, so that a step of all may go here."""

    def interrupt(self) -> StepPlan | None:
        """An exception stopped the step in flight: hand it over to the supervisors.

        Returns the plan they took their parts of; None if no step was in flight.
        """


class PartsPlane(Protocol):
    """A vector's healthy ``send``/``recv`` of whole workers (``InFlight`` tries it first)."""

    sent: int

    def is_busy(self) -> bool:
        """Whether any worker is in flight here, or done and not yet returned."""

    def num_busy(self) -> int:
        """How many envs are in flight here, or done and not yet returned."""

    def env_ids(self) -> list[int]:
        """The envs in flight here or done and not yet returned, ascending."""

    def send(self, actions: Any, env_ids: Any) -> bool:
        """Step every env of some workers; False, sending nothing, if it cannot go this way."""

    def receive(
        self, size: int, timeout: float | None, min_size: int | None = None, is_ready: bool = False
    ) -> StepBatch | dict[int, Any]:
        """The first ``size`` envs to finish, ascending; or every worker, handed over.

        At ``timeout``, the envs done so far if they are ``min_size`` or more (None: ``size``);
        ``is_ready``: the workers done as soon as their envs are ``min_size``, up to ``size``.
        """

    def flush_counts(self) -> None:
        """Count the steps and episodes of the batches returned since the last flush."""

    def forget_returned(self) -> None:
        """The envs the last ``recv`` returned were sent another way: no short ``send``."""

    def hand_over(self) -> dict[int, Any]:
        """Give every worker here to its supervisor; by worker, what the control plane gets.

        That is its part of a planned step, which its supervisor took in flight, or its
        outcome, ``(result, errors by env)``, if it was collected already.
        """


class OpenLink(Protocol):
    """Links a vector's handles into one ``VectorLink``."""

    def __call__(
        self,
        handles: Sequence[WorkerHandle],
        spaces: tuple[gym.Space[Any], gym.Space[Any]],
        env_indices: Sequence[Sequence[int]],
        slices: Sequence[Sequence[int]],
        shared_memory: bool | None,
    ) -> VectorLink:
        """Link ``handles`` (the vector's, by worker index) into one vector.

        Args:
            handles: The vector's handles, by worker index.
            spaces: The single-env observation and action spaces.
            env_indices: Per worker, the vector's index of each env, by position (-1: none).
            slices: The workers each collecting thread of the vector serves.
            shared_memory: Batch observations in shared memory: None when the space
                allows, True (TypeError if it does not) or False. Backends without shared
                memory ignore it.
        """


@dataclasses.dataclass(frozen=True)
class Backend:
    """One way to run workers: a name, a proxy factory and a link factory.

    Attributes:
        name: What ``MultiEnv(backend=...)`` calls it.
        create_envs: ``create_*_envs(env_fns, envs_per_worker=..., **options)``: ready proxies.
        open_link: Links a vector's handles (see ``OpenLink``); they are all of this backend.
        options: The keyword options ``create_envs`` passes on to each env's proxy.
        auto_layout: ``auto_layout(env_fns, **options)``: the ``multienv.Layout`` that
            ``envs_per_worker="auto"`` picks; None where the backend offers no ``"auto"``.
    """

    name: str
    create_envs: Callable[..., list[Any]]
    open_link: OpenLink
    options: frozenset[str]
    auto_layout: Callable[..., Any] | None = None

    @classmethod
    def of(
        cls,
        name: str,
        create_envs: Callable[..., list[Any]],
        open_link: OpenLink,
        proxy: type,
        auto_layout: Callable[..., Any] | None = None,
    ) -> Backend:
        """The backend whose options are the keywords its proxy class takes.

        Less the env's factory and index, which ``create_envs`` gives each proxy itself;
        ``proxy`` defines its own ``__init__``.
        """
        init = vars(proxy)["__init__"]
        options = keyword_options(init) - {"self", "env_fn", "env_index"}
        return cls(name, create_envs, open_link, frozenset(options), auto_layout)


# multienv's own backends, where its setup.cfg registers them: found even when the installed
# entry points are missing or stale (a checkout run without ``pip install -e .``, or pulled
# after modules moved).
BUILT_IN_BACKENDS = {
    "subprocess": "multienv.backends.subprocess.subprocess_env",
    "ray": "multienv.backends.ray.ray_env",
}


def backend_names() -> list[str]:
    """The names of the installed backends and the built-in ones, sorted."""
    installed = {point.name for point in entry_points(group=ENTRY_POINT_GROUP)}
    return sorted(installed | set(BUILT_IN_BACKENDS))


@functools.cache
def find_backend(name: str) -> Backend:
    """The backend registered under ``name``; its module is imported only now.

    Looked up once per name: reading the installed packages' entry points takes 2-4 ms,
    a tenth of a later vector's start-up.

    Raises:
        ValueError: No backend of that name is installed.
    """
    for point in entry_points(group=ENTRY_POINT_GROUP, name=name):
        try:
            backend: Backend = point.load()
        except ImportError:
            if name not in BUILT_IN_BACKENDS:
                raise
            logger.warning(
                "the installed entry point %s = %s does not load; using multienv's own "
                "(reinstall multienv: pip install -e .)",
                name,
                point.value,
            )
            break
        return backend
    if name in BUILT_IN_BACKENDS:
        built_in: Backend = importlib.import_module(BUILT_IN_BACKENDS[name]).BACKEND
        return built_in
    raise ValueError(f"backend must be one of {backend_names()}, got {name!r}.")


def keyword_options(*callables: Callable[..., Any]) -> set[str]:
    """The keyword options that ``callables`` take (what may be passed on to them)."""
    names: set[str] = set()
    for function in callables:
        for parameter in inspect.signature(function).parameters.values():
            if parameter.kind in (parameter.KEYWORD_ONLY, parameter.POSITIONAL_OR_KEYWORD):
                names.add(parameter.name)
    return names
