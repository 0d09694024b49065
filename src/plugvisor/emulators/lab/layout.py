"""Placing a profile's hardware on a PCI topology, the way firmware would.

Each NUMA node gets its own host bridge(s) and a slice of bus numbers. Every
device (or group of ``perSwitch`` devices behind a PCIe switch) hangs off its own
root port; bridges get secondary/subordinate bus ranges that cover everything
below them, including the extra buses an SR-IOV card needs for its VFs (VF
addresses are derived from the PF's routing id, ``first VF offset`` and
``stride``, as the SR-IOV capability defines them). Numbers that drivers assign
in probe order (NVIDIA minors, DRM cards, KFD nodes, DFL regions) follow bus
order. The result is a :class:`~.state.LabState`; nothing is written here.
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass, field

from plugvisor.emulators.lab import catalog, errors, nic
from plugvisor.emulators.lab.catalog import XilinxFpgaModel
from plugvisor.emulators.lab.pci import Bdf
from plugvisor.emulators.lab.profiles import FpgaGroup, GpuGroup, NicGroup, Placement, Profile
from plugvisor.emulators.lab.state import (
    BridgeState,
    DeviceKind,
    DeviceState,
    FunctionState,
    LabState,
    NumaState,
    SwitchState,
)

_UUID_NAMESPACE = uuid.UUID("6d3c1f0e-4a8b-5c2d-9e7f-1a2b3c4d5e6f")
MAX_ROOT_PORTS = 31


@dataclass
class _Unit:
    """One thing that occupies a PCIe slot: a GPU, an FPGA card or a NIC card."""

    section: str
    index: int
    group: Placement
    names: list[str]
    buses: int = 1


@dataclass
class _Node:
    """Bus bookkeeping for one NUMA node."""

    id: int
    next_bus: int
    limit: int
    source: str
    host_bridges: list[tuple[int, int]] = field(default_factory=list)
    """``(root bus, next root-port device number)`` per host bridge."""

    def bus(self, count: int = 1, *, what: str) -> int:
        first = self.next_bus
        if first + count > self.limit:
            raise errors.ProfileError(
                self.source,
                [
                    (
                        what,
                        f"too many devices on NUMA node {self.id}: its share of PCI bus numbers ran out",
                    )
                ],
            )
        self.next_bus += count
        return first


class _Builder:
    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self.nodes: list[_Node] = []
        span = 256 // profile.numa_nodes
        for n in range(profile.numa_nodes):
            self.nodes.append(_Node(n, n * span, (n + 1) * span, f"profile {profile.name}"))
        self.bridges: list[BridgeState] = []
        self.switches: list[SwitchState] = []
        self.devices: dict[str, DeviceState] = {}
        self.host_bridges: list[str] = []
        self.iommu_group = 0
        self.ifindex = 2

    def group_id(self, count: int = 1) -> int:
        first = self.iommu_group
        self.iommu_group += count
        return first

    # -- bridges ---------------------------------------------------------------------------------

    def root_port(self, node: _Node, *, what: str) -> tuple[str, int]:
        """Allocate a root port; return its path and bus."""
        if not node.host_bridges or node.host_bridges[-1][1] > MAX_ROOT_PORTS:
            root_bus = node.bus(what=what)
            node.host_bridges.append((root_bus, 1))
            self.host_bridges.append(f"pci0000:{root_bus:02x}")
        root_bus, devno = node.host_bridges[-1]
        node.host_bridges[-1] = (root_bus, devno + 1)
        bdf = Bdf(0, root_bus, devno, 0)
        return f"sys/devices/pci0000:{root_bus:02x}/{bdf}", root_bus

    def add_bridge(
        self, *, path: str, role: str, node: _Node, switch: str | None, buses: tuple[int, int, int]
    ) -> None:
        self.bridges.append(
            BridgeState(
                bdf=path.rsplit("/", 1)[1],
                path=path,
                role=role,  # type: ignore[arg-type]
                numa_node=node.id,
                switch=switch,
                buses=buses,
                iommu_group=self.group_id(),
            )
        )

    def attach(self, node: _Node, units: list[_Unit], *, switched: bool) -> None:
        """Put ``units`` on one root port, behind a switch if asked."""
        what = f"{units[0].section}[{units[0].index}]"
        rp_path, root_bus = self.root_port(node, what=what)
        rp_index = len(self.bridges)
        secondary = node.bus(what=what)
        if not switched:
            unit = units[0]
            extra = node.bus(unit.buses - 1, what=what) if unit.buses > 1 else secondary
            self.add_bridge(
                path=rp_path, role="root-port", node=node, switch=None, buses=(root_bus, secondary, 0)
            )
            self.place(unit, node, parent=rp_path, bus=secondary, switch=None)
            self.bridges[rp_index].buses = (root_bus, secondary, max(extra, secondary))
            return
        name = f"sw{len(self.switches)}"
        self.add_bridge(
            path=rp_path, role="root-port", node=node, switch=None, buses=(root_bus, secondary, 0)
        )
        up_path = f"{rp_path}/{Bdf(0, secondary, 0, 0)}"
        internal = node.bus(what=what)
        up_index = len(self.bridges)
        self.add_bridge(path=up_path, role="upstream", node=node, switch=name, buses=(secondary, internal, 0))
        downstream: list[str] = []
        for k, unit in enumerate(units):
            dn_bdf = Bdf(0, internal, k, 0)
            dn_path = f"{up_path}/{dn_bdf}"
            bus = node.bus(unit.buses, what=what)
            self.add_bridge(
                path=dn_path,
                role="downstream",
                node=node,
                switch=name,
                buses=(internal, bus, bus + unit.buses - 1),
            )
            downstream.append(str(dn_bdf))
            self.place(unit, node, parent=dn_path, bus=bus, switch=name)
        last = node.next_bus - 1
        self.bridges[up_index].buses = (secondary, internal, last)
        self.bridges[rp_index].buses = (root_bus, secondary, last)
        self.switches.append(
            SwitchState(
                name=name, numa_node=node.id, upstream=str(Bdf(0, secondary, 0, 0)), downstream=downstream
            )
        )

    # -- endpoints -------------------------------------------------------------------------------

    def place(self, unit: _Unit, node: _Node, *, parent: str, bus: int, switch: str | None) -> None:
        group = unit.group
        if isinstance(group, GpuGroup):
            self.place_gpu(unit.names[0], group, node=node, parent=parent, bus=bus, switch=switch)
        elif isinstance(group, FpgaGroup):
            self.place_fpga(unit.names[0], group, node=node, parent=parent, bus=bus, switch=switch)
        elif isinstance(group, NicGroup):
            self.place_nic(unit.names, group, node=node, parent=parent, bus=bus, switch=switch)

    def function(self, parent: str, bdf: Bdf, role: str, driver: str | None) -> FunctionState:
        return FunctionState(
            bdf=str(bdf),
            path=f"{parent}/{bdf}",
            role=role,  # type: ignore[arg-type]
            driver=driver,
            iommu_group=self.group_id(),
        )

    def place_gpu(
        self, name: str, group: GpuGroup, *, node: _Node, parent: str, bus: int, switch: str | None
    ) -> None:
        model = catalog.GPUS[group.model]
        bdf = Bdf(0, bus, 0, 0)
        fn = self.function(parent, bdf, "gpu", model.driver)
        ident = uuid.uuid5(_UUID_NAMESPACE, f"{self.profile.name}/{name}/{bdf}")
        self.devices[name] = DeviceState(
            name=name,
            kind=DeviceKind.GPU,
            model=model.key,
            numa_node=node.id,
            switch=switch,
            functions=[fn],
            uuid=f"GPU-{ident}",
        )

    def place_fpga(
        self, name: str, group: FpgaGroup, *, node: _Node, parent: str, bus: int, switch: str | None
    ) -> None:
        model = catalog.FPGAS[group.model]
        if isinstance(model, XilinxFpgaModel):
            functions = [
                self.function(parent, Bdf(0, bus, 0, 0), "mgmt", "xclmgmt"),
                self.function(parent, Bdf(0, bus, 0, 1), "user", "xocl"),
            ]
        else:
            functions = [self.function(parent, Bdf(0, bus, 0, 0), "fpga", "dfl-pci")]
        dev = DeviceState(
            name=name,
            kind=DeviceKind.FPGA,
            model=model.key,
            numa_node=node.id,
            switch=switch,
            functions=functions,
        )
        if isinstance(model, XilinxFpgaModel):
            dev.shell = group.shell or model.vbnv
        else:
            dev.afu_id = group.afu_id or model.afu_id
            dev.interface_id = group.interface_id or model.interface_id
        self.devices[name] = dev

    def place_nic(
        self, names: list[str], group: NicGroup, *, node: _Node, parent: str, bus: int, switch: str | None
    ) -> None:
        model = catalog.NICS[group.model]
        total = model.max_vfs if group.total_vfs is None else group.total_vfs
        ports = group.ports_per_card
        first = max(model.first_vf_offset, ports)
        base = Bdf(0, bus, 0, 0).routing_id
        vf_driver = "vfio-pci" if group.vf_driver == "vfio-pci" else model.vf_driver
        for port, name in enumerate(names):
            bdf = Bdf(0, bus, 0, port)
            fn = self.function(parent, bdf, "pf", model.pf_driver)
            digest = hashlib.sha256(f"{self.profile.name}/{name}".encode()).digest()
            self.devices[name] = DeviceState(
                name=name,
                kind=DeviceKind.NIC_PF,
                model=model.key,
                numa_node=node.id,
                switch=switch,
                functions=[fn],
                netdev=f"enp{bus}s0f{port}",
                mac=f"{model.oui}:{digest[0]:02x}:{digest[1]:02x}:{digest[2]:02x}",
                ifindex=self.ifindex,
                total_vfs=total,
                num_vfs=0,
                vf_offset=base + first + port * total - (base + port),
                vf_stride=1,
                vf_driver=vf_driver,
                vf_group_base=self.group_id(total),
            )
            self.ifindex += 1


def _units(profile: Profile) -> list[tuple[int, _Unit]]:
    """Expand the profile's groups into slot-sized units, each assigned a NUMA node."""
    counters = {"gpus": 0, "fpgas": 0, "nics": 0}
    prefix = {"gpus": "gpu", "fpgas": "fpga", "nics": "nic"}
    out: list[tuple[int, _Unit]] = []
    sections: list[tuple[str, list[GpuGroup] | list[FpgaGroup] | list[NicGroup]]] = [
        ("gpus", profile.gpus),
        ("fpgas", profile.fpgas),
        ("nics", profile.nics),
    ]
    for section, groups in sections:
        for gi, group in enumerate(groups):
            nodes = group.numa_nodes or list(range(profile.numa_nodes))
            per_unit = group.ports_per_card if isinstance(group, NicGroup) else 1
            count = group.count // per_unit
            buses = 1
            if isinstance(group, NicGroup):
                model = catalog.NICS[group.model]
                total = model.max_vfs if group.total_vfs is None else group.total_vfs
                rids = max(model.first_vf_offset, per_unit) + per_unit * total
                buses = -(-rids // 256)
            for i in range(count):
                names = [f"{prefix[section]}{counters[section] + k}" for k in range(per_unit)]
                counters[section] += per_unit
                out.append((nodes[i * len(nodes) // count], _Unit(section, gi, group, names, buses)))
    return out


def build(profile: Profile, *, mknod: bool = False) -> LabState:
    """Return the lab a profile describes, with every address and number decided."""
    builder = _Builder(profile)
    units = _units(profile)
    for node in builder.nodes:
        mine = [u for n, u in units if n == node.id]
        i = 0
        while i < len(mine):
            unit = mine[i]
            per_switch = unit.group.per_switch
            if per_switch:
                batch = [u for u in mine[i : i + per_switch] if u.group is unit.group]
                builder.attach(node, batch, switched=True)
                i += len(batch)
            else:
                builder.attach(node, [unit], switched=False)
                i += 1
    c = profile.cpus_per_numa_node
    numa = [
        NumaState(id=n, cpulist=f"{n * c}-{n * c + c - 1}" if c > 1 else str(n))
        for n in range(profile.numa_nodes)
    ]
    state = LabState(
        profile=profile,
        mknod=mknod,
        numa_nodes=numa,
        host_bridges=builder.host_bridges,
        bridges=builder.bridges,
        switches=builder.switches,
        devices=dict(sorted(builder.devices.items(), key=lambda kv: name_key(kv[0]))),
    )
    _number(state)
    return state


def name_key(name: str) -> tuple[str, int]:
    """Sort key that puts ``gpu2`` before ``gpu10``."""
    head = name.rstrip("0123456789")
    return head, int(name[len(head) :])


def _number(state: LabState) -> None:
    """Assign the numbers drivers hand out in probe (bus) order."""
    by_bus = sorted(state.devices.values(), key=lambda d: d.primary.address)
    minor = card = kfd = fpga = 0
    kfd = len(state.numa_nodes)
    for dev in by_bus:
        if dev.kind is DeviceKind.GPU:
            model = catalog.GPUS[dev.model]
            if model.flavor == "nvidia":
                dev.minor = minor
                minor += 1
            else:
                dev.card = card
                card += 1
            if model.flavor == "amd":
                dev.kfd_node = kfd
                kfd += 1
                dev.gpu_id = int.from_bytes(hashlib.sha256(dev.primary.bdf.encode()).digest()[:2], "big") | 1
        elif dev.kind is DeviceKind.FPGA:
            dev.fpga_index = fpga
            fpga += 1
            if catalog.FPGAS[dev.model].flavor == "xilinx":
                dev.card = card
                card += 1
    for dev in list(state.devices.values()):
        if dev.kind is DeviceKind.NIC_PF:
            nic.set_vf_states(state, dev, _nic_group(state.profile, dev.name).num_vfs)


def _nic_group(profile: Profile, name: str) -> NicGroup:
    index = int(name.removeprefix("nic"))
    seen = 0
    for group in profile.nics:
        if index < seen + group.count:
            return group
        seen += group.count
    raise AssertionError(name)
