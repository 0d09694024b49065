"""What a piece of the lab looks like on disk, as a value.

Every device renders to a :data:`Spec`: a mapping from a path relative to the lab
root to the entry that must be there. Faults, hot-plug and VF changes are then
all the same operation: render the device before and after, and let
:meth:`~plugvisor.emulators.lab.tree.FakeTree.apply` write only the difference.
That keeps the "what" (the kernel's layout, in the renderers) apart from the
"how" (atomic renames, the guard, mknod), and makes the layout testable without
touching a file system.

Only *owned* directories appear as :class:`Dir` entries: a directory a device
brings with it and takes away again (its PCI function directory, its KFD node).
Shared parents such as ``sys/bus/pci/drivers/ice`` are created on demand and
never removed.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import TypeAlias


@dataclass(frozen=True, slots=True)
class File:
    """A regular file (a sysfs attribute, a procfs entry, ``pci.ids``)."""

    content: bytes
    mode: int = 0o444
    size: int = 0
    """When larger than ``content``: the file's length, as a sparse hole (a BAR's ``resourceN``)."""


@dataclass(frozen=True, slots=True)
class Link:
    """A symbolic link; ``target`` is relative, exactly as sysfs writes it."""

    target: str


@dataclass(frozen=True, slots=True)
class Dir:
    """A directory owned by one device, removed with it."""

    mode: int = 0o755


@dataclass(frozen=True, slots=True)
class Node:
    """A character device node (a regular empty file unless the lab runs with ``--mknod``)."""

    major: int
    minor: int
    mode: int = 0o666


Entry: TypeAlias = File | Link | Dir | Node
Spec: TypeAlias = dict[str, Entry]


def sysfs_relpath(link: str, target: str) -> str:
    """Return the relative target the kernel would give a link at ``link`` pointing to ``target``.

    The kernel climbs from the link's directory to a common ancestor that is a
    *strict* ancestor of the target, so a link to an ancestor still goes one level
    further up and names it (``drm/card0/device -> ../../../0000:00:02.0``),
    where :func:`posixpath.relpath` would say ``../..``. Intel's GPU plugin parses
    the BDF out of such targets, so the difference matters.
    """
    link_parts = posixpath.dirname(link).split("/")
    target_parts = target.split("/")
    common = 0
    limit = min(len(link_parts), len(target_parts) - 1)
    while common < limit and link_parts[common] == target_parts[common]:
        common += 1
    ups = len(link_parts) - common
    return "../" * ups + "/".join(target_parts[common:])


def text(value: str | int) -> File:
    """Return a read-only attribute holding ``value`` and a newline, as sysfs prints it."""
    return File(f"{value}\n".encode())


def add_link(spec: Spec, at: str, to: str) -> None:
    """Add a sysfs-style relative link at ``at`` that resolves to ``to`` (both root-relative)."""
    spec[at] = Link(sysfs_relpath(at, to))


def add_node(spec: Spec, *, at: str, major: int, minor: int, sys_target: str, mode: int = 0o666) -> None:
    """Add a device node and the ``sys/dev/char`` and ``dev/char`` links that must agree with it.

    Readers that ``stat()`` a node and follow ``/sys/dev/char/M:m`` (Intel's
    topology and FPGA code) and those that check ``/dev/char/M:m`` (Intel DSA)
    both get a consistent answer, because all three are written together.
    """
    spec[at] = Node(major, minor, mode)
    add_link(spec, f"sys/dev/char/{major}:{minor}", sys_target)
    add_link(spec, f"dev/char/{major}:{minor}", at)


def virtual_device(spec: Spec, path: str, major: int, minor: int, node: str) -> None:
    """Add a class device under ``sys/devices/virtual`` (``dev``, ``uevent``) and its node."""
    spec[path] = Dir()
    spec[f"{path}/dev"] = text(f"{major}:{minor}")
    name = node.removeprefix("dev/")
    spec[f"{path}/uevent"] = text(f"MAJOR={major}\nMINOR={minor}\nDEVNAME={name}")
    add_node(spec, at=node, major=major, minor=minor, sys_target=path)


def driver_dir(spec: Spec, bus: str, driver: str, module: str | None) -> None:
    """Add ``sys/bus/<bus>/drivers/<driver>`` with its control files and, for a module, both links.

    ``module -> sys/module/<mod>`` and ``sys/module/<mod>/drivers/<bus>:<driver>``
    back: ROCm's plugin finds ``amdgpu`` devices through the latter.
    """
    d = f"sys/bus/{bus}/drivers/{driver}"
    spec[d] = Dir()
    for name in ("bind", "unbind", "uevent") + (("new_id", "remove_id") if bus == "pci" else ()):
        spec[f"{d}/{name}"] = File(b"", 0o200)
    if module:
        m = f"sys/module/{module}"
        spec[f"{m}/initstate"] = text("live")
        spec[f"{m}/refcnt"] = text(0)
        add_link(spec, f"{d}/module", m)
        add_link(spec, f"{m}/drivers/{bus}:{driver}", d)
