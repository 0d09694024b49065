"""The ``gpu`` device source and its hooks: IDs, replicas, Allocate contents, CDI, preferred sets."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Final

import structlog

from plugvisor.common.hostpaths import HostPaths
from plugvisor.common.monitoring import DeviceDescription, Reading
from plugvisor.deviceplugin.devices import Device, DeviceSpec, Health
from plugvisor.deviceplugin.hooks import ContainerAllocation
from plugvisor.deviceplugin.snapshot import Snapshot
from plugvisor.dra.devices import PublishedDevice
from plugvisor.plugins import sysfs, telemetry, topology
from plugvisor.plugins.gpu import cdi
from plugvisor.plugins.gpu import dra as gpu_dra
from plugvisor.plugins.gpu.discovery import Gpu, GpuScanner
from plugvisor.plugins.gpu.driverfiles import DriverFiles, DriverLocator
from plugvisor.plugins.gpu.nvml import GpuView, Nvml, System, Unavailable
from plugvisor.plugins.gpu.options import NVIDIA, GpuOptions, IdStrategy

REPLICA_SEPARATOR: Final = "::"
"""Between a GPU's ID and its replica number (NVIDIA's annotated IDs: ``GPU-...::3``)."""


class GpuScan:
    """What the hooks need from one scan: each device's PCI placement, and the CDI nodes of each GPU.

    Immutable and compared by value (a rescan that finds the same GPUs wakes
    nobody). The topology index is built on first use and kept with the scan it
    describes, so every request against one snapshot shares it.
    """

    __slots__ = ("_index", "cdi_devices", "cdi_shared", "gpus", "nvml", "placements", "system")

    def __init__(
        self,
        placements: Mapping[str, topology.Placement],
        cdi_devices: Mapping[str, tuple[cdi.Node, ...]],
        cdi_shared: tuple[cdi.Node, ...],
        gpus: Mapping[str, Gpu] | None = None,
        *,
        nvml: Mapping[str, GpuView] | None = None,
        system: System | None = None,
    ) -> None:
        self.placements = placements
        self.cdi_devices = cdi_devices
        self.cdi_shared = cdi_shared
        self.gpus: Mapping[str, Gpu] = gpus or {}
        """Each device's GPU as read (path, UUID, problems): what monitoring describes."""
        self.nvml: Mapping[str, GpuView] = nvml or MappingProxyType({})
        """NVML's side of each GPU it knows, by PCI address (empty without NVML)."""
        self.system = system
        """The driver as NVML reports it (None without NVML)."""
        self._index: topology.TopologyIndex | None = None

    @property
    def index(self) -> topology.TopologyIndex:
        """The PCI tree of this scan's devices (two threads may build it at once; both get equal trees)."""
        if self._index is None:
            self._index = topology.TopologyIndex(self.placements)
        return self._index

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, GpuScan):
            return NotImplemented
        return (self.placements, self.cdi_devices, self.cdi_shared, self.gpus, self.nvml) == (
            other.placements,
            other.cdi_devices,
            other.cdi_shared,
            other.gpus,
            other.nvml,
        )

    def __hash__(self) -> int:
        return hash(tuple(self.placements))


