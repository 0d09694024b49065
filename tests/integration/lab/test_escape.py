"""No lab write leaves the root, whatever symlinks an attacker plants inside it (real file system).

Each case plants a symlink (absolute, relative or dangling) at a level the lab writes
through, then drives the lab the way a user would: create with ``--force``, faults,
unplug and plug, VF changes. A decoy directory outside the root stands in for the
real ``/dev`` (the lab's guard would refuse the real one before it got that far):
afterwards it must be exactly as it was, and the lab must have refused with a
:class:`LabError` naming the symlink, or not needed to write there at all.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import shutil
from collections.abc import Callable

import pytest
from click.testing import CliRunner

from plugvisor.emulators.lab import Lab, LabError
from plugvisor.emulators.lab.cli import lab_group
from plugvisor.emulators.lab.spec import File
from plugvisor.emulators.lab.tree import FakeTree


def snapshot(path: str) -> dict[str, tuple[int, bytes]]:
    """Every entry under ``path`` with its mode and content (or link target)."""
    out: dict[str, tuple[int, bytes]] = {}
    for base, dirs, files in os.walk(path):
        for name in dirs + files:
            full = os.path.join(base, name)
            info = os.lstat(full)
            if os.path.islink(full):
                body = os.readlink(full).encode()
            elif os.path.isfile(full):
                with open(full, "rb") as handle:
                    body = handle.read()
            else:
                body = b""
            out[os.path.relpath(full, path)] = (info.st_mode, body)
    return out


@pytest.fixture
def decoy(root: str) -> str:
    """A directory outside the root that plays the real /dev, with one file the attacker wants clobbered."""
    path = posixpath.join(posixpath.dirname(root), "decoy-dev")
    os.makedirs(path)
    with open(f"{path}/null", "w") as handle:
        handle.write("precious\n")
    return path


def plant(root: str, rel: str, target: str) -> None:
    """Replace ``root/rel`` (whatever it is) by a symlink to ``target``."""
    full = posixpath.join(root, rel)
    os.makedirs(posixpath.dirname(full), exist_ok=True)
    if os.path.islink(full) or os.path.isfile(full):
        os.unlink(full)
    elif os.path.isdir(full):
        shutil.rmtree(full)
    os.symlink(target, full)


def every_write(root: str) -> None:
    """Drive every kind of lab write; each may be refused, none may escape."""
    steps: list[Callable[[], object]] = [
        lambda: Lab.open(root).fault("nic0", "link-down"),
        lambda: Lab.open(root).heal("nic0"),
        lambda: Lab.open(root).unplug("nic0"),
        lambda: Lab.open(root).plug("nic0"),
        lambda: Lab.open(root).set_num_vfs("nic0", 0),
        lambda: Lab.open(root).set_num_vfs("nic0", 2),
        lambda: Lab.open(root).fault("gpu0", "fallen-off-bus"),
        lambda: Lab.open(root).heal("gpu0"),
        lambda: Lab.create(root, "small", replace=True),
    ]
    for step in steps:
        with contextlib.suppress(LabError):  # a refusal (naming the input) is fine; writing outside is not
            step()


PLANTS = [
    # the lab's own directory and its staging area, lock and state
    ".plugvisor-lab",
    ".plugvisor-lab/tmp",
    ".plugvisor-lab/lock",
    # the pci.ids path (create and --force write and delete there)
    "usr",
    "usr/share/hwdata",
    "usr/share/hwdata/pci.ids",
    # directories and entries inside the tree that faults, unplug and VF changes write through
    "sys/bus/pci/devices",
    "sys/bus/pci/drivers/ice",
    "sys/bus/pci/drivers/iavf",
    "sys/class/net",
    "sys/kernel/iommu_groups",
    "sys/dev/char",
    "dev/char",
    "proc/driver",
    "sys/devices/pci0000:00",
]


KINDS = [(rel, "absolute") for rel in PLANTS] + [
    (rel, how)
    for rel in (".plugvisor-lab/tmp", ".plugvisor-lab/lock", "usr", "sys/bus/pci/drivers/iavf", "dev/char")
    for how in ("relative", "dangling")
]


@pytest.mark.parametrize(("rel", "how"), KINDS)
def test_no_write_follows_a_planted_symlink(root: str, decoy: str, rel: str, how: str) -> None:
    """A symlink planted anywhere the lab writes through never gets a write outside the root."""
    Lab.create(root, "small")
    before = snapshot(decoy)
    if how == "absolute":
        target = decoy
    elif how == "relative":
        target = posixpath.relpath(decoy, posixpath.dirname(posixpath.join(root, rel)))
    else:
        target = posixpath.join(decoy, "planted")
    if rel.endswith(("lock", "pci.ids")) and how != "dangling":
        target = posixpath.join(target, "null")
    plant(root, rel, target)
    every_write(root)
    assert snapshot(decoy) == before


def test_an_attribute_that_is_a_symlink_is_replaced_not_followed(root: str, decoy: str) -> None:
    """A sysfs attribute swapped for a link to a file outside gets replaced; the outside file is untouched."""
    lab = Lab.create(root, "small")
    operstate = f"{lab.device('nic0').sysfs_path}/net/{lab.device('nic0').netdev}/operstate"
    plant(root, operstate, f"{decoy}/null")
    lab.fault("nic0", "link-down")
    assert snapshot(decoy)["null"][1] == b"precious\n"
    assert not os.path.islink(posixpath.join(root, operstate))
    with open(posixpath.join(root, operstate)) as handle:
        assert handle.read() == "down\n"


def test_the_watcher_never_reads_through_a_symlink(root: str, decoy: str) -> None:
    """An attribute the watcher reads back (sriov_numvfs) that became a link to a device is refused."""
    lab = Lab.create(root, "small")
    tree = FakeTree(root)
    rel = f"{lab.device('nic0').sysfs_path}/sriov_numvfs"
    plant(root, rel, "/dev/zero")
    with pytest.raises(LabError, match="symlink"):
        tree.read(rel)
    tree.put(rel, File(b"4\n"))
    assert tree.read(rel) == b"4\n"


def test_create_through_proc_root_is_a_clear_error() -> None:
    """`lab create /proc/1/root/...` names the root and the reason, with no traceback."""
    result = CliRunner().invoke(lab_group, ["create", "/proc/1/root/tmp/pvlab-never"])
    assert result.exit_code in (1, 2), result.output
    assert isinstance(result.exception, SystemExit)
    assert "/proc/1/root/tmp/pvlab-never" in result.output
    assert not os.path.exists("/tmp/pvlab-never")
