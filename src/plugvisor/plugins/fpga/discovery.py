"""Finding FPGA ports and cards in sysfs, and reading their identity and health.

What is read (all under the host root; see docs/plugins.md):

- ``sys/bus/pci/devices/<BDF>``: ``class`` (``0x1200xx``, processing accelerator),
  ``vendor``, ``device``, the ``driver`` link, ``numa_node``, ``config``, ``aer_dev_*``.
- Intel, upstream DFL driver: ``<BDF>/fpga_region/region<N>/dfl-port.<P>``
  (``afu_id``, ``errors/errors``) and ``.../dfl-fme.<F>/dfl-fme-region.*/fpga_region/region*/compat_id``
  (the interface ID); node ``dev/dfl-port.<P>``. The OPAE driver's layout
  (``<BDF>/fpga/intel-fpga-dev.*/intel-fpga-port.*``, ``intel-fpga-fme.*/pr/interface_id``,
  ``dev/intel-fpga-port.<P>``) is read the same way.
- Xilinx-style: a function with a ``user_pf`` marker (the user PF; its address is
  the device ID), ``rom.*/VBNV`` and ``rom.*/timestamp`` (shell), ``xmc.*/serial_num``,
  ``drm/renderD<N>`` -> ``dev/dri/renderD<N>``; the sibling function (same bus and
  slot) with ``mgmt_pf`` and its ``instance`` -> ``dev/xclmgmt<instance>``.

Identity is remembered per PCI address: a card that falls off the bus loses its
DFL subtree (or its ``rom.*`` directory after ``xbutil reset``), but its devices
keep their IDs and membership and go Unhealthy instead of vanishing.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal

from plugvisor.common.hostpaths import HostPaths
from plugvisor.plugins import sysfs
from plugvisor.plugins.fpga.options import Family, FpgaOptions

ACCELERATOR_CLASS: Final = 0x12
FPGA_SUBCLASS: Final = 0x1200
"""``class >> 8`` of processing accelerators (FPGAs report ``0x120000``)."""
ALL_F: Final = "f" * 32


@dataclass(frozen=True, slots=True)
class FpgaDevice:
    """One allocatable FPGA unit as found by a scan: a DFL port, or a Xilinx user/management PF pair."""

    id: str
    flavor: Literal["dfl", "xilinx"]
    function: sysfs.PciFunction
    sysfs_path: Path
    """The port's directory (DFL) or the user PF's (Xilinx): ``{sysfs}`` in commands."""
    nodes: tuple[Path, ...]
    afu_id: str | None = None
    interface_id: str | None = None
    shell: str | None = None
    timestamp: str | None = None
    serial: str | None = None
    problems: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class _Port:
    name: str
    path: Path
    interface_id: str | None
    node: str
    """The device node's name under dev/."""


@dataclass(slots=True)
class _Memory:
    """What was last read right for one PCI address."""

    ports: dict[str, tuple[Path, str]] = field(default_factory=dict)
    """Port name -> (directory, node name)."""
    afu: dict[str, str] = field(default_factory=dict)
    interface: dict[str, str] = field(default_factory=dict)
    shell: tuple[str, str] | None = None


def valid_id(value: str | sysfs.Unreadable) -> str | None:
    """A usable 128-bit ID (32 hex digits, not all ``f``), lower case; else ``None``."""
    if not isinstance(value, str):
        return None
    text = value.strip().lower().removeprefix("0x")
    if len(text) != 32 or text == ALL_F or any(c not in "0123456789abcdef" for c in text):
        return None
    return text


def _id_problem(what: str, value: str | sysfs.Unreadable) -> str | None:
    if isinstance(value, sysfs.Unreadable):
        return f"{what} unreadable ({value.problem})"
    if valid_id(value) is None:
        shown = value.strip().lower()
        if shown.removeprefix("0x") == ALL_F:
            return f"{what} is all f"
        return f"{what} is not a 128-bit ID ({shown[:40]!r})"
    return None


def _entries(path: Path, prefix: str) -> list[str]:
    names = sysfs.list_dir(path)
    return [] if isinstance(names, sysfs.Unreadable) else [n for n in names if n.startswith(prefix)]


