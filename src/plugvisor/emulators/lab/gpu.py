"""GPUs in the three shapes real plugins know.

* **NVIDIA-like**: ``/dev/nvidia<minor>`` (195:minor) and the procfs
  ``information`` file the container toolkit parses; the shared control nodes are
  platform-wide (see :mod:`.platform`).
* **Intel-like DRM**: ``drm/cardN`` and ``renderD<128+N>`` under the PCI
  function, ``sys/class/drm/cardN`` as a link into it (Intel's plugin parses the
  BDF from that link's target), ``/dev/dri`` nodes and ``by-path`` links.
* **AMD-like**: the same DRM nodes plus a KFD topology node whose
  ``properties`` (``location_id``, ``drm_render_minor``, ``gfx_target_version``)
  and ``io_links`` are what ROCm's plugin maps and scores.

A GPU that has fallen off the bus keeps its PCI directory (the kernel does) but
loses its driver, its device nodes and its readable config space.
"""

from __future__ import annotations

import hashlib
import uuid
from typing import Any, Final

from plugvisor.emulators.lab import catalog, hwmon, kinds, majors, pci
from plugvisor.emulators.lab.catalog import GpuModel
from plugvisor.emulators.lab.pci import Bdf
from plugvisor.emulators.lab.profiles import GpuGroup, Profile
from plugvisor.emulators.lab.spec import Dir, File, Node, Spec, add_link, add_node, text, virtual_device
from plugvisor.emulators.lab.state import DeviceKind, DeviceState, GpuCounters, LabState

FALLEN_OFF_BUS = "fallen-off-bus"
ECC_DBE = "ecc-dbe"
ECC_SBE = "ecc-sbe"
XID = "xid-<N>"
"""How the XID faults are listed: ``xid-1`` .. ``xid-65535`` (see :func:`parse_xid`)."""
XID_RANGE = (1, 65535)


def parse_xid(name: str) -> int | None:
    """Return N of an ``xid-<N>`` fault name, None for another fault; raise ValueError out of range."""
    if not name.startswith("xid-"):
        return None
    number = name.removeprefix("xid-")
    low, high = XID_RANGE
    # one name per XID: "xid-079" would be a second fault beside "xid-79", so leading zeros are refused
    if (
        not number.isascii()
        or not number.isdigit()
        or number != str(int(number))
        or not low <= int(number) <= high
    ):
        raise ValueError(
            f"fault {name!r}: expected xid-<N> with N a decimal number in {low}..{high}, no leading zeros"
        )
    return int(number)


_UUID_NAMESPACE = uuid.UUID("6d3c1f0e-4a8b-5c2d-9e7f-1a2b3c4d5e6f")
KFD_NODES = "sys/devices/virtual/kfd/kfd/topology/nodes"
KFD_PROPERTIES = (
    "cpu_cores_count",
    "simd_count",
    "mem_banks_count",
    "caches_count",
    "io_links_count",
    "p2p_links_count",
    "cpu_core_id_base",
    "simd_id_base",
    "max_waves_per_simd",
    "lds_size_in_kb",
    "gds_size_in_kb",
    "num_gws",
    "wave_front_size",
    "array_count",
    "simd_arrays_per_engine",
    "cu_per_simd_array",
    "simd_per_cu",
    "max_slots_scratch_cu",
    "gfx_target_version",
    "vendor_id",
    "device_id",
    "location_id",
    "domain",
    "drm_render_minor",
    "hive_id",
    "num_sdma_engines",
    "num_sdma_xgmi_engines",
    "num_sdma_queues_per_engine",
    "num_cp_queues",
    "max_engine_clk_fcompute",
    "local_mem_size",
    "fw_version",
    "capability",
    "debug_prop",
    "sdma_fw_version",
    "unique_id",
    "num_xcc",
    "max_engine_clk_ccompute",
)
"""The keys of a KFD node's ``properties``, in the order the kernel prints them."""


