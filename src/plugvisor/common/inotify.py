"""One inotify instance per process, shared by every watcher in it.

Linux counts inotify instances per user, for all of that user's processes
together: ``fs.inotify.max_user_instances`` is 128 by default, and on a node
everything that runs as root (the kubelet, the container runtime, every
daemon) draws from the same 128. A plugin used to open two (one on the kubelet's
directory, one on its device paths), so an agent of 64 resources needed 129
instances by itself and the last children crash-looped with ``OSError: [Errno
24] Too many open files``. Watches are cheap by comparison (8,192 per user by
default, far more on most distributions; a plugin holds a handful).

:func:`open_watches` hands each watcher a :class:`WatchGroup` on the running
loop's single instance: its own watches, its own queue of events, the subset of
``asyncinotify.Inotify``'s interface that plugvisor uses (``add_watch``,
``rm_watch``, ``get``, ``sync_get``, ``close``). One reader on the loop moves each
event into the queue of every group that watches its inode for that kind of
event. inotify keeps one watch per inode per instance, so two groups watching the
same directory share it: its mask is the union of theirs (``IN_MASK_ADD``), each
group sees only the events it asked for, and the watch is removed when the last
group lets go. The instance closes with its last group.

Running out is an :class:`InotifyLimitError` whose message names the sysctl to
raise, not a traceback.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import weakref
from pathlib import Path
from typing import Final

from asyncinotify import Event, Inotify, Mask, Watch

MAX_QUEUED: Final = 16384
"""Events a group may have unread (the kernel's own default queue length): past that its queue is
replaced by one ``Q_OVERFLOW``, as the kernel does, so a watcher that stopped reading cannot grow
the process without bound."""

_ALWAYS: Final = Mask.IGNORED | Mask.Q_OVERFLOW | Mask.UNMOUNT
"""Delivered to a group whatever it asked for (inotify itself always sends them)."""

_PROC_SYS: Final = Path("/proc/sys")


class InotifyLimitError(Exception):
    """The user's inotify budget is spent; the message names the sysctl to raise."""


def _limit(name: str) -> str:
    """The limit that applies here, as text.

    ``user.max_inotify_*`` is this user namespace's (the same value as ``fs.inotify.max_user_*``
    outside containers), the other the host's.
    """
    for path in (f"user/max_inotify_{name}", f"fs/inotify/max_user_{name}"):
        with contextlib.suppress(OSError):
            return (_PROC_SYS / path).read_text().strip()
    return "unknown"


def limit_error(exc: OSError, *, what: str) -> InotifyLimitError | None:
    """The :class:`InotifyLimitError` that ``exc`` means while doing ``what``; None for other errors."""
    if exc.errno == errno.EMFILE:
        return InotifyLimitError(
            f"{what}: too many inotify instances: the limit is per user, for all of that user's processes "
            f"together (fs.inotify.max_user_instances = {_limit('instances')}); raise it, e.g. "
            "`sysctl fs.inotify.max_user_instances=1024` (each plugvisor process uses one), or this "
            "process's open file limit (RLIMIT_NOFILE) is reached"
        )
    if exc.errno == errno.ENOSPC:
        return InotifyLimitError(
            f"{what}: too many inotify watches: the limit is per user, for all of that user's processes "
            f"together (fs.inotify.max_user_watches = {_limit('watches')}); raise it, e.g. "
            "`sysctl fs.inotify.max_user_watches=524288`"
        )
    return None


class _Instance:
    """The loop's inotify instance and the reader that dispatches its events to the groups."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            self.inotify = Inotify(sync_timeout=0)
        except OSError as exc:
            raise limit_error(exc, what="cannot watch files") or exc from None
        self._loop = loop
        self.groups: set[WatchGroup] = set()
        self.wanted: dict[int, dict[WatchGroup, Mask]] = {}
        """wd -> the mask each group asked for on that inode."""
        loop.add_reader(self.inotify.fd, self.pump)

    def pump(self) -> None:
        """Move every event the kernel has ready into the groups' queues (never blocks)."""
        while (event := self.inotify.sync_get()) is not None:
            self._dispatch(event)

    def _dispatch(self, event: Event) -> None:
        if event.mask & Mask.Q_OVERFLOW:
            for group in self.groups:
                group.deliver(event)
            return
        watch = event.watch
        if watch is None:
            return
        wanted = self.wanted.get(watch.wd, {})
        for group, mask in list(wanted.items()):
            if event.mask & (mask | _ALWAYS):
                group.deliver(event)
        if event.mask & Mask.IGNORED:  # the kernel removed the watch (its inode went, or rm_watch)
            for group in self.wanted.pop(watch.wd, {}):
                group.forget(watch.wd)

    def add_watch(self, group: WatchGroup, path: Path, mask: Mask) -> Watch:
        try:
            watch = self.inotify.add_watch(path, mask | Mask.MASK_ADD)
        except OSError as exc:
            raise limit_error(exc, what=f"cannot watch {path}") or exc from None
        wanted = self.wanted.setdefault(watch.wd, {})
        wanted[group] = wanted.get(group, Mask.ZERO) | mask
        return watch

    def rm_watch(self, group: WatchGroup, watch: Watch) -> None:
        wanted = self.wanted.get(watch.wd)
        if wanted is None or wanted.pop(group, None) is None or wanted:
            return  # not ours, or another group still watches that inode
        del self.wanted[watch.wd]
        with contextlib.suppress(OSError):  # the kernel already dropped it (the inode is gone)
            self.inotify.rm_watch(watch)

    def leave(self, group: WatchGroup) -> None:
        self.groups.discard(group)
        if self.groups:
            return
        with contextlib.suppress(RuntimeError, ValueError):  # a closed loop has no readers left
            self._loop.remove_reader(self.inotify.fd)
        self.inotify.close()
        if _instances.get(self._loop) is self:
            del _instances[self._loop]


_instances: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Instance] = weakref.WeakKeyDictionary()


