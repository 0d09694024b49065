"""Writes to sriov_numvfs by anyone become VF changes, as the kernel would make them."""

from __future__ import annotations

import asyncio
import os

from plugvisor.emulators.lab import Lab
from plugvisor.emulators.lab.watcher import NumVfsWatcher

DEADLINE = 20.0


async def until(check: object, what: str) -> None:
    """Poll a condition (the watcher works asynchronously); fail with ``what`` if it never holds."""
    loop = asyncio.get_running_loop()
    end = loop.time() + DEADLINE
    while not check():  # type: ignore[operator]
        assert loop.time() < end, what
        await asyncio.sleep(0.02)


def write(path: str, value: str) -> None:
    with open(path, "w") as handle:  # an in-place write, like `echo 4 > sriov_numvfs`
        handle.write(value)


def read(path: str) -> str:
    with open(path) as handle:
        return handle.read().strip()


async def test_write_zero_then_n(root: str) -> None:
    """echo 0 then echo 6 removes the VFs, then creates six with their links."""
    lab = Lab.create(root, "small")
    attr = f"{root}/sys/bus/pci/devices/{lab.device('nic0').bdf}/sriov_numvfs"
    async with NumVfsWatcher(root) as watcher:
        write(attr, "0\n")
        await until(lambda: watcher.applied == 1, "VFs were not removed")
        assert lab.device("nic0").num_vfs == 0
        write(attr, "6\n")
        await until(lambda: watcher.applied == 2, "VFs were not created")
        assert len(lab.device("nic0").vfs) == 6
    pf_dir = os.path.dirname(attr)
    assert len([n for n in os.listdir(pf_dir) if n.startswith("virtfn")]) == 6
    assert read(attr) == "6"


async def test_refused_write_is_rolled_back(root: str) -> None:
    """N -> M (EBUSY) and junk (EINVAL) leave the VFs alone and restore the file."""
    lab = Lab.create(root, "small")
    attr = f"{root}/sys/bus/pci/devices/{lab.device('nic0').bdf}/sriov_numvfs"
    async with NumVfsWatcher(root) as watcher:
        write(attr, "2\n")
        await until(lambda: watcher.rejected == 1, "EBUSY write not refused")
        write(attr, "lots\n")
        await until(lambda: watcher.rejected == 2, "junk write not refused")
        await until(lambda: read(attr) == "4", "value not restored")
    assert len(lab.device("nic0").vfs) == 4


async def test_follows_replug(root: str) -> None:
    """After the PF is unplugged and plugged back, writes to its new directory still work."""
    lab = Lab.create(root, "small")
    attr = f"{root}/sys/bus/pci/devices/{lab.device('nic0').bdf}/sriov_numvfs"
    async with NumVfsWatcher(root) as watcher:
        lab.unplug("nic0")
        lab.plug("nic0")
        pf_dir = os.path.realpath(os.path.dirname(attr))
        await until(lambda: watcher.watching(pf_dir), "re-plugged PF not watched")
        write(attr, "0\n")
        await until(lambda: watcher.applied == 1, "write after re-plug ignored")
        assert lab.device("nic0").num_vfs == 0


async def test_follows_many_replugs(root: str) -> None:
    """Every re-plug is followed, also when the new PF directory reuses the old one's inode number."""
    lab = Lab.create(root, "small")
    attr = f"{root}/sys/bus/pci/devices/{lab.device('nic0').bdf}/sriov_numvfs"
    pf_dir = os.path.realpath(os.path.dirname(attr))
    async with NumVfsWatcher(root) as watcher:
        for cycle in range(1, 9):
            lab.unplug("nic0")
            lab.plug("nic0")
            await until(lambda: watcher.watching(pf_dir), "re-plug not watched")
            wanted = 0 if lab.device("nic0").num_vfs else 2
            write(attr, f"{wanted}\n")
            await until(lambda c=cycle: watcher.applied == c, f"write after re-plug {cycle} ignored")
            assert (lab.device("nic0").num_vfs or 0) == wanted
