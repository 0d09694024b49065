"""The gpu kind's scan on broken trees, its options, and its information parser."""

import os
import shutil
import tempfile
from pathlib import Path

import pydantic
import pytest

from plugvisor.common.hostpaths import HostPaths
from plugvisor.common.validation import describe
from plugvisor.emulators import lab
from plugvisor.plugins.gpu import KIND, GpuOptions
from plugvisor.plugins.gpu.discovery import parse_information


@pytest.fixture(scope="module")
def pristine():
    base = Path(tempfile.mkdtemp(prefix="/dev/shm/pvl-" if Path("/dev/shm").is_dir() else "/tmp/pvl-"))
    lab.Lab.create(str(base / "root"), "dgx-like")
    yield base / "root"
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def root(pristine, tmp_path):
    copy = tmp_path / "root"
    shutil.copytree(pristine, copy, symlinks=True)
    return copy


def scan(root, **options):
    return KIND.build(GpuOptions.model_validate(options), HostPaths(root=root), resource="x.io/gpu").scan()


def bus(root, bdf):
    return root / "sys/bus/pci/devices" / bdf


class TestBrokenTrees:
    def test_garbage_vendor_skips_that_gpu_only(self, root):
        (bus(root, "0000:03:00.0") / "vendor").unlink()
        (bus(root, "0000:03:00.0") / "vendor").write_text("banana\n")
        assert len(scan(root)) == 7

    def test_a_looping_or_dangling_bus_link_skips_that_gpu_only(self, root):
        link = bus(root, "0000:04:00.0")
        link.unlink()
        os.symlink("0000:04:00.0", link)
        dangling = bus(root, "0000:07:00.0")
        dangling.unlink()
        os.symlink("../../../devices/nowhere/0000:07:00.0", dangling)
        assert len(scan(root)) == 6

    def test_garbage_numa_node_gives_no_topology_not_a_crash(self, root):
        numa = bus(root, "0000:83:00.0") / "numa_node"
        numa.unlink()
        numa.write_text("-x\n")
        devices = scan(root, deviceIdStrategy="pci")
        assert devices["0000:83:00.0"].numa_nodes == () and devices["0000:83:00.0"].healthy

    def test_a_missing_device_node_makes_the_gpu_unhealthy(self, root):
        (root / "dev/nvidia2").unlink()
        devices = scan(root, deviceIdStrategy="index")
        assert not devices["2"].healthy and devices["1"].healthy

    def test_a_garbage_information_file_falls_back_to_the_pci_address(self, root):
        info = root / "proc/driver/nvidia/gpus/0000:08:00.0/information"
        info.unlink()
        info.write_bytes(b"\x00\xff")
        assert "0000:08:00.0" in scan(root)

    def test_no_sysfs_at_all_is_an_empty_list(self, tmp_path):
        assert len(scan(tmp_path)) == 0


class TestOptions:
    @pytest.mark.parametrize(
        ("options", "message"),
        [
            (
                {"match": {"vendors": ["nvidia"]}},
                "match.vendors[0]: Value error, 'nvidia' is not a 16-bit PCI ID",
            ),
            ({"replicas": 0}, "replicas: Input should be greater than or equal to 1"),
            ({"allocationPolicy": "random"}, "allocationPolicy: Input should be 'spread' or 'pack'"),
            ({"visibleDevicesEnv": "A-B"}, "visibleDevicesEnv: String should match pattern"),
            ({"cdiDir": "var/run/cdi"}, "cdiDir: Value error, 'var/run/cdi' must be an absolute path"),
            ({"mig": "single"}, "mig: unknown key"),
        ],
    )
    def test_bad_options_name_the_field(self, options, message):
        with pytest.raises(pydantic.ValidationError) as info:
            GpuOptions.model_validate(options)
        assert message in describe(info.value, source="node.yaml")

    def test_cdi_implies_no_device_specs_unless_asked(self):
        assert not GpuOptions.model_validate({"cdi": True}).device_specs
        assert GpuOptions.model_validate({"cdi": True, "passDeviceSpecs": True}).device_specs
        assert GpuOptions().device_specs


def test_information_parser_reads_the_drivers_spacing():
    text = "Model: \t\t NVIDIA H100\nGPU UUID: \t GPU-1234\nDevice Minor: \t 3\nGPU Excluded:\t No\n"
    assert parse_information(text) == {
        "Model": "NVIDIA H100",
        "GPU UUID": "GPU-1234",
        "Device Minor": "3",
        "GPU Excluded": "No",
    }
