"""The ``nic`` device source: SR-IOV virtual functions, one VF per device, PFs never handed out.

What is read (all under the host root; see docs/plugins.md):

- ``sys/bus/pci/devices/<PF>``: ``sriov_totalvfs`` (marks a PF), ``virtfn<i>``
  links (VF index -> VF address), ``net/<ifname>`` (the PF's interface name for
  ``pfNames``, its ``operstate`` and ``carrier`` for health), ``aer_dev_*``.
- each VF: ``vendor``, ``device``, ``class``, the ``driver`` link, ``numa_node``,
  ``iommu_group`` (-> ``/dev/vfio/<N>`` when bound to ``vfio-pci``; the group's
  ``name`` of ``vfio-noiommu`` -> ``/dev/vfio/noiommu-<N>``), ``aer_dev_*``.

Health, recomputed on every scan (so it recovers): the PF's link down (operstate
``down`` or carrier ``0``) makes all its VFs Unhealthy; AER errors on the PF or
the VF; a VF without a driver; a vfio VF whose group node is missing; with
``vfLinkHealth``, the VF's own link. VFs created or removed through
``sriov_numvfs`` appear and vanish on the next scan, which the bus directory's
inotify event triggers at once in the lab (on real sysfs, the periodic rescan).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

import structlog

from plugvisor.common.hostpaths import HostPaths
from plugvisor.common.monitoring import DeviceDescription, Reading
from plugvisor.deviceplugin.devices import Device, DeviceSpec, Health
from plugvisor.deviceplugin.hooks import ContainerAllocation
from plugvisor.deviceplugin.snapshot import Snapshot
from plugvisor.dra.devices import PublishedDevice
from plugvisor.dra.hooks import dra_device_name
from plugvisor.plugins import sysfs, telemetry
from plugvisor.plugins.draattributes import function_attributes
from plugvisor.plugins.nic.options import NicOptions

VFIO_DRIVER: Final = "vfio-pci"
_ENV_UNSAFE: Final = re.compile(r"[^A-Z0-9]")


def env_name(resource: str) -> str:
    """The SR-IOV plugin's variable: ``PCIDEVICE_<RESOURCE>`` upper-cased, other characters as ``_``."""
    return "PCIDEVICE_" + _ENV_UNSAFE.sub("_", resource.upper())


RDMA_CM: Final = "infiniband/rdma_cm"
_ACTIVE: Final = "4: ACTIVE"


@dataclass(frozen=True, slots=True)
class RdmaDevice:
    """A VF's RDMA device as the kernel's RDMA core shows it under the PCI function."""

    name: str
    """``mlx5_3``: what ``NCCL_IB_HCA`` and ``UCX_NET_DEVICES`` name."""
    uverbs: str | None
    """``uverbs3``: the verbs node in ``/dev/infiniband`` whose ``ibdev`` is ``name``."""
    ports: tuple[Path, ...]


@dataclass(frozen=True, slots=True)
class PhysicalFunction:
    """A PF as its VFs need it: address, interface, link state and its own health problems."""

    bdf: str
    path: Path
    ifname: str | None
    link_down: bool
    problems: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ScannedVf:
    """What monitoring needs of one VF from the scan that listed it (the snapshot's data, by VF address)."""

    path: Path
    pf: PhysicalFunction
    problems: tuple[str, ...]
    rdma: str | None = None
    """The VF's RDMA device name (``mlx5_3``) when it has one: what the post-allocate hook reports."""
    vf_index: int | None = None
    """The VF's number on its PF (``virtfn<N>``)."""
    function: sysfs.PciFunction | None = None
    """The VF as read: identity, driver, NUMA node, place in the PCI tree (what DRA publishes)."""