class GpuSource:
    """Device source for GPUs (the ``gpu`` kind), with preferred-allocation and post-allocate hooks.

    Stateless between scans and hooks: what a hook needs travels in the
    snapshot's :class:`GpuScan`. Kept across scans: which problems were
    already logged, and NVML (:mod:`.nvml`), opened by :meth:`start` in the
    plugin process where the resource can have NVIDIA GPUs and the library
    loads; its event thread asks for a rescan when a GPU's health changes.
    """

    def __init__(
        self, options: GpuOptions, paths: HostPaths, *, resource: str, log_as: str | None = None
    ) -> None:
        self.options = options
        self.paths = paths
        self.resource = resource
        self.scanner = GpuScanner(options, paths)
        self.log_as = log_as or resource
        """The name its log lines give the process (a DRA driver's name; else ``resource``)."""
        self._log = structlog.get_logger("plugvisor.plugins.gpu").bind(resource=self.log_as)
        self._problems = sysfs.ProblemLog(self._log)
        self._telemetry = telemetry.TelemetryLog(self._log)
        self._driver = DriverLocator(paths, options.driver_root, log=self._log)
        self.nvml: Nvml | None = None
        """NVML, between :meth:`start` and :meth:`close`, where it could be opened."""
        self._rescan: Callable[[], None] = lambda: None

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        """Open NVML where it is wanted and there; say once, with the reason, when it is not."""
        wanted = self.options.nvml.enabled == "auto" and NVIDIA in self.options.match.vendor_ids()
        if not wanted:
            return
        try:
            self.nvml = Nvml.open(
                self.paths, self.options.driver_root, self.options.nvml, resource=self.log_as
            )
        except Unavailable as exc:
            reason, absent = str(exc), exc.absent
        except Exception as exc:  # a bug or a library gone wrong must not keep the GPUs from the kubelet
            reason, absent = f"{type(exc).__name__}: {exc}", False
        else:
            try:
                self.nvml.watch_events(self._health_changed)
            except Exception as exc:  # identity and telemetry stay; health is sysfs's alone
                self._log.error("nvml_events_unavailable", error=f"{type(exc).__name__}: {exc}")
            return
        say = self._log.info if absent else self._log.warning  # no driver, or a broken one
        say("nvml_unavailable", reason=reason, effect="identity, health and telemetry from sysfs only")

    def close(self) -> None:
        """Stop NVML's event thread and shut NVML down."""
        nvml, self.nvml = self.nvml, None
        if nvml is not None:
            nvml.close()

    def _health_changed(self) -> None:
        self._rescan()

    def request_rescans(self, rescan: Callable[[], None]) -> None:
        """NVML health events rescan the devices through ``rescan`` (called from the event thread)."""
        self._rescan = rescan

    # -- discovery -----------------------------------------------------------------

    def scan(self) -> Snapshot[GpuScan]:
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
        if self.nvml is not None:
            self.nvml.track(addresses, [g.bdf for g in gpus if g.function.vendor == NVIDIA])
        views = self._nvml_views(gpus)
        self._problems.forget_absent([*addresses, *(bdf for bdf, _ in broken)])
        control = self.scanner.control_nodes(sorted({g.function.vendor for g in gpus}))
        devices: list[Device] = []
        placements: dict[str, topology.Placement] = {}
        by_id: dict[str, Gpu] = {}
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
                by_id[device_id] = gpu
        watch = {self.paths.sysfs / sysfs.PCI_DEVICES, self.paths.devfs, self.paths.devfs / "dri"}
        watch.add(self.paths.procfs / "driver/nvidia/gpus")
        for gpu in gpus:
            watch.add(gpu.function.path)
            watch.add(gpu.function.path / "drm")
        system = self.nvml.system if self.nvml is not None else None
        return Snapshot(
            devices,
            watch=sorted(watch, key=str),
            data=GpuScan(placements, cdi_devices, shared, by_id, nvml=views, system=system),
        )

    def _nvml_views(self, gpus: list[Gpu]) -> dict[str, GpuView]:
        """NVML's view of each NVIDIA GPU it knows; its health problems join the GPU's (in ``gpus``)."""
        views: dict[str, GpuView] = {}
        nvml = self.nvml
        if nvml is None:
            return views
        for position, gpu in enumerate(gpus):
            view = nvml.view(gpu.bdf) if gpu.function.vendor == NVIDIA else None
            if view is not None:
                views[gpu.bdf] = view
                if view.problems:
                    gpus[position] = dataclasses.replace(gpu, problems=gpu.problems + view.problems)
        return views

    def describe(self, snapshot: Snapshot[GpuScan]) -> Mapping[str, DeviceDescription]:
        """Monitoring: address, UUID, health cause, AER, PCIe link, hwmon and NVML readings (once per GPU)."""
        gpus = snapshot.data.gpus
        devices = snapshot.devices
        nvml = self.nvml
        readings: dict[str, tuple[Reading, ...]] = {}
        described: dict[str, DeviceDescription] = {}
        for device_id in devices:
            gpu = gpus.get(device_id)
            if gpu is None:
                continue
            if gpu.bdf not in readings:
                found = telemetry.pci_readings(gpu.bdf, gpu.function.path, self._telemetry)
                if nvml is not None and gpu.function.vendor == NVIDIA:
                    found += nvml.readings(gpu.bdf)
                readings[gpu.bdf] = tuple(found)
            described[device_id] = DeviceDescription(
                kind="gpu",
                pci_address=gpu.bdf,
                identity=telemetry.identity(uuid=gpu.uuid),
                cause=telemetry.first_problem_text(gpu.problems),
                cause_code=telemetry.cause_code(gpu.problems),
                readings=readings[gpu.bdf],
            )
        return described

    def dra_devices(self, snapshot: Snapshot[GpuScan]) -> Mapping[str, PublishedDevice]:
        """DRA: one device per physical GPU: identity, placement, memory and taints (see :mod:`.dra`)."""
        physical = {device_id: p.physical for device_id, p in snapshot.data.placements.items()}
        data = snapshot.data
        return gpu_dra.published(
            self.paths, snapshot, data.gpus, physical, nvml=data.nvml, system=data.system
        )

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

    # -- hooks ---------------------------------------------------------------------

    def preferred_allocation(
        self, available: Sequence[str], must_include: Sequence[str], size: int, snapshot: Snapshot[GpuScan]
    ) -> Sequence[str]:
        """The topology-best set: closest in the PCI tree; replicas spread or packed by policy."""
        placements = snapshot.data.placements
        index = snapshot.data.index
        if any(device_id not in placements for device_id in available):
            return [*must_include, *[i for i in available if i not in set(must_include)]][:size]
        policy = self.options.allocation_policy if self.options.replicas > 1 else topology.Policy.PACK
        return topology.preferred(available, must_include, size, index, policy=policy)

    def post_allocate(
        self, allocation: ContainerAllocation, snapshot: Snapshot[GpuScan]
    ) -> ContainerAllocation:
        """Add NVIDIA's driver files (or toolkit devices) and, with ``cdi: true``, write the spec first.

        With ``cdi: true`` the spec on disk must describe the snapshot's GPUs
        before containers run; NVIDIA GPUs also get the driver's user-space files
        or the toolkit's devices (:func:`.cdi.with_driver`). Written here (as Intel
        does) rather than in ``scan``, which stays free of side effects.
        """
        scan = snapshot.data
        files = self._driver_files(scan.gpus.values())
        if self.options.cdi:
            self.write_cdi_spec(scan, files)
        mine = [scan.gpus[i] for i in snapshot.devices if i in scan.gpus]
        return cdi.with_driver(allocation, files, _nvidia(mine), in_spec=self.options.cdi)

    def _driver_files(self, gpus: Iterable[Gpu]) -> DriverFiles | None:
        """The node's NVIDIA driver files, looked for only when there are NVIDIA GPUs."""
        return self._driver.find() if _nvidia(gpus) else None

    def write_cdi_spec(self, scan: GpuScan, files: DriverFiles | None = None) -> Path:
        """Write the CDI spec for the GPUs of ``scan`` (only if its bytes changed); return its path."""
        directory = self.paths.host(self.options.cdi_dir)
        if files is None:
            files = self._driver_files(scan.gpus.values())
        driver = cdi.driver_edits(files, _nvidia(scan.gpus.values()))
        content = cdi.render(self.resource, scan.cdi_devices, scan.cdi_shared, driver)
        if cdi.write_if_changed(directory, self.resource, content):
            self._log.info("cdi_spec_written", path=str(directory / cdi.spec_file_name(self.resource)))
        return directory / cdi.spec_file_name(self.resource)


def _nvidia(gpus: Iterable[Gpu]) -> list[tuple[str | None, int | None]]:
    """The NVIDIA GPUs among ``gpus`` as the toolkit names them (UUID, minor number), each once."""
    return list(dict.fromkeys((g.uuid, g.index) for g in gpus if g.function.vendor == NVIDIA))
