"""Safe reads of sysfs, devfs and procfs: every failure is a value, never an exception.

Real trees go wrong in many small ways: an attribute vanishes between listing
and reading (hot-unplug), reads ``EIO`` or ``EACCES``, holds garbage, a link
dangles or loops. A scanner that lets one of these escape loses *every* device
of the resource for that scan (Intel's FPGA plugin crash-loops on "AFU without
FME", Xilinx's scan goroutine dies for good). So each reader here returns either
the parsed value or an :class:`Unreadable` naming the path and the cause, and the
kinds decide per device: skip it, or list it Unhealthy, with one log line.

:class:`ProblemLog` keeps that "one log line per device and cause" promise across
periodic rescans: it logs when a device's problem appears or changes, and once
when it clears, rather than on every scan.

Also here, because all three kinds need them: the PCI function record
(:class:`PciFunction`) with the identity, driver, NUMA node and PCI-tree path the
kinds select and score on, and the AER / link-state health checks.
"""

# os.* rather than pathlib on purpose: scans of thousands of functions stay cheap (no Path objects per read).
# ruff: noqa: PTH112, PTH114, PTH115, PTH116, PTH208

from __future__ import annotations

import errno
import os
import re
import stat
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Final

import pydantic
import structlog

from plugvisor.common.hostpaths import resolve_in_root

PCI_DEVICES: Final = "bus/pci/devices"
"""Under sysfs: one link per PCI function, named by its address, into ``devices/pci...``."""

_BDF: Final = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_HEX16: Final = re.compile(r"^(0x)?[0-9a-fA-F]{1,4}$")
_USER_BDF: Final = re.compile(r"^([0-9a-fA-F]{4}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")
_MAX_ATTRIBUTE_BYTES: Final = 1 << 16


def _hex_id(value: str) -> str:
    if not _HEX16.match(value):
        raise ValueError(f"{value!r} is not a 16-bit PCI ID such as 0x10de")
    return value


def _user_bdf(value: str) -> str:
    if not _USER_BDF.match(value):
        raise ValueError(f"{value!r} is not a PCI address such as 0000:03:00.0")
    value = value.lower()
    return value if value.count(":") == 2 else f"0000:{value}"


HexId = Annotated[str, pydantic.AfterValidator(_hex_id)]
"""An option naming a PCI vendor or device ID (``0x10de`` or ``10de``)."""

PciAddress = Annotated[str, pydantic.AfterValidator(_user_bdf)]
"""An option naming a PCI address; the domain may be left out (``03:00.0``)."""


def hex_ids(values: Iterable[str] | None) -> frozenset[int] | None:
    """Validated :data:`HexId` options as integers (``None`` stays ``None``: no filter)."""
    return None if values is None else frozenset(int(v, 16) for v in values)


class AerKind(StrEnum):
    """AER counters (``aer_dev_<kind>``) that can make a device Unhealthy."""

    FATAL = "fatal"
    NONFATAL = "nonfatal"
    CORRECTABLE = "correctable"


class Problem(StrEnum):
    """Why a sysfs entry could not be used."""

    MISSING = "missing"
    UNREADABLE = "unreadable"
    GARBAGE = "garbage"
    LOOP = "symlink loop"
    DANGLING = "dangling link"
    OUTSIDE = "link leaves the host root"


@dataclass(frozen=True, slots=True)
class Unreadable:
    """A failed read: which path, why, and the detail (errno text or the garbage seen)."""

    path: Path
    problem: Problem
    detail: str = ""

    def __str__(self) -> str:
        detail = f" ({self.detail})" if self.detail else ""
        return f"{self.path}: {self.problem}{detail}"


def _from_oserror(path: Path, exc: OSError) -> Unreadable:
    code = exc.errno
    if code in (errno.ENOENT, errno.ENOTDIR):
        return Unreadable(path, Problem.MISSING)
    if code == errno.ELOOP:
        return Unreadable(path, Problem.LOOP)
    return Unreadable(path, Problem.UNREADABLE, os.strerror(code) if code else str(exc))


_FILE_TYPES: Final = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


