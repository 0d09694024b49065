"""Restart delays: capped exponential backoff with jitter, immediate on the first failure.

The first unexpected exit restarts at once: a single crash (an OOM kill, a bug
hit once) should cost the node as little capacity as possible, and the product
target is a re-registration within 300 ms. Only repeated failures back off, so
that a crash-looping child costs little CPU and log volume; the delay never
exceeds the cap, and the child is never given up on. Jitter spreads the restarts
of children that failed together (say, when a shared device driver reloaded).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BackoffPolicy:
    """How long to wait before restart number ``failures`` (1 = the first failure).

    ``initial`` is the delay after the second consecutive failure, multiplied by
    ``multiplier`` for each further one up to ``cap``; ``jitter`` is the
    relative spread (0.2 = +-20 %). ``reset_after``: a process up that long
    wipes the failure count. ``crash_loop_after`` consecutive failures make the
    child reported as crash-looping.
    """

    initial: float = 0.25
    multiplier: float = 2.0
    cap: float = 30.0
    jitter: float = 0.2
    reset_after: float = 10.0
    crash_loop_after: int = 5

    def base_delay(self, failures: int) -> float:
        """The delay without jitter."""
        if failures <= 1:
            return 0.0
        exponent = min(failures - 2, 64)  # 2.0**64 already exceeds any sane cap
        return min(self.cap, self.initial * self.multiplier**exponent)

    def delay(self, failures: int, *, rand: Callable[[], float] = random.random) -> float:
        """The delay with jitter applied, never above the cap nor below zero."""
        base = self.base_delay(failures)
        spread = base * self.jitter * (2 * rand() - 1)
        return max(0.0, min(self.cap, base + spread))

    def crash_looping(self, failures: int) -> bool:
        """Whether ``failures`` consecutive failures are a crash loop worth reporting."""
        return failures >= self.crash_loop_after
