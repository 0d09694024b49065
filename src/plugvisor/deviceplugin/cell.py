"""A latest-value cell: every reader sees the newest value, none ever sees a stale one last.

ListAndWatch streams must each get the full current list at once and then every
change. A queue gets this wrong twice over: with several streams each update goes
to only one of them, and a slow stream works through a backlog of states that are
already obsolete. A cell with a version counter gets it right: a reader that
falls behind skips intermediate states but always ends on the latest one, and
any number of readers can wait on it.
"""

from __future__ import annotations

import asyncio
from typing import Generic, TypeVar

T = TypeVar("T")


class CellClosedError(Exception):
    """The cell was closed while (or before) a reader waited: the owner is shutting down."""


class SnapshotCell(Generic[T]):
    """Holds the latest value of something and wakes readers when it changes.

    ``publish`` is synchronous and must run on the event loop's thread; readers
    await :meth:`wait_newer`. Publishing a value equal to the current one is a
    no-op, so identical rescans never wake anybody.
    """

    def __init__(self, initial: T) -> None:
        self._value = initial
        self._version = 0
        self._changed = asyncio.Event()
        self._closed = False

    @property
    def value(self) -> T:
        """The current value."""
        return self._value

    @property
    def version(self) -> int:
        """Increases by one for every published change."""
        return self._version

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def publish(self, value: T) -> bool:
        """Make ``value`` current; returns whether it differed from the previous value."""
        if self._closed:
            raise CellClosedError("cannot publish to a closed cell")
        if value == self._value:
            return False
        self._value = value
        self._version += 1
        self._wake()
        return True

    def close(self) -> None:
        """Wake every reader with :class:`CellClosedError`; later waits fail at once."""
        self._closed = True
        self._wake()

    def _wake(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def wait_newer(self, seen_version: int) -> tuple[int, T]:
        """Return ``(version, value)`` as soon as the version is past ``seen_version``."""
        while self._version <= seen_version:
            if self._closed:
                raise CellClosedError("cell closed")
            await self._changed.wait()
        return self._version, self._value
