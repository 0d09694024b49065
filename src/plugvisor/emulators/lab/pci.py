"""PCI functions as the kernel shows them in sysfs.

One renderer, :func:`render_function`, writes every attribute a PCI function
has, in the kernel's exact formats (the fidelity checklist: ``0x%04x`` ids,
``0x%06x`` class, upper-case fixed-width ``modalias`` that ghw parses, decimal
``numa_node``), plus the links every reader follows: ``driver``,
``iommu_group``, ``subsystem`` and the ``sys/bus/pci/devices/<BDF>`` entry.
GPU, FPGA and NIC renderers add their own files on top of it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from plugvisor.emulators.lab.spec import Dir, File, Spec, add_link, text

PCI_DEVICES = "sys/bus/pci/devices"
PCI_DRIVERS = "sys/bus/pci/drivers"
IOMMU_GROUPS = "sys/kernel/iommu_groups"

AER_UNCORRECTABLE = (
    "Undefined", "DLP", "SDES", "TLP", "FCP", "CmpltTO", "CmpltAbrt", "UnxCmplt", "RxOF", "MalfTLP",
    "ECRC", "UnsupReq", "ACSViol", "UncorrIntErr", "BlockedTLP", "AtomicOpBlocked", "TLPBlockedErr",
    "PoisonTLPBlocked",
)  # fmt: skip
"""Names the kernel's AER code prints, in bit order (``aer_uncorrectable_error_string``)."""

WRITABLE = frozenset({"sriov_numvfs", "sriov_drivers_autoprobe"})
"""Attributes that are writable (mode 0644) in sysfs."""

AER_CORRECTABLE = (
    "RxErr",
    "BadTLP",
    "BadDLLP",
    "Rollover",
    "Timeout",
    "NonFatalErr",
    "CorrIntErr",
    "HeaderOF",
)


@dataclass(frozen=True, slots=True, order=True)
class Bdf:
    """A PCI address; ``str()`` is the kernel's ``%04x:%02x:%02x.%d``."""

    domain: int
    bus: int
    device: int
    function: int

    def __str__(self) -> str:
        return f"{self.domain:04x}:{self.bus:02x}:{self.device:02x}.{self.function}"

    @property
    def routing_id(self) -> int:
        """The 16-bit requester id, which SR-IOV offsets and strides count in."""
        return (self.bus << 8) | (self.device << 3) | self.function

    @classmethod
    def on_bus(cls, bus: int, device: int, function: int) -> Bdf:
        """The address of a function on the lab's ``bus``, which counts across PCI domains.

        ``bus`` is ``domain << 8 | bus number``: a profile of thousands of devices needs
        more than one domain's 256 buses (as big servers have several PCI segments).
        """
        return cls(bus >> 8, bus & 0xFF, device, function)

    @classmethod
    def from_routing_id(cls, domain: int, rid: int) -> Bdf:
        """Return the address of a routing id (how VF addresses are derived from their PF)."""
        return cls(domain, (rid >> 8) & 0xFF, (rid >> 3) & 0x1F, rid & 0x7)

    @classmethod
    def parse(cls, value: str) -> Bdf:
        """Parse ``0000:3b:00.0``."""
        domain, bus, rest = value.split(":")
        device, function = rest.split(".")
        return cls(int(domain, 16), int(bus, 16), int(device, 16), int(function))


@dataclass(frozen=True, slots=True)
class Identity:
    """What a PCI function says it is, read from config space by the kernel."""

    vendor: int
    device: int
    subsystem_vendor: int
    subsystem_device: int
    class_code: int
    revision: int = 0

    @property
    def modalias(self) -> str:
        """The ``modalias`` the kernel builds (``pci:v%08Xd%08Xsv%08Xsd%08Xbc%02Xsc%02Xi%02X``)."""
        return (
            f"pci:v{self.vendor:08X}d{self.device:08X}sv{self.subsystem_vendor:08X}"
            f"sd{self.subsystem_device:08X}bc{self.class_code >> 16:02X}"
            f"sc{(self.class_code >> 8) & 0xFF:02X}i{self.class_code & 0xFF:02X}"
        )


