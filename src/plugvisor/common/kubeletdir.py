"""Watching the kubelet's device-plugins directory, for the plugins and for the agent alike.

A starting kubelet deletes every socket in its device-plugins directory and then
listens on a new ``kubelet.sock`` (docs/architecture.md, "Kubelet restarts"). A plugin
must notice this to serve a fresh socket and register again; the agent notices it
to report the restart, to know which children lost their registration and (policy
``restart``) to restart them at once. Plugins in the wild watch for either sign:
their own socket vanishing (Intel) or ``kubelet.sock`` being created (NVIDIA, the
kubelet's own test stub). This watch reports both, with inotify, so a reaction
starts within milliseconds rather than at the next poll; in a process that has
no inotify left, by looking every :data:`~plugvisor.common.inotify.POLL_INTERVAL`
seconds (:mod:`plugvisor.common.inotify`), with the same events.

One watch serves both users, so it reports every sign and leaves the choice of
which matter to them: a ``kubelet.sock`` created or moved in, any other file
created (a plugin cares about another one taking its resource over), any file
deleted or moved away (the plugin cares about its own socket, the agent about any
of its children's), and the directory itself going away.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from asyncinotify import Mask

from plugvisor.common import inotify as inotify_
from plugvisor.common.constants import KUBELET_SOCKET_NAME

_MASK: Final = Mask.CREATE | Mask.MOVED_TO | Mask.DELETE | Mask.MOVED_FROM | Mask.DELETE_SELF | Mask.ONLYDIR


class DirChange(enum.Enum):
    """What happened in the kubelet's directory."""

    KUBELET_SOCKET_CREATED = "kubelet-socket-created"
    """``kubelet.sock`` was created or moved in: a kubelet (possibly a new one) listens."""
    FILE_CREATED = "file-created"
    """Another file was created or moved in (another plugin's socket, perhaps of our resource)."""
    FILE_REMOVED = "file-removed"
    """A file was deleted or moved away (a starting kubelet removes every socket)."""
    DIR_REMOVED = "dir-removed"
    """The directory itself was deleted; nothing more will be reported."""
    EVENTS_LOST = "events-lost"
    """The kernel's event queue overflowed: anything may have happened; look at the files."""


@dataclass(frozen=True, slots=True)
class DirEvent:
    """One change, with the file name it concerns (empty for :attr:`DirChange.DIR_REMOVED`)."""

    change: DirChange
    name: str


_OVERFLOW: Final = int(Mask.Q_OVERFLOW)
_CREATED: Final = int(Mask.CREATE | Mask.MOVED_TO)
_REMOVED: Final = int(Mask.DELETE | Mask.MOVED_FROM)
_GONE: Final = int(Mask.DELETE_SELF)


def classify(mask: Mask, name: str) -> DirEvent | None:
    """Turn one inotify event into what it means for the kubelet contract (None: nothing).

    Tested as integers: every plugin classifies every event of the directory, and a ``Flag``
    operation costs a microsecond or two.
    """
    bits = int(mask)
    if bits & _OVERFLOW:
        return DirEvent(DirChange.EVENTS_LOST, "")
    if bits & _CREATED:
        change = DirChange.KUBELET_SOCKET_CREATED if name == KUBELET_SOCKET_NAME else DirChange.FILE_CREATED
        return DirEvent(change, name)
    if bits & _REMOVED:
        return DirEvent(DirChange.FILE_REMOVED, name)
    if bits & _GONE:
        return DirEvent(DirChange.DIR_REMOVED, "")
    return None


