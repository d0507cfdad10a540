"""BOTH SIDES: the autoreset rule, the only copy: Gymnasium 1.x semantics for a vector's envs.

The three modes match ``gymnasium.vector.AutoresetMode`` exactly, env by env:

- NEXT_STEP: the step that ends an episode returns its last observation; the env's next
  step resets it instead (returning the first observation, reward 0, no flags) and ignores
  that action. The reset travels in the same batch as the other envs' steps.
- SAME_STEP: the step that ends an episode resets at once (in the worker, inside the same
  round trip) and returns the new episode's first observation, with the final observation
  and info in ``info["final_obs"]`` and ``info["final_info"]``.
- DISABLED: nothing is reset; stepping a finished env is an error until the caller resets it
  (``MultiEnv.reset(options={"reset_mask": ...})``).

The worker's half is ``step_env``: step, and under SAME_STEP reset a finished episode in the
same round trip; and ``resolve_next_step``: in a vector's planned step, an item flagged
``IS_NEXT_STEP`` resets an env whose last result (still in shared memory) ended its episode,
so that the parent's data plane sends the same flags on every step. The vector's half is
``Autoreset``: which envs reset at their next step (NEXT_STEP), which steps are misuse
(DISABLED), and the infos the caller sees (``same_step_info``).

A worker crash during a step arrives here as a plain truncation, so each mode handles it
like any time limit. Under SAME_STEP the worker could not reset in the same trip, so the
vector resets that env itself (``step_info`` says so), and the ``info["multienv"]`` flag is
also lifted to the top level, where the caller looks first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode

from multienv.errors import EnvStateError, ResetNeededError
from multienv.wire.framing import IS_NEXT_STEP, IS_RESET
from multienv.wire.info_columns import AddInfo, ColumnReader
from multienv.wire.protocol import Outcome

# A worker's step: obs, reward, terminated, truncated, info, and (final_obs, final_info) when
# the step ended the episode and a same-step autoreset started the next one (else None).
Stepped = tuple[Any, Any, bool, bool, dict[str, Any], "tuple[Any, dict[str, Any]] | None"]


def step_env(
    env: gym.Env[Any, Any],
    position: int,
    action: Any,
    is_same_step: bool,
    check: Callable[[int, Any], None],
) -> Stepped:
    """WORKER SIDE: step one env; under same-step autoreset, reset it if the episode ended.

    Args:
        env: The env.
        position: Its place in its worker, for ``check``.
        action: The action.
        is_same_step: Same-step autoreset is on.
        check: Checks an observation of the env at a position against its space (raises).
    """
    obs, reward, terminated, truncated, info = env.step(action)
    check(position, obs)
    if is_same_step and (terminated or truncated):
        new_obs, new_info = env.reset()
        check(position, new_obs)
        return new_obs, reward, terminated, truncated, new_info, (obs, info)
    return obs, reward, terminated, truncated, info, None


def resolve_next_step(items: list[tuple[int, int]], ended: list[bool]) -> list[tuple[int, int]]:
    """WORKER SIDE: NEXT_STEP in a planned step: reset the envs whose last result ended.

    Args:
        items: The step's ``(position, flags)`` items.
        ended: By position, whether the env's last result (terminated or truncated, in
            shared memory) ended its episode. A reset's result ends nothing.
    """
    return [
        (position, flags | IS_RESET if flags & IS_NEXT_STEP and ended[position] else flags)
        for position, flags in items
    ]


def same_step_info(
    final_obs: Any, final_info: dict[str, Any], reset_info: dict[str, Any]
) -> dict[str, Any]:
    """The info a SAME_STEP step that ended an episode reports, Gymnasium's way."""
    merged: dict[str, Any] = {"final_obs": final_obs, "final_info": final_info}
    if "multienv" in final_info:  # a crash's flag, where the caller looks first
        merged["multienv"] = final_info["multienv"]
    merged.update(reset_info)
    return merged


def shared_finals(
    final_obs: np.ndarray, final_infos: ColumnReader, env_ids: np.ndarray
) -> dict[int, dict[str, Any]]:
    """PARENT SIDE: same-step finals a planned step left in shared memory, by env.

    For envs whose episode ended in a planned step their worker answered in full in shared
    memory (``planned_step``), which then wrote each one's final obs into ``final_obs`` and
    its final info into ``final_infos``' rows. Each gets ``same_step_info``, as a pickled
    answer would give it; the reset's own info is in the env's usual row.
    """
    rows = final_obs[env_ids]  # a copy: each env's final obs is a view of it
    infos = final_infos.row_infos(env_ids)
    return {
        env_index: same_step_info(rows[row], infos.get(env_index, {}), {})
        for row, env_index in enumerate(env_ids.tolist())
    }