@dataclass(frozen=True, slots=True)
class Bar:
    """An assigned memory BAR: index (0-5, 7-12 for SR-IOV BARs), start address, size."""

    index: int
    start: int
    size: int
    prefetch: bool


IOV_BASE = 7
"""``PCI_IOV_RESOURCES``: resource lines 7-12 are the SR-IOV BARs (after six BARs and the ROM)."""
_ENDPOINT_RESOURCES = 13
"""``PCI_BRIDGE_RESOURCES``: lines an endpoint's ``resource`` has (BARs, ROM, SR-IOV BARs)."""
_BRIDGE_RESOURCES = 17
"""``PCI_NUM_RESOURCES``: a bridge adds its four windows."""
_IORESOURCE_MEM = 0x200
_IORESOURCE_PREFETCH = 0x2000
_IORESOURCE_SIZEALIGN = 0x40000
_IORESOURCE_MEM_64 = 0x100000
_BAR_MEM_TYPE_64 = 0x4
_BAR_MEM_PREFETCH = 0x8


def bar_flags(bar: Bar) -> int:
    """The ``struct resource`` flags the kernel prints for a 64-bit memory BAR (low byte: its own bits)."""
    flags = _IORESOURCE_MEM | _IORESOURCE_SIZEALIGN | _IORESOURCE_MEM_64 | _BAR_MEM_TYPE_64
    if bar.prefetch:
        flags |= _IORESOURCE_PREFETCH | _BAR_MEM_PREFETCH
    return flags


