"""The ``gpu`` device source and its hooks: IDs, replicas, Allocate contents, CDI, preferred sets."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

import pydantic
import structlog

from plugvisor.common.hostpaths import HostPaths
from plugvisor.deviceplugin.devices import Device, DeviceSet, DeviceSpec, Health
from plugvisor.deviceplugin.hooks import ContainerAllocation
from plugvisor.plugins import sysfs, topology
from plugvisor.plugins.gpu import cdi
from plugvisor.plugins.gpu.discovery import Gpu, GpuScanner
from plugvisor.plugins.gpu.options import GpuOptions, IdStrategy

REPLICA_SEPARATOR: Final = "::"
"""Between a GPU's ID and its replica number (NVIDIA's annotated IDs: ``GPU-...::3``)."""


@dataclass(frozen=True, slots=True)
class _CdiSnapshot:
    devices: Mapping[str, tuple[cdi.Node, ...]]
    shared: tuple[cdi.Node, ...]


class GpuSource:
    """Device source for GPUs (the ``gpu`` kind), with preferred-allocation and post-allocate hooks."""

    def __init__(self, options: GpuOptions, paths: HostPaths, *, resource: str) -> None:
        self.options = options
        self.paths = paths
        self.resource = resource
        self.scanner = GpuScanner(options, paths)
        self._log = structlog.get_logger("plugvisor.plugins.gpu").bind(resource=resource)
        self._problems = sysfs.ProblemLog(self._log)
        self._placements: Mapping[str, topology.Placement] = {}
        self._index: tuple[Mapping[str, topology.Placement], topology.TopologyIndex] | None = None
        self._watch: tuple[Path, ...] = ()
        self._cdi = _CdiSnapshot({}, ())
        self._lock = threading.Lock()

    # -- discovery -----------------------------------------------------------------

    def scan(self) -> DeviceSet:
        """Read every matching GPU and return one device per GPU and replica, health included."""
        addresses, broken = self.scanner.matching_addresses()
        for bdf, why in broken:
            self._problems.report(bdf, str(why), skipped=True)
        gpus: list[Gpu] = []
        for bdf in addresses:
            gpu = self.scanner.read(bdf)
            if isinstance(gpu, sysfs.Unreadable):
                if gpu.problem is not sysfs.Problem.GARBAGE or "wanted" not in gpu.detail:
                    self._problems.report(bdf, str(gpu), skipped=True)
                continue
            self._problems.report(bdf, "; ".join(gpu.problems) or None)
            gpus.append(gpu)
        self._problems.forget_absent([*addresses, *(bdf for bdf, _ in broken)])
        control = self.scanner.control_nodes(sorted({g.function.vendor for g in gpus}))
        devices: list[Device] = []
        placements: dict[str, topology.Placement] = {}
        cdi_devices: dict[str, tuple[cdi.Node, ...]] = {}
        shared = tuple(self._cdi_node(n) for n in control)
        used: set[str] = set()
        for gpu in gpus:
            physical = self._physical_id(gpu)
            if physical in used:  # two GPUs claiming one UUID/index: fall back to the address
                physical = gpu.bdf
            used.add(physical)
            name = cdi.device_name(physical)
            nodes = tuple(self._cdi_node(n) for n in gpu.nodes)
            cdi_devices[name] = nodes
            specs = [DeviceSpec(n.path, n.host_path) for n in (*nodes, *shared)]
            if not self.options.device_specs:
                specs = []
            health = Health.UNHEALTHY if gpu.problems else Health.HEALTHY
            numa = gpu.function.numa_node
            placement = topology.Placement(numa, gpu.function.chain, physical)
            for replica in range(self.options.replicas):
                device_id = physical
                if self.options.replicas > 1:
                    device_id = f"{physical}{REPLICA_SEPARATOR}{replica}"
                devices.append(
                    Device(
                        device_id,
                        health=health,
                        numa_nodes=() if numa is None else (numa,),
                        specs=specs,
                        envs={self.options.visible_devices_env: physical},
                        cdi_devices=[cdi.qualified(self.resource, name)] if self.options.cdi else [],
                    )
                )
                placements[device_id] = placement
        watch = {self.paths.sysfs / sysfs.PCI_DEVICES, self.paths.devfs, self.paths.devfs / "dri"}
        watch.add(self.paths.procfs / "driver/nvidia/gpus")
        for gpu in gpus:
            watch.add(gpu.function.path)
            watch.add(gpu.function.path / "drm")
        with self._lock:
            self._placements = placements
            self._cdi = _CdiSnapshot(cdi_devices, shared)
            self._watch = tuple(sorted(watch, key=str))
        return DeviceSet(devices)

    def _physical_id(self, gpu: Gpu) -> str:
        strategy = self.options.device_id_strategy
        if strategy is IdStrategy.UUID and gpu.uuid:
            return gpu.uuid
        if strategy is IdStrategy.INDEX and gpu.index is not None:
            return str(gpu.index)
        return gpu.bdf

    def _cdi_node(self, local: Path) -> cdi.Node:
        return cdi.Node("/" + str(local.relative_to(self.paths.root)), self.paths.for_kubelet(local))

    def uevent_subsystems(self) -> tuple[str, ...]:
        """Rescan on real nodes when the kernel announces PCI or DRM device changes."""
        return ("pci", "drm")

    def watch_paths(self) -> Sequence[Path]:
        """The bus directory (hot-plug), each GPU's directory (driver, AER), devfs and NVIDIA's procfs."""
        with self._lock:
            return self._watch or (self.paths.sysfs / sysfs.PCI_DEVICES,)

    # -- hooks ---------------------------------------------------------------------

    def preferred_allocation(
        self, available: Sequence[str], must_include: Sequence[str], size: int, devices: DeviceSet
    ) -> Sequence[str]:
        """The topology-best set: closest in the PCI tree; replicas spread or packed by policy."""
        with self._lock:
            placements = self._placements
            cached = self._index
        if cached is None or cached[0] is not placements:
            cached = (placements, topology.TopologyIndex(placements))
            with self._lock:
                self._index = cached
        index = cached[1]
        if any(device_id not in placements for device_id in available):
            return [*must_include, *[i for i in available if i not in set(must_include)]][:size]
        policy = self.options.allocation_policy if self.options.replicas > 1 else topology.Policy.PACK
        return topology.preferred(available, must_include, size, index, policy=policy)

    def post_allocate(self, allocation: ContainerAllocation, devices: DeviceSet) -> ContainerAllocation:
        """With ``cdi: true``, make sure the spec on disk describes the current GPUs before containers start.

        Written here (as Intel does) rather than in ``scan``, which stays free of side effects.
        """
        if self.options.cdi:
            self.write_cdi_spec()
        return allocation

    def write_cdi_spec(self) -> Path:
        """Write the CDI spec for the GPUs of the latest scan (only if its bytes changed); return its path."""
        with self._lock:
            snapshot = self._cdi
        directory = self.paths.host(self.options.cdi_dir)
        content = cdi.render(self.resource, snapshot.devices, snapshot.shared)
        if cdi.write_if_changed(directory, self.resource, content):
            self._log.info("cdi_spec_written", path=str(directory / cdi.spec_file_name(self.resource)))
        return directory / cdi.spec_file_name(self.resource)


class GpuKind:
    """The ``gpu`` kind object registered under the ``plugvisor.plugins`` entry point."""

    name: Literal["gpu"] = "gpu"
    options_model: type[pydantic.BaseModel] = GpuOptions

    def build(self, options: Any, paths: HostPaths, *, resource: str) -> GpuSource:
        """Create the source; ``options`` is a validated :class:`GpuOptions`."""
        if not isinstance(options, GpuOptions):
            options = GpuOptions.model_validate(options)
        return GpuSource(options, paths, resource=resource)