def read_bytes(path: Path, *, limit: int = _MAX_ATTRIBUTE_BYTES) -> bytes | Unreadable:  # noqa: PLR0911 - one return per way a read fails
    """Read at most ``limit`` bytes of an attribute file; anything that is not one is garbage.

    sysfs and procfs attributes are small regular files, never links. So the
    last component is opened with ``O_NOFOLLOW`` (a link there could lead out of
    the host root), ``O_NONBLOCK`` (opening a FIFO must not block the scan), and
    only a regular file of at most 64 KiB is read: a directory, FIFO, device or
    a multi-gigabyte file put in an attribute's place is reported, not read.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno == errno.ELOOP and os.path.islink(path):
            return Unreadable(path, Problem.GARBAGE, "a symlink where an attribute file belongs")
        if exc.errno == errno.ENXIO:  # a FIFO or socket with no peer
            return Unreadable(path, Problem.GARBAGE, "not a regular file")
        return _from_oserror(path, exc)
    try:
        info = os.fstat(fd)
        kind = stat.S_IFMT(info.st_mode)
        if kind != stat.S_IFREG:
            return Unreadable(path, Problem.GARBAGE, f"{_FILE_TYPES.get(kind, 'not a regular file')}")
        if info.st_size > _MAX_ATTRIBUTE_BYTES:
            return Unreadable(path, Problem.GARBAGE, f"{info.st_size} bytes, far larger than an attribute")
        return os.read(fd, limit)
    except OSError as exc:
        return _from_oserror(path, exc)
    finally:
        os.close(fd)


def read_text(path: Path) -> str | Unreadable:
    """Read an attribute as stripped text; undecodable bytes are garbage."""
    data = read_bytes(path)
    if isinstance(data, Unreadable):
        return data
    try:
        return data.decode("utf-8").strip()
    except UnicodeDecodeError:
        return Unreadable(path, Problem.GARBAGE, repr(data[:32]))


def read_int(path: Path, *, base: int = 10) -> int | Unreadable:
    """Read an integer attribute (``base=16`` accepts an optional ``0x``)."""
    text = read_text(path)
    if isinstance(text, Unreadable):
        return text
    try:
        return int(text, base)
    except ValueError:
        return Unreadable(path, Problem.GARBAGE, repr(text[:32]))


def read_hex(path: Path) -> int | Unreadable:
    """Read a ``0x%04x``-style attribute (``vendor``, ``device``, ``class``)."""
    return read_int(path, base=16)


def link_name(path: Path) -> str | Unreadable:
    """The last component of a symlink's target (``driver`` -> ``nvidia``), without resolving it."""
    try:
        target = os.readlink(path)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return Unreadable(path, Problem.GARBAGE, "not a symlink")
        return _from_oserror(path, exc)
    name = target.rstrip("/").rsplit("/", 1)[-1]
    if not name or name in (".", ".."):
        return Unreadable(path, Problem.GARBAGE, repr(target))
    return name


def resolve(path: Path, root: Path) -> Path | Unreadable:
    """Resolve every link of ``path``; the result must exist and stay under ``root``.

    The lab's links (and a real sysfs seen through a host-root prefix) are
    relative, so resolving them lands under the same root; a target outside it
    would read the wrong machine and is refused.
    """
    try:
        real = Path(os.path.realpath(path, strict=True))
    except OSError as exc:
        if exc.errno == errno.ENOENT and os.path.lexists(path):
            return Unreadable(path, Problem.DANGLING)
        return _from_oserror(path, exc)
    except RuntimeError:  # pragma: no cover - older Pythons report loops this way
        return Unreadable(path, Problem.LOOP)
    real_root = Path(os.path.realpath(root))
    if real != real_root and real_root not in real.parents:
        return Unreadable(path, Problem.OUTSIDE, str(real))
    return real


def list_dir(path: Path) -> list[str] | Unreadable:
    """Sorted entry names of a directory."""
    try:
        return sorted(os.listdir(path))
    except OSError as exc:
        return _from_oserror(path, exc)


def exists(path: Path) -> bool:
    """Whether ``path`` exists (following links); any error counts as absent."""
    try:
        os.stat(path)
    except (OSError, ValueError):
        return False
    return True


def node_problem(path: Path) -> str | None:
    """Why a device node cannot be handed out (missing, a loop, a directory), or ``None``.

    A regular file passes: the emulated lab writes those unless it may ``mknod``.
    """
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        return (
            "missing" if exc.errno in (errno.ENOENT, errno.ENOTDIR) else str(_from_oserror(path, exc).problem)
        )
    except ValueError:
        return "missing"
    kind = stat.S_IFMT(mode)
    if kind in (stat.S_IFDIR, stat.S_IFIFO, stat.S_IFSOCK):
        return f"is {_FILE_TYPES[kind]}, not a device node"
    return None


def is_bdf(name: str) -> bool:
    """Whether ``name`` is a PCI address in sysfs spelling (``0000:03:00.0``)."""
    return _BDF.match(name) is not None