def assign_bars(
    bdf: Bdf,
    bars: tuple[tuple[int, int, bool], ...],
    iov: tuple[tuple[int, int, bool], ...] = (),
    vfs: int = 0,
) -> tuple[Bar, ...]:
    """Give a function's BARs addresses the way firmware would: naturally aligned, no overlaps.

    Each (bus, function) owns a 64 GiB-aligned window high in the 64-bit space, big enough for
    the largest BARs of the catalog; SR-IOV BARs (``iov``, per-VF sizes times ``vfs``) follow
    the function's own. VFs take their BARs from their PF's SR-IOV BARs (:func:`vf_bars`).
    """
    window = (1 << 48) + (bdf.bus << 40) + (bdf.function << 36)
    wanted = [(index, size, pref) for index, size, pref in bars]
    wanted += [(IOV_BASE + index, size * vfs, pref) for index, size, pref in iov if vfs]
    out: list[Bar] = []
    cursor = window
    for index, size, pref in sorted(wanted, key=lambda b: -b[1]):
        align = 1 << (size - 1).bit_length() if index < IOV_BASE else size // max(vfs, 1)
        cursor = -(-cursor // align) * align
        out.append(Bar(index, cursor, size, pref))
        cursor += size
    return tuple(sorted(out, key=lambda b: b.index))


def vf_bars(pf: tuple[Bar, ...], vf_index: int, total_vfs: int) -> tuple[Bar, ...]:
    """A VF's BARs: slice ``vf_index`` of each of its PF's SR-IOV BARs."""
    out = []
    for bar in pf:
        if bar.index >= IOV_BASE and total_vfs:
            size = bar.size // total_vfs
            out.append(Bar(bar.index - IOV_BASE, bar.start + vf_index * size, size, bar.prefetch))
    return tuple(out)


def cpumask(cpulist: str, nr_cpus: int) -> str:
    """``local_cpus``/``cpumap``: the kernel's ``%*pb`` of ``cpulist`` over ``nr_cpus`` bits.

    32-bit hex chunks, most significant first, comma-separated; the first chunk only as wide as
    the bits it holds (``0000,00000000,00ffffff,ffffffff`` for CPUs 0-55 of 112).
    """
    mask = 0
    for part in cpulist.split(","):
        low, _, high = part.partition("-")
        for cpu in range(int(low), int(high or low) + 1):
            mask |= 1 << cpu
    chunks = []
    first = nr_cpus % 32 or 32
    top = -(-nr_cpus // 32) * 32 - 32
    width = -(-first // 4)
    for start in range(top, -1, -32):
        chunks.append(f"{(mask >> start) & 0xFFFFFFFF:0{width}x}")
        width = 8
    return ",".join(chunks)


@dataclass(frozen=True, slots=True)
class Function:
    """Everything needed to render one PCI function's directory and links."""

    bdf: Bdf
    path: str
    """Root-relative path of the function's directory under ``sys/devices``."""
    identity: Identity
    driver: str | None
    numa_node: int
    cpulist: str
    iommu_group: int | None
    link_speed: str = "16.0 GT/s PCIe"
    link_width: int = 16
    bridge_buses: tuple[int, int, int] | None = None
    """``(primary, secondary, subordinate)`` for bridges."""
    aer: tuple[int, int, int] = (0, 0, 0)
    """Fatal, non-fatal and correctable error counts."""
    aer_capable: bool = True
    """False: no AER capability, so no ``aer_dev_*`` files at all (as in a VM)."""
    irq: int = 0
    """The ``irq`` attribute (the interrupt line)."""
    serial_number: str | None = None
    """The Device Serial Number capability as ``serial_number`` prints it; None: no such capability."""
    config_readable: bool = True
    link_degraded: bool = False
    """The link trained below its capability: current speed one generation down, half the lanes."""
    multifunction: bool = False
    extra: dict[str, str] = field(default_factory=dict)
    """More attributes of this function (``sriov_*``, ``user_pf``, ...)."""
    bars: tuple[Bar, ...] = ()
    nr_cpus: int = 0
    """CPUs of the whole node (the width of ``local_cpus``); 0 derives it from ``cpulist``."""
    msi_vectors: int = 0
    """MSI-X vectors the driver allocated (``msi_irqs/<irq>``); 0 with no driver."""


def config_space(fn: Function) -> bytes:
    """Return the function's config space: a type 0/1 header, or all ``0xff`` once it is gone.

    A device that fell off the bus answers every config read with ones; readers
    that look at raw config (lspci, ghw's revision fallback) see exactly that.
    """
    if not fn.config_readable:
        return b"\xff" * 256
    ident = fn.identity
    header_type = (1 if fn.bridge_buses else 0) | (0x80 if fn.multifunction else 0)
    command = 0x0406 if fn.driver else 0x0000
    head = struct.pack(
        "<HHHHB3sBBBB",
        ident.vendor,
        ident.device,
        command,
        0x0010,
        ident.revision,
        ident.class_code.to_bytes(3, "little"),
        0x10,
        0x00,
        header_type,
        0x00,
    )
    body = bytearray(256)
    body[: len(head)] = head
    if fn.bridge_buses:
        body[0x18:0x1B] = bytes(fn.bridge_buses)
    else:
        body[0x2C:0x30] = struct.pack("<HH", ident.subsystem_vendor, ident.subsystem_device)
    for bar in fn.bars:
        if bar.index < IOV_BASE - 1:
            # A 64-bit memory BAR takes two registers: low dword with its type bits, then the high dword.
            low = (bar.start & 0xFFFFFFF0) | _BAR_MEM_TYPE_64 | (_BAR_MEM_PREFETCH if bar.prefetch else 0)
            at = 0x10 + 4 * bar.index
            body[at : at + 8] = struct.pack("<II", low, bar.start >> 32)
    return bytes(body)


def _aer_text(names: tuple[str, ...], first: int, total_name: str, count: int) -> File:
    lines = [f"{name} {count if i == first else 0}" for i, name in enumerate(names)]
    lines.append(f"{total_name} {count}")
    return File(("\n".join(lines) + "\n").encode())


LINK_DEGRADED = "link-degraded"
LINK_SPEEDS = (
    "2.5 GT/s PCIe",
    "5.0 GT/s PCIe",
    "8.0 GT/s PCIe",
    "16.0 GT/s PCIe",
    "32.0 GT/s PCIe",
    "64.0 GT/s PCIe",
)
"""``current_link_speed`` values the kernel prints (``PCIE_SPEED2STR``), slowest first."""


def degraded_link(fn: Function) -> tuple[str, int]:
    """What a badly trained link reads: one speed generation lower (at least 2.5 GT/s), half the lanes."""
    index = LINK_SPEEDS.index(fn.link_speed) if fn.link_speed in LINK_SPEEDS else 1
    return LINK_SPEEDS[max(index - 1, 0)], max(fn.link_width // 2, 1)


def render_function(spec: Spec, fn: Function) -> None:
    """Add one PCI function (its directory, attributes and links) to ``spec``."""
    ident = fn.identity
    p = fn.path
    bdf = str(fn.bdf)
    spec[p] = Dir()
    spec[f"{p}/vendor"] = text(f"0x{ident.vendor:04x}")
    spec[f"{p}/device"] = text(f"0x{ident.device:04x}")
    spec[f"{p}/subsystem_vendor"] = text(f"0x{ident.subsystem_vendor:04x}")
    spec[f"{p}/subsystem_device"] = text(f"0x{ident.subsystem_device:04x}")
    spec[f"{p}/class"] = text(f"0x{ident.class_code:06x}")
    spec[f"{p}/revision"] = text(f"0x{ident.revision:02x}")
    spec[f"{p}/modalias"] = text(ident.modalias)
    spec[f"{p}/numa_node"] = text(fn.numa_node)
    spec[f"{p}/local_cpulist"] = text(fn.cpulist)
    spec[f"{p}/enable"] = File(b"1\n" if fn.driver else b"0\n", 0o644)
    current_speed, current_width = degraded_link(fn) if fn.link_degraded else (fn.link_speed, fn.link_width)
    spec[f"{p}/current_link_speed"] = text(current_speed)
    spec[f"{p}/current_link_width"] = text(current_width)
    spec[f"{p}/max_link_speed"] = text(fn.link_speed)
    spec[f"{p}/max_link_width"] = text(fn.link_width)
    spec[f"{p}/irq"] = text(fn.irq)
    spec[f"{p}/dma_mask_bits"] = text(64)
    spec[f"{p}/d3cold_allowed"] = File(b"1\n", 0o644)
    spec[f"{p}/config"] = File(config_space(fn), 0o644)
    spec[f"{p}/remove"] = File(b"", 0o200)
    spec[f"{p}/rescan"] = File(b"", 0o200)
    if fn.aer_capable:
        fatal, nonfatal, correctable = fn.aer
        spec[f"{p}/aer_dev_fatal"] = _aer_text(AER_UNCORRECTABLE, 3, "TOTAL_ERR_FATAL", fatal)
        spec[f"{p}/aer_dev_nonfatal"] = _aer_text(AER_UNCORRECTABLE, 5, "TOTAL_ERR_NONFATAL", nonfatal)
        spec[f"{p}/aer_dev_correctable"] = _aer_text(AER_CORRECTABLE, 0, "TOTAL_ERR_COR", correctable)
    uevent = [f"PCI_CLASS={ident.class_code:X}", f"PCI_ID={ident.vendor:04X}:{ident.device:04X}"]
    uevent.append(f"PCI_SUBSYS_ID={ident.subsystem_vendor:04X}:{ident.subsystem_device:04X}")
    uevent += [f"PCI_SLOT_NAME={bdf}", f"MODALIAS={ident.modalias}"]
    if fn.driver:
        uevent.insert(0, f"DRIVER={fn.driver}")
    spec[f"{p}/uevent"] = File(("\n".join(uevent) + "\n").encode(), 0o644)
    if fn.bridge_buses:
        spec[f"{p}/secondary_bus_number"] = text(fn.bridge_buses[1])
        spec[f"{p}/subordinate_bus_number"] = text(fn.bridge_buses[2])
    _more(spec, fn)
    for name, value in fn.extra.items():
        spec[f"{p}/{name}"] = File(f"{value}\n".encode(), 0o644 if name in WRITABLE else 0o444)
    _links(spec, fn)


def _more(spec: Spec, fn: Function) -> None:
    """The attributes lspci, ghw, hwloc and DPDK read beyond the IDs: resources, CPUs, power, MSI, ASPM."""
    p = fn.path
    lines = _BRIDGE_RESOURCES if fn.bridge_buses else _ENDPOINT_RESOURCES
    by_index = {bar.index: bar for bar in fn.bars}
    rows = []
    for i in range(lines):
        bar = by_index.get(i)
        if bar is None:
            rows.append(f"0x{0:016x} 0x{0:016x} 0x{0:016x}")
        else:
            rows.append(f"0x{bar.start:016x} 0x{bar.start + bar.size - 1:016x} 0x{bar_flags(bar):016x}")
    spec[f"{p}/resource"] = File(("\n".join(rows) + "\n").encode())
    for bar in fn.bars:
        if bar.index < IOV_BASE and fn.config_readable:
            # On a real node mmap()able and st_size is the BAR's size. The lab writes them empty: a sparse
            # file of that size (128 GiB for an H100) is materialized in full by anything that copies the
            # tree (shutil.copytree, tar, container build contexts). Sizes are in ``resource``.
            spec[f"{p}/resource{bar.index}"] = File(b"", 0o600)
            if bar.prefetch:
                spec[f"{p}/resource{bar.index}_wc"] = File(b"", 0o600)
    last = max((int(x.partition("-")[2] or x) for x in fn.cpulist.split(",")), default=0)
    spec[f"{p}/local_cpus"] = text(cpumask(fn.cpulist, fn.nr_cpus or last + 1))
    spec[f"{p}/driver_override"] = File(b"(null)\n", 0o644)
    spec[f"{p}/power_state"] = text("D0" if fn.config_readable else "D3cold")
    spec[f"{p}/broken_parity_status"] = File(b"0\n", 0o644)
    spec[f"{p}/consistent_dma_mask_bits"] = text(64)
    spec[f"{p}/msi_bus"] = File(b"1\n", 0o644)
    spec[f"{p}/reset_method"] = File(b"flr bus\n" if not fn.bridge_buses else b"pm bus\n", 0o644)
    spec[f"{p}/reset"] = File(b"", 0o200)
    spec[f"{p}/ari_enabled"] = text(0)
    if fn.serial_number is not None:
        spec[f"{p}/serial_number"] = text(fn.serial_number)
    power = f"{p}/power"
    spec[f"{power}/control"] = File(b"on\n", 0o644)
    spec[f"{power}/runtime_status"] = text("active" if fn.driver else "unsupported")
    spec[f"{power}/runtime_enabled"] = text("forbidden")
    spec[f"{power}/runtime_active_time"] = text(0)
    spec[f"{power}/runtime_suspended_time"] = text(0)
    spec[f"{power}/runtime_usage"] = text(1 if fn.driver else 0)
    spec[f"{power}/async"] = File(b"enabled\n", 0o644)
    if fn.driver and fn.msi_vectors:
        spec[f"{p}/msi_irqs"] = Dir()
        base = 64 + (fn.iommu_group or 0) * 4
        kind = "msi" if fn.bridge_buses else "msix"
        for irq in range(base, base + fn.msi_vectors):
            spec[f"{p}/msi_irqs/{irq}"] = text(kind)
    if not fn.bridge_buses:
        for name, value in (
            ("clkpm", 0),
            ("l0s_aspm", 0),
            ("l1_aspm", 1),
            ("l1_1_aspm", 0),
            ("l1_2_aspm", 0),
        ):
            spec[f"{p}/link/{name}"] = File(f"{value}\n".encode(), 0o644)


def _links(spec: Spec, fn: Function) -> None:
    """Add the links every reader follows: bus entry, driver, IOMMU group."""
    p = fn.path
    bdf = str(fn.bdf)
    add_link(spec, f"{p}/subsystem", "sys/bus/pci")
    add_link(spec, f"{PCI_DEVICES}/{bdf}", p)
    if fn.driver:
        add_link(spec, f"{p}/driver", f"{PCI_DRIVERS}/{fn.driver}")
        add_link(spec, f"{PCI_DRIVERS}/{fn.driver}/{bdf}", p)
    if fn.iommu_group is not None:
        group = f"{IOMMU_GROUPS}/{fn.iommu_group}"
        spec[group] = Dir()
        spec[f"{group}/type"] = text("DMA-FQ")
        spec[f"{group}/reserved_regions"] = text("0x00000000fee00000 0x00000000feefffff msi")
        add_link(spec, f"{group}/devices/{bdf}", p)
        add_link(spec, f"{p}/iommu_group", group)
