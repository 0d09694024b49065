"""The ``nvidia-h200-vm`` profile writes what a real H200 VM showed, byte for byte.

Every expected value below is a literal copied from the real node's capture (not from the
lab's own constants), so a renderer that drifts from the real node fails here.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from pyfakefs.fake_filesystem import FakeFilesystem

from plugvisor.emulators.lab import Lab, UsageError, fidelity

ROOT = "/lab/root"
FN = f"{ROOT}/sys/devices/pci0000:00/0000:00:06.0"

ENTRIES = [
    "ari_enabled",
    "broken_parity_status",
    "class",
    "config",
    "consistent_dma_mask_bits",
    "current_link_speed",
    "current_link_width",
    "d3cold_allowed",
    "device",
    "dma_mask_bits",
    "driver",
    "driver_override",
    "enable",
    "firmware_node",
    "irq",
    "link",
    "local_cpulist",
    "local_cpus",
    "max_link_speed",
    "max_link_width",
    "modalias",
    "msi_bus",
    "msi_irqs",
    "numa_node",
    "power",
    "power_state",
    "remove",
    "rescan",
    "reset",
    "reset_method",
    "resource",
    "resource0",
    "resource0_wc",
    "resource2",
    "resource2_wc",
    "resource4",
    "resource4_wc",
    "revision",
    "serial_number",
    "subsystem",
    "subsystem_device",
    "subsystem_vendor",
    "uevent",
    "vendor",
]

INFORMATION = (
    b"Model: \t\t NVIDIA H200\n"
    b"IRQ:   \t\t 41\n"
    b"GPU UUID: \t GPU-2b75dc85-67dc-fd5d-9317-96e28aca4f63\n"
    b"Video BIOS: \t 96.00.a5.00.1a\n"
    b"Bus Type: \t PCIe\n"
    b"DMA Size: \t 52 bits\n"
    b"DMA Mask: \t 0xfffffffffffff\n"
    b"Bus Location: \t 0000:00:06.0\n"
    b"Device Minor: \t 0\n"
    b"GPU Firmware: \t 580.159.04\n"
    b"GPU Excluded:\t No\n"
)

VERSION = (
    b"NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (nixbld@)  \n"
    b"GCC version:  gcc version 15.3.0 (GCC) \n"
)


@pytest.fixture
def h200(fs: FakeFilesystem) -> Lab:
    return Lab.create(ROOT, "nvidia-h200-vm")


def read(path: str) -> bytes:
    return Path(path).read_bytes()


@pytest.mark.usefixtures("h200")
class TestThePciFunction:
    def test_the_only_function_is_the_gpu_on_the_root_bus_with_no_switch_or_root_port(self) -> None:
        """/sys/bus/pci/devices holds 0000:00:06.0, a direct child of pci0000:00."""
        assert os.listdir(f"{ROOT}/sys/bus/pci/devices") == ["0000:00:06.0"]
        link = f"{ROOT}/sys/bus/pci/devices/0000:00:06.0"
        assert os.readlink(link) == "../../../devices/pci0000:00/0000:00:06.0"
        assert sorted(os.listdir(f"{ROOT}/sys/devices/pci0000:00")) == ["0000:00:06.0"]

    def test_its_directory_holds_exactly_the_real_functions_entries(self) -> None:
        """No AER files, no iommu_group, no hwmon, no drm: the same names the real node listed."""
        assert sorted(os.listdir(FN)) == ENTRIES

    def test_attributes_read_as_on_the_real_node(self) -> None:
        expected = {
            "class": b"0x030200\n",
            "vendor": b"0x10de\n",
            "device": b"0x2335\n",
            "subsystem_vendor": b"0x10de\n",
            "subsystem_device": b"0x18bf\n",
            "numa_node": b"-1\n",
            "local_cpulist": b"0-15\n",
            "current_link_speed": b"32.0 GT/s PCIe\n",
            "max_link_speed": b"32.0 GT/s PCIe\n",
            "current_link_width": b"16\n",
            "max_link_width": b"16\n",
        }
        assert {name: read(f"{FN}/{name}") for name in expected} == expected

    def test_driver_link_is_the_kernels_relative_one(self) -> None:
        assert os.readlink(f"{FN}/driver") == "../../../bus/pci/drivers/nvidia"

    def test_no_drm_class_at_all(self) -> None:
        assert not os.path.exists(f"{ROOT}/sys/class/drm")
        assert not os.path.exists(f"{ROOT}/dev/dri")


@pytest.mark.usefixtures("h200")
class TestTheDriver:
    def test_proc_version_is_the_open_modules_wording_trailing_spaces_included(self) -> None:
        assert read(f"{ROOT}/proc/driver/nvidia/version") == VERSION

    def test_information_file_is_byte_for_byte_the_real_one(self) -> None:
        assert read(f"{ROOT}/proc/driver/nvidia/gpus/0000:00:06.0/information") == INFORMATION

    def test_module_version_and_uvm_module(self) -> None:
        assert read(f"{ROOT}/sys/module/nvidia/version") == b"580.159.04\n"
        assert os.path.isdir(f"{ROOT}/sys/module/nvidia_uvm")

    def test_mig_capabilities(self) -> None:
        expected = {
            "config": b"DeviceFileMinor: 1\nDeviceFileMode: 256\nDeviceFileModify: 1\n",
            "monitor": b"DeviceFileMinor: 2\nDeviceFileMode: 292\nDeviceFileModify: 1\n",
        }
        mig = f"{ROOT}/proc/driver/nvidia/capabilities/mig"
        assert {name: read(f"{mig}/{name}") for name in expected} == expected


@pytest.mark.usefixtures("h200")
class TestDeviceNodes:
    def test_dev_holds_the_real_nodes_and_no_modeset(self) -> None:
        names = {n for n in os.listdir(f"{ROOT}/dev") if n != "char"}
        assert names == {"nvidia0", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-caps"}

    def test_node_modes(self) -> None:
        expected = {"nvidia-caps/nvidia-cap1": 0o400, "nvidia-caps/nvidia-cap2": 0o444, "nvidia0": 0o666}
        assert {node: stat.S_IMODE(os.stat(f"{ROOT}/dev/{node}").st_mode) for node in expected} == expected

    def test_numbers_agree_with_the_real_node(self) -> None:
        expected = {
            "195:0": "nvidia0",
            "195:255": "nvidiactl",
            "238:0": "nvidia-uvm",
            "238:1": "nvidia-uvm-tools",
        }
        found = {
            n: os.path.relpath(os.path.realpath(f"{ROOT}/dev/char/{n}"), f"{ROOT}/dev") for n in expected
        }
        assert found == expected

    def test_proc_devices_names_the_caps_major(self) -> None:
        text = read(f"{ROOT}/proc/devices").decode()
        assert "238 nvidia-uvm\n" in text
        assert "241 nvidia-caps\n" in text


class TestTheLab:
    def test_the_tree_passes_the_labs_own_checks(self, h200: Lab) -> None:
        assert fidelity.problems(ROOT) == []

    def test_the_gpu_record_says_no_numa_node(self, h200: Lab) -> None:
        record = h200.device("gpu0")
        assert (record.bdf, record.numa_node, record.uuid) == (
            "0000:00:06.0",
            -1,
            "GPU-2b75dc85-67dc-fd5d-9317-96e28aca4f63",
        )

    def test_aer_faults_do_not_apply_to_a_gpu_without_aer(self, h200: Lab) -> None:
        with pytest.raises(UsageError, match=r"aer-fatal.*does not apply"):
            h200.fault("gpu0", "aer-fatal")

    def test_tools_are_under_the_driver_root(self, h200: Lab) -> None:
        tools = sorted(os.listdir(f"{ROOT}/usr/local/nvidia/bin"))
        assert tools == ["nvidia-cuda-mps-control", "nvidia-debugdump", "nvidia-persistenced", "nvidia-smi"]
        assert os.access(f"{ROOT}/usr/local/nvidia/bin/nvidia-smi", os.X_OK)
