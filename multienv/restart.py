"""RestartPolicy, used in the parent process: how often a dead worker may be respawned.

Pure: the proxy keeps the times of its recent restarts and passes the clock in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class RestartPolicy:
    """At most ``max_restarts`` respawns in any ``window_s`` seconds, with exponential backoff.

    Backoff follows consecutive failures (deaths with no successful call in between), not
    the window: a respawn after a worker that was working is immediate, the k-th respawn of
    a crash loop waits ``backoff * 2 ** (k - 2)`` seconds, capped at ``max_backoff_s``.

    Args:
        max_restarts: Respawns allowed inside any window; 0 turns respawning off.
        window_s: Length of the sliding window, in seconds.
        backoff: Base delay in seconds before the second and later respawns in a window.
        max_backoff_s: Upper bound on one delay, in seconds.

    Example:
        >>> policy = RestartPolicy(max_restarts=3, window_s=60.0, backoff=0.1)
        >>> policy.next_delay([], now=100.0)  # a worker that was working died: at once
        0.0
        >>> policy.next_delay([99.0], now=100.0, consecutive=2)  # a crash loop backs off
        0.2
        >>> print(policy.next_delay([70.0, 80.0, 90.0], now=100.0))  # 3 in 60 s: spent
        None
        >>> RestartPolicy.never().is_never
        True
    """

    max_restarts: int = 5
    window_s: float = 60.0
    backoff: float = 0.05
    max_backoff_s: float = 2.0

    def __post_init__(self) -> None:
        """Reject values that would make the policy meaningless."""
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts!r}")
        if self.window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s!r}")
        if self.backoff < 0 or self.max_backoff_s < 0:
            raise ValueError(
                "backoff and max_backoff_s must be >= 0, "
                f"got {self.backoff!r}, {self.max_backoff_s!r}"
            )

    @classmethod
    def never(cls) -> RestartPolicy:
        """Return a policy that never respawns: a death raises ``EnvCrashedError``."""
        return cls(max_restarts=0)

    @property
    def is_never(self) -> bool:
        """True when respawning is off."""
        return self.max_restarts == 0

    def recent(self, restart_times: Sequence[float], now: float) -> list[float]:
        """Return the restart times that still fall inside the window ending at ``now``."""
        return [t for t in restart_times if now - t < self.window_s]

    def next_delay(
        self, restart_times: Sequence[float], now: float, consecutive: int = 0
    ) -> float | None:
        """Return the seconds to wait before the next respawn, or None if the budget is spent.

        Args:
            restart_times: Monotonic times of earlier respawns (older ones are ignored).
            now: The current monotonic time.
            consecutive: Respawns since the last successful call to the env.
        """
        if len(self.recent(restart_times, now)) >= self.max_restarts:
            return None
        if consecutive == 0:
            return 0.0
        return float(min(self.backoff * 2 ** (consecutive - 1), self.max_backoff_s))
