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

from plugvisor.emulators.lab import catalog, cpus, kinds, majors, pci
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
                nr_cpus=state.nr_cpus,
                msi_vectors=1,
            ),
        )
        spec[bridge.path] = Dir()


_MEMINFO_KEYS = (
    "MemTotal", "MemFree", "MemUsed", "SwapCached", "Active", "Inactive", "Active(anon)", "Inactive(anon)",
    "Active(file)", "Inactive(file)", "Unevictable", "Mlocked", "Dirty", "Writeback", "FilePages", "Mapped",
    "AnonPages", "Shmem", "KernelStack", "PageTables", "SecPageTables", "NFS_Unstable", "Bounce",
    "WritebackTmp", "KReclaimable", "Slab", "SReclaimable", "SUnreclaim", "AnonHugePages",
    "ShmemHugePages", "ShmemPmdMapped", "FileHugePages", "FilePmdMapped",
)  # fmt: skip
"""The ``kB`` lines of ``node<N>/meminfo``, in the order ``drivers/base/node.c`` prints them."""


def _node_meminfo(node: int, total_kb: int, hugepages: dict[int, int]) -> bytes:
    """``nodeN/meminfo``: ``Node N Key:`` padded to the kernel's column, ``%8lu kB``; huge pages ``%5u``."""
    reserved = sum(size * pages for size, pages in hugepages.items())
    used = reserved + total_kb // 50
    values = dict.fromkeys(_MEMINFO_KEYS, 0)
    values.update(MemTotal=total_kb, MemFree=total_kb - used, MemUsed=used, Slab=total_kb // 200)
    values.update(SUnreclaim=total_kb // 400, SReclaimable=total_kb // 400, KReclaimable=total_kb // 400)
    lines = [f"Node {node} {key + ':':<15} {value:8d} kB" for key, value in values.items()]
    default = hugepages.get(2048, 0)
    lines += [
        f"Node {node} HugePages_Total: {default:5d}",
        f"Node {node} HugePages_Free:  {default:5d}",
        f"Node {node} HugePages_Surp:  {0:5d}",
    ]
    return ("\n".join(lines) + "\n").encode()


def _proc_meminfo(total_kb: int, hugepages: dict[int, int]) -> bytes:
    """``/proc/meminfo`` for the whole node (the lines readers such as ghw take totals from)."""
    reserved = sum(size * pages for size, pages in hugepages.items())
    free = total_kb - reserved - total_kb // 50
    default = hugepages.get(2048, 0)
    rows = [
        ("MemTotal", f"{total_kb:8d} kB"),
        ("MemFree", f"{free:8d} kB"),
        ("MemAvailable", f"{free:8d} kB"),
        ("SwapTotal", f"{0:8d} kB"),
        ("SwapFree", f"{0:8d} kB"),
        ("HugePages_Total", f"{default:5d}"),
        ("HugePages_Free", f"{default:5d}"),
        ("HugePages_Rsvd", f"{0:5d}"),
        ("HugePages_Surp", f"{0:5d}"),
        ("Hugepagesize", f"{2048:8d} kB"),
        ("Hugetlb", f"{reserved:8d} kB"),
    ]
    return "".join(f"{key + ':':<15} {value}\n" for key, value in rows).encode()


def _numa(spec: Spec, state: LabState) -> None:
    """NUMA nodes as ``drivers/base/node.c`` shows them, memory as the profile says; CPUs from :mod:`.cpus`.

    Each NUMA node is one package of ``cpusPerNumaNode`` CPUs, numbered contiguously.
    """
    base = "sys/devices/system/node"
    profile = state.profile
    last = len(state.numa_nodes) - 1
    span = "0" if last == 0 else f"0-{last}"
    for name in ("online", "possible", "has_cpu", "has_memory", "has_normal_memory"):
        spec[f"{base}/{name}"] = text(span)
    per_node = profile.cpus_per_numa_node
    count = per_node * len(state.numa_nodes)
    cpus.render(spec, [range(n.id * per_node, (n.id + 1) * per_node) for n in state.numa_nodes])
    total_kb = profile.memory_per_numa_node_gib * 2**20
    hugepages = profile.hugepages_per_numa_node.sizes()
    for node in state.numa_nodes:
        d = f"{base}/node{node.id}"
        spec[f"{d}/cpulist"] = text(node.cpulist)
        spec[f"{d}/cpumap"] = text(pci.cpumask(node.cpulist, count))
        distances = " ".join("10" if other.id == node.id else "21" for other in state.numa_nodes)
        spec[f"{d}/distance"] = text(distances)
        spec[f"{d}/meminfo"] = File(_node_meminfo(node.id, total_kb, hugepages))
        for size, pages in hugepages.items():
            h = f"{d}/hugepages/hugepages-{size}kB"
            spec[f"{h}/nr_hugepages"] = File(f"{pages}\n".encode(), 0o644)
            spec[f"{h}/free_hugepages"] = text(pages)
            spec[f"{h}/surplus_hugepages"] = text(0)
        for cpu in range(node.id * per_node, (node.id + 1) * per_node):
            cpus.link_node(spec, cpu, d, node.id)
    for size, pages in hugepages.items():
        g = f"sys/kernel/mm/hugepages/hugepages-{size}kB"
        total = pages * len(state.numa_nodes)
        spec[f"{g}/nr_hugepages"] = File(f"{total}\n".encode(), 0o644)
        spec[f"{g}/nr_overcommit_hugepages"] = File(b"0\n", 0o644)
        spec[f"{g}/free_hugepages"] = text(total)
        spec[f"{g}/resv_hugepages"] = text(0)
        spec[f"{g}/surplus_hugepages"] = text(0)
    spec["proc/meminfo"] = File(_proc_meminfo(total_kb * len(state.numa_nodes), hugepages))


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
    outside = kinds.Shared()
    for kind, devices in by_kind.items():
        shared = kind.shared(state, devices)
        spec.update(shared.spec)
        used |= shared.majors
        drivers |= shared.drivers
        outside.names.update(shared.names)
        outside.modules.update(shared.modules)
        outside.pci_ids.update(shared.pci_ids)
    modules = {**MODULES, **outside.modules}
    for driver in sorted(drivers):
        driver_dir(spec, "pci", driver, modules.get(driver))
    lines = ["Character devices:", "  1 mem", "  4 /dev/vc/0", "  4 tty", "  5 /dev/tty", "  5 /dev/console"]
    names = {**majors.NAMES, **outside.names}
    names = {**_device_nodes(spec, state), **{major: names[major] for major in used}}
    lines += [f"{major:3d} {names[major]}" for major in sorted(names)]
    lines += ["", "Block devices:", "  7 loop", "  8 sd", "259 blkext"]
    spec["proc/devices"] = File(("\n".join(lines) + "\n").encode())
    spec["usr/share/hwdata/pci.ids"] = File(catalog.pci_ids(outside.pci_ids), 0o644)
    return spec