def render_drm(spec: Spec, fn_path: str, bdf: str, card: int, *, lmem_bytes: int = 0) -> None:
    """Add ``cardN`` and ``renderD<128+N>`` under a PCI function, with their class links and nodes."""
    for name, minor in (
        (f"card{card}", card),
        (f"renderD{majors.RENDER_BASE + card}", majors.RENDER_BASE + card),
    ):
        d = f"{fn_path}/drm/{name}"
        spec[d] = Dir()
        spec[f"{d}/dev"] = text(f"{majors.DRM}:{minor}")
        spec[f"{d}/uevent"] = text(
            f"MAJOR={majors.DRM}\nMINOR={minor}\nDEVNAME=dri/{name}\nDEVTYPE=drm_minor"
        )
        add_link(spec, f"{d}/device", fn_path)
        add_link(spec, f"{d}/subsystem", "sys/class/drm")
        add_link(spec, f"sys/class/drm/{name}", d)
        add_node(spec, at=f"dev/dri/{name}", major=majors.DRM, minor=minor, sys_target=d)
        kind = "card" if name.startswith("card") else "render"
        add_link(spec, f"dev/dri/by-path/pci-{bdf}-{kind}", f"dev/dri/{name}")
    if lmem_bytes:
        card_dir = f"{fn_path}/drm/card{card}"
        spec[f"{card_dir}/lmem_total_bytes"] = text(lmem_bytes)
        spec[f"{card_dir}/gt/gt0/id"] = text(0)


def _information(state: LabState, model: GpuModel, dev: DeviceState) -> bytes:
    """The NVIDIA driver's ``/proc/driver/nvidia/gpus/<BDF>/information``, spacing included.

    The open kernel module runs the GPU's firmware (GSP) and says which (``GPU Firmware``).
    """
    lines = [
        f"Model: \t\t {model.name}",
        f"IRQ:   \t\t {dev.irq or 0}",
        f"GPU UUID: \t {dev.uuid}",
        f"Video BIOS: \t {model.vbios}",
        "Bus Type: \t PCIe",
        "DMA Size: \t 52 bits",
        "DMA Mask: \t 0xfffffffffffff",
        f"Bus Location: \t {dev.primary.bdf}",
        f"Device Minor: \t {dev.minor}",
    ]
    if state.profile.nvidia_kernel_module == "open":
        lines.append(f"GPU Firmware: \t {state.profile.nvidia_driver_version}")
    lines.append("GPU Excluded:\t No")
    return ("\n".join(lines) + "\n").encode()


def _properties(values: dict[str, int]) -> bytes:
    return "".join(f"{k} {v}\n" for k, v in values.items()).encode()


def kfd_properties(
    *,
    cpu_cores: int = 0,
    cpu_core_base: int = 0,
    io_links: int = 0,
    gpu: tuple[GpuModel, DeviceState] | None = None,
) -> bytes:
    """Return a KFD node's ``properties``: ``name value`` lines, decimal, in the kernel's order."""
    values = dict.fromkeys(KFD_PROPERTIES, 0)
    values.update(cpu_cores_count=cpu_cores, cpu_core_id_base=cpu_core_base, mem_banks_count=1)
    values.update(io_links_count=io_links, max_engine_clk_ccompute=2600)
    if gpu is not None:
        model, dev = gpu
        address = dev.primary.address
        assert dev.card is not None and dev.gpu_id is not None
        values.update(
            simd_count=model.simd_count,
            simd_id_base=2147487744,
            max_waves_per_simd=8,
            lds_size_in_kb=64,
            num_gws=64,
            wave_front_size=64,
            array_count=8,
            simd_arrays_per_engine=1,
            cu_per_simd_array=13,
            simd_per_cu=4,
            max_slots_scratch_cu=32,
            gfx_target_version=model.gfx_target_version,
            vendor_id=model.identity.vendor,
            device_id=model.identity.device,
            location_id=(address.bus << 8) | (address.device << 3) | address.function,
            domain=address.domain,
            drm_render_minor=majors.RENDER_BASE + dev.card,
            hive_id=int(model.identity.device) << 32 | 0xA5A5,
            num_sdma_engines=2,
            num_sdma_xgmi_engines=6,
            num_sdma_queues_per_engine=8,
            num_cp_queues=24,
            max_engine_clk_fcompute=1700,
            fw_version=78,
            capability=1253392512,
            sdma_fw_version=8,
            unique_id=dev.gpu_id * 7919,
            num_xcc=1,
        )
    return _properties(values)


def io_link(kind: int, node_from: int, node_to: int, weight: int) -> bytes:
    """Return an ``io_links/<k>/properties`` file (type 2 = PCIe, 11 = XGMI)."""
    return _properties(
        {
            "type": kind,
            "version_major": 0,
            "version_minor": 0,
            "node_from": node_from,
            "node_to": node_to,
            "weight": weight,
            "min_latency": 0,
            "max_latency": 0,
            "min_bandwidth": 312 if kind == 2 else 50000,
            "max_bandwidth": 64000 if kind == 2 else 100000,
            "recommended_transfer_size": 0,
            "flags": 1,
        }
    )


