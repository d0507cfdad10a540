"""PARENT SIDE: a vector's autoreset bookkeeping, which gives its envs Gymnasium 1.x semantics.

The three modes match ``gymnasium.vector.AutoresetMode`` exactly, env by env:

- NEXT_STEP: the step that ends an episode returns its last observation; the env's next
  step resets it instead (returning the first observation, reward 0, no flags) and ignores
  that action. The reset travels in the same batch as the other envs' steps.
- SAME_STEP: the step that ends an episode resets at once (in the worker, inside the same
  round trip) and returns the new episode's first observation, with the final observation
  and info in ``info["final_obs"]`` and ``info["final_info"]``.
- DISABLED: nothing is reset; stepping a finished env is an error until the caller resets it
  (``MultiEnv.reset(options={"reset_mask": ...})``).

A worker crash during a step arrives here as a plain truncation, so each mode handles it
like any time limit. Under SAME_STEP the worker could not reset in the same trip, so the
vector resets that env itself (``needs_sync_reset``), and the ``info["multienv"]`` flag is
also lifted to the top level, where the caller looks first.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gymnasium.vector import AutoresetMode

from multienv.errors import EnvStateError
from multienv.protocol import Outcome


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
        self.needs_reset = np.zeros(num_envs, dtype=np.bool_)  # the episode ended, not reset

    def check_can_step(self, env_ids: Any) -> None:
        """Raise before anything is sent if stepping these envs now is misuse."""
        if self.mode is AutoresetMode.DISABLED:
            ended = np.flatnonzero(self.needs_reset[env_ids])
            if ended.size:
                env_index = int(np.arange(len(self.needs_reset))[env_ids][ended[0]])
                raise EnvStateError(
                    f"env {env_index}: step() after its episode ended, with autoreset "
                    "disabled; reset it first, e.g. reset(options={'reset_mask': mask}).",
                    env_index=env_index,
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

    def after_step(self, env_ids: Any, terminated: np.ndarray, truncated: np.ndarray) -> None:
        """Note which episodes the step ended (SAME_STEP reset them already)."""
        if not self.is_same_step:
            self.needs_reset[env_ids] = terminated | truncated

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
        merged: dict[str, Any] = {"final_obs": extra.obs, "final_info": extra.info}
        merged.update(extra.reset[1])
        return merged, False

    @staticmethod
    def crash_info(
        final_obs: Any, info: dict[str, Any], reset_info: dict[str, Any]
    ) -> dict[str, Any]:
        """The SAME_STEP info of a step a crash ended, after the vector reset the env."""
        merged: dict[str, Any] = {"final_obs": final_obs, "final_info": info}
        if "multienv" in info:
            merged["multienv"] = info["multienv"]
        merged.update(reset_info)
        return merged
