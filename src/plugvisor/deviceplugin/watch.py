"""Event-driven rescans: inotify on the paths a source names, plus a periodic safety net.

Polling every few seconds (what Intel, squat and Xilinx do) puts seconds between
a device fault and the kubelet hearing of it. Here a change under a watched
directory triggers a scan at once; bursts of events coalesce into one scan
without any fixed debounce delay (events that arrive while a scan runs cause
exactly one more scan). Real sysfs sends no inotify events for attribute
changes, so the periodic rescan stays as the safety net and is configurable.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Final

import structlog
from asyncinotify import Mask

from plugvisor.common import inotify as inotify_
from plugvisor.deviceplugin.cell import SnapshotCell
from plugvisor.deviceplugin.hooks import DeviceSource, RescanRequester, UeventSubscriber
from plugvisor.deviceplugin.snapshot import Snapshot
from plugvisor.deviceplugin.uevents import UeventListener

CHANGE_MASK: Final = (
    Mask.CREATE | Mask.DELETE | Mask.MOVED_FROM | Mask.MOVED_TO | Mask.DELETE_SELF | Mask.MOVE_SELF
)
"""Entries appearing, vanishing or renamed into place. Not CLOSE_WRITE or ATTRIB: in a watched
``/dev`` every process that writes to ``/dev/null`` would trigger a rescan. Attribute writers
(the lab, like sysfs-style tools) replace files by rename; in-place edits are caught by the
periodic rescan."""

MIN_EVENT_SCAN_INTERVAL: Final = 0.005
"""Floor between event-triggered scans: a storm of events costs at most 200 scans a second."""


def nearest_directory(path: Path) -> Path | None:
    """The directory to watch for ``path``: itself if a directory, else its nearest existing parent."""
    candidate = path
    while True:
        if candidate.is_dir():
            return candidate
        parent = candidate.parent
        if parent == candidate:
            return None
        candidate = parent


def drain(inotify: inotify_.WatchGroup) -> int:
    """Consume the events already queued (the kernel's pending ones included) without waiting."""
    count = 0
    while inotify.sync_get() is not None:
        count += 1
    return count


class WatchSet:
    """Keeps an inotify instance watching exactly a desired set of directories."""

    def __init__(self, inotify: inotify_.WatchGroup, mask: Mask = CHANGE_MASK) -> None:
        self._inotify = inotify
        self._mask = mask
        self._watches: dict[Path, inotify_.WatchHandle] = {}
        self._log = structlog.get_logger("plugvisor.watch")

    @property
    def paths(self) -> frozenset[Path]:
        """The directories currently watched."""
        return frozenset(self._watches)

    def sync(self, wanted: Iterable[Path]) -> None:
        """Add and remove watches so that exactly the nearest directories of ``wanted`` are watched."""
        dirs = {d for d in (nearest_directory(p) for p in wanted) if d is not None}
        for path, watch in list(self._watches.items()):
            if path not in dirs:
                del self._watches[path]
                with contextlib.suppress(OSError):  # the kernel already dropped it (directory deleted)
                    self._inotify.rm_watch(watch)
            elif not self._inotify.watching(watch):
                # Its directory went, and the path is there again (a driver reload makes its /dev
                # directory anew): the old watch sees nothing of the new directory.
                del self._watches[path]
        for path in dirs - set(self._watches):
            # Vanished in between: the periodic rescan covers it (as it covers a watch polled for
            # want of inotify budget, which add_watch takes care of).
            try:
                self._watches[path] = self._inotify.add_watch(path, self._mask)
            except OSError as exc:
                self._log.warning("watch_failed", path=str(path), error=os.strerror(exc.errno or 0))


class DeviceWatcher:
    """Runs a source's one-shot scan on every trigger and publishes each new snapshot to a cell.

    A failing scan is logged with its cause and the previous snapshot is kept:
    a transient read error must not make every device vanish from the kubelet.
    The directories watched are those of the latest snapshot (none before the first scan).
    """

    def __init__(
        self,
        source: DeviceSource,
        cell: SnapshotCell[Snapshot[Any]],
        *,
        rescan_interval: float = 30.0,
        resource: str = "",
        uevent_socket: socket.socket | None = None,
    ) -> None:
        self._source = source
        self._kick = asyncio.Event()
        self.uevents: UeventListener | None = None
        """Set when the source names uevent subsystems; ``uevent_socket`` replaces the kernel's (tests)."""
        if isinstance(source, UeventSubscriber):
            self.uevents = UeventListener(
                source.uevent_subsystems(), lambda _event: self.kick(), sock=uevent_socket
            )
        self._cell = cell
        self._rescan_interval = rescan_interval
        self._log = structlog.get_logger("plugvisor.discovery").bind(resource=resource)
        self.scans = 0
        self.failed_scans = 0
        self.first_scan_done = asyncio.Event()
        self.idle = asyncio.Event()
        """Set while the watcher waits for a change (its inotify read pending), cleared while it scans."""

    def kick(self) -> None:
        """Rescan as soon as possible (what a matching uevent does)."""
        self._kick.set()

    async def scan_once(self) -> bool:
        """Scan now and publish the result; returns whether the device set changed."""
        started = time.monotonic()
        try:
            snapshot = await asyncio.to_thread(self._source.scan)
            if not isinstance(snapshot, Snapshot):
                raise TypeError(  # noqa: TRY301 - reported like any failed scan
                    f"scan() must return a plugvisor.deviceplugin.Snapshot, got {type(snapshot).__name__}"
                )
        except Exception as exc:  # a scan bug or a bad tree must not kill discovery
            self.failed_scans += 1
            self._log.error("scan_failed", error=f"{type(exc).__name__}: {exc}")
            return False
        finally:
            self.scans += 1
            self.first_scan_done.set()
        devices = snapshot.devices
        changed = devices != self._cell.value.devices
        self._cell.publish(snapshot)
        if changed:
            self._log.info(
                "devices_changed",
                devices=len(devices),
                healthy=len(devices.healthy_ids),
                scan_seconds=round(time.monotonic() - started, 4),
            )
        return changed

    async def run(self) -> None:
        """Scan, then rescan on every inotify event, matching uevent, source's request and rescan interval."""
        loop = asyncio.get_running_loop()
        if isinstance(self._source, RescanRequester):

            def rescan() -> None:
                with contextlib.suppress(RuntimeError):  # the loop is closed: the plugin is stopping
                    loop.call_soon_threadsafe(self.kick)

            self._source.request_rescans(rescan)
        uevents = self.uevents if self.uevents is not None and self.uevents.open() else None
        if uevents is not None:
            loop.add_reader(uevents.fileno(), uevents.read_ready)
        try:
            # The process's one instance, shared; without budget, the rescan interval is the poll.
            with inotify_.open_watches(poll_interval=None) as inotify:
                await self._loop(inotify)
        finally:
            if uevents is not None:
                loop.remove_reader(uevents.fileno())
                uevents.close()

    async def _loop(self, inotify: inotify_.WatchGroup) -> None:
        watches = WatchSet(inotify)
        while True:
            # Arm the watches before scanning: a change during the scan then triggers another one.
            watches.sync(self._cell.value.watch)
            drain(inotify)
            self._kick.clear()
            self.idle.clear()
            last_scan = time.monotonic()
            await self.scan_once()
            watches.sync(self._cell.value.watch)
            if not await self._wait_for_change(inotify):
                continue  # the periodic rescan
            # Coalesce the rest of a burst: let already-sent events arrive, then take them all.
            since = time.monotonic() - last_scan
            await asyncio.sleep(max(0.0, MIN_EVENT_SCAN_INTERVAL - since))
            drain(inotify)

    async def _wait_for_change(self, inotify: inotify_.WatchGroup) -> bool:
        """Wait for an inotify event or a uevent kick; False when the rescan interval ran out first.

        A kick cancels the pending inotify read; events that read may have taken
        are covered by the rescan the kick causes.
        """
        event = asyncio.ensure_future(inotify.get())
        kicked = asyncio.ensure_future(self._kick.wait())
        # Whoever this wakes runs after the read has started (the loop runs callbacks in order).
        self.idle.set()
        try:
            done, _ = await asyncio.wait(
                {event, kicked}, timeout=self._rescan_interval, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            # Also when we are cancelled: nothing of this wait may outlive it.
            for task in (event, kicked):
                task.cancel()
            for task in (event, kicked):
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        return bool(done)