def _kfd_node(spec: Spec, state: LabState, model: GpuModel, dev: DeviceState) -> None:
    assert dev.kfd_node is not None
    node = f"{KFD_NODES}/{dev.kfd_node}"
    hive = [
        d
        for d in state.devices.values()
        if d.kind is DeviceKind.GPU and d.model == dev.model and d.kfd_node is not None and d is not dev
    ]
    links = [io_link(2, dev.kfd_node, dev.numa_node, 20)]
    links += [io_link(11, dev.kfd_node, peer.kfd_node or 0, 15) for peer in hive]
    spec[node] = Dir()
    spec[f"{node}/properties"] = File(kfd_properties(io_links=len(links), gpu=(model, dev)))
    spec[f"{node}/gpu_id"] = text(dev.gpu_id or 0)
    spec[f"{node}/name"] = text(model.asic)
    spec[f"{node}/io_links"] = Dir()
    spec[f"{node}/p2p_links"] = Dir()
    spec[f"{node}/mem_banks/0/properties"] = File(
        _properties(
            {"heap_type": 1, "size_in_bytes": 68702699520, "flags": 0, "width": 4096, "mem_clk_max": 1600}
        )
    )
    for k, content in enumerate(links):
        spec[f"{node}/io_links/{k}/properties"] = File(content)


def render(state: LabState, dev: DeviceState) -> Spec:
    """Render one GPU."""
    model = catalog.GPUS[dev.model]
    fn = dev.primary
    fallen = FALLEN_OFF_BUS in dev.faults
    driver = None if fallen else fn.driver
    spec: Spec = {}
    extra: dict[str, str] = {}
    if model.partitions:
        extra = {
            "current_compute_partition": "SPX",
            "available_compute_partition": "SPX, DPX, QPX, CPX",
            "current_memory_partition": "NPS1",
            "available_memory_partition": "NPS1, NPS4",
        }
    if model.vram_bytes and not fallen:  # amdgpu's attributes: gone with the driver
        extra["mem_info_vram_total"] = str(model.vram_bytes)
        extra["mem_info_vram_used"] = str(model.vram_used_bytes)
    pci.render_function(
        spec,
        pci.Function(
            bdf=fn.address,
            path=fn.path,
            identity=model.identity,
            driver=driver,
            numa_node=dev.numa_node,
            cpulist=state.cpulist(dev.numa_node),
            iommu_group=fn.iommu_group,
            link_speed=model.link_speed,
            aer=dev.aer,
            aer_capable=dev.aer_capable,
            irq=dev.irq or 0,
            serial_number=_dsn(dev) if model.flavor == "nvidia" else None,
            config_readable=not fallen,
            link_degraded=pci.LINK_DEGRADED in dev.faults,
            extra=extra,
            bars=pci.assign_bars(fn.address, model.bars),
            nr_cpus=state.nr_cpus,
            msi_vectors=4,
        ),
    )
    if model.flavor == "amd":
        _kfd_node(spec, state, model, dev)
    if fn.path.count("/") == 3:  # sys/devices/pciDDDD:BB/<BDF>: on the root bus, as in a VM
        _acpi_companion(spec, fn.path, fn.address)
    if fallen:
        return spec
    if model.flavor == "nvidia":
        assert dev.minor is not None
        add_node(spec, at=f"dev/nvidia{dev.minor}", major=majors.NVIDIA, minor=dev.minor, sys_target=fn.path)
        proc = f"proc/driver/nvidia/gpus/{fn.bdf}"
        spec[proc] = Dir()
        spec[f"{proc}/information"] = File(_information(state, model, dev))
        spec[f"{proc}/power"] = File(
            b"Runtime D3 status:          Disabled by default\nVideo Memory:               Active\n"
        )
    else:
        assert dev.card is not None
        render_drm(spec, fn.path, fn.bdf, dev.card, lmem_bytes=model.lmem_bytes)
        hwmon.render(spec, fn.path, dev.card, model.driver, overheat=hwmon.OVERHEAT in dev.faults)
    return spec


def _kfd(spec: Spec, state: LabState) -> None:
    """The KFD device and its CPU topology nodes (one per NUMA node), written once for the node."""
    virtual_device(spec, "sys/devices/virtual/kfd/kfd", majors.KFD, 0, "dev/kfd")
    add_link(spec, "sys/class/kfd/kfd", "sys/devices/virtual/kfd/kfd")
    topo = "sys/devices/virtual/kfd/kfd/topology"
    spec[f"{topo}/generation_id"] = text(1)
    spec[f"{topo}/system_properties"] = File(b"platform_oem 0\nplatform_id 0\nplatform_rev 0\n")
    cores = state.profile.cpus_per_numa_node
    for node in state.numa_nodes:
        d = f"{KFD_NODES}/{node.id}"
        others = [o for o in state.numa_nodes if o.id != node.id]
        spec[f"{d}/properties"] = File(
            kfd_properties(cpu_cores=cores, cpu_core_base=node.id * cores, io_links=len(others))
        )
        spec[f"{d}/gpu_id"] = text(0)
        spec[f"{d}/name"] = text("")
        spec[f"{d}/io_links"] = Dir()
        spec[f"{d}/p2p_links"] = Dir()
        for k, other in enumerate(others):
            spec[f"{d}/io_links/{k}/properties"] = File(io_link(2, node.id, other.id, 21))