class NicSource:
    """Device source for SR-IOV VFs (the ``nic`` kind); a post-allocate hook adds the ``_INFO`` variable."""

    def __init__(
        self, options: NicOptions, paths: HostPaths, *, resource: str, log_as: str | None = None
    ) -> None:
        self.options = options
        self.paths = paths
        self.resource = resource
        self.env = env_name(resource)
        match = options.match
        self._vendors = sysfs.hex_ids(match.vendors)
        self._devices = sysfs.hex_ids(match.devices)
        self._drivers = None if match.drivers is None else frozenset(match.drivers)
        self._pf_ranges = match.pf_ranges()
        self._roots = None if match.root_devices is None else frozenset(match.root_devices)
        self._addresses = None if match.pci_addresses is None else frozenset(match.pci_addresses)
        self._is_rdma = match.is_rdma
        self._aer = [k.value for k in options.aer_unhealthy]
        self.log_as = log_as or resource
        """The name its log lines give the process (a DRA driver's name; else ``resource``)."""
        self._log = structlog.get_logger("plugvisor.plugins.nic").bind(resource=self.log_as)
        self._problems = sysfs.ProblemLog(self._log)
        self._telemetry = telemetry.TelemetryLog(self._log)
        self._matched_nothing = False

    # -- discovery -----------------------------------------------------------------

    def _physical_functions(self, addresses: Sequence[str]) -> list[PhysicalFunction]:
        pfs: list[PhysicalFunction] = []
        for bdf in addresses:
            if self._roots is not None and bdf not in self._roots:
                continue
            entry = sysfs.function_dir(self.paths.sysfs, bdf)
            if isinstance(entry, sysfs.Unreadable) or not sysfs.exists(entry / "sriov_totalvfs"):
                continue
            names = sysfs.list_dir(entry / "net")
            ifname = names[0] if isinstance(names, list) and names else None
            if self._pf_ranges is not None and (ifname is None or ifname not in self._pf_ranges):
                continue
            problems = [f"PF {bdf}: {p}" for p in sysfs.aer_problems(entry, self._aer)]
            link_down = False
            if ifname is not None:
                link = sysfs.netdev_link_problem(entry / "net" / ifname, f"PF {ifname}")
                link_down = link is not None
                if link is not None:
                    problems.append(link)
            pfs.append(PhysicalFunction(bdf, entry, ifname, link_down, tuple(problems)))
        return pfs

    def _virtual_functions(self, pf: PhysicalFunction, reported: list[str]) -> list[tuple[int, str]]:
        names = sysfs.list_dir(pf.path)
        if isinstance(names, sysfs.Unreadable):
            return []
        allowed = None if self._pf_ranges is None or pf.ifname is None else self._pf_ranges.get(pf.ifname)
        vfs: list[tuple[int, str]] = []
        for name in names:
            if not name.startswith("virtfn") or not name[6:].isdigit():
                continue
            index = int(name[6:])
            if allowed is not None and index not in allowed:
                continue
            target = sysfs.link_name(pf.path / name)
            if isinstance(target, sysfs.Unreadable) or not sysfs.is_bdf(target):
                reported.append(f"{pf.bdf}/{name}")  # kept across scans: logged once, not every scan
            if isinstance(target, sysfs.Unreadable):
                self._problems.report(f"{pf.bdf}/{name}", str(target), skipped=True)
                continue
            if not sysfs.is_bdf(target):
                cause = f"{pf.path / name}: points to {target!r}, not a PCI function"
                self._problems.report(f"{pf.bdf}/{name}", cause, skipped=True)
                continue
            vfs.append((index, target))
        vfs.sort()
        return vfs

    def scan(self) -> Snapshot[Mapping[str, ScannedVf]]:
        """Read every PF's VFs that the selectors match; one device per VF, health included."""
        addresses = sysfs.pci_addresses(self.paths.sysfs)
        if isinstance(addresses, sysfs.Unreadable):
            addresses = []
        devices: list[Device] = []
        seen: list[str] = []
        found: dict[str, ScannedVf] = {}
        watch = {self.paths.sysfs / sysfs.PCI_DEVICES, self.paths.devfs / "vfio"}
        pfs = self._physical_functions(addresses)
        for pf in pfs:
            watch.add(pf.path)
            if pf.ifname is not None:
                watch.add(pf.path / "net" / pf.ifname)
            for vf_index, vf_bdf in self._virtual_functions(pf, seen):
                if self._addresses is not None and vf_bdf not in self._addresses:
                    continue
                seen.append(vf_bdf)
                device = self._device(pf, vf_bdf, vf_index, watch, found)
                if device is not None:
                    devices.append(device)
        self._problems.forget_absent(seen)
        self._say_if_nothing_matches(devices, pfs, len(seen))
        return Snapshot(devices, watch=sorted(watch, key=str), data=MappingProxyType(found))

    def _say_if_nothing_matches(self, devices: list[Device], pfs: list[PhysicalFunction], vfs: int) -> None:
        """Warn once each time the selectors come to match nothing, saying what the scan did see.

        A mistyped PF name or vendor ID, a host root without the NIC, or VFs not created
        yet (``sriov_numvfs`` is 0) would otherwise register zero devices in silence.
        Not an error: VFs created later are picked up then.
        """
        nothing = not devices
        if nothing and not self._matched_nothing:
            self._log.warning(
                "selector_matches_nothing",
                match=self.options.match.model_dump(by_alias=True, exclude_none=True),
                pfs_seen=[pf.ifname or pf.bdf for pf in pfs][:16],
                vfs_seen=vfs,
                looked_in=str(self.paths.sysfs / sysfs.PCI_DEVICES),
                hint="no device until a matching VF appears (are VFs created? is hostRoot right?)",
            )
        self._matched_nothing = nothing

    def _device(
        self, pf: PhysicalFunction, bdf: str, vf_index: int, watch: set[Path], found: dict[str, ScannedVf]
    ) -> Device | None:
        vf = sysfs.read_function(self.paths.sysfs, bdf)
        if isinstance(vf, sysfs.Unreadable):
            self._problems.report(bdf, str(vf), skipped=True)
            return None
        if (self._vendors is not None and vf.vendor not in self._vendors) or (
            self._devices is not None and vf.device not in self._devices
        ):
            return None
        if self._drivers is not None and vf.driver not in self._drivers:
            return None
        rdma = self._rdma_device(vf.path) if self._is_rdma is not None else None
        if self._is_rdma is not None and (rdma is not None) != self._is_rdma:
            return None
        watch.add(vf.path)
        problems = list(pf.problems)
        problems += sysfs.aer_problems(vf.path, self._aer)
        specs: list[DeviceSpec] = []
        if vf.driver_problem is not None:
            problems.append(vf.driver_problem)
        elif vf.driver is None:
            problems.append("no driver bound")
        elif vf.driver == VFIO_DRIVER:
            node = self._vfio_node(vf.path)
            if isinstance(node, str):
                problems.append(node)
            else:
                control = self.paths.devfs / "vfio/vfio"
                specs = [self._spec(control), self._spec(node)]
                problems += self._node_problems(control, node)
        if rdma is not None:
            specs, rdma_problems = self._rdma_specs(rdma, specs, watch)
            problems += rdma_problems
        if self.options.vf_link_health:
            problems += self._vf_link(vf.path, watch)
        self._problems.report(bdf, "; ".join(problems) or None)
        found[bdf] = ScannedVf(
            vf.path, pf, tuple(problems), None if rdma is None else rdma.name, vf_index=vf_index, function=vf
        )
        numa = None if self.options.exclude_topology else vf.numa_node
        return Device(
            bdf,
            health=Health.UNHEALTHY if problems else Health.HEALTHY,
            numa_nodes=() if numa is None else (numa,),
            specs=specs,
            envs={self.env: bdf},
        )

    def _vf_link(self, path: Path, watch: set[Path]) -> list[str]:
        """The VF's own link, when ``vfLinkHealth`` asks for it."""
        names = sysfs.list_dir(path / "net")
        if not isinstance(names, list) or not names:
            return []
        watch.add(path / "net" / names[0])
        link = sysfs.netdev_link_problem(path / "net" / names[0], f"VF {names[0]}")
        return [] if link is None else [link]

    def _rdma_device(self, fn: Path) -> RdmaDevice | None:
        """The function's IB device (a directory under ``<fn>/infiniband``), its verbs node and ports."""
        names = sysfs.list_dir(fn / "infiniband")
        if not isinstance(names, list) or not names:
            return None
        name = sorted(names)[0]
        uverbs = None
        verbs = sysfs.list_dir(fn / "infiniband_verbs")
        for entry in sorted(verbs) if isinstance(verbs, list) else ():
            if (
                entry.startswith("uverbs")
                and sysfs.read_text(fn / "infiniband_verbs" / entry / "ibdev") == name
            ):
                uverbs = entry
                break
        ports = sysfs.list_dir(fn / "infiniband" / name / "ports")
        port_dirs = (
            tuple(fn / "infiniband" / name / "ports" / p for p in sorted(ports))
            if isinstance(ports, list)
            else ()
        )
        return RdmaDevice(name, uverbs, port_dirs)

    def _rdma_specs(
        self, rdma: RdmaDevice, specs: list[DeviceSpec], watch: set[Path]
    ) -> tuple[list[DeviceSpec], list[str]]:
        """Add the verbs node and ``rdma_cm`` to a VF's specs; a down port or missing node is a problem."""
        problems: list[str] = []
        control = self.paths.devfs / RDMA_CM
        if rdma.uverbs is None:
            problems.append(f"RDMA device {rdma.name} has no uverbs device")
            nodes = [control]
        else:
            nodes = [self.paths.devfs / "infiniband" / rdma.uverbs, control]
        problems += self._node_problems(*nodes)
        if not rdma.ports:
            problems.append(f"RDMA device {rdma.name} has no ports")
        for port in rdma.ports:
            watch.add(port)
            state = sysfs.read_text(port / "state")
            if state != _ACTIVE:
                problems.append(f"RDMA {rdma.name} port {port.name} is {state}, not ACTIVE")
        return [*specs, *(self._spec(n) for n in nodes)], problems

    def _node_problems(self, *nodes: Path) -> list[str]:
        found = ((node, sysfs.node_problem(node)) for node in nodes)
        return [f"device node {self.paths.for_kubelet(n)} {problem}" for n, problem in found if problem]

    def describe(self, snapshot: Snapshot[Mapping[str, ScannedVf]]) -> Mapping[str, DeviceDescription]:
        """Monitoring: VF address, its PF, health cause, the VF's AER, the PF's PCIe link, PF and VF links.

        A VF has no PCIe link of its own: the physical link (speed, width,
        degraded) is its PF's, read once per PF.
        """
        vfs = snapshot.data
        devices = snapshot.devices
        per_pf: dict[str, list[Reading]] = {}
        described: dict[str, DeviceDescription] = {}
        for bdf in devices:
            known = vfs.get(bdf)
            if known is None:
                continue
            path, pf, problems = known.path, known.pf, known.problems
            if pf.bdf not in per_pf:
                per_pf[pf.bdf] = [
                    *telemetry.link_readings(pf.bdf, pf.path, self._telemetry),
                    *telemetry.netdev_readings(pf.bdf, pf.path, "pf", self._telemetry),
                ]
            readings = [
                *telemetry.aer_readings(bdf, path, self._telemetry),
                *per_pf[pf.bdf],
                *telemetry.netdev_readings(bdf, path, "vf", self._telemetry),
            ]
            described[bdf] = DeviceDescription(
                kind="nic",
                pci_address=bdf,
                identity=telemetry.identity(pf=pf.bdf, interface=pf.ifname),
                cause=telemetry.first_problem_text(problems),
                cause_code=telemetry.cause_code(problems),
                readings=readings,
            )
        return described

    def _vfio_node(self, path: Path) -> Path | str:
        group = sysfs.link_name(path / "iommu_group")
        if isinstance(group, sysfs.Unreadable):
            return f"bound to {VFIO_DRIVER} but has no IOMMU group ({group.problem})"
        group_dir = sysfs.in_sysfs(self.paths.sysfs, path / "iommu_group")
        name = group_dir if isinstance(group_dir, sysfs.Unreadable) else sysfs.read_text(group_dir / "name")
        if isinstance(name, str) and name == "vfio-noiommu":
            return self.paths.devfs / "vfio" / f"noiommu-{group}"
        return self.paths.devfs / "vfio" / group

    def _spec(self, local: Path) -> DeviceSpec:
        return DeviceSpec("/" + str(local.relative_to(self.paths.root)), self.paths.for_kubelet(local))

    def uevent_subsystems(self) -> tuple[str, ...]:
        """Rescan on real nodes when the kernel announces PCI or network device changes."""
        return ("pci", "net")

    # -- hooks ---------------------------------------------------------------------

    def dra_devices(self, snapshot: Snapshot[Mapping[str, ScannedVf]]) -> Mapping[str, PublishedDevice]:
        """DRA: each VF as ``<pf>-vf<N>``, with its PF, VF number, RDMA device and PCI placement.

        Attributes: ``pfName`` (the PF's interface), ``pfPciBusID``, ``vfIndex``,
        the VF's ``vendor``, ``pciDeviceId``, ``driver`` and ``model``, and the
        standard ``resource.kubernetes.io/pciBusID``, ``pcieRoot`` and
        ``numaNode``; with ``isRdma`` given (the scan looked for RDMA devices,
        and a VF that has one comes with its verbs node and ``rdma_cm``)
        also ``rdma`` (whether the VF has an RDMA device) and ``rdmaDevice``
        (``mlx5_3``). Without it ``rdma`` is left out rather than said false:
        a claim can ask for "a VF with RDMA on PF ens1f0" or "a VF on the same
        PCIe root as the GPU".
        """
        answer: dict[str, PublishedDevice] = {}
        for bdf in snapshot.devices:
            vf = snapshot.data.get(bdf)
            if vf is None or vf.function is None:
                continue
            attributes = function_attributes(vf.function, self.paths)
            attributes["pfPciBusID"] = vf.pf.bdf
            if vf.pf.ifname is not None:
                attributes["pfName"] = vf.pf.ifname[:64]
            if self._is_rdma is not None:
                attributes["rdma"] = vf.rdma is not None
            if vf.rdma is not None:
                attributes["rdmaDevice"] = vf.rdma[:64]
            name = dra_device_name(bdf)
            if vf.vf_index is not None:
                attributes["vfIndex"] = vf.vf_index
                name = dra_device_name(f"{vf.pf.ifname or vf.pf.bdf}-vf{vf.vf_index}")
            answer[bdf] = PublishedDevice(name, attributes)
        return answer

    def post_allocate(self, allocation: ContainerAllocation, snapshot: Snapshot[Any]) -> ContainerAllocation:
        """Add ``<ENV>_INFO``: the network device-info JSON the SR-IOV plugin hands to CNI plugins."""
        info: dict[str, dict[str, Any]] = {}
        scanned = snapshot.data if isinstance(snapshot.data, Mapping) else {}
        rdma_names = {
            bdf: vf.rdma for bdf, vf in scanned.items() if isinstance(vf, ScannedVf) and vf.rdma is not None
        }
        hcas: list[str] = []
        for bdf, device in snapshot.devices.items():
            entry: dict[str, Any] = {"generic": {"deviceID": bdf}}
            paths = [s.container_path for s in device.specs]
            vfio = [p for p in paths if p.startswith("/dev/vfio/") and p != "/dev/vfio/vfio"]
            if vfio:
                entry["vfio"] = {"dev-mount": vfio[0], "mount": "/dev/vfio/vfio"}
            if bdf in rdma_names:
                # The SR-IOV plugin's RDMA info: the nodes by kind, and the device's name.
                entry["rdma"] = {"rdma_dev": rdma_names[bdf]}
                for path in paths:
                    key = "rdma_cm" if path.endswith("/rdma_cm") else "uverbs" if "/uverbs" in path else None
                    if key:
                        entry["rdma"][key] = path
                hcas.append(rdma_names[bdf])
            info[bdf] = entry
        envs = dict(allocation.envs)
        if hcas:
            # What RDMA workloads read to pick their HCAs: NCCL (``=`` for exact names, so mlx5_1 never
            # matches mlx5_10) and UCX (device:port).
            envs["NCCL_IB_HCA"] = "=" + ",".join(sorted(hcas))
            envs["UCX_NET_DEVICES"] = ",".join(f"{h}:1" for h in sorted(hcas))
        envs[f"{self.env}_INFO"] = json.dumps(info, sort_keys=True, separators=(",", ":"))
        return ContainerAllocation(
            specs=allocation.specs,
            mounts=allocation.mounts,
            envs=envs,
            annotations=allocation.annotations,
            cdi_devices=allocation.cdi_devices,
        )
