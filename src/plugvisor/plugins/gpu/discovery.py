"""Finding GPUs in PCI sysfs and reading their device nodes, identity and health.

What is read (all under the host root; see docs/plugins.md):

- ``sys/bus/pci/devices/<BDF>``: ``class`` (base class 0x03; 0x12 for AMD), ``vendor``, ``device``,
  the ``driver`` link, ``numa_node``, and where the link points (the PCI tree
  position used for topology).
- NVIDIA (vendor 0x10de): ``proc/driver/nvidia/gpus/<BDF>/information`` for
  ``GPU UUID`` and ``Device Minor`` (what NVML reports, without needing NVML),
  ``dev/nvidia<minor>``.
- Others (AMD, Intel): ``<BDF>/drm/card<N>`` and ``renderD<M>`` ->
  ``dev/dri/card<N>``, ``dev/dri/renderD<M>``.
- Health: ``driver`` link present, ``config`` not all ``0xff`` (fallen off the
  bus), ``aer_dev_*`` totals, ``current_link_width``/``current_link_speed``, and
  the device nodes present. Recomputed on every scan, so a GPU that recovers is
  Healthy again (NVIDIA's plugin marks it Unhealthy until restarted).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from plugvisor.common.hostpaths import HostPaths
from plugvisor.plugins import sysfs
from plugvisor.plugins.gpu.options import ACCELERATOR_CLASS, AMD, DISPLAY_CLASS, NVIDIA, GpuOptions

NVIDIA_CONTROL_NODES: Final = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
"""Shared NVIDIA nodes handed out with any GPU, when they exist (as NVIDIA's plugin does)."""

_CANDIDATE_CLASSES: Final = frozenset({DISPLAY_CLASS, ACCELERATOR_CLASS})

AMD_CONTROL_NODES: Final = ("kfd",)
"""ROCm's compute node, handed out with every AMD GPU."""


@dataclass(frozen=True, slots=True)
class Gpu:
    """One physical GPU as found by a scan."""

    function: sysfs.PciFunction
    uuid: str | None
    index: int | None
    nodes: tuple[Path, ...]
    problems: tuple[str, ...]

    @property
    def bdf(self) -> str:
        """The GPU's PCI address."""
        return self.function.bdf


def parse_information(text: str) -> dict[str, str]:
    """Parse NVIDIA's ``information`` file (``Key: <tabs/spaces> value`` lines)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    return fields


class GpuScanner:
    """Reads every GPU the options match; remembers identities across scans.

    A GPU that falls off the bus loses its procfs entry (and with it its UUID),
    but must keep its device ID so that the kubelet sees it go Unhealthy rather
    than vanish and reappear under another name: the UUID and minor last read
    for each PCI address are kept for that.
    """

    def __init__(self, options: GpuOptions, paths: HostPaths) -> None:
        self.options = options
        self.paths = paths
        self._vendors = options.match.vendor_ids()
        self._devices = options.match.device_ids()
        self._drivers = None if options.match.drivers is None else frozenset(options.match.drivers)
        wanted = options.match.pci_addresses
        self._addresses = None if wanted is None else frozenset(wanted)
        self._known: dict[str, tuple[str | None, int | None]] = {}
        self._lock = threading.Lock()

    def matching_addresses(self) -> tuple[list[str], list[tuple[str, sysfs.Unreadable]]]:
        """Addresses of display-class functions of the wanted vendors, and those that could not be read."""
        sys_root = self.paths.sysfs
        listed = sysfs.pci_addresses(sys_root)
        if isinstance(listed, sysfs.Unreadable):
            return [], []
        found: list[str] = []
        broken: list[tuple[str, sysfs.Unreadable]] = []
        for bdf in listed:
            if self._addresses is not None and bdf not in self._addresses:
                continue
            entry = sysfs.function_dir(sys_root, bdf)
            if isinstance(entry, sysfs.Unreadable):
                broken.append((bdf, entry))  # a dangling or escaping bus link: say so, once
                continue
            klass = sysfs.read_hex(entry / "class")
            if isinstance(klass, sysfs.Unreadable):
                if klass.problem is not sysfs.Problem.MISSING or self._addresses is not None:
                    broken.append((bdf, klass))
                continue
            if klass >> 16 not in _CANDIDATE_CLASSES and self.options.match.classes is None:
                continue
            vendor = sysfs.read_hex(entry / "vendor")
            if isinstance(vendor, sysfs.Unreadable):
                broken.append((bdf, vendor))
                continue
            if vendor in self._vendors and self.options.match.accepts_class(klass >> 16, vendor):
                found.append(bdf)
        return found, broken

    def read(self, bdf: str) -> Gpu | sysfs.Unreadable:
        """Read one GPU (identity, nodes, health) or say why it cannot be listed."""
        function = sysfs.read_function(self.paths.sysfs, bdf)
        if isinstance(function, sysfs.Unreadable):
            return function
        if self._devices is not None and function.device not in self._devices:
            return sysfs.Unreadable(function.path / "device", sysfs.Problem.GARBAGE, "not a wanted device ID")
        problems: list[str] = []
        if function.driver_problem is not None:
            problems.append(function.driver_problem)
        elif function.driver is None:
            problems.append("no driver bound")
        elif self._drivers is not None and function.driver not in self._drivers:
            return sysfs.Unreadable(function.path / "driver", sysfs.Problem.GARBAGE, "not a wanted driver")
        if sysfs.config_all_ones(function.path):
            problems.append("config space reads all ones (fallen off the bus)")
        problems += sysfs.aer_problems(function.path, [k.value for k in self.options.aer_unhealthy])
        link = sysfs.link_problem(function.path)
        if link:
            problems.append(link)
        if function.vendor == NVIDIA:
            uuid, index, nodes = self._nvidia(function)
        else:
            uuid, index, nodes = self._drm(function)
        if not nodes:
            problems.append("no device node")
        for node in nodes:
            node_problem = sysfs.node_problem(node)
            if node_problem is not None:
                problems.append(f"device node {self.paths.for_kubelet(node)} {node_problem}")
        return Gpu(function, uuid, index, tuple(nodes), tuple(problems))

    def _remember(self, bdf: str, uuid: str | None, index: int | None) -> tuple[str | None, int | None]:
        with self._lock:
            old_uuid, old_index = self._known.get(bdf, (None, None))
            uuid = uuid or old_uuid
            index = index if index is not None else old_index
            self._known[bdf] = (uuid, index)
        return uuid, index

    def _nvidia(self, function: sysfs.PciFunction) -> tuple[str | None, int | None, list[Path]]:
        info = sysfs.read_text(self.paths.procfs / "driver/nvidia/gpus" / function.bdf / "information")
        uuid: str | None = None
        minor: int | None = None
        if isinstance(info, str):
            fields = parse_information(info)
            uuid = fields.get("GPU UUID") or None
            try:
                minor = int(fields.get("Device Minor", ""))
            except ValueError:
                minor = None
        uuid, minor = self._remember(function.bdf, uuid, minor)
        nodes = [] if minor is None else [self.paths.devfs / f"nvidia{minor}"]
        return uuid, minor, nodes

    def _drm(self, function: sysfs.PciFunction) -> tuple[str | None, int | None, list[Path]]:
        names = sysfs.list_dir(function.path / "drm")
        card: int | None = None
        nodes: list[Path] = []
        if isinstance(names, list):
            for name in names:
                if name.startswith("card") and name[4:].isdigit():
                    card = int(name[4:])
                    nodes.append(self.paths.devfs / "dri" / name)
                elif name.startswith("renderD") and name[7:].isdigit():
                    nodes.append(self.paths.devfs / "dri" / name)
        _, card = self._remember(function.bdf, None, card)
        if not nodes and card is not None:
            nodes.append(self.paths.devfs / "dri" / f"card{card}")
        return None, card, nodes

    def control_nodes(self, vendors: Sequence[int]) -> list[Path]:
        """The shared nodes that exist for the vendors present (NVIDIA ctl/uvm/modeset, AMD kfd)."""
        names: list[str] = []
        if NVIDIA in vendors:
            names += NVIDIA_CONTROL_NODES
        if AMD in vendors:
            names += AMD_CONTROL_NODES
        return [self.paths.devfs / n for n in names if sysfs.exists(self.paths.devfs / n)]