@dataclass(frozen=True, slots=True)
class PciFunction:
    """One PCI function as the kinds select, score and health-check it.

    ``chain`` is the function's place in the PCI tree, from the host bridge down
    to the function itself (``("pci0000:00", "0000:00:01.0", ..., "0000:03:00.0")``),
    read from where its ``bus/pci/devices`` link points; two functions are as
    close as the length of their common prefix.
    """

    bdf: str
    path: Path
    vendor: int
    device: int
    class_code: int
    driver: str | None
    numa_node: int | None
    chain: tuple[str, ...]
    driver_problem: str | None = None
    """Why the ``driver`` link is unusable although present (dangling, a loop); ``driver`` is then None."""

    @property
    def base_class(self) -> int:
        """The class code's top byte (0x02 network, 0x03 display, 0x12 accelerator)."""
        return self.class_code >> 16


def pci_addresses(sysfs: Path) -> list[str] | Unreadable:
    """Every PCI address listed in ``bus/pci/devices`` (names that are not addresses are ignored)."""
    names = list_dir(sysfs / PCI_DEVICES)
    if isinstance(names, Unreadable):
        return names
    return [name for name in names if is_bdf(name)]


def in_sysfs(sysfs: Path, path: Path) -> Path | Unreadable:
    """``path`` (under ``sysfs``) with every link resolved, never leaving ``sysfs``.

    The kernel's sysfs links are relative and stay in sysfs; one that does not
    (an absolute link, too many ``..``) is resolved as if sysfs were the root, so
    it can only miss, never read another tree.
    """
    try:
        return resolve_in_root(sysfs, path.relative_to(sysfs))
    except OSError as exc:
        return _from_oserror(path, exc)


def pci_chain(sysfs: Path, bdf: str) -> tuple[tuple[str, ...], Path] | Unreadable:  # noqa: PLR0911
    """Where a function sits in the PCI tree, from its ``bus/pci/devices`` link (one readlink, no walk).

    The returned directory is link-free and inside ``sysfs`` (:func:`in_sysfs`),
    so the attributes read under it are the function's own.
    """
    entry = sysfs / PCI_DEVICES / bdf
    try:
        target = os.readlink(entry)
    except OSError as exc:
        if exc.errno == errno.EINVAL:  # a directory, not a link: use it as it is, no tree position
            return (bdf,), entry
        return _from_oserror(entry, exc)
    local = Path(os.path.normpath(entry.parent / target))
    try:
        rel = local.relative_to(sysfs / "devices")
    except ValueError:
        return Unreadable(entry, Problem.OUTSIDE, target)
    parts = rel.parts
    if not parts or parts[-1] != bdf:
        return Unreadable(entry, Problem.GARBAGE, f"points to {target}")
    real = in_sysfs(sysfs, local)
    if isinstance(real, Unreadable):
        return Unreadable(entry, real.problem, real.detail)
    if not os.path.isdir(real):
        return Unreadable(entry, Problem.DANGLING, f"points to {target}, which does not exist")
    return parts, real


def function_dir(sysfs: Path, bdf: str) -> Path | Unreadable:
    """The directory of a listed PCI function, resolved inside ``sysfs`` (dangling links say so)."""
    located = pci_chain(sysfs, bdf)
    return located if isinstance(located, Unreadable) else located[1]


def read_identity(path: Path) -> tuple[int, int, int] | Unreadable:
    """``(vendor, device, class)`` of a function directory; the first failure is returned."""
    values: list[int] = []
    for name in ("vendor", "device", "class"):
        value = read_hex(path / name)
        if isinstance(value, Unreadable):
            return value
        values.append(value)
    return values[0], values[1], values[2]


def read_numa(path: Path) -> int | None:
    """The function's NUMA node; ``None`` for ``-1`` (no affinity), a missing or a garbage file."""
    value = read_int(path / "numa_node")
    if isinstance(value, Unreadable) or value < 0:
        return None
    return value


def read_function(sysfs: Path, bdf: str) -> PciFunction | Unreadable:
    """Read one PCI function, or say why it cannot be used."""
    located = pci_chain(sysfs, bdf)
    if isinstance(located, Unreadable):
        return located
    chain, path = located
    identity = read_identity(path)
    if isinstance(identity, Unreadable):
        return identity
    linked = link_name(path / "driver")
    driver = None if isinstance(linked, Unreadable) else linked
    driver_problem: str | None = None
    if driver is not None:
        try:
            os.stat(path / "driver")
        except OSError as exc:
            broken = _from_oserror(path / "driver", exc)
            problem = Problem.DANGLING if broken.problem is Problem.MISSING else broken.problem
            driver_problem = f"driver link ({driver}): {problem}"
            driver = None
    return PciFunction(
        bdf=bdf,
        path=path,
        vendor=identity[0],
        device=identity[1],
        class_code=identity[2],
        driver=driver,
        numa_node=read_numa(path),
        chain=chain,
        driver_problem=driver_problem,
    )


