"""What each built-in kind publishes as a DRA driver: the names and attributes users select on."""

import shutil
import tempfile
from pathlib import Path

import pytest

from plugvisor.common.hostpaths import HostPaths
from plugvisor.dra.devices import NUMA_NODE, PCI_BUS_ID, PCIE_ROOT, SemVer
from plugvisor.dra.pool import build_pool
from plugvisor.emulators import lab
from plugvisor.plugins.kinds import get_kind


@pytest.fixture(scope="module")
def labs():
    base = Path(tempfile.mkdtemp(prefix="/dev/shm/pvd-" if Path("/dev/shm").is_dir() else "/tmp/pvd-"))
    for profile in ("dgx-like", "intel-gpu-like"):
        lab.Lab.create(str(base / profile), profile)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def pool(root, kind, options=None):
    source = get_kind(kind).build(options or {}, HostPaths(root=root), resource=f"{kind}.plugvisor.io")
    describer = source if hasattr(source, "dra_devices") else None
    return build_pool(source.scan(), describer, driver=f"{kind}.plugvisor.io")


class TestGpu:
    def test_each_gpu_has_its_identity_placement_and_driver(self, labs):
        published = pool(labs / "dgx-like", "gpu")
        assert len(published.devices) == 8
        first = next(iter(published.devices.values()))
        attributes = dict(first.attributes)
        assert first.name == attributes["uuid"].lower()
        assert attributes["index"] == 0
        assert attributes["model"] == "NVIDIA H100 80GB HBM3"
        assert (attributes["vendor"], attributes["driver"], attributes["pciDeviceId"]) == (
            "nvidia",
            "nvidia",
            "0x2330",
        )
        assert attributes["driverVersion"] == SemVer("550.54.15")
        assert (attributes[PCI_BUS_ID], attributes[PCIE_ROOT], attributes[NUMA_NODE]) == (
            "0000:03:00.0",
            "pci0000:00",
            0,
        )

    def test_gpus_on_two_root_complexes_split_four_and_four(self, labs):
        roots = [d.attributes[PCIE_ROOT] for d in pool(labs / "dgx-like", "gpu").devices.values()]
        assert sorted(roots) == ["pci0000:00"] * 4 + ["pci0000:80"] * 4

    def test_replicas_are_not_devices_of_their_own_in_dra(self, labs):
        published = pool(labs / "dgx-like", "gpu", {"replicas": 4})
        assert len(published.devices) == 8
        assert all(device_id.endswith("::0") for device_id in published.ids.values())

    def test_memory_is_a_capacity_where_the_kernel_reports_it(self, labs):
        published = pool(labs / "intel-gpu-like", "gpu")
        device = next(iter(published.devices.values()))
        assert dict(device.capacity) == {"memory": "16Gi"}
        assert device.name.startswith("gpu-0000-")
        assert device.attributes["model"] == "ATS-M [Data Center GPU Flex 170]"

    def test_no_pci_database_means_no_model_but_everything_else(self, labs, tmp_path):
        copy = tmp_path / "root"
        shutil.copytree(labs / "intel-gpu-like", copy, symlinks=True)
        (copy / "usr/share/hwdata/pci.ids").unlink()
        device = next(iter(pool(copy, "gpu").devices.values()))
        assert "model" not in device.attributes and device.attributes["vendor"] == "intel"


class TestNic:
    def test_a_vf_is_named_by_its_pf_and_says_its_rdma_device(self, labs):
        published = pool(labs / "dgx-like", "nic", {"match": {"isRdma": True}})
        device = published.devices["enp138s0f0-vf0"]
        assert {k: device.attributes[k] for k in ("pfName", "vfIndex", "rdma", "rdmaDevice", "vendor")} == {
            "pfName": "enp138s0f0",
            "vfIndex": 0,
            "rdma": True,
            "rdmaDevice": "mlx5_1",
            "vendor": "mellanox",
        }
        assert (device.attributes[PCIE_ROOT], device.attributes[NUMA_NODE]) == ("pci0000:80", 1)

    def test_a_vf_without_rdma_says_so(self, labs):
        published = pool(labs / "dgx-like", "nic", {"match": {"pfNames": ["enp10s0f0"]}})
        assert len(published.devices) == 8
        assert published.devices["enp10s0f0-vf3"].attributes["rdma"] is False


class TestFpga:
    def test_a_dfl_port_says_its_interface_and_afu(self, labs):
        (device,) = pool(labs / "dgx-like", "fpga").devices.values()
        assert device.attributes["flavor"] == "dfl"
        assert len(str(device.attributes["interfaceId"])) == 32 and len(str(device.attributes["afuId"])) == 32

    def test_a_xilinx_card_says_its_shell(self, labs):
        (device,) = pool(labs / "dgx-like", "fpga", {"mode": "xilinx"}).devices.values()
        assert device.attributes["interfaceId"] == "xilinx_u250_gen3x16_xdma_shell_4_1"


class TestGeneric:
    def test_a_generic_device_says_its_path(self, labs):
        published = pool(labs / "dgx-like", "generic", {"paths": ["/dev/nvidia[0-9]"]})
        assert {d.name: d.attributes["path"] for d in published.devices.values()}["nvidia3"] == "/dev/nvidia3"
