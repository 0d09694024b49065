"""The lab's own record of what it wrote, kept in the root so every invocation agrees.

``plugvisor lab create`` in one process and ``lab fault`` or the ``sriov_numvfs``
watcher in others must all see the same devices, faults and VF counts. The
record lives in ``ROOT/.plugvisor-lab/state.json``, is replaced atomically, and
every change happens under an exclusive ``flock`` on ``ROOT/.plugvisor-lab/lock``.

The tree is always a pure function of this record (see :mod:`.render`), which is
why the record stores decisions (addresses, numbers, names) and never file contents.
"""

# Paths here are root-relative POSIX strings shared with the tree writer (see tree.py).
# ruff: noqa: PTH113

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import posixpath
import re
import stat
from collections.abc import Iterator
from enum import StrEnum
from typing import Annotated, Literal

import pydantic
from pydantic import BaseModel, ConfigDict

from plugvisor.emulators.lab import errors, kinds
from plugvisor.emulators.lab.pci import Bdf
from plugvisor.emulators.lab.profiles import Profile
from plugvisor.emulators.lab.spec import File
from plugvisor.emulators.lab.tree import LAB_DIR, FakeTree, ensure_dir

STATE_FILE = f"{LAB_DIR}/state.json"
LOCK_FILE = f"{LAB_DIR}/lock"
FORMAT_VERSION = 1


class DeviceKind(StrEnum):
    """What a built-in lab device is, which decides its faults and its tree.

    A device of a lab kind from another package (docs/lab.md, "Lab device kinds
    from other packages") has that kind's name, a plain string, instead.
    """

    GPU = "gpu"
    FPGA = "fpga"
    NIC_PF = "nic-pf"
    NIC_VF = "nic-vf"


def device_kind(value: object) -> DeviceKind | str:
    """A built-in kind as its :class:`DeviceKind` member (so ``is`` comparisons hold), any other as is."""
    if not isinstance(value, str):
        raise TypeError(f"expected a kind name, got {type(value).__name__}")
    try:
        return DeviceKind(value)
    except ValueError:
        return value