def _dsn(dev: DeviceState) -> str:
    """The Device Serial Number NVIDIA GPUs carry, as ``serial_number`` prints it (stable per GPU)."""
    digest = hashlib.sha256((dev.uuid or dev.name).encode()).digest()
    return "-".join(f"{b:02x}" for b in (0x48, 0xB0, 0x2D, 0xFF, 0xFF, *digest[:3]))


def _acpi_companion(spec: Spec, fn_path: str, address: Bdf) -> None:
    """The ACPI slot device a root-bus function's ``firmware_node`` points at (a VM's ``_SB.PCI0.Sxx``).

    QEMU's firmware describes each slot of the root bus as ``S<devfn in hex>``; the kernel links
    the function to it and back (``physical_node``).
    """
    host = fn_path.split("/")[2]
    acpi = f"sys/devices/LNXSYSTM:00/LNXSYBUS:00/PNP0A03:{int(host[3:7], 16):02x}/device:{address.device:02x}"
    spec[acpi] = Dir()
    spec[f"{acpi}/path"] = text(f"\\_SB_.PCI0.S{address.device << 3:02X}_")
    spec[f"{acpi}/adr"] = text(f"0x{address.device << 16 | address.function:08x}")
    spec[f"{acpi}/uevent"] = File(b"")
    add_link(spec, f"{acpi}/physical_node", fn_path)
    add_link(spec, f"{fn_path}/firmware_node", acpi)


def _group(state: LabState, dev: DeviceState) -> GpuGroup:
    assert dev.group is not None
    return state.profile.gpus[dev.group]


def proc_version(profile: Profile) -> bytes:
    """``/proc/driver/nvidia/version`` in the loaded module's own words (trailing spaces included).

    The open module prints its build as a real 580 build does (``Release Build (builder@)``);
    the proprietary one its build date, as 550-series drivers do.
    """
    version = profile.nvidia_driver_version
    if profile.nvidia_kernel_module == "open":
        return (
            "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  "
            f"{version}  Release Build  (nixbld@)  \n"
            "GCC version:  gcc version 15.3.0 (GCC) \n"
        ).encode()
    return (
        f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {version}  Tue Mar  5 22:23:56 UTC 2024\n"
        "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n"
    ).encode()


_MIG_CAPABILITIES = (("config", 1, 0o400), ("monitor", 2, 0o444))
"""MIG's capabilities: the minor of ``/dev/nvidia-caps/nvidia-cap<N>`` and its mode."""


def _nvidia(spec: Spec, profile: Profile) -> None:
    """Add the NVIDIA driver's shared nodes, procfs entries and module attributes."""
    virtual_device(
        spec,
        "sys/devices/virtual/nvidia/nvidiactl",
        majors.NVIDIA,
        majors.NVIDIACTL_MINOR,
        "dev/nvidiactl",
    )
    if profile.nvidia_modeset:
        virtual_device(
            spec,
            "sys/devices/virtual/nvidia/nvidia-modeset",
            majors.NVIDIA,
            majors.NVIDIA_MODESET_MINOR,
            "dev/nvidia-modeset",
        )
    virtual_device(spec, "sys/devices/virtual/nvidia-uvm/nvidia-uvm", majors.NVIDIA_UVM, 0, "dev/nvidia-uvm")
    virtual_device(
        spec,
        "sys/devices/virtual/nvidia-uvm/nvidia-uvm-tools",
        majors.NVIDIA_UVM,
        1,
        "dev/nvidia-uvm-tools",
    )
    spec["proc/driver/nvidia/gpus"] = Dir()
    spec["proc/driver/nvidia/version"] = File(proc_version(profile))
    spec["sys/module/nvidia/version"] = text(profile.nvidia_driver_version)
    for module in ("nvidia_uvm", *(("nvidia_modeset",) if profile.nvidia_modeset else ())):
        spec[f"sys/module/{module}/initstate"] = text("live")
        spec[f"sys/module/{module}/refcnt"] = text(0)
    spec["dev/nvidia-caps"] = Dir()
    for name, minor, mode in _MIG_CAPABILITIES:
        # nvidia-modprobe makes these nodes for a char region that has no sysfs device.
        spec[f"dev/nvidia-caps/nvidia-cap{minor}"] = Node(majors.NVIDIA_CAPS, minor, mode)
        spec[f"proc/driver/nvidia/capabilities/mig/{name}"] = File(
            f"DeviceFileMinor: {minor}\nDeviceFileMode: {mode}\nDeviceFileModify: 1\n".encode()
        )
    spec["proc/driver/nvidia/params"] = text("ModifyDeviceFiles: 1\nDeviceFileUID: 0\nDeviceFileGID: 0")


