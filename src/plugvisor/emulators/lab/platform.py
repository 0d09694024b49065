"""What a node has besides its devices: bridges, drivers, modules, shared nodes, side data.

These entries are written once at creation and stay for the lab's life, as they
would on a real node across device faults: root ports and switch ports, the
``sys/bus/pci/drivers/<drv>`` directories (with ``module`` links, and
``sys/module/<mod>/drivers/pci:<drv>`` back, which is how ROCm's plugin finds
``amdgpu``), control nodes such as ``/dev/nvidiactl`` and ``/dev/vfio/vfio``,
the KFD CPU nodes, NUMA nodes under ``sys/devices/system/node``,
``proc/devices`` and a ``pci.ids`` naming every device.
"""

from __future__ import annotations

from plugvisor.emulators.lab import catalog, gpu, majors, pci
from plugvisor.emulators.lab.spec import Dir, File, Spec, add_link, add_node, text
from plugvisor.emulators.lab.state import DeviceKind, LabState

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

PLATFORM_DRIVERS = {"dfl-fme": "dfl_fme", "dfl-port": "dfl_afu"}


def _virtual(spec: Spec, path: str, major: int, minor: int, node: str) -> None:
    spec[path] = Dir()
    spec[f"{path}/dev"] = text(f"{major}:{minor}")
    name = node.removeprefix("dev/")
    spec[f"{path}/uevent"] = text(f"MAJOR={major}\nMINOR={minor}\nDEVNAME={name}")
    add_node(spec, at=node, major=major, minor=minor, sys_target=path)


def _driver_dir(spec: Spec, bus: str, driver: str, module: str | None) -> None:
    d = f"sys/bus/{bus}/drivers/{driver}"
    spec[d] = Dir()
    for name in ("bind", "unbind", "uevent") + (("new_id", "remove_id") if bus == "pci" else ()):
        spec[f"{d}/{name}"] = File(b"", 0o200)
    if module:
        m = f"sys/module/{module}"
        spec[f"{m}/initstate"] = text("live")
        spec[f"{m}/refcnt"] = text(0)
        add_link(spec, f"{d}/module", m)
        add_link(spec, f"{m}/drivers/{bus}:{driver}", d)


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


def _kfd(spec: Spec, state: LabState) -> None:
    _virtual(spec, "sys/devices/virtual/kfd/kfd", majors.KFD, 0, "dev/kfd")
    add_link(spec, "sys/class/kfd/kfd", "sys/devices/virtual/kfd/kfd")
    topo = "sys/devices/virtual/kfd/kfd/topology"
    spec[f"{topo}/generation_id"] = text(1)
    spec[f"{topo}/system_properties"] = File(b"platform_oem 0\nplatform_id 0\nplatform_rev 0\n")
    cores = state.profile.cpus_per_numa_node
    for node in state.numa_nodes:
        d = f"{gpu.KFD_NODES}/{node.id}"
        others = [o for o in state.numa_nodes if o.id != node.id]
        spec[f"{d}/properties"] = File(
            gpu.kfd_properties(cpu_cores=cores, cpu_core_base=node.id * cores, io_links=len(others))
        )
        spec[f"{d}/gpu_id"] = text(0)
        spec[f"{d}/name"] = text("")
        spec[f"{d}/io_links"] = Dir()
        spec[f"{d}/p2p_links"] = Dir()
        for k, other in enumerate(others):
            spec[f"{d}/io_links/{k}/properties"] = File(gpu.io_link(2, node.id, other.id, 21))


def _nvidia(spec: Spec) -> None:
    """Add the NVIDIA driver's shared nodes and procfs entries."""
    _virtual(
        spec,
        "sys/devices/virtual/nvidia/nvidiactl",
        majors.NVIDIA,
        majors.NVIDIACTL_MINOR,
        "dev/nvidiactl",
    )
    _virtual(
        spec,
        "sys/devices/virtual/nvidia/nvidia-modeset",
        majors.NVIDIA,
        majors.NVIDIA_MODESET_MINOR,
        "dev/nvidia-modeset",
    )
    _virtual(spec, "sys/devices/virtual/nvidia-uvm/nvidia-uvm", majors.NVIDIA_UVM, 0, "dev/nvidia-uvm")
    _virtual(
        spec,
        "sys/devices/virtual/nvidia-uvm/nvidia-uvm-tools",
        majors.NVIDIA_UVM,
        1,
        "dev/nvidia-uvm-tools",
    )
    spec["proc/driver/nvidia/gpus"] = Dir()
    spec["proc/driver/nvidia/version"] = text(
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n"
        "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)"
    )
    spec["proc/driver/nvidia/params"] = text("ModifyDeviceFiles: 1\nDeviceFileUID: 0\nDeviceFileGID: 0")


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
    flavors: set[str] = set()
    for dev in state.devices.values():
        drivers.update(fn.driver for fn in dev.functions if fn.driver)
        if dev.kind is DeviceKind.GPU:
            flavors.add(catalog.GPUS[dev.model].flavor)
        elif dev.kind is DeviceKind.NIC_PF:
            drivers.add(dev.vf_driver or "")
            spec["sys/class/net"] = Dir()
        elif dev.kind is DeviceKind.FPGA:
            flavors.add(catalog.FPGAS[dev.model].flavor)
    drivers.discard("")
    for driver in sorted(drivers):
        _driver_dir(spec, "pci", driver, MODULES.get(driver))
    used = {majors.MISC}
    if "nvidia" in flavors:
        used |= {majors.NVIDIA, majors.NVIDIA_UVM}
        _nvidia(spec)
    if flavors & {"intel", "amd", "xilinx"}:
        used.add(majors.DRM)
        spec["sys/class/drm"] = Dir()
        spec["dev/dri/by-path"] = Dir()
    if "amd" in flavors:
        used.add(majors.KFD)
        _kfd(spec, state)
    if "dfl" in flavors:
        used |= {majors.DFL_FME, majors.DFL_PORT}
        spec["sys/class/fpga_region"] = Dir()
        for driver, module in PLATFORM_DRIVERS.items():
            _driver_dir(spec, "platform", driver, module)
    if "xilinx" in flavors:
        used.add(majors.XCLMGMT)
    if "vfio-pci" in drivers:
        used.add(majors.VFIO)
        _virtual(
            spec, "sys/devices/virtual/misc/vfio", majors.MISC, majors.VFIO_CONTAINER_MINOR, "dev/vfio/vfio"
        )
    lines = ["Character devices:", "  1 mem", "  4 /dev/vc/0", "  4 tty", "  5 /dev/tty", "  5 /dev/console"]
    lines += [f"{major:3d} {majors.NAMES[major]}" for major in sorted(used)]
    lines += ["", "Block devices:", "  7 loop", "  8 sd", "259 blkext"]
    spec["proc/devices"] = File(("\n".join(lines) + "\n").encode())
    spec["usr/share/hwdata/pci.ids"] = File(catalog.pci_ids(), 0o644)
    return spec