KindName = Annotated[DeviceKind | str, pydantic.PlainValidator(device_kind), pydantic.PlainSerializer(str)]
"""A device's kind in the state file: a :class:`DeviceKind`, or an outside kind's name."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=False)


class FunctionState(_Model):
    """One PCI function of a device."""

    bdf: str
    path: str
    role: Literal["gpu", "fpga", "mgmt", "user", "pf", "vf", "device"]
    """``device``: the one function of a device of an outside PCI kind."""
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
    iommu_group: int | None
    """None on a node without an IOMMU (profile ``iommuGroups: false``)."""


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


class GpuCounters(_Model):
    """What NVML counts on an NVIDIA GPU, kept here so the counters only go up across lab changes.

    Times are wall-clock nanoseconds (``time.time_ns()``), the clock the NVML stand-in reads:
    a fault's events are due at its injection time and every period after it.
    """

    ecc_volatile: tuple[int, int] = (0, 0)
    """Single-bit and double-bit ECC errors since the driver last enumerated the GPU (not counting
    an active ``ecc-*`` fault's, which the stand-in adds from its injection time)."""
    ecc_aggregate: tuple[int, int] = (0, 0)
    """The same over the GPU's life (the infoROM's count): a re-plug keeps it."""
    energy_mj: int = 0
    energy_at_ns: int = 0
    """``energy_mj`` is the energy counter at this time; the present draw adds to it since."""
    fault_since_ns: dict[str, int] = {}
    """When each active fault was injected."""
    lost_at_ns: int = 0
    """When the GPU fell off the bus or was unplugged; 0 while it answers."""


class DeviceState(_Model):
    """One lab device and everything decided about it.

    Kind-specific fields are ``None`` for other kinds; keeping one flat record
    keeps the state file readable and the JSON schema obvious.
    """

    name: str
    kind: KindName
    model: str
    numa_node: int
    switch: str | None
    functions: list[FunctionState]
    present: bool = True
    faults: list[str] = []
    aer: tuple[int, int, int] = (0, 0, 0)
    aer_capable: bool = True
    """False: its functions have no AER capability (no ``aer_dev_*`` files, no AER faults)."""
    group: int | None = None
    """Index of the profile group (in its kind's section) the device came from, for per-group options."""
    member: int | None = None
    """The device's place within that group (0 for its first device)."""
    # GPUs
    minor: int | None = None
    card: int | None = None
    uuid: str | None = None
    kfd_node: int | None = None
    gpu_id: int | None = None
    irq: int | None = None
    """The interrupt line a profile fixed for it (``devices[].irq``); None: the lab's default."""
    nvml: GpuCounters | None = None
    """NVIDIA GPUs: what NVML counts (ECC errors, energy, fault times)."""
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
    rdma_index: int | None = None
    """``N`` of the function's RDMA device (``mlx5_N``) and of its ``uverbsN`` node; None without RDMA."""
    # Devices of outside kinds (plugvisor.emulators.lab.extension)
    index: int | None = None
    """Its number among the devices of its kind, in bus order (``npu0`` is ``/dev/acme_npu0``)."""
    attributes: dict[str, str | int] = {}
    """What the kind decided about it when the lab was created (a serial number, a memory size)."""

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

    @property
    def nr_cpus(self) -> int:
        """CPUs of the whole node (the width of every CPU mask)."""
        return self.profile.cpus_per_numa_node * len(self.numa_nodes)

    def cpulist(self, numa_node: int) -> str:
        """Return the CPUs of a NUMA node; node -1 (no NUMA information) is every CPU of the node."""
        if numa_node < 0:
            return "0" if self.nr_cpus == 1 else f"0-{self.nr_cpus - 1}"
        return self.numa_nodes[numa_node].cpulist

    def vfs_of(self, pf: str) -> list[DeviceState]:
        """Return a PF's VFs in index order."""
        vfs = [d for d in self.devices.values() if d.parent == pf]
        return sorted(vfs, key=lambda d: d.vf_index or 0)


def exists(root: str) -> bool:
    """Whether ``root`` holds a lab."""
    return os.path.isfile(posixpath.join(root, STATE_FILE))


MAX_STATE_BYTES = 256 << 20
"""Far above the largest real state (``big``, 4,096 VFs, is a few MB); beyond it the file is not ours."""

_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


def _read_state(path: str) -> str:
    """Read the state file as text: a regular file, not a symlink, bounded, UTF-8."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        why = "it is a symlink" if exc.errno == errno.ELOOP else exc.strerror
        raise errors.StateError(f"{path}: cannot read the lab's state file ({why})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise errors.StateError(f"{path}: the lab's state file is not a regular file")
        if info.st_size > MAX_STATE_BYTES:
            raise errors.StateError(
                f"{path}: the lab's state file is {info.st_size} bytes; expected at most {MAX_STATE_BYTES}"
            )
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        raw = b"".join(chunks)
    finally:
        os.close(fd)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise errors.StateError(
            f"{path}: the lab's state file is not UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start}); "
            "recreate the lab with `plugvisor lab create --force`"
        ) from None


def _device_problems(st: LabState, name: str, dev: DeviceState) -> list[str]:
    where = f"devices.{name}"
    problems: list[str] = []
    if dev.name != name or not _NAME.match(name):
        problems.append(f"{where}.name: expected {name!r}, a short name of letters and digits")
    if not -1 <= dev.numa_node < len(st.numa_nodes):
        problems.append(f"{where}.numa_node: {dev.numa_node} is not a NUMA node of this lab")
    if not dev.functions:
        problems.append(f"{where}.functions: expected at least one PCI function")
    for fn in dev.functions:
        if not _BDF.match(fn.bdf) or posixpath.basename(fn.path) != fn.bdf:
            problems.append(f"{where}.functions: {fn.bdf!r} is not the PCI address its path ends in")
        for driver in (fn.driver, dev.vf_driver):
            if driver is not None and not _NAME.match(driver):
                problems.append(f"{where}: driver name {driver!r} is not a plain name")
    if dev.netdev is not None and not re.fullmatch(r"[A-Za-z0-9_.-]{1,15}", dev.netdev):
        problems.append(f"{where}.netdev: {dev.netdev!r} is not an interface name")
    if dev.parent is not None and dev.parent not in st.devices:
        problems.append(f"{where}.parent: no device {dev.parent!r}")
    try:
        kinds.get(dev.kind).identity(dev)
    except KeyError:
        problems.append(f"{where}.model: {dev.model!r} is not a {dev.kind} model the lab knows")
    except errors.LabError as exc:
        problems.append(f"{where}.kind: {exc}")
    return problems


def _problems(st: LabState) -> list[str]:
    """What pydantic cannot see: names and paths that would leave the root, dangling references."""
    problems: list[str] = []
    for i, node in enumerate(st.numa_nodes):
        if node.id != i:
            problems.append(f"numa_nodes[{i}].id: expected {i}, got {node.id}")
    paths = [(f"bridges[{b.bdf}].path", b.path) for b in st.bridges]
    for name, dev in st.devices.items():
        problems += _device_problems(st, name, dev)
        paths += [(f"devices.{name}.functions[{fn.bdf}].path", fn.path) for fn in dev.functions]
    for field, path in paths:
        parts = path.split("/")
        if parts[:2] != ["sys", "devices"] or any(p in ("", ".", "..") for p in parts):
            problems.append(f"{field}: {path!r} is not a path below sys/devices")
    return problems


def load(root: str) -> LabState:
    """Read the state of the lab at ``root``; a damaged file is a :class:`~.errors.StateError` naming it."""
    path = posixpath.join(root, STATE_FILE)
    try:
        raw = _read_state(path)
    except FileNotFoundError:
        raise errors.NotALabError(
            f"{root!r} holds no lab ({STATE_FILE} is missing); create one first"
        ) from None
    try:
        st = LabState.model_validate_json(raw)
    except pydantic.ValidationError as exc:
        shown = [
            f"{'.'.join(str(p) for p in err['loc']) or '(top)'}: {err['msg']}" for err in exc.errors()[:3]
        ]
        more = f" (and {exc.error_count() - 3} more)" if exc.error_count() > 3 else ""
        raise errors.StateError(
            f"{path}: the lab's state file is damaged: {'; '.join(shown)}{more}; "
            "recreate the lab with `plugvisor lab create --force`"
        ) from None
    except ValueError as exc:
        raise errors.StateError(
            f"{path}: the lab's state file is damaged ({exc}); recreate the lab"
        ) from None
    problems = _problems(st)
    if problems:
        raise errors.StateError(
            f"{path}: the lab's state file is damaged: {'; '.join(problems[:3])}; "
            "recreate the lab with `plugvisor lab create --force`"
        )
    return st


def save(tree: FakeTree, state: LabState) -> None:
    """Replace the state file atomically."""
    tree.put(STATE_FILE, File(state.model_dump_json(indent=1).encode(), 0o644))


@contextlib.contextmanager
def locked(root: str) -> Iterator[None]:
    """Hold the lab's exclusive lock, so concurrent CLI calls and the watcher serialize."""
    ensure_dir(root, LAB_DIR)
    try:
        fd = os.open(
            posixpath.join(root, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644
        )
    except OSError as exc:
        lock = posixpath.join(root, LOCK_FILE)
        if exc.errno in (errno.ELOOP, errno.EISDIR):
            raise errors.UnsafeRootError(
                f"{lock}: cannot open the lab's lock ({exc.strerror}); "
                "it must be a regular file inside the root, not a symlink"
            ) from None
        raise  # the environment (a read-only or full file system): the CLI names the file and the reason
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
