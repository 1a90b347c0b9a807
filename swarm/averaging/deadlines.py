"""Phase deadlines that follow the measured durations of recent all-reduces."""

from __future__ import annotations

from collections import deque
from typing import Optional


class AdaptiveDeadlines:
    """Per-phase timeouts that follow the measured durations of recent all-reduces: a multiple of the slowest
    recent round, clamped to [floor, ceiling] from the recipe. Slow swarms do not time out every round; fast
    swarms do not wait long for a dead peer."""

    def __init__(self, floor: float, ceiling: float, factor: float = 3.0, window: int = 8):
        self.floor, self.ceiling, self.factor = floor, ceiling, factor
        self.recent: deque[float] = deque(maxlen=window)

    def record(self, seconds: float) -> None:
        self.recent.append(seconds)

    def record_timeout(self, waited: float) -> None:
        """An attempt failed because someone did not deliver within `waited` s: a dead peer, or links slower
        than recent rounds measured. Count it as a round of 2/3 x `waited` s, so the next deadline is twice as
        long (up to the ceiling): a swarm whose links got slower does not fail every round from then on."""
        self.recent.append(2.0 * waited / self.factor)

    def measured(self) -> Optional[float]:
        """The deadline our own measurements give, or None before the first round (shared in matchmaking)."""
        return self.clamp(self.factor * max(self.recent)) if self.recent else None

    def clamp(self, seconds: float) -> float:
        return min(max(seconds, self.floor), self.ceiling)

    def phase_timeout(self, group_timeout: Optional[float] = None) -> float:
        """The group's agreed deadline (the slowest measured member's, from matchmaking) if there is one, else
        ours; before anything was measured, the ceiling."""
        if group_timeout is not None:
            return self.clamp(group_timeout)
        measured = self.measured()
        return self.ceiling if measured is None else measured
