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

from dataclasses import dataclass, field

from plugvisor.emulators.lab import errors, kinds
from plugvisor.emulators.lab.pci import Bdf
from plugvisor.emulators.lab.profiles import GpuGroup, Placement, Profile
from plugvisor.emulators.lab.state import (
    BridgeState,
    DeviceState,
    FunctionState,
    LabState,
    NumaState,
    SwitchState,
)

MAX_ROOT_PORTS = 31


@dataclass
class _Unit:
    """One thing that occupies a PCIe slot: a GPU, an FPGA card or a NIC card."""

    kind: kinds.LabKind
    section: str
    index: int
    group: Placement
    names: list[str]
    buses: int = 1
    member: int = 0
    """The unit's first device's place within its group."""

    def fixed_address(self) -> Bdf | None:
        """The root-bus address the profile gives this unit's GPU (``devices[].pciAddress``), if any."""
        if not isinstance(self.group, GpuGroup) or self.member >= len(self.group.devices):
            return None
        address = self.group.devices[self.member].pci_address
        return Bdf.parse(address) if address else None


@dataclass
class _Node:
    """Bus bookkeeping for one NUMA node.

    Bus numbers here count across PCI domains (``domain << 8 | bus``, see
    :meth:`~.pci.Bdf.on_bus`). A node starts in domain 0, on its share of its 256
    buses (so small labs have the addresses they always had); when that runs out it
    goes on in a domain of its own (1 + its id, then that plus the node count...),
    as servers with thousands of devices have several PCI segments. A root port and
    everything below it stay in one domain.
    """

    id: int
    next_bus: int
    limit: int
    source: str
    nodes: int
    host_bridges: list[tuple[int, int]] = field(default_factory=list)
    """``(root bus, next root-port device number)`` per host bridge."""
    overflows: int = 0

    def make_room(self, count: int, *, what: str) -> None:
        """Move to a fresh domain unless ``count`` more buses fit in this one."""
        if self.next_bus + count <= self.limit:
            return
        if count > 0xFF:
            raise errors.ProfileError(
                self.source, [(what, f"needs {count} PCI bus numbers; a PCI domain has 256")]
            )
        self.overflows += 1
        domain = self.id + 1 + (self.overflows - 1) * self.nodes
        if domain > 0xFFFF:
            raise errors.ProfileError(
                self.source, [(what, f"too many devices on NUMA node {self.id}: PCI domains ran out")]
            )
        self.next_bus, self.limit = domain << 8, (domain + 1) << 8
        self.host_bridges.append((-1, MAX_ROOT_PORTS + 1))  # the next root port opens a host bridge here

    def bus(self, count: int = 1, *, what: str) -> int:
        self.make_room(count, what=what)
        first = self.next_bus
        self.next_bus += count
        return first


