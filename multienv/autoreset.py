"""PARENT SIDE: the per-env autoreset wrapper that gives a proxy Gymnasium 1.x vector semantics.

The three modes match ``gymnasium.vector.AutoresetMode`` exactly, env by env:

- NEXT_STEP: the step that ends an episode returns its last observation; the env's next
  ``step`` resets it instead (returning the first observation, reward 0, no flags) and
  ignores that action.
- SAME_STEP: the step that ends an episode resets at once (inside the same round trip to
  the worker) and returns the new episode's first observation, with the final observation
  and info in ``info["final_obs"]`` and ``info["final_info"]``.
- DISABLED: nothing is reset; stepping a finished env is an error until the caller resets it
  (``MultiEnv.reset(options={"reset_mask": ...})``).

A worker crash during ``step`` arrives here as a plain truncation, so each mode handles it
like any time limit; under SAME_STEP the ``info["multienv"]`` flag is also lifted to the
top level, where the caller looks first.
"""

from __future__ import annotations

from typing import Any, Protocol

from gymnasium.vector import AutoresetMode

from multienv.errors import EnvStateError

StepResult = tuple[Any, Any, bool, bool, dict[str, Any]]


class EnvProxy(Protocol):
    """The split-phase interface a backend's env proxy offers to ``MultiEnv``."""

    env_index: int

    def send_reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> None:
        """Send a reset without waiting."""

    def recv_reset(self) -> tuple[Any, dict[str, Any]]:
        """Collect the reset."""

    def send_step(self, action: Any, *, autoreset: bool = False) -> None:
        """Send a step without waiting."""

    def recv_step(self) -> tuple[Any, Any, bool, bool, dict[str, Any], Any]:
        """Collect the step, with the worker's autoreset result or None."""

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """Reset and wait."""


class AutoResetEnv:
    """Wraps one env proxy and applies one autoreset mode to its steps.

    Args:
        env: The proxy to wrap.
        mode: The Gymnasium autoreset mode.
    """

    def __init__(self, env: EnvProxy, mode: AutoresetMode) -> None:
        """Start with no episode to finish."""
        self.env = env
        self.mode = mode
        self.needs_reset = False  # the last step ended an episode that was not reset yet
        self._is_resetting = False  # the in-flight "step" is a NEXT_STEP reset

    def check_can_step(self) -> None:
        """Raise before anything is sent if stepping this env now is misuse."""
        if self.mode is AutoresetMode.DISABLED and self.needs_reset:
            raise EnvStateError(
                f"env {self.env.env_index}: step() after its episode ended, with autoreset "
                "disabled; reset it first, e.g. reset(options={'reset_mask': mask}).",
                env_index=self.env.env_index,
            )

    def send_reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> None:
        """Send a reset; the episode state is cleared."""
        self.needs_reset = False
        self._is_resetting = False
        self.env.send_reset(seed=seed, options=options)

    def recv_reset(self) -> tuple[Any, dict[str, Any]]:
        """Collect the reset."""
        return self.env.recv_reset()

    def send_step(self, action: Any) -> None:
        """Send this step's command: a step, or under NEXT_STEP the pending reset."""
        self._is_resetting = self.mode is AutoresetMode.NEXT_STEP and self.needs_reset
        if self._is_resetting:
            self.env.send_reset()
        else:
            self.env.send_step(action, autoreset=self.mode is AutoresetMode.SAME_STEP)

    def recv_step(self) -> StepResult:
        """Collect the step and apply the autoreset mode."""
        if self._is_resetting:
            self._is_resetting = False
            self.needs_reset = False
            obs, info = self.env.recv_reset()
            return obs, 0.0, False, False, info
        obs, reward, terminated, truncated, info, reset_result = self.env.recv_step()
        is_done = bool(terminated or truncated)
        if self.mode is not AutoresetMode.SAME_STEP or not is_done:
            self.needs_reset = is_done
            return obs, reward, terminated, truncated, info
        if reset_result is None:  # the worker crashed, so it could not reset in the same trip
            reset_result = self.env.reset()
        reset_obs, reset_info = reset_result
        merged: dict[str, Any] = {"final_obs": obs, "final_info": info}
        if "multienv" in info:
            merged["multienv"] = info["multienv"]
        merged.update(reset_info)
        return reset_obs, reward, terminated, truncated, merged
