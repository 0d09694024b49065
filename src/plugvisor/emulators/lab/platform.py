"""What a node has besides its devices: bridges, drivers, modules, shared nodes, side data.

These entries are written once at creation and stay for the lab's life, as they
would on a real node across device faults: root ports and switch ports, the
``sys/bus/pci/drivers/<drv>`` directories (with ``module`` links, and
``sys/module/<mod>/drivers/pci:<drv>`` back, which is how ROCm's plugin finds
``amdgpu``), NUMA nodes under ``sys/devices/system/node``, the profile's plain
device nodes (``deviceNodes``: ``/dev/fuse`` and the like, as virtual devices),
``proc/devices`` and a ``pci.ids`` naming every device. What a kind needs node-wide
(``/dev/nvidiactl``, the KFD CPU nodes, ``/dev/vfio/vfio``) comes from its module's ``shared()``.
"""

from __future__ import annotations

from plugvisor.emulators.lab import catalog, kinds, majors, pci
from plugvisor.emulators.lab.spec import Dir, File, Spec, add_link, driver_dir, text, virtual_device
from plugvisor.emulators.lab.state import DeviceState, LabState

MODULES = {
    "nvidia": "nvidia",
    "i915": "i915",
    "amdgpu": "amdgpu",
    "dfl-pci": "dfl_pci",
    "xclmgmt": "xclmgmt",
    "xocl": "xocl",
    "ice": "ice",
    "iavf": "iavf",
    "mlx5_core": "mlx5_core",
    "vfio-pci": "vfio_pci",
}
"""PCI driver name -> module name (``pcieport`` is built in and has none)."""


def _bridges(spec: Spec, state: LabState) -> None:
    for bridge in state.bridges:
        ident = catalog.ROOT_PORT if bridge.role == "root-port" else catalog.SWITCH
        pci.render_function(
            spec,
            pci.Function(
                bdf=pci.Bdf.parse(bridge.bdf),
                path=bridge.path,
                identity=ident,
                driver="pcieport",
                numa_node=bridge.numa_node,
                cpulist=state.cpulist(bridge.numa_node),
                iommu_group=bridge.iommu_group,
                link_speed="32.0 GT/s PCIe",
                bridge_buses=bridge.buses,
            ),
        )
        spec[bridge.path] = Dir()


def _numa(spec: Spec, state: LabState) -> None:
    base = "sys/devices/system/node"
    last = len(state.numa_nodes) - 1
    span = "0" if last == 0 else f"0-{last}"
    for name in ("online", "possible", "has_cpu", "has_normal_memory"):
        spec[f"{base}/{name}"] = text(span)
    for node in state.numa_nodes:
        d = f"{base}/node{node.id}"
        spec[f"{d}/cpulist"] = text(node.cpulist)
        distances = " ".join("10" if other.id == node.id else "21" for other in state.numa_nodes)
        spec[f"{d}/distance"] = text(distances)


def _device_nodes(spec: Spec, state: LabState) -> dict[int, str]:
    """Render the profile's plain device nodes; return the majors they add to ``proc/devices``."""
    for node in state.profile.device_nodes:
        name = node.path.rsplit("/", 1)[-1]
        where = f"sys/devices/virtual/{node.subsystem}/{name}"
        virtual_device(spec, where, node.major, node.minor, f"dev/{node.path}")
        add_link(spec, f"sys/class/{node.subsystem}/{name}", where)
    return {n.major: n.subsystem for n in state.profile.device_nodes if n.major not in majors.NAMES}


def render(state: LabState) -> Spec:
    """Render everything that is not a device."""
    spec: Spec = {"sys/kernel/iommu_groups": Dir(), "sys/bus/pci/devices": Dir(), "sys/dev/char": Dir()}
    spec["dev/char"] = Dir()
    spec["sys/bus/pci/drivers_autoprobe"] = File(b"1\n", 0o644)
    spec["sys/bus/pci/drivers_probe"] = File(b"", 0o200)
    spec["sys/bus/pci/rescan"] = File(b"", 0o200)
    _bridges(spec, state)
    _numa(spec, state)
    drivers = {"pcieport"}
    used = {majors.MISC}
    by_kind: dict[kinds.LabKind, list[DeviceState]] = {}
    for dev in state.devices.values():
        drivers.update(fn.driver for fn in dev.functions if fn.driver)
        by_kind.setdefault(kinds.get(dev.kind), []).append(dev)
    for kind, devices in by_kind.items():
        shared = kind.shared(state, devices)
        spec.update(shared.spec)
        used |= shared.majors
        drivers |= shared.drivers
    for driver in sorted(drivers):
        driver_dir(spec, "pci", driver, MODULES.get(driver))
    lines = ["Character devices:", "  1 mem", "  4 /dev/vc/0", "  4 tty", "  5 /dev/tty", "  5 /dev/console"]
    names = {**_device_nodes(spec, state), **{major: majors.NAMES[major] for major in used}}
    lines += [f"{major:3d} {names[major]}" for major in sorted(names)]
    lines += ["", "Block devices:", "  7 loop", "  8 sd", "259 blkext"]
    spec["proc/devices"] = File(("\n".join(lines) + "\n").encode())
    spec["usr/share/hwdata/pci.ids"] = File(catalog.pci_ids(), 0o644)
    return spec
