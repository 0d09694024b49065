"""One inotify instance per process, shared by every watcher in it, and polling when there is none.

Linux counts inotify instances per user, for all of that user's processes
together: ``fs.inotify.max_user_instances`` is 128 by default, and on a node
everything that runs as root (the kubelet, the container runtime, every
daemon) draws from the same 128. A plugin used to open two (one on the kubelet's
directory, one on its device paths), so an agent of 64 resources needed 129
instances by itself. Watches are cheap by comparison (8,192 per user by
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

**Without inotify.** A process that cannot have an instance (``EMFILE``: the
user's instances, or its own descriptors, are spent) or a watch (``ENOSPC``: the
user's watches are spent) does not refuse to serve: that watch is *polled*
instead (:class:`_PolledWatch`), and the process says so once
(``watching_by_polling``, naming the sysctl to raise) and tells whoever asked
(:func:`on_polling`: a plugin reports it to its agent, which shows it). The line
is said through the logger a listener hands over, so it carries that process's
name (a plugin's ``resource``, the agent's ``process="agent"``): under ``plugvisor
run`` all of them write to one standard error, and a line naming nobody could be
any of 256 processes'. What polling costs is the group's choice, made when it is opened:

- ``poll_interval`` seconds (:data:`POLL_INTERVAL` for the kubelet's directories):
  the group looks at its directories that often while it waits for an event,
  and reports what changed as the events inotify would have sent (entries
  created, deleted, replaced; the directory itself gone). A look is one
  ``stat``; the directory is listed only when its modification time moved (or
  was too recent to trust, see :data:`_MTIME_GRAIN_NS`). While it keeps changing, each
  look that found a change, from the second in a row, doubles the wait before the
  next one, up to :data:`POLL_BUSY_MAX`: at a kubelet restart of N resources every
  plugin's socket goes and comes, the directory changes for as long as the restart
  takes, and each look lists N entries (70 % of a polling plugin's CPU while 256 of
  them came back was that listing). A change after a quiet spell is still seen within
  ``poll_interval``.
- ``None`` (a plugin's device paths): no events at all; the watcher's periodic
  rescan, which it has anyway for what inotify never reports (sysfs attributes),
  is then the only way it notices a change.

**Names that concern a group.** A group may say which entry names it cares about
(:meth:`WatchGroup.narrow`: name prefixes). Every plugin watches the kubelet's
directory, where every other plugin's socket comes and goes: at a kubelet restart
of N resources each of N processes is handed about 5 N events, of which a handful
are its own. An event whose name is outside a group's prefixes is dropped by the
reader before it becomes a string or an object, and a polled directory's listing
keeps only those names, so that what a plugin pays for the others' sockets is a
``struct`` unpack and a ``bytes.startswith`` each, not the ~11 microseconds an
event delivered and classified costs (15 ms per plugin and per restart at 256
resources, O(N²) for the node). Events without a name (the directory itself,
``Q_OVERFLOW``) always pass.

A process that fell back stays in that mode: it does not try inotify again (it
would take an instance another process may be waiting for, and flapping
between modes would make the mode it reports meaningless); its next start
tries again.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import itertools
import os
import stat
import struct
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

import structlog
from asyncinotify import Inotify, Mask, Watch

MAX_QUEUED: Final = 16384
"""Events a group may have unread (the kernel's own default queue length): past that its queue is
replaced by one ``Q_OVERFLOW``, as the kernel does, so a watcher that stopped reading cannot grow
the process without bound."""

POLL_INTERVAL: Final = 0.5
"""Seconds between two looks at a polled kubelet directory (the device-plugins directory, the plugin
registry, a DRA driver's socket directories). A kubelet restart is then seen within half a second
instead of milliseconds: as soon as the kubelet's own plugin watcher, which reconciles every second,
and far within the grace its device manager gives a resource. Each look is one ``stat`` and a wake-up
of the process: an idle polling plugin used 1.5 millicores more than one with inotify at 0.25 s
(2.5 against 1.0, on a loaded 2-core machine), so 256 of them would cost a third of a core; half
as often, half that.
"""

POLL_BUSY_MAX: Final = 2.0
"""Seconds between two looks, at most, while a polled directory keeps changing (:meth:`WatchGroup.get`)."""

BURST_WINDOW: Final = 0.1
"""Seconds: an event that wakes the reader within this long of the previous wake-up is part of a burst."""
BURST_GAP_FIRST: Final = 0.02
"""Seconds the reader pauses after a wake-up before it reads what came meanwhile (:class:`_Instance`)."""
BURST_GAP_MAX: Final = POLL_INTERVAL
"""The longest pause: while events keep coming the pause doubles up to this, a polling process's delay."""

_MTIME_GRAIN_NS: Final = 50_000_000
"""Filesystems stamp times with the kernel's coarse clock (a tick: up to 10 ms), so a change made
within the same tick as a listing, after it, leaves the directory's time as the listing saw it. A
listing made within this long of the time it saw is not trusted: the next look lists again."""

_ALWAYS: Final = int(Mask.IGNORED | Mask.Q_OVERFLOW | Mask.UNMOUNT)
"""Delivered to a group whatever it asked for (inotify itself always sends them)."""
_Q_OVERFLOW: Final = int(Mask.Q_OVERFLOW)
_IGNORED: Final = int(Mask.IGNORED)
_EVENT_HEADER: Final = struct.Struct("iIII")
"""``struct inotify_event`` without its name: wd, mask, cookie, len (the name's bytes, NUL-padded)."""
_READ_SIZE: Final = 64 * 1024

_PROC_SYS: Final = Path("/proc/sys")

WatchMode = Literal["inotify", "polling"]


def _limit(name: str) -> str:
    """The limit that applies here, as text.

    ``user.max_inotify_*`` is this user namespace's (the same value as ``fs.inotify.max_user_*``
    outside containers), the other the host's.
    """
    for path in (f"user/max_inotify_{name}", f"fs/inotify/max_user_{name}"):
        with contextlib.suppress(OSError):
            return (_PROC_SYS / path).read_text().strip()
    return "unknown"


def fallback_reason(exc: OSError, *, what: str) -> str | None:
    """Why ``exc`` (raised while doing ``what``) means polling instead of inotify; None: not a budget error.

    ``EMFILE`` from ``inotify_init``: the user's instances are spent (or this
    process's descriptors); ``ENFILE``: the system's file table; ``ENOSPC`` from
    ``inotify_add_watch``: the user's watches; ``ENOMEM``: the kernel's memory.
    Other errors (a path that does not exist, or is not a directory) are about the
    path, not the budget, and polling would fail the same way: they stay errors.
    """
    if exc.errno == errno.EMFILE:
        return (
            f"{what}: too many inotify instances: the limit is per user, for all of that user's processes "
            f"together (fs.inotify.max_user_instances = {_limit('instances')}); raise it, e.g. "
            "`sysctl fs.inotify.max_user_instances=1024` (each plugvisor process uses one), or this "
            "process's open file limit (RLIMIT_NOFILE) is reached"
        )
    if exc.errno == errno.ENOSPC:
        return (
            f"{what}: too many inotify watches: the limit is per user, for all of that user's processes "
            f"together (fs.inotify.max_user_watches = {_limit('watches')}); raise it, e.g. "
            "`sysctl fs.inotify.max_user_watches=524288`"
        )
    if exc.errno in (errno.ENFILE, errno.ENOMEM):
        return f"{what}: {os.strerror(exc.errno)} (the system's open files or the kernel's memory)"
    return None


@dataclass(frozen=True, slots=True, eq=False)
class WatchHandle:
    """One watch of a group: what :meth:`WatchGroup.add_watch` returns and events point to.

    ``wd`` is the kernel's watch descriptor, or a negative number for a polled
    watch (never the kernel's).
    """

    wd: int
    path: Path


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One event, from the kernel or made by a poll: what happened, to which entry, under which watch."""

    mask: Mask
    name: str
    """The entry's name in the watched directory; empty for the directory itself and ``Q_OVERFLOW``."""
    watch: WatchHandle | None


_OVERFLOW: Final = WatchEvent(Mask.Q_OVERFLOW, "", None)


def _say_polling(log: Any, reason: str) -> None:
    log.warning(
        "watching_by_polling",
        reason=reason,
        meaning=f"files are looked at instead: the kubelet's directories every {POLL_INTERVAL:g} s, "
        "device paths at each periodic rescan; everything keeps working, changes are seen later",
    )


@dataclass(frozen=True, slots=True, eq=False)
class _Listener:
    hear: Callable[[str], None]
    log: Any
    """The logger (bound to the process's name) that says ``watching_by_polling``; None: says nothing."""


class _LoopState:
    """What a loop's watchers share beyond the instance: whether it polls, and who wants to hear."""

    def __init__(self) -> None:
        self.instance: _Instance | None = None
        self.polling: str | None = None
        """Why this loop polls (the first budget error's text); None while everything is inotify."""
        self.listeners: list[_Listener] = []

    def fall_back(self, reason: str) -> None:
        """Record that some watch of this loop is polled; say it once, through each listener's logger.

        With no listener that names itself (an emulator, a tool), the line is
        said unnamed rather than not at all.
        """
        if self.polling is not None:
            return
        self.polling = reason
        listeners = list(self.listeners)
        if not any(listener.log is not None for listener in listeners):
            _say_polling(structlog.get_logger("plugvisor.watch"), reason)
        for listener in listeners:
            if listener.log is not None:
                _say_polling(listener.log, reason)
            listener.hear(reason)


_loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopState] = weakref.WeakKeyDictionary()
_polled_wds = itertools.count(-1, -1)


def _state() -> _LoopState:
    loop = asyncio.get_running_loop()
    state = _loops.get(loop)
    if state is None:
        state = _loops[loop] = _LoopState()
    return state


def watch_mode() -> tuple[WatchMode, str | None]:
    """The running loop's mode: ``("inotify", None)``, or ``("polling", why)`` once any watch is polled."""
    state = _state()
    return ("inotify", None) if state.polling is None else ("polling", state.polling)


def on_polling(listener: Callable[[str], None], *, log: Any = None) -> Callable[[], None]:
    """Call ``listener(why)`` when the running loop falls back to polling (at once if it has).

    ``log``: a structlog logger bound to the name the operator knows this
    process by (``resource=...``); the ``watching_by_polling`` line is said
    through it, once, so that it names the process. Returns a function that
    stops the calls.
    """
    state = _state()
    entry = _Listener(listener, log)
    state.listeners.append(entry)
    if state.polling is not None:
        if log is not None:
            _say_polling(log, state.polling)
        listener(state.polling)

    def stop() -> None:
        with contextlib.suppress(ValueError):
            state.listeners.remove(entry)

    return stop


class _Instance:
    """The loop's inotify instance and the reader that dispatches its events to the groups.

    **Bursts.** Every plugin watches the kubelet's directory, and every plugin's socket is
    in it: when the kubelet restarts, each of N processes sees every one of the others'
    sockets go and come again, and each write of the kubelet's checkpoint (a temporary
    file renamed, three events, after every registration). Woken for each event, a
    process spent ~190 microseconds of CPU per event (the loop's wake-up, the read, the
    hand-over to the waiting task; on the shared 2-core machine, loaded): 0.15-0.25 s per
    plugin and per kubelet restart at 256 resources, O(N²) for the node, and all of it
    while the kubelet, one process among hundreds of runnable ones, waited for CPU to
    answer their registrations. So an event wakes the process at once only when none
    came shortly before: a wake-up that follows another within :data:`BURST_WINDOW`
    reads at once, as ever, and then the reader stays off for a pause
    (:data:`BURST_GAP_FIRST`), after which whatever came meanwhile is read in one go;
    while events keep coming, each pause is twice the last, up to :data:`BURST_GAP_MAX`
    (the delay a polling process has anyway); a look that finds nothing puts the reader
    back, and the next event that comes alone starts the pauses from the first again.
    A watcher to which an event mattered says so (:meth:`WatchGroup.hurry`), which ends
    the pause: the events a process acts on are not held back, only the others' are.
    A lone event (a kubelet restart on a quiet node starts with one) is seen within
    milliseconds as before, with one wake-up; in a storm a process wakes a few times a
    second, whatever the number of events, and an event waits at most :data:`BURST_GAP_MAX`.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, state: _LoopState) -> None:
        self.inotify: Inotify | None = None
        self._loop = loop
        self._state = state
        self._paused: asyncio.TimerHandle | None = None
        """The pause after a wake-up (None: the reader is on)."""
        self._gap = BURST_GAP_FIRST / 2
        """The last pause (it doubles at each pause of a burst)."""
        self._woken_at = -BURST_WINDOW
        self.groups: set[WatchGroup] = set()
        self.wanted: dict[int, dict[WatchGroup, int]] = {}
        """wd -> the mask each group asked for on that inode (as an integer: tested for every event)."""
        self.handles: dict[int, tuple[WatchHandle, Watch]] = {}
        """wd -> the groups' handle and asyncinotify's watch (which ``rm_watch`` takes)."""
        if state.polling is not None:
            return  # fell back before: stays so (module docstring)
        try:
            self.inotify = Inotify(sync_timeout=0)
        except OSError as exc:
            reason = fallback_reason(exc, what="cannot watch files")
            if reason is None:
                raise
            state.fall_back(reason)
            return
        os.set_blocking(self.inotify.fd, False)  # pump reads until nothing is left, never waits
        loop.add_reader(self.inotify.fd, self._readable)

    def _readable(self) -> None:
        """The kernel has events: read them now; in a burst, pause the reader afterwards (above)."""
        self.pump()
        if self.inotify is None or self._paused is not None:
            return
        now = self._loop.time()
        burst, self._woken_at = now - self._woken_at < BURST_WINDOW, now
        if not burst:
            self._gap = BURST_GAP_FIRST / 2
            return
        self._loop.remove_reader(self.inotify.fd)
        self._pause()

    def hurry(self) -> None:
        """An event mattered to a watcher: end any pause, and take the next event as a lone one.

        A kubelet that crash-loops restarts again the moment a plugin has registered:
        each restart is a burst, but the plugin must see the next one at once.
        """
        self._gap = BURST_GAP_FIRST / 2
        self._woken_at = -BURST_WINDOW
        if self._paused is not None and self.inotify is not None:
            self._paused.cancel()
            self._paused = None
            self._loop.add_reader(self.inotify.fd, self._readable)

    def _pause(self) -> None:
        self._gap = min(self._gap * 2, BURST_GAP_MAX)
        self._paused = self._loop.call_later(self._gap, self._resume)

    def _resume(self) -> None:
        """End of a pause: read what came meanwhile; pause again, longer, if anything did."""
        self._paused = None
        if self.inotify is None:
            return
        if self.pump():
            self._woken_at = self._loop.time()
            self._pause()
        else:
            self._loop.add_reader(self.inotify.fd, self._readable)

    def pump(self) -> int:
        """Move every event the kernel has ready into the groups' queues (never blocks).

        Read and parsed here rather than by asyncinotify, whose events cost ~40 microseconds
        each (a ctypes structure, a ``Path``, several ``Flag`` operations): every plugin sees
        every file of the kubelet's directory come and go, so a kubelet restart of N resources
        is about 4 N events in each of N processes, and at 256 resources that was most of
        the CPU the children spent coming back. Here an event is a ``struct`` unpack and
        integer tests, and only a delivered one becomes an object. Returns how many events
        it read.
        """
        if self.inotify is None:
            return 0
        fd = self.inotify.fd
        read = 0
        while True:
            try:
                data = os.read(fd, _READ_SIZE)
            except (BlockingIOError, InterruptedError):
                return read
            offset, end = 0, len(data)
            while offset < end:
                wd, mask, _, length = _EVENT_HEADER.unpack_from(data, offset)
                offset += _EVENT_HEADER.size
                raw = data[offset : offset + length].rstrip(b"\0") if length else b""
                offset += length
                read += 1
                self._dispatch(wd, mask, raw)
            if end < _READ_SIZE // 2:
                return read  # what was ready fitted: nothing more to read now (saves a read that fails)

    def _dispatch(self, wd: int, mask: int, raw: bytes) -> None:
        """Hand one event to each group that watches ``wd`` for it and whose names include ``raw``."""
        if mask & _Q_OVERFLOW:
            for group in self.groups:
                group.deliver(_OVERFLOW)
            return
        wanted = self.wanted.get(wd)
        if wanted is None:
            return
        event: WatchEvent | None = None
        for group, group_mask in list(wanted.items()):
            names = group.names
            if mask & (group_mask | _ALWAYS) and (names is None or not raw or raw.startswith(names)):
                if event is None:
                    known = self.handles.get(wd)
                    event = WatchEvent(Mask(mask), os.fsdecode(raw), known[0] if known is not None else None)
                group.deliver(event)
        if mask & _IGNORED:  # the kernel removed the watch (its inode went, or rm_watch)
            self.handles.pop(wd, None)
            for group in self.wanted.pop(wd, {}):
                group.forget(wd)

    def add_watch(self, group: WatchGroup, path: Path, mask: Mask) -> WatchHandle | None:
        """A kernel watch for ``group``; None when the budget is spent (the caller polls instead)."""
        if self.inotify is None:
            return None
        try:
            watch = self.inotify.add_watch(path, mask | Mask.MASK_ADD)
        except OSError as exc:
            reason = fallback_reason(exc, what=f"cannot watch {path}")
            if reason is None:
                raise
            self._state.fall_back(reason)
            return None
        known = self.handles.get(watch.wd)
        handle = known[0] if known is not None else WatchHandle(watch.wd, path)
        self.handles[watch.wd] = (handle, watch)
        wanted = self.wanted.setdefault(watch.wd, {})
        wanted[group] = wanted.get(group, 0) | int(mask)
        return handle

    def rm_watch(self, group: WatchGroup, handle: WatchHandle) -> None:
        wanted = self.wanted.get(handle.wd)
        if wanted is None or wanted.pop(group, None) is None or wanted:
            return  # not ours, or another group still watches that inode
        del self.wanted[handle.wd]
        known = self.handles.pop(handle.wd, None)
        if self.inotify is None or known is None:
            return
        with contextlib.suppress(OSError):  # the kernel already dropped it (the inode is gone)
            self.inotify.rm_watch(known[1])

    def leave(self, group: WatchGroup) -> None:
        self.groups.discard(group)
        if self.groups:
            return
        if self._paused is not None:
            self._paused.cancel()
            self._paused = None
        if self.inotify is not None:
            with contextlib.suppress(RuntimeError, ValueError):  # a closed loop has no readers left
                self._loop.remove_reader(self.inotify.fd)
            self.inotify.close()
        if self._state.instance is self:
            self._state.instance = None


class _PolledWatch:
    """A directory (or file) looked at instead of watched: what inotify would have said, by comparison.

    An entry is told apart from a later one of the same name by its inode (the
    listing's own, no ``stat`` per entry: 256 plugins list a directory of 256
    sockets), so a ``kubelet.sock`` deleted and created again between two looks
    is reported as both, unless the filesystem gave the new file the very inode
    the old one freed. That case is caught all the same where it matters: a
    starting kubelet also deletes every plugin's socket, and a socket name is
    never used twice (docs/architecture.md, "Plugin sockets").

    The watched path replaced (another inode) or gone is ``DELETE_SELF`` then
    ``IGNORED``, as the kernel reports its watch's inode going.
    """

    def __init__(self, group: WatchGroup, handle: WatchHandle, mask: Mask, *, listing: bool) -> None:
        self.handle = handle
        self.mask = mask
        self._group = group
        """Whose names (:attr:`WatchGroup.names`) the listing keeps."""
        self._listing = listing
        info = handle.path.stat()
        if mask & Mask.ONLYDIR and not stat.S_ISDIR(info.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(handle.path))
        self._identity = (info.st_dev, info.st_ino)
        self._is_dir = stat.S_ISDIR(info.st_mode)
        self._mtime_ns = -1
        self._trusted = False
        self._entries: dict[str, int] = {}
        if listing:
            self._entries = self._list(info.st_mtime_ns) or {}

    def _list(self, mtime_ns: int) -> dict[str, int] | None:
        if not self._is_dir:
            return {}
        names = self._group.names
        try:
            with os.scandir(self.handle.path) as entries:
                if names is None:
                    listed = {entry.name: entry.inode() for entry in entries}
                else:
                    wanted = tuple(os.fsdecode(name) for name in names)
                    listed = {entry.name: entry.inode() for entry in entries if entry.name.startswith(wanted)}
        except OSError:
            return None
        self._mtime_ns = mtime_ns
        self._trusted = time.time_ns() - mtime_ns >= _MTIME_GRAIN_NS
        return listed

    def narrowed(self, wanted: tuple[str, ...]) -> None:
        """Forget the listed entries outside ``wanted``: they are no longer listed, and gone they are not."""
        self._entries = {name: inode for name, inode in self._entries.items() if name.startswith(wanted)}

    def look(self) -> Iterator[WatchEvent]:
        """The events since the last look; ends with ``IGNORED`` when the watched inode is gone."""
        try:
            info = self.handle.path.stat()
        except OSError:
            info = None
        if info is None or (info.st_dev, info.st_ino) != self._identity:
            if self.mask & Mask.DELETE_SELF:
                yield WatchEvent(Mask.DELETE_SELF, "", self.handle)
            yield WatchEvent(Mask.IGNORED, "", self.handle)
            return
        if not self._listing:
            return
        if info.st_mtime_ns == self._mtime_ns and self._trusted:
            return
        listed = self._list(info.st_mtime_ns)
        if listed is None:
            return  # gone between the stat and the listing: the next look says so
        before, self._entries = self._entries, listed
        removed = Mask.DELETE if self.mask & Mask.DELETE else Mask.MOVED_FROM
        created = Mask.CREATE if self.mask & Mask.CREATE else Mask.MOVED_TO
        for name, identity in before.items():
            if listed.get(name) != identity and self.mask & (Mask.DELETE | Mask.MOVED_FROM):
                yield WatchEvent(removed, name, self.handle)
        for name, identity in listed.items():
            if before.get(name) != identity and self.mask & (Mask.CREATE | Mask.MOVED_TO):
                yield WatchEvent(created, name, self.handle)


def open_watches(*, poll_interval: float | None = None) -> WatchGroup:
    """A new group on the running loop's inotify instance (created on first use).

    Never fails for want of budget: a watch that cannot be an inotify one is
    polled every ``poll_interval`` seconds, or, with None, not at all (the caller
    has a periodic look of its own): see the module docstring.
    """
    loop = asyncio.get_running_loop()
    state = _state()
    instance = state.instance
    if instance is None:
        instance = state.instance = _Instance(loop, state)
    group = WatchGroup(instance, poll_interval)
    instance.groups.add(group)
    return group


class WatchGroup:
    """One watcher's share of the process's inotify instance: its watches and its events, in order."""

    def __init__(self, instance: _Instance, poll_interval: float | None) -> None:
        self._instance: _Instance | None = instance
        self._poll_interval = poll_interval
        self._poll_wait = poll_interval or 0.0
        """Seconds between two looks: ``poll_interval``, longer while the directories keep changing."""
        self._next_look = 0.0
        self._changed = False
        """Whether the last look found a change (two in a row: the directory is busy)."""
        """When the next look is due (the loop's clock): the first :meth:`get` looks at once."""
        self._watches: dict[int, WatchHandle] = {}
        self._polled: dict[int, _PolledWatch] = {}
        self._events: collections.deque[WatchEvent] = collections.deque()
        self._ready = asyncio.Event()
        self.names: tuple[bytes, ...] | None = None
        """The name prefixes this group is handed events for (:meth:`narrow`); None: every name."""

    @property
    def polled(self) -> frozenset[Path]:
        """The paths this group polls rather than watches with inotify."""
        return frozenset(polled.handle.path for polled in self._polled.values())

    def add_watch(self, path: Path, mask: Mask) -> WatchHandle:
        """Watch ``path`` for ``mask``; polled when the inotify budget is spent (module docstring).

        Raises :class:`OSError` for the path's own problems (missing, not a directory
        with ``ONLYDIR``, not readable), as inotify does.
        """
        instance = self._live()
        handle = instance.add_watch(self, path, mask)
        if handle is None:
            handle = WatchHandle(next(_polled_wds), path)
            listing = self._poll_interval is not None
            self._polled[handle.wd] = _PolledWatch(self, handle, mask, listing=listing)
        self._watches[handle.wd] = handle
        return handle

    def narrow(self, prefixes: tuple[str, ...]) -> None:
        """From now on, hand over only events whose entry name starts with one of ``prefixes``.

        Events without a name (the watched path itself, ``Q_OVERFLOW``) always pass.
        Already queued events stay: they were wanted when they came. See the module
        docstring for why (a plugin among hundreds in the kubelet's directory).
        """
        if not prefixes:
            raise ValueError("narrow() needs at least one name prefix (an empty tuple would drop every name)")
        self.names = tuple(os.fsencode(prefix) for prefix in prefixes)
        for polled in self._polled.values():
            polled.narrowed(prefixes)

    def watching(self, watch: WatchHandle) -> bool:
        """Whether ``watch`` still watches: False once its inode went (deleted, replaced, unmounted).

        The path may exist again by then as another directory, which this watch does not see:
        whoever keeps watches by path asks this to know when to add one again.
        """
        return watch.wd in self._watches

    def rm_watch(self, watch: WatchHandle) -> None:
        """Stop watching (the inode stays watched for other groups that watch it)."""
        self._watches.pop(watch.wd, None)
        if self._polled.pop(watch.wd, None) is not None:
            return
        if self._instance is not None:
            self._instance.rm_watch(self, watch)

    def hurry(self) -> None:
        """An event of this group mattered: read and look at once from now on (ends a burst's pauses)."""
        if self._poll_interval is not None:
            self._poll_wait = self._poll_interval
            self._changed = False
            self._next_look = min(self._next_look, asyncio.get_running_loop().time() + self._poll_interval)
        if self._instance is not None:
            self._instance.hurry()

    def _poll(self) -> None:
        """Look at the polled paths if a look is due; the wait before the next grows while they change."""
        interval = self._poll_interval
        now = asyncio.get_running_loop().time()
        if interval is None or not self._polled or now < self._next_look:
            return
        changed = False
        for wd, polled in list(self._polled.items()):
            for event in polled.look():
                changed = True
                self.deliver(event)
                if event.mask & Mask.IGNORED:
                    del self._polled[wd]
                    self._watches.pop(wd, None)
        busy, self._changed = changed and self._changed, changed
        self._poll_wait = min(self._poll_wait * 2, max(POLL_BUSY_MAX, interval)) if busy else interval
        self._next_look = now + self._poll_wait

    async def get(self) -> WatchEvent:
        """The next event of this group's watches (or a ``Q_OVERFLOW``: anything may have happened)."""
        while not self._events:
            self._ready.clear()
            self._live().pump()
            self._poll()
            if self._events:
                break
            if self._polled and self._poll_interval is not None:
                # A timer that wakes the wait, not a timeout that cancels it: an idle poller wakes
                # several times a second, and a cancellation costs twice the look itself.
                loop = asyncio.get_running_loop()
                timer = loop.call_at(self._next_look, self._ready.set)
                try:
                    await self._ready.wait()
                finally:
                    timer.cancel()
            else:
                await self._ready.wait()
        return self._events.popleft()

    def sync_get(self) -> WatchEvent | None:
        """The next event if there is one now (the kernel's pending ones included), else None.

        Polled watches are looked at by :meth:`get` only, when it waits.
        """
        if not self._events and self._instance is not None:
            self._instance.pump()
        return self._events.popleft() if self._events else None

    def close(self) -> None:
        """Remove this group's watches, and the instance with its last group."""
        instance, self._instance = self._instance, None
        if instance is None:
            return
        for watch in list(self._watches.values()):
            if watch.wd >= 0:
                instance.rm_watch(self, watch)
        self._watches.clear()
        self._polled.clear()
        instance.leave(self)

    def __enter__(self) -> WatchGroup:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- for the instance ------------------------------------------------------------

    def deliver(self, event: WatchEvent) -> None:
        """Queue ``event`` for :meth:`get` (bounded: see :data:`MAX_QUEUED`)."""
        if len(self._events) >= MAX_QUEUED:
            self._events.clear()
            self._events.append(_OVERFLOW)
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