class FpgaScanner:
    """Reads every FPGA device the options select; remembers identities across scans."""

    def __init__(self, options: FpgaOptions, paths: HostPaths) -> None:
        self.options = options
        self.paths = paths
        self._vendors = options.vendor_ids()
        self._devices = sysfs.hex_ids(options.match.devices)
        wanted = options.match.pci_addresses
        self._addresses = None if wanted is None else frozenset(wanted)
        self._aer = [k.value for k in options.aer_unhealthy]
        self._memory: dict[str, _Memory] = {}
        self._lock = threading.Lock()

    def _memo(self, bdf: str) -> _Memory:
        with self._lock:
            return self._memory.setdefault(bdf, _Memory())

    # -- candidates ----------------------------------------------------------------

    def candidates(self) -> tuple[list[sysfs.PciFunction], list[tuple[str, sysfs.Unreadable]]]:
        """The accelerator-class functions of the wanted vendors, and those that could not be read."""
        listed = sysfs.pci_addresses(self.paths.sysfs)
        if isinstance(listed, sysfs.Unreadable):
            return [], []
        found: list[sysfs.PciFunction] = []
        broken: list[tuple[str, sysfs.Unreadable]] = []
        for bdf in listed:
            if self._addresses is not None and bdf not in self._addresses:
                continue
            entry = sysfs.function_dir(self.paths.sysfs, bdf)
            if isinstance(entry, sysfs.Unreadable):
                broken.append((bdf, entry))
                continue
            klass = sysfs.read_hex(entry / "class")
            if isinstance(klass, sysfs.Unreadable):
                if klass.problem is not sysfs.Problem.MISSING:
                    broken.append((bdf, klass))
                continue
            if klass >> 8 != FPGA_SUBCLASS:
                continue
            function = sysfs.read_function(self.paths.sysfs, bdf)
            if isinstance(function, sysfs.Unreadable):
                broken.append((bdf, function))
                continue
            if self._vendors is not None and function.vendor not in self._vendors:
                continue
            if self._devices is not None and function.device not in self._devices:
                continue
            found.append(function)
        return found, broken

    def _pci_problems(self, function: sysfs.PciFunction) -> list[str]:
        problems: list[str] = []
        if function.driver_problem is not None:
            problems.append(f"{function.bdf}: {function.driver_problem}")
        elif function.driver is None:
            problems.append(f"{function.bdf}: no driver bound")
        if sysfs.config_all_ones(function.path):
            problems.append(f"{function.bdf}: config space reads all ones (fallen off the bus)")
        problems += [f"{function.bdf}: {p}" for p in sysfs.aer_problems(function.path, self._aer)]
        link = sysfs.link_problem(function.path)
        if link:
            problems.append(f"{function.bdf}: {link}")
        return problems

    def _node_problems(self, nodes: list[Path]) -> list[str]:
        found = ((n, sysfs.node_problem(n)) for n in nodes)
        return [f"device node {self.paths.for_kubelet(n)} {problem}" for n, problem in found if problem]

    # -- Intel DFL / OPAE ----------------------------------------------------------

    def _ports(self, function: sysfs.PciFunction) -> list[_Port]:
        ports: list[_Port] = []
        base = function.path / "fpga_region"
        for region in _entries(base, "region"):
            entries = _entries(base / region, "dfl-")
            interface = self._dfl_interface(base / region, entries)
            for name in entries:
                if name.startswith("dfl-port."):
                    ports.append(_Port(name, base / region / name, interface, name))
        base = function.path / "fpga"
        for dev in _entries(base, "intel-fpga-dev."):
            entries = _entries(base / dev, "intel-fpga-")
            fmes = [e for e in entries if e.startswith("intel-fpga-fme.")]
            interface = None
            if fmes:
                text = sysfs.read_text(base / dev / fmes[0] / "pr" / "interface_id")
                interface = text if isinstance(text, str) else None
            for name in entries:
                if name.startswith("intel-fpga-port."):
                    ports.append(_Port(name, base / dev / name, interface, name))
        return ports

    def _dfl_interface(self, region: Path, entries: list[str]) -> str | None:
        for fme in (e for e in entries if e.startswith("dfl-fme.")):
            for pr in _entries(region / fme, "dfl-fme-region."):
                inner = region / fme / pr / "fpga_region"
                for name in _entries(inner, "region"):
                    text = sysfs.read_text(inner / name / "compat_id")
                    if isinstance(text, str):
                        return text
        return None

    def dfl_devices(self, function: sysfs.PciFunction) -> list[FpgaDevice]:
        """The ports of one DFL (or OPAE) card, read now or remembered, with their problems."""
        memo = self._memo(function.bdf)
        found = self._ports(function)
        if not found and not memo.ports:
            return []
        pci = self._pci_problems(function)
        devices: list[FpgaDevice] = []
        present = {p.name for p in found}
        for port in found:
            with self._lock:
                memo.ports[port.name] = (port.path, port.node)
            devices.append(self._dfl_port(function, memo, port, pci))
        with self._lock:
            gone = sorted((n, v) for n, v in memo.ports.items() if n not in present)
        for name, (path, node) in gone:
            problems = [*pci, f"port {name} missing from sysfs"]
            devices.append(self._dfl_device(function, memo, name, path=path, node=node, problems=problems))
        return devices

    def _dfl_port(
        self, function: sysfs.PciFunction, memo: _Memory, port: _Port, pci: list[str]
    ) -> FpgaDevice:
        problems = list(pci)
        afu_text = sysfs.read_text(port.path / "afu_id")
        afu = valid_id(afu_text)
        interface = valid_id(port.interface_id) if port.interface_id is not None else None
        if self.options.family is Family.AF:
            problem = _id_problem("afu_id", afu_text)
            if problem:
                problems.append(problem)
        if port.interface_id is None:
            problems.append("interface ID (compat_id) not found")
        else:
            problem = _id_problem("interface ID", port.interface_id)
            if problem:
                problems.append(problem)
        errors = sysfs.read_hex(port.path / "errors" / "errors")
        if isinstance(errors, int) and errors != 0:
            problems.append(f"port errors 0x{errors:x}")
        with self._lock:
            if afu is not None:
                memo.afu[port.name] = afu
            if interface is not None:
                memo.interface[port.name] = interface
        return self._dfl_device(
            function,
            memo,
            port.name,
            path=port.path,
            node=port.node,
            afu=afu,
            interface=interface,
            problems=problems,
        )

    def _dfl_device(
        self,
        function: sysfs.PciFunction,
        memo: _Memory,
        name: str,
        *,
        path: Path,
        node: str,
        afu: str | None = None,
        interface: str | None = None,
        problems: list[str],
    ) -> FpgaDevice:
        with self._lock:
            afu = afu or memo.afu.get(name)
            interface = interface or memo.interface.get(name)
        nodes = [self.paths.devfs / node]
        problems += self._node_problems(nodes)
        return FpgaDevice(
            id=name,
            flavor="dfl",
            function=function,
            sysfs_path=path,
            nodes=tuple(nodes),
            afu_id=afu,
            interface_id=interface,
            problems=tuple(problems),
        )

    def wanted_dfl(self, device: FpgaDevice) -> bool:
        """Whether a port belongs to this resource (by its current or last valid IDs)."""
        match = self.options.match
        if match.afu_ids is not None and device.afu_id not in match.afu_ids:
            return False
        return match.interface_ids is None or device.interface_id in match.interface_ids

    # -- Xilinx --------------------------------------------------------------------

    def xilinx_device(self, function: sysfs.PciFunction) -> FpgaDevice | None:
        """The card whose user PF this is (``None`` when it is not a user PF)."""
        if not sysfs.exists(function.path / "user_pf"):
            return None
        memo = self._memo(function.bdf)
        problems = self._pci_problems(function)
        shell = self._shell(function, memo, problems)
        serial = None
        for xmc in _entries(function.path, "xmc."):
            text = sysfs.read_text(function.path / xmc / "serial_num")
            serial = text if isinstance(text, str) and text else None
        nodes: list[Path] = []
        for name in _entries(function.path / "drm", "renderD"):
            nodes.append(self.paths.devfs / "dri" / name)
        if not nodes:
            problems.append("no render node (drm/renderD*)")
        mgmt = self._mgmt_function(function)
        if mgmt is None:
            problems.append("no management PF (mgmt_pf) beside the user PF")
        elif self.options.mgmt_node:
            instance = sysfs.read_int(mgmt.path / "instance")
            if isinstance(instance, sysfs.Unreadable):
                problems.append(f"{mgmt.bdf}: instance {instance.problem}")
            else:
                nodes.append(self.paths.devfs / f"xclmgmt{instance}")
        if mgmt is not None:
            problems += self._pci_problems(mgmt)
        problems += self._node_problems(nodes)
        return FpgaDevice(
            id=function.bdf,
            flavor="xilinx",
            function=function,
            sysfs_path=function.path,
            nodes=tuple(nodes),
            shell=None if shell is None else shell[0],
            timestamp=None if shell is None else shell[1],
            serial=serial,
            problems=tuple(problems),
        )

    def _shell(
        self, function: sysfs.PciFunction, memo: _Memory, problems: list[str]
    ) -> tuple[str, str] | None:
        """``(VBNV, timestamp)`` read now, else as last read; adds a problem when it cannot be read now."""
        shell: tuple[str, str] | None = None
        roms = _entries(function.path, "rom.")
        if roms:
            vbnv = sysfs.read_text(function.path / roms[0] / "VBNV")
            stamp = sysfs.read_text(function.path / roms[0] / "timestamp")
            if isinstance(vbnv, str) and vbnv and isinstance(stamp, str) and stamp:
                shell = (vbnv, stamp)
            else:
                problems.append(f"shell unreadable in {roms[0]}")
        else:
            problems.append("no rom.* directory (shell reset or not flashed)")
        with self._lock:
            if shell is not None:
                memo.shell = shell
            return shell or memo.shell

    def _mgmt_function(self, user: sysfs.PciFunction) -> sysfs.PciFunction | None:
        slot = user.bdf.rsplit(".", 1)[0]
        for fn in range(8):
            bdf = f"{slot}.{fn}"
            if bdf == user.bdf or not sysfs.exists(self.paths.sysfs / sysfs.PCI_DEVICES / bdf / "mgmt_pf"):
                continue
            function = sysfs.read_function(self.paths.sysfs, bdf)
            if isinstance(function, sysfs.PciFunction):
                return function
        return None

    def wanted_xilinx(self, device: FpgaDevice) -> bool:
        """Whether a card belongs to this resource (by its current or last known shell)."""
        shells = self.options.match.shells
        return shells is None or device.shell in shells