def drm_shared(shared: kinds.Shared) -> None:
    """What any DRM driver brings node-wide: the DRM major, ``sys/class/drm``, ``dev/dri/by-path``."""
    shared.majors.add(majors.DRM)
    shared.spec["sys/class/drm"] = Dir()
    shared.spec["dev/dri/by-path"] = Dir()


class _GpuKind:
    """GPUs: one PCI function each, numbered by their driver in bus order."""

    owns: tuple[str, ...] = (DeviceKind.GPU,)
    section: str | None = "gpus"
    prefix = "gpu"

    def ports(self, group: Any) -> int:
        return 1

    def buses(self, group: Any) -> int:
        return 1

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
        model = catalog.GPUS[group.model]
        bdf = Bdf.on_bus(bus, 0, 0)
        fn = placer.function(parent, bdf, "gpu", model.driver)
        ident = uuid.uuid5(_UUID_NAMESPACE, f"{placer.profile_name}/{names[0]}/{bdf}")
        placer.add(
            DeviceState(
                name=names[0],
                kind=DeviceKind.GPU,
                model=model.key,
                numa_node=node,
                switch=switch,
                functions=[fn],
                uuid=f"GPU-{ident}",
            )
        )

    def number(self, state: LabState, dev: DeviceState, counters: dict[str, int]) -> None:
        model = catalog.GPUS[dev.model]
        if model.flavor == "nvidia":
            dev.minor = counters.get("nvidia", 0)
            counters["nvidia"] = dev.minor + 1
        else:
            dev.card = counters.get("drm", 0)
            counters["drm"] = dev.card + 1
        if model.flavor == "amd":
            dev.kfd_node = counters["kfd"]
            counters["kfd"] += 1
            dev.gpu_id = int.from_bytes(hashlib.sha256(dev.primary.bdf.encode()).digest()[:2], "big") | 1

    def finish(self, state: LabState, dev: DeviceState) -> None:
        if dev.group is not None and dev.member is not None:
            dev.aer_capable = _group(state, dev).aer
            fixed = _group(state, dev).devices
            if dev.member < len(fixed):
                dev.uuid = fixed[dev.member].uuid or dev.uuid
                dev.irq = fixed[dev.member].irq
        if catalog.GPUS[dev.model].flavor == "nvidia":
            dev.nvml = GpuCounters()

    def render(self, state: LabState, dev: DeviceState) -> Spec:
        return render(state, dev)

    def family(self, state: LabState, dev: DeviceState) -> list[str]:
        return [dev.name]

    def identity(self, dev: DeviceState) -> pci.Identity:
        return catalog.GPUS[dev.model].identity

    def faults(self, dev: DeviceState) -> tuple[str, ...]:
        flavor = catalog.GPUS[dev.model].flavor
        if flavor == "nvidia":  # temperatures and events through NVML
            return (FALLEN_OFF_BUS, pci.LINK_DEGRADED, hwmon.OVERHEAT, ECC_DBE, ECC_SBE, XID)
        if flavor == "amd":  # the lab's GPUs with hwmon temperatures
            return (FALLEN_OFF_BUS, pci.LINK_DEGRADED, hwmon.OVERHEAT)
        return (FALLEN_OFF_BUS, pci.LINK_DEGRADED)

    def shared(self, state: LabState, devices: list[DeviceState]) -> kinds.Shared:
        out = kinds.Shared()
        flavors = {catalog.GPUS[d.model].flavor for d in devices}
        if "nvidia" in flavors:
            out.majors |= {majors.NVIDIA, majors.NVIDIA_UVM, majors.NVIDIA_CAPS}
            _nvidia(out.spec, state.profile)
        if flavors & {"intel", "amd"}:
            drm_shared(out)
        if "amd" in flavors:
            out.majors.add(majors.KFD)
            _kfd(out.spec, state)
        return out


KIND: Final = _GpuKind()
"""What the registry finds under ``gpu`` (:data:`.kinds.BUILTIN`)."""