def open_watches() -> WatchGroup:
    """A new group on the running loop's inotify instance (created on first use).

    Raises :class:`InotifyLimitError` when the instance cannot be created for lack of budget.
    """
    loop = asyncio.get_running_loop()
    instance = _instances.get(loop)
    if instance is None:
        instance = _Instance(loop)
        _instances[loop] = instance
    group = WatchGroup(instance)
    instance.groups.add(group)
    return group


class WatchGroup:
    """One watcher's share of the process's inotify instance: its watches and its events, in order."""

    def __init__(self, instance: _Instance) -> None:
        self._instance: _Instance | None = instance
        self._watches: dict[int, Watch] = {}
        self._events: collections.deque[Event] = collections.deque()
        self._ready = asyncio.Event()

    def add_watch(self, path: Path, mask: Mask) -> Watch:
        """Watch ``path`` for ``mask``; raises :class:`InotifyLimitError` when the watch budget is spent."""
        instance = self._live()
        watch = instance.add_watch(self, path, mask)
        self._watches[watch.wd] = watch
        return watch

    def rm_watch(self, watch: Watch) -> None:
        """Stop watching (the inode stays watched for other groups that watch it)."""
        self._watches.pop(watch.wd, None)
        if self._instance is not None:
            self._instance.rm_watch(self, watch)

    async def get(self) -> Event:
        """The next event of this group's watches (or a ``Q_OVERFLOW``: anything may have happened)."""
        while not self._events:
            self._ready.clear()
            self._live().pump()
            if not self._events:
                await self._ready.wait()
        return self._events.popleft()

    def sync_get(self) -> Event | None:
        """The next event if there is one now (the kernel's pending ones included), else None."""
        if not self._events and self._instance is not None:
            self._instance.pump()
        return self._events.popleft() if self._events else None

    def close(self) -> None:
        """Remove this group's watches, and the instance with its last group."""
        instance, self._instance = self._instance, None
        if instance is None:
            return
        for watch in list(self._watches.values()):
            instance.rm_watch(self, watch)
        self._watches.clear()
        instance.leave(self)

    def __enter__(self) -> WatchGroup:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- for the instance ------------------------------------------------------------

    def deliver(self, event: Event) -> None:
        """Queue ``event`` for :meth:`get` (bounded: see :data:`MAX_QUEUED`)."""
        if len(self._events) >= MAX_QUEUED:
            self._events.clear()
            self._events.append(Event(watch=None, mask=Mask.Q_OVERFLOW, cookie=0, name=None))
        else:
            self._events.append(event)
        self._ready.set()

    def forget(self, wd: int) -> None:
        """The kernel removed watch ``wd`` (its inode went): nothing to remove at close."""
        self._watches.pop(wd, None)

    def _live(self) -> _Instance:
        if self._instance is None:
            raise ValueError("this watch group is closed")
        return self._instance