class KubeletDirWatch:
    """inotify on one kubelet directory, calling ``on_event`` for each :class:`DirEvent`, in order.

    :meth:`open` starts watching at once (before anything is registered, so no
    event can be missed); :meth:`run` delivers the events and runs until
    cancelled, on the running event loop.

    ``log`` is a structlog logger bound to the name the operator knows the watching
    process by (a plugin's ``resource=``, the agent's ``process="agent"``): the agent
    and every plugin watch this one directory and, under ``plugvisor run``, write to one
    standard error, so a ``kubelet_dir_*`` line that named nobody could be any of them.
    """

    def __init__(self, kubelet_dir: Path, on_event: Callable[[DirEvent], None], *, log: Any) -> None:
        self.kubelet_dir = kubelet_dir
        self.kubelet_socket = kubelet_dir / KUBELET_SOCKET_NAME
        self._on_event = on_event
        self._inotify: inotify_.WatchGroup | None = None
        self._log = log
        self._names: tuple[str, ...] | None = None

    def open(self) -> None:
        """Start watching, creating the directory as the kubelet would (mode 0750).

        On the running loop's shared inotify instance (:mod:`plugvisor.common.inotify`),
        polled when the node's inotify budget is spent.
        """
        if not self.kubelet_dir.exists():
            self.kubelet_dir.mkdir(mode=0o750, parents=True, exist_ok=True)
            self._log.warning(
                "kubelet_dir_created",
                dir=str(self.kubelet_dir),
                note="it did not exist; a kubelet creates it when it starts. If that is not the kubelet's "
                "directory (a typo?), nothing will ever register here",
            )
        watches = inotify_.open_watches(poll_interval=inotify_.POLL_INTERVAL)
        try:
            watches.add_watch(self.kubelet_dir, _MASK)
        except BaseException:
            watches.close()
            raise
        if self._names is not None:
            watches.narrow(self._names)
        self._inotify = watches

    def narrow(self, prefixes: tuple[str, ...]) -> None:
        """Report only the files whose names start with one of ``prefixes`` (and the directory's own fate).

        A plugin cares about ``kubelet.sock`` and its own resource's sockets; handed
        every other plugin's socket too, it paid for each at every kubelet restart
        (:mod:`plugvisor.common.inotify`, "Names that concern a group"). Kept across
        the directory's re-creation. The agent, which cares about every socket, never narrows.
        """
        self._names = prefixes
        if self._inotify is not None:
            self._inotify.narrow(prefixes)

    def close(self) -> None:
        """Stop watching."""
        if self._inotify is not None:
            self._inotify.close()
            self._inotify = None

    def hurry(self) -> None:
        """The event just delivered mattered: read the next ones at once (see ``inotify``'s bursts)."""
        if self._inotify is not None:
            self._inotify.hurry()

    def _deliver(self, mask: Mask, name: str) -> bool:
        """Deliver one event; returns whether the directory itself went away."""
        event = classify(mask, name)
        if event is None:
            return False
        if event.change is DirChange.DIR_REMOVED:
            self._log.error("kubelet_dir_deleted", dir=str(self.kubelet_dir))
        elif event.change is DirChange.EVENTS_LOST:
            self._log.warning("kubelet_dir_events_lost", dir=str(self.kubelet_dir))
        self._on_event(event)
        return event.change is DirChange.DIR_REMOVED

    async def run(self) -> None:
        """Deliver events until cancelled (a burst is delivered without yielding in between).

        When the directory itself is deleted, its watch ends with it: the watch is
        opened again on the directory as re-created (by us, as the kubelet would),
        and a ``kubelet.sock`` already there is reported as created, so that no
        later kubelet start goes unseen.
        """
        if self._inotify is None:
            raise RuntimeError("KubeletDirWatch.open() must be called before run()")
        while True:
            inotify = self._inotify
            removed = False
            event = await inotify.get()
            removed |= self._deliver(event.mask, event.name)
            while (more := inotify.sync_get()) is not None:
                removed |= self._deliver(more.mask, more.name)
            if removed:
                self._rearm()

    def _rearm(self) -> None:
        self.close()
        try:
            self.open()
        except OSError as exc:
            self._log.error("kubelet_dir_unwatchable", dir=str(self.kubelet_dir), error=str(exc))
            raise
        self._log.info("kubelet_dir_watched_again", dir=str(self.kubelet_dir))
        if self.kubelet_socket.exists():
            self._on_event(DirEvent(DirChange.KUBELET_SOCKET_CREATED, KUBELET_SOCKET_NAME))
