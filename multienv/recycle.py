"""PARENT SIDE, pure: ``RecyclePolicy``, when a worker is replaced by a fresh one.

A long run meets envs that leak (emulators, simulators, physics engines with caches). A
worker that has run its budget of steps or episodes, or whose resident memory passed
``max_rss_mb``, is replaced at the next episode boundary of its envs: no episode is cut, no
truncation is reported. Its replacement is started ahead of time (when 90% of a step
budget is spent, in the last episode of an episode budget, or at 90% of the memory cap),
so that the swap does not wait for it to build its envs.
A worker whose memory passes ``hard_rss_mb`` is killed at once, mid-episode: a death with
cause ``"rss"``, counted against the ``RestartPolicy``.

Example:
    >>> policy = RecyclePolicy(max_episodes=100, max_rss_mb=2048)
    >>> policy.reason(steps=5000, episodes=100, rss_mb=300.0)
    'max_episodes'
    >>> policy.reason(steps=5000, episodes=20, rss_mb=2100.0)
    'max_rss_mb'
    >>> print(policy.reason(steps=5000, episodes=20, rss_mb=300.0))
    None
    >>> policy.is_near(steps=5000, episodes=90, rss_mb=300.0)  # start the replacement now
    True
"""

from __future__ import annotations

import dataclasses

_NEAR = 0.9  # the replacement starts when this share of a budget is spent


@dataclasses.dataclass(frozen=True)
class RecyclePolicy:
    """When a worker is replaced by a fresh one, at an episode boundary of its envs.

    Counts are per worker since it started (its envs together, when it hosts several).

    Args:
        max_episodes: Episodes the worker's envs may finish before it is recycled.
        max_steps: Env steps the worker may take before it is recycled.
        max_rss_mb: Resident memory (MiB) past which the worker is recycled at the next
            boundary.
        hard_rss_mb: Resident memory (MiB) past which the worker is killed at once: a
            death (cause ``"rss"``, flagged truncation, counted by the ``RestartPolicy``).
        check_every_s: Seconds between two reads of a worker's memory.
    """

    max_episodes: int | None = None
    max_steps: int | None = None
    max_rss_mb: float | None = None
    hard_rss_mb: float | None = None
    check_every_s: float = 1.0

    def __post_init__(self) -> None:
        """Reject limits that could never be met or are not limits."""
        for name in ("max_episodes", "max_steps", "max_rss_mb", "hard_rss_mb"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 or None, got {value!r}")
        if self.check_every_s <= 0:
            raise ValueError(f"check_every_s must be > 0, got {self.check_every_s!r}")
        if (
            self.max_rss_mb is not None
            and self.hard_rss_mb is not None
            and self.hard_rss_mb <= self.max_rss_mb
        ):
            raise ValueError(
                f"hard_rss_mb ({self.hard_rss_mb}) must be above max_rss_mb ({self.max_rss_mb}): "
                "the soft cap recycles at a boundary, the hard one kills at once"
            )

    @property
    def reads_memory(self) -> bool:
        """Whether the workers' memory must be read at all."""
        return self.max_rss_mb is not None or self.hard_rss_mb is not None

    def reason(self, steps: int, episodes: int, rss_mb: float | None) -> str | None:
        """The limit a worker has reached (its name), or None: recycle it at the next boundary."""
        if self.max_episodes is not None and episodes >= self.max_episodes:
            return "max_episodes"
        if self.max_steps is not None and steps >= self.max_steps:
            return "max_steps"
        if self.max_rss_mb is not None and rss_mb is not None and rss_mb >= self.max_rss_mb:
            return "max_rss_mb"
        return None

    def is_near(self, steps: int, episodes: int, rss_mb: float | None) -> bool:
        """Whether a limit is close enough to start the replacement worker now."""
        return (
            (
                self.max_episodes is not None
                and episodes >= min(_NEAR * self.max_episodes, self.max_episodes - 1)
            )
            or (self.max_steps is not None and steps >= _NEAR * self.max_steps)
            or (
                self.max_rss_mb is not None
                and rss_mb is not None
                and rss_mb >= _NEAR * self.max_rss_mb
            )
        )

    def is_over_hard_cap(self, rss_mb: float | None) -> bool:
        """Whether a worker must be killed at once for its memory."""
        return self.hard_rss_mb is not None and rss_mb is not None and rss_mb >= self.hard_rss_mb
