"""The lab's own record of what it wrote, kept in the root so every invocation agrees.

``plugvisor lab create`` in one process and ``lab fault`` or the ``sriov_numvfs``
watcher in others must all see the same devices, faults and VF counts. The
record lives in ``ROOT/.plugvisor-lab/state.json``, is replaced atomically, and
every change happens under an exclusive ``flock`` on ``ROOT/.plugvisor-lab/lock``.

The tree is always a pure function of this record (see :mod:`.render`), which is
why the record stores decisions (addresses, numbers, names) and never file contents.
"""

# Paths here are root-relative POSIX strings shared with the tree writer (see tree.py).
# ruff: noqa: PTH103, PTH113, PTH123

from __future__ import annotations

import contextlib
import fcntl
import os
import posixpath
from collections.abc import Iterator
from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict

from plugvisor.emulators.lab import errors
from plugvisor.emulators.lab.pci import Bdf
from plugvisor.emulators.lab.profiles import Profile
from plugvisor.emulators.lab.spec import File
from plugvisor.emulators.lab.tree import LAB_DIR, FakeTree

STATE_FILE = f"{LAB_DIR}/state.json"
LOCK_FILE = f"{LAB_DIR}/lock"
FORMAT_VERSION = 1


class DeviceKind(StrEnum):
    """What a lab device is, which decides its faults and its tree."""

    GPU = "gpu"
    FPGA = "fpga"
    NIC_PF = "nic-pf"
    NIC_VF = "nic-vf"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=False)


class FunctionState(_Model):
    """One PCI function of a device."""

    bdf: str
    path: str
    role: Literal["gpu", "fpga", "mgmt", "user", "pf", "vf"]
    driver: str | None
    iommu_group: int | None

    @property
    def address(self) -> Bdf:
        """The parsed address."""
        return Bdf.parse(self.bdf)


class BridgeState(_Model):
    """A root port or PCIe switch port: present for the lab's whole life."""

    bdf: str
    path: str
    role: Literal["root-port", "upstream", "downstream"]
    numa_node: int
    switch: str | None
    buses: tuple[int, int, int]
    iommu_group: int


class SwitchState(_Model):
    """A PCIe switch: one upstream port and its downstream ports."""

    name: str
    numa_node: int
    upstream: str
    downstream: list[str]


class NumaState(_Model):
    """A NUMA node and its CPUs (``local_cpulist`` of the devices on it)."""

    id: int
    cpulist: str


class DeviceState(_Model):
    """One lab device and everything decided about it.

    Kind-specific fields are ``None`` for other kinds; keeping one flat record
    keeps the state file readable and the JSON schema obvious.
    """

    name: str
    kind: DeviceKind
    model: str
    numa_node: int
    switch: str | None
    functions: list[FunctionState]
    present: bool = True
    faults: list[str] = []
    aer: tuple[int, int, int] = (0, 0, 0)
    # GPUs
    minor: int | None = None
    card: int | None = None
    uuid: str | None = None
    kfd_node: int | None = None
    gpu_id: int | None = None
    # FPGAs
    fpga_index: int | None = None
    afu_id: str | None = None
    interface_id: str | None = None
    shell: str | None = None
    # NICs
    netdev: str | None = None
    mac: str | None = None
    ifindex: int | None = None
    total_vfs: int | None = None
    num_vfs: int | None = None
    saved_num_vfs: int | None = None
    vf_offset: int | None = None
    vf_stride: int | None = None
    vf_driver: str | None = None
    vf_group_base: int | None = None
    parent: str | None = None
    vf_index: int | None = None

    @property
    def primary(self) -> FunctionState:
        """The function that names the device (the user PF of a Xilinx-like card)."""
        for fn in self.functions:
            if fn.role == "user":
                return fn
        return self.functions[0]


class LabState(_Model):
    """The whole lab."""

    version: int = FORMAT_VERSION
    profile: Profile
    mknod: bool = False
    numa_nodes: list[NumaState]
    host_bridges: list[str]
    bridges: list[BridgeState]
    switches: list[SwitchState]
    devices: dict[str, DeviceState]

    def device(self, name: str) -> DeviceState:
        """Return a device by name, or raise a :class:`~.errors.UsageError` listing what exists."""
        try:
            return self.devices[name]
        except KeyError:
            known = [n for n, d in self.devices.items() if d.kind is not DeviceKind.NIC_VF]
            raise errors.UsageError(
                f"no device {name!r} in this lab; expected one of: {', '.join(known)} (or a VF, e.g. nic0vf0)"
            ) from None

    def cpulist(self, numa_node: int) -> str:
        """Return the CPUs of a NUMA node."""
        return self.numa_nodes[numa_node].cpulist

    def vfs_of(self, pf: str) -> list[DeviceState]:
        """Return a PF's VFs in index order."""
        vfs = [d for d in self.devices.values() if d.parent == pf]
        return sorted(vfs, key=lambda d: d.vf_index or 0)


def exists(root: str) -> bool:
    """Whether ``root`` holds a lab."""
    return os.path.isfile(posixpath.join(root, STATE_FILE))


def load(root: str) -> LabState:
    """Read the state of the lab at ``root``."""
    path = posixpath.join(root, STATE_FILE)
    try:
        with open(path, encoding="utf-8") as handle:
            raw = handle.read()
    except FileNotFoundError:
        raise errors.NotALabError(
            f"{root!r} holds no lab ({STATE_FILE} is missing); create one first"
        ) from None
    try:
        return LabState.model_validate_json(raw)
    except ValueError as exc:
        raise errors.LabError(f"{path}: the lab's state file is damaged ({exc}); recreate the lab") from None


def save(tree: FakeTree, state: LabState) -> None:
    """Replace the state file atomically."""
    tree.put(STATE_FILE, File(state.model_dump_json(indent=1).encode(), 0o644))


@contextlib.contextmanager
def locked(root: str) -> Iterator[None]:
    """Hold the lab's exclusive lock, so concurrent CLI calls and the watcher serialize."""
    os.makedirs(posixpath.join(root, LAB_DIR), exist_ok=True)
    fd = os.open(posixpath.join(root, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
