"""Event-driven discovery with real inotify: what triggers a rescan, and what does not."""

import asyncio
import contextlib
import shutil
from pathlib import Path

import pytest

from plugvisor.deviceplugin.cell import SnapshotCell
from plugvisor.deviceplugin.devices import Device
from plugvisor.deviceplugin.snapshot import Snapshot
from plugvisor.deviceplugin.watch import DeviceWatcher


class DirSource:
    """One device per file in `<root>/devs` (which may not exist yet)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def scan(self) -> Snapshot:
        devs = self.root / "devs"
        names = sorted(p.name for p in devs.iterdir()) if devs.is_dir() else []
        return Snapshot([Device(n) for n in names], watch=[self.root / "devs"])


async def start(root: Path):
    cell = SnapshotCell(Snapshot())
    watcher = DeviceWatcher(DirSource(root), cell, rescan_interval=3600)
    task = asyncio.create_task(watcher.run())
    await watcher.first_scan_done.wait()
    return cell, watcher, task


async def until(cell, predicate, timeout=10):
    seen = -1
    async with asyncio.timeout(timeout):
        while not predicate(cell.value.devices):
            seen, _ = await cell.wait_newer(max(seen, cell.version))


async def stop(task):
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def test_a_directory_that_appears_later_is_watched_from_then_on(short_dir):
    cell, _, task = await start(short_dir)
    try:
        (short_dir / "devs").mkdir()
        (short_dir / "devs" / "a").touch()
        await until(cell, lambda d: list(d) == ["a"])
        (short_dir / "devs" / "b").touch()
        await until(cell, lambda d: list(d) == ["a", "b"])
    finally:
        await stop(task)


async def test_a_watched_directory_removed_and_made_again_is_watched_again(short_dir):
    """A driver reload removes and recreates its /dev directory at once: the new one must be watched too."""
    (short_dir / "devs").mkdir()
    (short_dir / "devs" / "a").touch()
    cell, _, task = await start(short_dir)
    try:
        shutil.rmtree(short_dir / "devs")  # no await in between: the watcher sees both at once
        (short_dir / "devs").mkdir()
        (short_dir / "devs" / "b").touch()
        await until(cell, lambda d: list(d) == ["b"])
        (short_dir / "devs" / "c").touch()  # only a watch on the new directory sees this (no rescans)
        await until(cell, lambda d: list(d) == ["b", "c"])
    finally:
        await stop(task)


async def test_writing_inside_a_watched_directory_does_not_rescan(short_dir):
    (short_dir / "devs").mkdir()
    (short_dir / "devs" / "a").touch()
    cell, watcher, task = await start(short_dir)
    try:
        scans = watcher.scans
        for _ in range(200):
            with (short_dir / "devs" / "a").open("w") as f:
                f.write("x")
        # A later creation proves the watcher is alive and has processed everything before it.
        (short_dir / "devs" / "z").touch()
        await until(cell, lambda d: "z" in d)
        assert watcher.scans - scans <= 2
    finally:
        await stop(task)


async def test_a_burst_of_changes_costs_far_fewer_scans_than_events(short_dir):
    (short_dir / "devs").mkdir()
    cell, watcher, task = await start(short_dir)
    try:
        scans = watcher.scans
        for i in range(300):
            (short_dir / "devs" / f"d{i:03}").touch()
        await until(cell, lambda d: len(d) == 300)
        assert watcher.scans - scans < 300
    finally:
        await stop(task)


async def test_a_failing_scan_keeps_the_last_good_list(short_dir):
    (short_dir / "devs").mkdir()
    (short_dir / "devs" / "a").touch()
    source = DirSource(short_dir)
    cell = SnapshotCell(Snapshot())
    watcher = DeviceWatcher(source, cell, rescan_interval=3600)
    await watcher.scan_once()
    assert list(cell.value.devices) == ["a"]
    (short_dir / "devs" / "bad name").touch()  # an invalid device ID makes the scan raise
    assert await watcher.scan_once() is False
    assert watcher.failed_scans == 1
    assert list(cell.value.devices) == ["a"]


class CountFile:
    """Devices counted from a file nobody watches: only a uevent or the timer can notice a change."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def scan(self) -> Snapshot:
        return Snapshot([Device(f"d{i}") for i in range(int(self.path.read_text()))])

    def uevent_subsystems(self) -> list[str]:
        return ["pci"]


async def test_a_matching_kernel_uevent_triggers_a_rescan(short_dir):
    import socket

    count = short_dir / "count"
    count.write_text("1")
    kernel, ours = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    cell = SnapshotCell(Snapshot())
    watcher = DeviceWatcher(CountFile(count), cell, rescan_interval=3600, uevent_socket=ours)
    listener = watcher.uevents
    assert listener is not None
    task = asyncio.create_task(watcher.run())
    try:
        await until(cell, lambda d: len(d) == 1)
        count.write_text("3")
        kernel.send(b"add@/devices/usb1/1-1\0ACTION=add\0SUBSYSTEM=usb\0")  # not ours: ignored
        kernel.send(b"add@/devices/pci0000:00/0000:00:02.0\0ACTION=add\0SUBSYSTEM=pci\0")
        await until(cell, lambda d: len(d) == 3)
        assert listener.matched == 1
    finally:
        await stop(task)
        kernel.close()


async def test_a_source_that_names_subsystems_gets_a_kernel_listener(short_dir):
    count = short_dir / "count"
    count.write_text("0")
    watcher = DeviceWatcher(CountFile(count), SnapshotCell(Snapshot()), rescan_interval=3600)
    assert watcher.uevents is not None
    assert watcher.uevents.subsystems == {"pci"}
    if not watcher.uevents.open():
        pytest.skip("this machine refuses the kernel's uevent socket (needs a netlink-capable sandbox)")
    watcher.uevents.close()


async def test_a_stopped_watcher_leaves_nothing_that_steals_the_next_ones_events(short_dir):
    """Stopping cancels the pending inotify read; an orphan would keep reading the (reused) descriptor."""
    (short_dir / "devs").mkdir()
    for _ in range(3):
        cell, watcher, task = await start(short_dir)
        await asyncio.wait_for(watcher.idle.wait(), 10)  # stopped while its inotify read is pending
        await stop(task)
    cell, _, task = await start(short_dir)
    try:
        (short_dir / "devs" / "fresh").touch()
        await until(cell, lambda d: "fresh" in d, timeout=5)
    finally:
        await stop(task)


class EventSource:
    """Devices a thread of its own learns about (as NVML's event thread): it asks for the rescan."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.rescan = None

    def request_rescans(self, rescan) -> None:
        self.rescan = rescan

    def scan(self) -> Snapshot:
        return Snapshot([Device(n) for n in self.names])


async def test_a_source_with_its_own_events_asks_for_a_rescan_from_another_thread():
    source = EventSource()
    cell = SnapshotCell(Snapshot())
    watcher = DeviceWatcher(source, cell, rescan_interval=3600)
    task = asyncio.create_task(watcher.run())
    try:
        await watcher.first_scan_done.wait()
        assert source.rescan is not None and list(cell.value.devices) == []
        source.names.append("gpu0")
        await asyncio.to_thread(source.rescan)
        await until(cell, lambda d: list(d) == ["gpu0"])
    finally:
        await stop(task)
