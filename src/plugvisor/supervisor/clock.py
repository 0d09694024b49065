"""Time as the supervisor sees it: a monotonic clock for every delay, wall time only for humans.

supervisord needed ``_check_and_adjust_for_system_clock_rollback`` because it
timed backoff with wall-clock time; every delay here is monotonic. The wall
clock is used only to show start times and to compare a registration with the
change time of ``kubelet.sock`` (both wall-clock by nature). A :class:`FakeClock`
lets the state machine be tested without sleeping.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """**Protocol:** a monotonic clock plus the wall clock."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back."""
        ...

    def wall(self) -> float:
        """Seconds since the epoch (may jump)."""
        ...


class SystemClock:
    """The real clocks."""

    def monotonic(self) -> float:
        """``time.monotonic()``."""
        return time.monotonic()

    def wall(self) -> float:
        """``time.time()``."""
        return time.time()


class FakeClock:
    """A clock that moves only when told to (for tests); wall time moves in step."""

    def __init__(self, start: float = 1000.0, wall_offset: float = 1_700_000_000.0) -> None:
        self.now = start
        self.wall_offset = wall_offset

    def monotonic(self) -> float:
        """The current fake time."""
        return self.now

    def wall(self) -> float:
        """The current fake wall time."""
        return self.now + self.wall_offset

    def advance(self, seconds: float) -> None:
        """Move time forward."""
        if seconds < 0:
            raise ValueError("a monotonic clock cannot go back")
        self.now += seconds
