"""SR-IOV NICs: physical functions, virtual functions and their network interfaces.

What the SR-IOV device plugin (through ghw) and the sriov operator read:
``sriov_totalvfs``/``sriov_numvfs`` on the PF, ``virtfn<i>``/``physfn`` links
between siblings under the same bridge, VF addresses derived from the PF's
routing id plus ``sriov_offset`` and ``sriov_stride``, ``net/<ifname>/operstate``,
and for VFs handed to userspace, ``/dev/vfio/<group>`` named after the VF's
``iommu_group``.
"""

from __future__ import annotations

import hashlib
import posixpath
from typing import Any, Final

from plugvisor.emulators.lab import catalog, kinds, majors, pci, rdma
from plugvisor.emulators.lab.pci import Bdf
from plugvisor.emulators.lab.profiles import NicGroup, Profile
from plugvisor.emulators.lab.spec import Dir, Spec, add_link, add_node, text, virtual_device
from plugvisor.emulators.lab.state import DeviceKind, DeviceState, FunctionState, LabState

LINK_DOWN = "link-down"
VFS_RESET = "vfs-reset"
VFIO_DRIVER = "vfio-pci"


def vf_address(pf: DeviceState, index: int) -> Bdf:
    """Return the address of a PF's VF ``index``, as the SR-IOV capability defines it."""
    assert pf.vf_offset is not None and pf.vf_stride is not None
    base = pf.primary.address
    return Bdf.from_routing_id(base.domain, base.routing_id + pf.vf_offset + index * pf.vf_stride)


def set_vf_states(state: LabState, pf: DeviceState, count: int) -> None:
    """Make ``pf`` have exactly ``count`` VFs in the state (all present), as the kernel does on a write."""
    for vf in state.vfs_of(pf.name):
        del state.devices[vf.name]
    pf.num_vfs = count
    rdma_model = catalog.NICS[pf.model].rdma
    with_rdma = rdma_model is not None and pf.vf_driver != VFIO_DRIVER
    taken = {d.rdma_index for d in state.devices.values() if d.rdma_index is not None}
    free = (n for n in range(1 << 16) if n not in taken)
    parent = posixpath.dirname(pf.primary.path)
    assert pf.vf_group_base is not None and pf.ifindex is not None
    for i in range(count):
        bdf = vf_address(pf, i)
        digest = hashlib.sha256(f"{pf.mac}/{i}".encode()).digest()
        name = f"{pf.name}vf{i}"
        state.devices[name] = DeviceState(
            name=name,
            kind=DeviceKind.NIC_VF,
            model=pf.model,
            numa_node=pf.numa_node,
            switch=pf.switch,
            functions=[
                FunctionState(
                    bdf=str(bdf),
                    path=f"{parent}/{bdf}",
                    role="vf",
                    driver=pf.vf_driver,
                    iommu_group=pf.vf_group_base + i,
                )
            ],
            netdev=None if pf.vf_driver == VFIO_DRIVER else f"{pf.netdev}v{i}",
            mac="02:" + ":".join(f"{b:02x}" for b in digest[:5]),
            ifindex=pf.ifindex * 1000 + i,
            parent=pf.name,
            vf_index=i,
            rdma_index=next(free) if with_rdma else None,
        )


def _netdev(spec: Spec, fn_path: str, dev: DeviceState, *, up: bool, speed_mbps: int, dev_port: int) -> None:
    """Add ``net/<ifname>/`` with the attributes link-state readers use, and its ``sys/class/net`` link."""
    assert dev.netdev is not None
    d = f"{fn_path}/net/{dev.netdev}"
    spec[d] = Dir()
    spec[f"{d}/operstate"] = text("up" if up else "down")
    spec[f"{d}/carrier"] = text(1 if up else 0)
    spec[f"{d}/address"] = text(dev.mac or "00:00:00:00:00:00")
    spec[f"{d}/broadcast"] = text("ff:ff:ff:ff:ff:ff")
    spec[f"{d}/mtu"] = text(1500)
    spec[f"{d}/ifindex"] = text(dev.ifindex or 0)
    spec[f"{d}/iflink"] = text(dev.ifindex or 0)
    spec[f"{d}/speed"] = text(speed_mbps if up else -1)
    spec[f"{d}/duplex"] = text("full" if up else "unknown")
    spec[f"{d}/type"] = text(1)
    spec[f"{d}/addr_len"] = text(6)
    spec[f"{d}/dev_port"] = text(dev_port)
    spec[f"{d}/tx_queue_len"] = text(1000)
    spec[f"{d}/flags"] = text("0x1003" if up else "0x1002")
    spec[f"{d}/uevent"] = text(f"INTERFACE={dev.netdev}\nIFINDEX={dev.ifindex}")
    add_link(spec, f"{d}/device", fn_path)
    add_link(spec, f"{d}/subsystem", "sys/class/net")
    add_link(spec, f"sys/class/net/{dev.netdev}", d)