def add_shared_finals(
    infos: dict[str, Any],
    ended: np.ndarray,
    env_ids: np.ndarray,
    final_obs: np.ndarray,
    final_infos: ColumnReader,
    add_info: AddInfo,
) -> dict[str, Any] | None:
    """PARENT SIDE: ``infos`` with the ``shared_finals`` of envs ``env_ids``, as arrays.

    What ``add_info`` makes of them, built for all at once: ``final_obs`` (an object array,
    None where no episode ended) and ``final_info`` (the final infos' columns), each with
    ``ended`` as its mask. None, nothing added, when a key would meet another (a final
    info's ``"multienv"``, or a ``"final_info"`` among ``infos``): merge them env by env.
    """
    merged_finals = final_infos.merge({}, env_ids, add_info)
    if "multienv" in merged_finals or "final_info" in infos:
        return None
    rows = final_obs[env_ids]
    finals = np.empty(len(ended), dtype=object)  # all None, as Gymnasium's
    for env_index, row in zip(env_ids.tolist(), rows, strict=True):
        finals[env_index] = row
    infos["final_obs"], infos["_final_obs"] = finals, ended
    infos["final_info"], infos["_final_info"] = merged_finals, ended.copy()
    return infos


class Autoreset:
    """Which envs of a vector must reset before their next step, for one autoreset mode.

    Args:
        mode: The Gymnasium autoreset mode.
        num_envs: How many envs the vector has.
    """

    def __init__(self, mode: AutoresetMode, num_envs: int) -> None:
        """Start with no episode to finish."""
        self.mode = mode
        self.is_same_step = mode is AutoresetMode.SAME_STEP
        self._needs_reset = np.zeros(num_envs, dtype=np.bool_)  # the episode ended, not reset
        self._never_reset = np.ones(num_envs, dtype=np.bool_)  # no reset (nor state set) yet
        self.is_started = False  # every env was reset at least once
        # Brings ``needs_reset`` up to date; a vector's data plane keeps it lazily.
        self.pending: Callable[[], None] | None = None

    @property
    def needs_reset(self) -> np.ndarray:
        """Per env, whether its episode ended and it was not reset yet."""
        if self.pending is not None:
            self.pending()
        return self._needs_reset

    @property
    def needs_reset_array(self) -> np.ndarray:
        """``needs_reset``'s array itself, not brought up to date (for its keeper)."""
        return self._needs_reset

    def check_can_step(self, env_ids: Any, name: str = "step") -> None:
        """Raise before anything is sent if stepping these envs now is misuse.

        ``name``: the caller's method, named in the message (``step``, ``send``, ...).
        """
        never = None if self.is_started else _first_set(self._never_reset, env_ids)
        if never is not None:
            raise ResetNeededError(
                f"env {never}: {name}() before the env's first reset(); call "
                "envs.reset(seed=...) first.",
                env_index=never,
            )
        ended = (
            _first_set(self.needs_reset, env_ids) if self.mode is AutoresetMode.DISABLED else None
        )
        if ended is not None:
            raise EnvStateError(
                f"env {ended}: {name}() after its episode ended, with autoreset "
                "disabled; reset it first, e.g. reset(options={'reset_mask': mask}).",
                env_index=ended,
            )

    def resets(self, env_ids: Any) -> np.ndarray:
        """Which of ``env_ids`` this step resets instead of stepping (NEXT_STEP only)."""
        if self.mode is AutoresetMode.NEXT_STEP:
            resets: np.ndarray = self.needs_reset[env_ids].copy()
            return resets
        return np.zeros(len(self.needs_reset[env_ids]), dtype=np.bool_)

    def after_reset(self, env_ids: Any) -> None:
        """These envs were reset by the caller."""
        self.needs_reset[env_ids] = False
        if not self.is_started:
            self._never_reset[env_ids] = False
            self.is_started = not self._never_reset.any()

    def after_step(self, env_ids: Any, terminated: np.ndarray, truncated: np.ndarray) -> None:
        """Note which episodes the step ended (SAME_STEP reset them already)."""
        self.after_episodes(env_ids, terminated | truncated)

    def after_episodes(self, env_ids: Any, done: np.ndarray) -> None:
        """``after_step`` with ``terminated | truncated`` given."""
        if not self.is_same_step:
            self.needs_reset[env_ids] = done

    def step_info(self, extra: Outcome, is_done: bool) -> tuple[dict[str, Any], bool]:
        """The info to report for one env's step, and whether the vector must reset it now.

        Args:
            extra: What the worker said beyond the shared arrays (info, final obs, reset).
            is_done: The step ended the episode.
        """
        if not (self.is_same_step and is_done):
            return extra.info, False
        if extra.reset is None:  # a crash: the worker could not reset in the same trip
            return extra.info, True
        return same_step_info(extra.obs, extra.info, extra.reset[1]), False


def _first_set(flags: np.ndarray, env_ids: Any) -> int | None:
    """The first env of ``env_ids`` (indices or a slice) whose flag is set; None if none."""
    found = np.flatnonzero(flags[env_ids])
    return int(np.arange(len(flags))[env_ids][found[0]]) if found.size else None
