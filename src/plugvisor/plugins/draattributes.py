"""DRA attributes every PCI kind publishes the same way: the standard ``resource.kubernetes.io`` ones.

``pcieRoot``, ``pciBusID`` and ``numaNode`` have one meaning across drivers
(``k8s.io/dynamic-resource-allocation/deviceattribute``), which is what makes a
claim's ``matchAttribute`` constraint work across kinds: a GPU and a VF on the
same root complex, two GPUs on one NUMA node. The PCIe root is the first
element of the function's place in the PCI tree (``pci0000:80``), read from
the same link the kinds' topology comes from.
"""

from __future__ import annotations

from pathlib import Path

from plugvisor.common.hostpaths import HostPaths
from plugvisor.dra.devices import NUMA_NODE, PCI_BUS_ID, PCIE_ROOT, AttributeValue, SemVer
from plugvisor.plugins import pciids, sysfs

VENDORS = {0x10DE: "nvidia", 0x1002: "amd", 0x8086: "intel", 0x15B3: "mellanox", 0x10EE: "xilinx"}
"""Vendor names users select on (``device.attributes["gpu.plugvisor.io"].vendor == "nvidia"``)."""


def pci_placement(bdf: str, chain: tuple[str, ...], numa_node: int | None) -> dict[str, AttributeValue]:
    """The standard attributes of a PCI function: its address, its root complex, its NUMA node."""
    attributes: dict[str, AttributeValue] = {PCI_BUS_ID: bdf}
    if chain and chain[0].startswith("pci"):
        attributes[PCIE_ROOT] = chain[0]
    if numa_node is not None:
        attributes[NUMA_NODE] = numa_node
    return attributes


def function_attributes(function: sysfs.PciFunction, paths: HostPaths) -> dict[str, AttributeValue]:
    """A function's standard attributes plus its vendor, PCI device ID, driver and database name."""
    attributes = pci_placement(function.bdf, function.chain, function.numa_node)
    attributes["vendor"] = VENDORS.get(function.vendor, f"0x{function.vendor:04x}")
    attributes["pciDeviceId"] = f"0x{function.device:04x}"
    if function.driver is not None:
        attributes["driver"] = function.driver[:64]
    name = pciids.device_name(paths, function.vendor, function.device)
    if name:
        attributes["model"] = name[:64]
    return attributes


def module_version(paths: HostPaths, module: str) -> SemVer | None:
    """A kernel module's version from ``/sys/module/<module>/version`` (out-of-tree drivers have one)."""
    text = sysfs.read_text(paths.sysfs / "module" / module / "version")
    return SemVer.tolerant(text) if isinstance(text, str) else None


def read_bytes_count(path: Path) -> int | None:
    """An attribute holding a byte count (``lmem_total_bytes``, ``mem_info_vram_total``), or None."""
    value = sysfs.read_int(path)
    return value if isinstance(value, int) and value > 0 else None
