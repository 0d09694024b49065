"""The hardware the lab knows how to impersonate, with real PCI identities.

Identities are the ones real plugins match on (the SR-IOV plugin's ``vendors``
and ``devices`` selectors, Intel's ``0x8086`` check, ROCm's ``vendor_id 4098``),
so a plugin configured for real hardware selects the lab's devices unchanged.
Profiles name a model by its key; adding hardware means adding an entry here and
a ``pci.ids`` line, nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal

from plugvisor.emulators.lab.pci import Identity

GpuFlavor = Literal["nvidia", "intel", "amd"]

BarSpec = tuple[int, int, bool]
"""``(BAR index, size in bytes, prefetchable)``; the lab makes every BAR 64-bit."""

MiB = 2**20
GiB = 2**30


@dataclass(frozen=True, slots=True)
class NvmlFacts:
    """What NVML says about an NVIDIA GPU at rest (the lab's NVML stand-in answers these).

    Idle figures, as a real part reads with nothing running on it; the lab's faults move
    temperature and power (``overheat``) and the ECC counters (``ecc-sbe``/``ecc-dbe``).
    """

    architecture: int
    """``nvmlDeviceArchitecture_t``: 7 Ampere, 9 Hopper."""
    compute_capability: tuple[int, int]
    memory_bytes: int
    memory_used_bytes: int
    """Used at idle (what the driver's own allocations take)."""
    temperature_c: int
    power_mw: int
    power_limit_mw: int
    clocks_mhz: tuple[int, int, int, int]
    """Graphics, SM, memory and video clocks at idle (``nvmlClockType_t`` order)."""
    hot_temperature_c: int
    """What ``overheat`` reads: past the part's slowdown temperature."""
    brand: int = 14
    """``nvmlBrandType_t``; 14 (``NVML_BRAND_NVIDIA``) for data-centre parts."""


@dataclass(frozen=True, slots=True)
class GpuModel:
    """A GPU: its identity and what its driver exposes."""

    key: str
    flavor: GpuFlavor
    name: str
    identity: Identity
    driver: str
    link_speed: str
    vbios: str = ""
    lmem_bytes: int = 0
    gfx_target_version: int = 0
    simd_count: int = 0
    asic: str = ""
    partitions: bool = False
    """Whether the driver exposes compute/memory partition attributes (MI300)."""
    bars: tuple[BarSpec, ...] = ((0, 16 * MiB, False), (1, 64 * GiB, True), (3, 32 * MiB, True))
    nvml: NvmlFacts | None = None
    """NVIDIA GPUs: what NVML reports (None for other vendors)."""
    vram_bytes: int = 0
    """AMD GPUs: ``mem_info_vram_total`` (0: the model does not write the attribute)."""
    vram_used_bytes: int = 0


@dataclass(frozen=True, slots=True)
class DflFpgaModel:
    """An Intel FPGA card served by the upstream DFL driver."""

    key: str
    name: str
    identity: Identity
    afu_id: str
    interface_id: str
    bitstream_id: str
    flavor: Literal["dfl"] = "dfl"
    bars: tuple[BarSpec, ...] = ((0, 512 * 1024, True), (2, 128 * 1024, True))


@dataclass(frozen=True, slots=True)
class XilinxFpgaModel:
    """A Xilinx Alveo-like card: a management PF and a user PF on one bus."""

    key: str
    name: str
    mgmt: Identity
    user: Identity
    vbnv: str
    """The default shell name (``rom.*/VBNV``)."""
    timestamp: str
    flavor: Literal["xilinx"] = "xilinx"
    mgmt_bars: tuple[BarSpec, ...] = ((0, 32 * MiB, False), (2, 128 * 1024, False))
    user_bars: tuple[BarSpec, ...] = ((0, 32 * MiB, False), (2, 256 * 1024, False), (4, 256 * MiB, True))


FpgaModel = DflFpgaModel | XilinxFpgaModel


@dataclass(frozen=True, slots=True)
class NicModel:
    """An SR-IOV capable NIC: PF and VF identities, drivers, and how VFs are addressed."""

    key: str
    name: str
    pf: Identity
    vf: Identity
    pf_driver: str
    vf_driver: str
    max_vfs: int
    first_vf_offset: int
    speed_mbps: int
    oui: str
    link_speed: str
    rdma: RdmaModel | None = None
    """The RDMA (RoCE) device its driver registers per function, if any."""
    pf_bars: tuple[BarSpec, ...] = ((0, 32 * MiB, True), (3, 64 * 1024, True))
    vf_bars: tuple[BarSpec, ...] = ((0, 128 * 1024, True), (3, 16 * 1024, True))
    """Per VF; the PF's SR-IOV BARs hold ``sriov_totalvfs`` of each."""


@dataclass(frozen=True, slots=True)
class RdmaModel:
    """What the RDMA stack shows for one function of an RDMA-capable NIC (``mlx5_N``)."""

    prefix: str
    hca_type: str
    fw_ver: str
    board_id: str
    rate: str
    """``ports/1/rate`` as the kernel prints it at the port's speed."""


GPUS: Final[dict[str, GpuModel]] = {
    m.key: m
    for m in (
        GpuModel(
            key="nvidia-h100",
            flavor="nvidia",
            name="NVIDIA H100 80GB HBM3",
            identity=Identity(0x10DE, 0x2330, 0x10DE, 0x16C1, 0x030200, 0xA1),
            driver="nvidia",
            link_speed="32.0 GT/s PCIe",
            vbios="96.00.74.00.01",
            bars=((0, 16 * MiB, False), (1, 128 * GiB, True), (3, 32 * MiB, True)),
            nvml=NvmlFacts(
                architecture=9,
                compute_capability=(9, 0),
                memory_bytes=85520809984,
                memory_used_bytes=575209472,
                temperature_c=33,
                power_mw=71000,
                power_limit_mw=700000,
                clocks_mhz=(345, 345, 2619, 765),
                hot_temperature_c=92,
            ),
        ),
        GpuModel(
            key="nvidia-h200",
            flavor="nvidia",
            name="NVIDIA H200",
            identity=Identity(0x10DE, 0x2335, 0x10DE, 0x18BF, 0x030200, 0xA1),
            driver="nvidia",
            link_speed="32.0 GT/s PCIe",
            vbios="96.00.a5.00.1a",
            # As a real H200 passed through to a VM reads: three 64-bit BARs (0, 2, 4), each
            # with a write-combining resource file.
            bars=((0, 16 * MiB, True), (2, 256 * GiB, True), (4, 32 * MiB, True)),
            nvml=NvmlFacts(
                architecture=9,
                compute_capability=(9, 0),
                memory_bytes=150754820096,
                memory_used_bytes=644939776,
                temperature_c=36,
                power_mw=92000,
                power_limit_mw=700000,
                clocks_mhz=(345, 345, 3201, 765),
                hot_temperature_c=93,
            ),
        ),
        GpuModel(
            key="nvidia-a100",
            flavor="nvidia",
            name="NVIDIA A100-SXM4-40GB",
            identity=Identity(0x10DE, 0x20B0, 0x10DE, 0x134F, 0x030200, 0xA1),
            driver="nvidia",
            link_speed="16.0 GT/s PCIe",
            vbios="92.00.19.00.10",
            nvml=NvmlFacts(
                architecture=7,
                compute_capability=(8, 0),
                memory_bytes=42949672960,
                memory_used_bytes=444006400,
                temperature_c=31,
                power_mw=54000,
                power_limit_mw=400000,
                clocks_mhz=(210, 210, 1215, 585),
                hot_temperature_c=90,
            ),
        ),
        GpuModel(
            key="intel-flex-170",
            flavor="intel",
            name="Intel Data Center GPU Flex 170",
            identity=Identity(0x8086, 0x56C0, 0x8086, 0x4905, 0x038000, 0x08),
            driver="i915",
            link_speed="16.0 GT/s PCIe",
            lmem_bytes=16 * 2**30,
            bars=((0, 16 * MiB, False), (2, 16 * GiB, True)),
        ),
        GpuModel(
            key="intel-max-1100",
            flavor="intel",
            name="Intel Data Center GPU Max 1100",
            identity=Identity(0x8086, 0x0BDA, 0x8086, 0x0000, 0x038000, 0x2F),
            driver="i915",
            link_speed="32.0 GT/s PCIe",
            lmem_bytes=48 * 2**30,
            bars=((0, 16 * MiB, False), (2, 64 * GiB, True)),
        ),
        GpuModel(
            key="amd-mi210",
            flavor="amd",
            name="AMD Instinct MI210",
            identity=Identity(0x1002, 0x740F, 0x1002, 0x0C34, 0x038000, 0x02),
            driver="amdgpu",
            link_speed="16.0 GT/s PCIe",
            gfx_target_version=90010,
            simd_count=416,
            asic="aldebaran",
            bars=((0, 64 * GiB, True), (2, 2 * MiB, True), (5, 512 * 1024, False)),
        ),
        GpuModel(
            key="amd-mi300x",
            flavor="amd",
            name="AMD Instinct MI300X",
            identity=Identity(0x1002, 0x74A1, 0x1002, 0x74A1, 0x120000, 0x00),
            driver="amdgpu",
            link_speed="32.0 GT/s PCIe",
            gfx_target_version=90402,
            simd_count=1216,
            asic="ip discovery",
            bars=((0, 256 * GiB, True), (2, 2 * MiB, True), (5, 512 * 1024, False)),
            partitions=True,
            vram_bytes=206141652992,
            vram_used_bytes=297795584,
        ),
    )
}

FPGAS: Final[dict[str, FpgaModel]] = {
    m.key: m
    for m in (
        DflFpgaModel(
            key="intel-pac-n3000",
            name="Intel FPGA Programmable Acceleration Card N3000",
            identity=Identity(0x8086, 0x0B30, 0x8086, 0x0000, 0x120000, 0x02),
            afu_id="d8424dc4a4a3c413f89e433683f9040b",
            interface_id="69528db6eb31577a8c3668f9faa081f6",
            bitstream_id="0x23000410010309",
        ),
        DflFpgaModel(
            key="intel-pac-d5005",
            name="Intel FPGA Programmable Acceleration Card D5005",
            identity=Identity(0x8086, 0x0B2B, 0x8086, 0x0000, 0x120000, 0x01),
            afu_id="f7df405cbd7acf7222f144b0b93acd18",
            interface_id="bfac4d851ee856fe8c95865ce1bbaa2d",
            bitstream_id="0x4010002055023a4",
        ),
        XilinxFpgaModel(
            key="xilinx-u250",
            name="Xilinx Alveo U250",
            mgmt=Identity(0x10EE, 0x5004, 0x10EE, 0x000E, 0x120000, 0x00),
            user=Identity(0x10EE, 0x5005, 0x10EE, 0x000E, 0x120000, 0x00),
            vbnv="xilinx_u250_gen3x16_xdma_shell_4_1",
            timestamp="0x5f0e2a62",
        ),
    )
}

NICS: Final[dict[str, NicModel]] = {
    m.key: m
    for m in (
        NicModel(
            key="intel-e810",
            name="Intel Ethernet Controller E810-C for QSFP",
            pf=Identity(0x8086, 0x1592, 0x8086, 0x0002, 0x020000, 0x02),
            vf=Identity(0x8086, 0x1889, 0x8086, 0x0000, 0x020000, 0x02),
            pf_driver="ice",
            vf_driver="iavf",
            max_vfs=256,
            first_vf_offset=8,
            speed_mbps=100000,
            oui="b4:96:91",
            link_speed="16.0 GT/s PCIe",
        ),
        NicModel(
            key="mellanox-cx6",
            name="Mellanox MT28908 Family [ConnectX-6]",
            pf=Identity(0x15B3, 0x101B, 0x15B3, 0x0006, 0x020000, 0x00),
            vf=Identity(0x15B3, 0x101C, 0x15B3, 0x0006, 0x020000, 0x00),
            pf_driver="mlx5_core",
            vf_driver="mlx5_core",
            max_vfs=127,
            first_vf_offset=2,
            speed_mbps=200000,
            oui="0c:42:a1",
            link_speed="16.0 GT/s PCIe",
            rdma=RdmaModel(
                prefix="mlx5_",
                hca_type="MT4123",
                fw_ver="20.39.1002",
                board_id="MT_0000000222",
                rate="200 Gb/sec (4X HDR)",
            ),
            pf_bars=((0, 32 * MiB, True),),
            vf_bars=((0, 1 * MiB, True),),
        ),
    )
}

SWITCH = Identity(0x1000, 0xC030, 0x1000, 0x100B, 0x060400, 0xB0)
"""A Broadcom PEX89xxx-like PCIe switch port (upstream and downstream ports share it)."""

ROOT_PORT = Identity(0x8086, 0x347A, 0x8086, 0x0000, 0x060400, 0x04)
"""An Intel Xeon-like PCIe root port."""

VENDOR_NAMES: Final[dict[int, str]] = {
    0x1000: "Broadcom / LSI",
    0x1002: "Advanced Micro Devices, Inc. [AMD/ATI]",
    0x10DE: "NVIDIA Corporation",
    0x10EE: "Xilinx Corporation",
    0x15B3: "Mellanox Technologies",
    0x8086: "Intel Corporation",
}

DEVICE_NAMES: Final[dict[tuple[int, int], str]] = {
    (0x1000, 0xC030): "PEX89000 PCIe Gen 5 Switch",
    (0x8086, 0x347A): "Ice Lake-SP PCI Express Root Port",
    (0x10DE, 0x2330): "GH100 [H100 SXM5 80GB]",
    (0x10DE, 0x2335): "GH100 [H200 SXM 141GB]",
    (0x10DE, 0x20B0): "GA100 [A100 SXM4 40GB]",
    (0x8086, 0x56C0): "ATS-M [Data Center GPU Flex 170]",
    (0x8086, 0x0BDA): "Ponte Vecchio XT (1 Tile) [Data Center GPU Max 1100]",
    (0x1002, 0x740F): "Aldebaran/MI200 [Instinct MI210]",
    (0x1002, 0x74A1): "Aqua Vanjaram [Instinct MI300X]",
    (0x8086, 0x0B30): "PAC N3000 [Programmable Acceleration Card N3000]",
    (0x8086, 0x0B2B): "PAC D5005 [Programmable Acceleration Card D5005]",
    (0x10EE, 0x5004): "Alveo U250 (mgmt)",
    (0x10EE, 0x5005): "Alveo U250 (user)",
    (0x8086, 0x1592): "Ethernet Controller E810-C for QSFP",
    (0x8086, 0x1889): "Ethernet Adaptive Virtual Function",
    (0x15B3, 0x101B): "MT28908 Family [ConnectX-6]",
    (0x15B3, 0x101C): "MT28908 Family [ConnectX-6 Virtual Function]",
}
"""The ``pci.ids`` lines the lab writes, so ghw and lspci can name the devices."""


def pci_ids(more: Mapping[tuple[int, int], tuple[str, str]] | None = None) -> bytes:
    """Return a ``pci.ids`` with the vendors and devices above, in the file's own syntax.

    ``more``: (vendor, device) -> (vendor name, device name) of outside kinds' models.
    """
    vendors = dict(VENDOR_NAMES)
    devices = dict(DEVICE_NAMES)
    for (vendor, device), (vendor_name, name) in (more or {}).items():
        vendors.setdefault(vendor, vendor_name)
        devices.setdefault((vendor, device), name)
    lines = ["# pci.ids subset written by the plugvisor hardware lab", ""]
    for vendor in sorted(vendors):
        lines.append(f"{vendor:04x}  {vendors[vendor]}")
        for (v, device), name in sorted(devices.items()):
            if v == vendor:
                lines.append(f"\t{device:04x}  {name}")
    lines += ["", "C 02  Network controller", "\t00  Ethernet controller"]
    lines += ["C 03  Display controller", "\t00  VGA compatible controller", "\t02  3D controller"]
    lines += ["\t80  Display controller", "C 06  Bridge", "\t04  PCI bridge", "C 12  Processing accelerators"]
    return ("\n".join(lines) + "\n").encode()
