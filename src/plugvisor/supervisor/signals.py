"""Stop requests that arrive before the agent's event loop is there to take them.

An agent told to stop while it is still importing, reading its configuration or
waiting for the fork server must still stop cleanly (exit 0, nothing left in the
runtime directory), not die by the signal. :func:`install` records SIGTERM and
SIGINT from the first moment the ``run`` command is known; the agent's loop takes
over the signals when it starts and honours what was recorded meanwhile. This
module imports nothing heavy, so it can be installed before anything else loads.
"""

from __future__ import annotations

import signal
from types import FrameType
from typing import Final

STOP_SIGNALS: Final = (signal.SIGTERM, signal.SIGINT)

_requested: int | None = None


def _record(signum: int, frame: FrameType | None) -> None:
    global _requested  # noqa: PLW0603 - a signal handler has nowhere else to put it
    _requested = signum


def install() -> None:
    """Record SIGTERM/SIGINT instead of dying by them (until the agent's loop installs its own)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _record)


def requested() -> int | None:
    """The stop signal received before the loop took over, if any."""
    return _requested