class _Builder:
    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self.nodes: list[_Node] = []
        span = 256 // profile.numa_nodes
        for n in range(profile.numa_nodes):
            self.nodes.append(
                _Node(n, n * span, (n + 1) * span, f"profile {profile.name}", nodes=profile.numa_nodes)
            )
        self.bridges: list[BridgeState] = []
        self.switches: list[SwitchState] = []
        self.devices: dict[str, DeviceState] = {}
        self.host_bridges: list[str] = []
        self.iommu_group = 0
        self.ifindex = 2
        self.taken: set[tuple[int, int]] = set()
        """(root bus, device number) pairs that devices placed on a root bus hold."""

    def group_id(self, count: int = 1) -> int:
        first = self.iommu_group
        self.iommu_group += count
        return first

    # -- bridges ---------------------------------------------------------------------------------

    def root_port(self, node: _Node, *, what: str) -> tuple[str, int]:
        """Allocate a root port; return its path and bus."""
        if node.host_bridges and (node.host_bridges[-1][0], node.host_bridges[-1][1]) in self.taken:
            root_bus, devno = node.host_bridges[-1]
            while devno <= MAX_ROOT_PORTS and (root_bus, devno) in self.taken:
                devno += 1
            node.host_bridges[-1] = (root_bus, devno)
        if not node.host_bridges or node.host_bridges[-1][1] > MAX_ROOT_PORTS:
            root_bus = node.bus(what=what)
            devno = 1
            while (root_bus, devno) in self.taken:
                devno += 1
            node.host_bridges.append((root_bus, devno))
            if _host_bridge(root_bus) not in self.host_bridges:
                self.host_bridges.append(_host_bridge(root_bus))
        root_bus, devno = node.host_bridges[-1]
        node.host_bridges[-1] = (root_bus, devno + 1)
        bdf = Bdf.on_bus(root_bus, devno, 0)
        return f"sys/devices/{_host_bridge(root_bus)}/{bdf}", root_bus

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
                buses=_in_domain(buses),
                iommu_group=self.group_id() if self.profile.iommu_groups else None,
            )
        )

    def on_root_bus(self, node: _Node, unit: _Unit, address: Bdf) -> None:
        """Put ``unit`` directly on the root bus at ``address``, with no root port (a VM's layout)."""
        root = f"sys/devices/{_host_bridge(address.bus)}"
        if _host_bridge(address.bus) not in self.host_bridges:
            self.host_bridges.append(_host_bridge(address.bus))
        self.taken.add((address.bus, address.device))
        before = set(self.devices)
        self.place(unit, node, parent=root, bus=address.bus, switch=None)
        for name in set(self.devices) - before:
            for fn in self.devices[name].functions:
                fn.bdf = str(address)
                fn.path = f"{root}/{address}"

    def attach(self, node: _Node, units: list[_Unit], *, switched: bool) -> None:
        """Put ``units`` on one root port, behind a switch if asked."""
        what = f"{units[0].section}[{units[0].index}]"
        # The root port's tree stays in one domain: its buses (and a new host bridge's) must fit.
        node.make_room(2 + int(switched) + sum(unit.buses for unit in units), what=what)
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
            self.bridges[rp_index].buses = _in_domain((root_bus, secondary, max(extra, secondary)))
            return
        name = f"sw{len(self.switches)}"
        self.add_bridge(
            path=rp_path, role="root-port", node=node, switch=None, buses=(root_bus, secondary, 0)
        )
        up_path = f"{rp_path}/{Bdf.on_bus(secondary, 0, 0)}"
        internal = node.bus(what=what)
        up_index = len(self.bridges)
        self.add_bridge(path=up_path, role="upstream", node=node, switch=name, buses=(secondary, internal, 0))
        downstream: list[str] = []
        for k, unit in enumerate(units):
            dn_bdf = Bdf.on_bus(internal, k, 0)
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
        self.bridges[up_index].buses = _in_domain((secondary, internal, last))
        self.bridges[rp_index].buses = _in_domain((root_bus, secondary, last))
        self.switches.append(
            SwitchState(
                name=name, numa_node=node.id, upstream=str(Bdf.on_bus(secondary, 0, 0)), downstream=downstream
            )
        )

    # -- endpoints (the kind modules decide what a unit is; see kinds.py) -----------------------------

    def place(self, unit: _Unit, node: _Node, *, parent: str, bus: int, switch: str | None) -> None:
        before = set(self.devices)
        unit.kind.place(self, unit.names, unit.group, node=node.id, parent=parent, bus=bus, switch=switch)
        for k, name in enumerate(unit.names):
            if name in self.devices and name not in before:
                self.devices[name].group = unit.index
                self.devices[name].member = unit.member + k

    @property
    def profile_name(self) -> str:
        return self.profile.name

    def function(self, parent: str, bdf: Bdf, role: str, driver: str | None) -> FunctionState:
        return FunctionState(
            bdf=str(bdf),
            path=f"{parent}/{bdf}",
            role=role,  # type: ignore[arg-type]
            driver=driver,
            iommu_group=self.group_id() if self.profile.iommu_groups else None,
        )

    def next_ifindex(self) -> int:
        self.ifindex += 1
        return self.ifindex - 1

    def add(self, dev: DeviceState) -> None:
        self.devices[dev.name] = dev


def _host_bridge(root_bus: int) -> str:
    """The sysfs name of the host bridge whose root bus is ``root_bus`` (counting across domains)."""
    return f"pci{root_bus >> 8:04x}:{root_bus & 0xFF:02x}"


def _in_domain(buses: tuple[int, int, int]) -> tuple[int, int, int]:
    """A bridge's (primary, secondary, subordinate) bus numbers as its config space holds them."""
    primary, secondary, subordinate = buses
    return primary & 0xFF, secondary & 0xFF, subordinate & 0xFF


def _units(profile: Profile) -> list[tuple[int, _Unit]]:
    """Expand the profile's groups into slot-sized units, each assigned a NUMA node."""
    out: list[tuple[int, _Unit]] = []
    for kind in kinds.placing():
        assert kind.section is not None
        counter = 0
        groups: list[Placement] = kinds.groups(profile, kind)
        for gi, group in enumerate(groups):
            nodes = group.numa_nodes or list(range(profile.numa_nodes))
            per_unit = kind.ports(group)
            count = group.count // per_unit
            buses = kind.buses(group)
            for i in range(count):
                names = [f"{kind.prefix}{counter + k}" for k in range(per_unit)]
                counter += per_unit
                unit = _Unit(kind, kind.section, gi, group, names, buses, member=i * per_unit)
                out.append((nodes[i * len(nodes) // count], unit))
    return out


def build(profile: Profile, *, mknod: bool = False) -> LabState:
    """Return the lab a profile describes, with every address and number decided."""
    builder = _Builder(profile)
    units = _units(profile)
    for node in builder.nodes:
        for unit in [u for n, u in units if n == node.id]:
            address = unit.fixed_address()
            if address is not None:
                builder.on_root_bus(node, unit, address)
    for node in builder.nodes:
        mine = [u for n, u in units if n == node.id and u.fixed_address() is None]
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
    if not profile.numa_information:
        # The firmware gave no NUMA information: the kernel reads -1 for every device's node.
        for dev in builder.devices.values():
            dev.numa_node = -1
        for bridge in builder.bridges:
            bridge.numa_node = -1
        for switch in builder.switches:
            switch.numa_node = -1
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
    """Assign the numbers drivers hand out in probe (bus) order, then let each device finish."""
    counters = {"kfd": len(state.numa_nodes)}
    for dev in sorted(state.devices.values(), key=lambda d: d.primary.address):
        kinds.get(dev.kind).number(state, dev, counters)
    for dev in list(state.devices.values()):
        kinds.get(dev.kind).finish(state, dev)