def render_pf(state: LabState, dev: DeviceState) -> Spec:
    """Render a PF (its VFs render separately, see :func:`render_vf`)."""
    model = catalog.NICS[dev.model]
    fn = dev.primary
    spec: Spec = {}
    address = fn.address
    extra = {
        "sriov_totalvfs": str(dev.total_vfs),
        "sriov_numvfs": str(dev.num_vfs),
        "sriov_offset": str(dev.vf_offset),
        "sriov_stride": str(dev.vf_stride),
        "sriov_vf_device": f"{model.vf.device:x}",
        "sriov_vf_total_msix": "0",
        "sriov_drivers_autoprobe": "1",
    }
    pci.render_function(
        spec,
        pci.Function(
            bdf=address,
            path=fn.path,
            identity=model.pf,
            driver=fn.driver,
            numa_node=dev.numa_node,
            cpulist=state.cpulist(dev.numa_node),
            iommu_group=fn.iommu_group,
            link_speed=model.link_speed,
            aer=dev.aer,
            link_degraded=pci.LINK_DEGRADED in dev.faults,
            multifunction=address.function > 0 or _ports(state, dev) > 1,
            extra=extra,
            bars=pf_bars(dev),
            nr_cpus=state.nr_cpus,
            msi_vectors=4,
        ),
    )
    up = LINK_DOWN not in dev.faults
    _netdev(spec, fn.path, dev, up=up, speed_mbps=model.speed_mbps, dev_port=0)
    if model.rdma is not None and dev.rdma_index is not None:
        rdma.render(spec, fn.path, model.rdma, dev, link_up=up)
    return spec


def pf_bars(pf: DeviceState) -> tuple[pci.Bar, ...]:
    """A PF's BARs, its SR-IOV BARs sized for ``sriov_totalvfs`` VFs."""
    model = catalog.NICS[pf.model]
    return pci.assign_bars(pf.primary.address, model.pf_bars, model.vf_bars, pf.total_vfs or 0)


def _ports(state: LabState, dev: DeviceState) -> int:
    prefix = dev.primary.bdf[:-1]
    return sum(
        1 for d in state.devices.values() if d.kind is DeviceKind.NIC_PF and d.primary.bdf[:-1] == prefix
    )


def render_vf(state: LabState, dev: DeviceState) -> Spec:
    """Render a VF: its function, the ``physfn``/``virtfn`` pair, and its netdev or vfio node."""
    assert dev.parent is not None and dev.vf_index is not None
    pf = state.devices[dev.parent]
    model = catalog.NICS[dev.model]
    fn = dev.primary
    spec: Spec = {}
    pci.render_function(
        spec,
        pci.Function(
            bdf=fn.address,
            path=fn.path,
            identity=model.vf,
            driver=fn.driver,
            numa_node=dev.numa_node,
            cpulist=state.cpulist(dev.numa_node),
            iommu_group=fn.iommu_group,
            link_speed=model.link_speed,
            aer=dev.aer,
            bars=pci.vf_bars(pf_bars(pf), dev.vf_index, pf.total_vfs or 0),
            nr_cpus=state.nr_cpus,
            msi_vectors=2,
        ),
    )
    add_link(spec, f"{fn.path}/physfn", pf.primary.path)
    add_link(spec, f"{pf.primary.path}/virtfn{dev.vf_index}", fn.path)
    if fn.driver == VFIO_DRIVER:
        assert fn.iommu_group is not None
        group = fn.iommu_group
        virtual = f"sys/devices/virtual/vfio/{group}"
        spec[virtual] = Dir()
        spec[f"{virtual}/dev"] = text(f"{majors.VFIO}:{group}")
        spec[f"{virtual}/uevent"] = text(f"MAJOR={majors.VFIO}\nMINOR={group}\nDEVNAME=vfio/{group}")
        add_node(spec, at=f"dev/vfio/{group}", major=majors.VFIO, minor=group, sys_target=virtual, mode=0o600)
    elif dev.netdev:
        up = LINK_DOWN not in dev.faults and LINK_DOWN not in pf.faults
        _netdev(spec, fn.path, dev, up=up, speed_mbps=model.speed_mbps, dev_port=0)
        if model.rdma is not None and dev.rdma_index is not None:
            rdma.render(spec, fn.path, model.rdma, dev, link_up=up)
    return spec


def _group(profile: Profile, name: str) -> NicGroup:
    """The profile group a PF (``nic<i>``) came from."""
    index = int(name.removeprefix("nic"))
    seen = 0
    for group in profile.nics:
        if index < seen + group.count:
            return group
        seen += group.count
    raise AssertionError(name)