def aer_total(path: Path, kind: str) -> int | Unreadable:
    """The ``TOTAL_ERR_*`` line of ``aer_dev_<kind>`` (``fatal``, ``nonfatal``, ``correctable``)."""
    text = read_text(path / f"aer_dev_{kind}")
    if isinstance(text, Unreadable):
        return text
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith("TOTAL_ERR_"):
            try:
                return int(value.strip())
            except ValueError:
                break
    return Unreadable(path / f"aer_dev_{kind}", Problem.GARBAGE, "no TOTAL_ERR_ line")


def aer_problems(path: Path, kinds: Iterable[str]) -> list[str]:
    """Health problems from AER counters: one entry per configured kind above zero or unreadable.

    A missing file means the kernel has no AER for the device (common on
    consumer boards): that is not a fault. A counter file that is there but
    cannot be read or parsed (garbage, a directory, a FIFO, a huge file) is: the
    device's health is then unknown, and unknown is unhealthy.
    """
    problems = []
    for kind in kinds:
        total = aer_total(path, kind)
        if isinstance(total, Unreadable):
            if total.problem is not Problem.MISSING:
                problems.append(f"AER {kind} counters unreadable: {total}")
        elif total > 0:
            problems.append(f"{total} AER {kind} error(s)")
    return problems


def link_problem(path: Path) -> str | None:
    """A PCIe link that reads as down (width 0 or speed ``Unknown``) or cannot be read, else ``None``.

    Missing link attributes are normal (integrated devices have none).
    """
    width = read_int(path / "current_link_width")
    if isinstance(width, int) and width == 0:
        return "PCIe link down (width 0)"
    if isinstance(width, Unreadable) and width.problem is not Problem.MISSING:
        return f"PCIe link width unreadable: {width}"
    speed = read_text(path / "current_link_speed")
    if isinstance(speed, str) and speed.lower().startswith("unknown"):
        return "PCIe link down (speed unknown)"
    if isinstance(speed, Unreadable) and speed.problem is not Problem.MISSING:
        return f"PCIe link speed unreadable: {speed}"
    return None


OPERSTATES: Final = frozenset({"unknown", "notpresent", "down", "lowerlayerdown", "testing", "dormant", "up"})
"""Every value the kernel writes to ``/sys/class/net/<if>/operstate`` (RFC 2863 names)."""


def netdev_link_problem(netdev: Path, label: str) -> str | None:
    """Why a network interface cannot carry traffic (``operstate`` down, ``carrier`` 0, unreadable).

    ``carrier`` reads ``EINVAL`` while an interface is administratively down,
    so only a clear ``0`` counts; ``operstate`` must be one of the kernel's values.
    """
    state = read_text(netdev / "operstate")
    if isinstance(state, Unreadable):
        if state.problem is not Problem.MISSING:
            return f"{label} operstate unreadable: {state}"
    elif state == "down":
        return f"{label} link down"
    elif state not in OPERSTATES:
        return f"{label} operstate unreadable: {netdev / 'operstate'}: garbage ({state[:32]!r})"
    carrier = read_int(netdev / "carrier")
    if isinstance(carrier, int) and carrier == 0:
        return f"{label} link down"
    return None


def config_all_ones(path: Path) -> bool:
    """Whether config space reads all ``0xff``: what a function that fell off the bus returns."""
    data = read_bytes(path / "config", limit=4)
    return isinstance(data, bytes) and len(data) == 4 and data == b"\xff\xff\xff\xff"


class ProblemLog:
    """Logs each device's problem once when it appears or changes, and once when it clears.

    Scans repeat every few seconds on real nodes; logging every problem on every
    scan would drown the one line an operator needs.
    """

    def __init__(self, logger: structlog.typing.FilteringBoundLogger) -> None:
        self._log = logger
        self._seen: dict[str, str] = {}
        self._lock = threading.Lock()

    def report(self, key: str, problem: str | None, *, skipped: bool = False) -> None:
        """Record ``key``'s current problem (``None`` when it has none)."""
        with self._lock:
            before = self._seen.get(key)
            if problem == before:
                return
            if problem is None:
                del self._seen[key]
                self._log.info("device_recovered", device=key)
                return
            self._seen[key] = problem
        event = "device_skipped" if skipped else "device_unhealthy"
        self._log.warning(event, device=key, cause=problem)

    def forget_absent(self, present: Sequence[str]) -> None:
        """Drop devices that are gone, so a re-plugged device's problems are logged afresh."""
        keep = set(present)
        with self._lock:
            for key in [k for k in self._seen if k not in keep]:
                del self._seen[key]