class _NicKind:
    """SR-IOV NICs: PFs (ports of a card) placed from the profile, VFs derived from ``sriov_numvfs``."""

    owns: tuple[str, ...] = (DeviceKind.NIC_PF, DeviceKind.NIC_VF)
    section: str | None = "nics"
    prefix = "nic"

    def ports(self, group: Any) -> int:
        ports: int = group.ports_per_card
        return ports

    def buses(self, group: Any) -> int:
        model = catalog.NICS[group.model]
        total = model.max_vfs if group.total_vfs is None else group.total_vfs
        rids: int = max(model.first_vf_offset, group.ports_per_card) + group.ports_per_card * total
        return -(-rids // 256)

    def place(
        self,
        placer: kinds.Placer,
        names: list[str],
        group: Any,
        *,
        node: int,
        parent: str,
        bus: int,
        switch: str | None,
    ) -> None:
        model = catalog.NICS[group.model]
        total = model.max_vfs if group.total_vfs is None else group.total_vfs
        ports = group.ports_per_card
        first = max(model.first_vf_offset, ports)
        base = Bdf.on_bus(bus, 0, 0).routing_id
        vf_driver = VFIO_DRIVER if group.vf_driver == VFIO_DRIVER else model.vf_driver
        for port, name in enumerate(names):
            bdf = Bdf.on_bus(bus, 0, port)
            fn = placer.function(parent, bdf, "pf", model.pf_driver)
            digest = hashlib.sha256(f"{placer.profile_name}/{name}".encode()).digest()
            placer.add(
                DeviceState(
                    name=name,
                    kind=DeviceKind.NIC_PF,
                    model=model.key,
                    numa_node=node,
                    switch=switch,
                    functions=[fn],
                    netdev=f"enp{bus}s0f{port}",
                    mac=f"{model.oui}:{digest[0]:02x}:{digest[1]:02x}:{digest[2]:02x}",
                    ifindex=placer.next_ifindex(),
                    total_vfs=total,
                    num_vfs=0,
                    vf_offset=base + first + port * total - (base + port),
                    vf_stride=1,
                    vf_driver=vf_driver,
                    vf_group_base=placer.group_id(total),
                )
            )

    def number(self, state: LabState, dev: DeviceState, counters: dict[str, int]) -> None:
        if dev.kind is DeviceKind.NIC_PF and catalog.NICS[dev.model].rdma is not None:
            dev.rdma_index = counters.get("rdma", 0)
            counters["rdma"] = dev.rdma_index + 1

    def finish(self, state: LabState, dev: DeviceState) -> None:
        if dev.kind is DeviceKind.NIC_PF:
            set_vf_states(state, dev, _group(state.profile, dev.name).num_vfs)

    def render(self, state: LabState, dev: DeviceState) -> Spec:
        if dev.kind is DeviceKind.NIC_PF:
            return render_pf(state, dev)
        assert dev.parent is not None
        if not state.devices[dev.parent].present:
            return {}
        return render_vf(state, dev)

    def family(self, state: LabState, dev: DeviceState) -> list[str]:
        if dev.kind is DeviceKind.NIC_PF:
            return [dev.name, *(vf.name for vf in state.vfs_of(dev.name))]
        return [dev.name]

    def identity(self, dev: DeviceState) -> pci.Identity:
        model = catalog.NICS[dev.model]
        return model.pf if dev.kind is DeviceKind.NIC_PF else model.vf

    def faults(self, dev: DeviceState) -> tuple[str, ...]:
        port = (rdma.PORT_DOWN,) if dev.rdma_index is not None else ()
        if dev.kind is DeviceKind.NIC_PF:
            return (LINK_DOWN, VFS_RESET, pci.LINK_DEGRADED, *port)
        return ((LINK_DOWN,) if dev.netdev else ()) + port

    def shared(self, state: LabState, devices: list[DeviceState]) -> kinds.Shared:
        out = kinds.Shared()
        pfs = [d for d in devices if d.kind is DeviceKind.NIC_PF]
        if pfs:
            # Every NIC node has the kernel's tun and vhost-net misc devices (SR-IOV configs ask for them).
            out.spec["sys/class/net"] = Dir()
            out.majors.add(majors.MISC)
            virtual_device(
                out.spec, "sys/devices/virtual/misc/tun", majors.MISC, majors.TUN_MINOR, "dev/net/tun"
            )
            virtual_device(
                out.spec,
                "sys/devices/virtual/misc/vhost-net",
                majors.MISC,
                majors.VHOST_NET_MINOR,
                "dev/vhost-net",
            )
        if any(d.rdma_index is not None for d in devices):
            out.majors |= rdma.shared(out.spec)
        out.drivers = {d.vf_driver for d in pfs if d.vf_driver}
        if VFIO_DRIVER in out.drivers:
            out.majors.add(majors.VFIO)
            virtual_device(
                out.spec,
                "sys/devices/virtual/misc/vfio",
                majors.MISC,
                majors.VFIO_CONTAINER_MINOR,
                "dev/vfio/vfio",
            )
        return out


KIND: Final = _NicKind()
"""What the registry finds under ``nic`` (:data:`.kinds.BUILTIN`)."""
