"""Every NVIDIA lab's driver side: module version, the kernel module's wording, NVML's faults and state.

The NVML stand-in itself is exercised through pynvml in tests/integration/lab/test_nvml_standin.py;
here the file system is a fake one (no compiler runs), so these tests check what the lab writes
and validates.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pyfakefs.fake_filesystem import FakeFilesystem

from plugvisor.common.hostpaths import multiarch_triplet
from plugvisor.emulators.lab import Lab, ProfileError, UsageError, fidelity, nvml, parse_profile
from plugvisor.emulators.lab.nvml import cuda_driver_version

ROOT = "/lab/root"
NVML_GPU0 = f"{ROOT}/.plugvisor-lab/nvml/gpu0"


def nvml_values(path: str = NVML_GPU0) -> dict[str, list[str]]:
    values: dict[str, list[str]] = {}
    for line in Path(path).read_text().splitlines():
        key, _, value = line.partition("=")
        values.setdefault(key, []).append(value)
    return values


@pytest.fixture
def small(fs: FakeFilesystem) -> Lab:
    """A ``small`` lab made in the fake file system itself, which has no C compiler: what these tests
    check of the driver's files depends on it (conftest's copy of a real lab was made where cc may be)."""
    return Lab.create(ROOT, "small")


def one_gpu(**top: Any) -> dict[str, Any]:
    return {"name": "one", "gpus": [{"model": "nvidia-h100", "count": 1}], **top}


class TestEveryNvidiaLab:
    def test_module_version_is_the_driver_version(self, small: Lab) -> None:
        """/sys/module/nvidia/version: what nvidia-smi and the container toolkit compare against."""
        assert Path(f"{ROOT}/sys/module/nvidia/version").read_bytes() == b"550.54.15\n"
        assert os.path.isdir(f"{ROOT}/sys/module/nvidia_uvm")

    def test_the_proprietary_module_keeps_its_wording_by_default(self, small: Lab) -> None:
        version = Path(f"{ROOT}/proc/driver/nvidia/version").read_bytes()
        assert version.startswith(b"NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  ")

    def test_any_nvidia_profile_can_load_the_open_module(self, fs: FakeFilesystem) -> None:
        profile = parse_profile(
            one_gpu(nvidiaKernelModule="open", nvidiaDriverVersion="570.86.15"), source="p.yaml"
        )
        Lab.create(ROOT, profile)
        version = Path(f"{ROOT}/proc/driver/nvidia/version").read_bytes()
        assert version.startswith(b"NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.15  ")
        info = Path(f"{ROOT}/proc/driver/nvidia/gpus/0000:01:00.0/information").read_text()
        assert "GPU Firmware: \t 570.86.15\n" in info

    def test_modeset_node_is_there_unless_the_profile_says_otherwise(self, small: Lab) -> None:
        assert os.path.exists(f"{ROOT}/dev/nvidia-modeset")

    def test_without_a_compiler_the_libraries_are_left_out_and_said_so(self, small: Lab) -> None:
        """The fake file system has no cc: tools are written, libraries are not, and the lab says why."""
        assert any("no C compiler (cc)" in note for note in small.notes)
        assert not os.path.exists(f"{ROOT}/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1")
        assert os.path.exists(f"{ROOT}/usr/bin/nvidia-smi")

    def test_a_stand_in_the_installation_carries_is_used_without_a_compiler(self, fs: FakeFilesystem) -> None:
        """The release image has no cc, but its build stage compiled the stand-in into the installation's
        share/plugvisor/nvml: a lab created there (the lab overlays' pod) gets NVML and the libraries."""
        shipped = Path(nvml.installed_dir()) / nvml.library_name()
        fs.create_file(shipped, contents=b"\x7fELF the stand-in")
        node = Lab.create(ROOT, parse_profile(one_gpu(), source="p.yaml"))
        assert node.notes == ()
        libraries = f"{ROOT}/usr/lib/{multiarch_triplet()}"
        assert Path(f"{libraries}/libnvidia-ml.so.1").read_bytes() == b"\x7fELF the stand-in"
        assert os.path.exists(f"{libraries}/libcuda.so.1")

    def test_a_stand_in_of_another_source_is_not_taken_for_this_one(self, fs: FakeFilesystem) -> None:
        """Only the file named after this source's hash counts: an image built from older sources carries
        a library that answers differently, and the lab says it has none rather than use it."""
        fs.create_file(Path(nvml.installed_dir()) / "libnvidia-ml-0000000000000000.so", contents=b"old")
        node = Lab.create(ROOT, parse_profile(one_gpu(), source="p.yaml"))
        assert any("no C compiler (cc)" in note for note in node.notes)
        assert not os.path.exists(f"{ROOT}/usr/lib/{multiarch_triplet()}/libnvidia-ml.so.1")


class TestNvmlState:
    def test_the_stand_in_gets_the_gpus_identity_as_sysfs_and_procfs_show_it(self, small: Lab) -> None:
        values = nvml_values()
        record = small.device("gpu0")
        assert values["uuid"] == [record.uuid]
        assert values["bus_id"] == ["00000000:01:00.0"]
        assert values["minor"] == ["0"]
        assert values["memory_total"] == ["85520809984"]
        system = Path(f"{ROOT}/.plugvisor-lab/nvml/system").read_text()
        assert "driver_version=550.54.15\nnvml_version=12.550.54.15\ncuda_driver_version=12040\n" in system

    @pytest.mark.parametrize(
        ("driver", "cuda"),
        [("470.256.02", 11040), ("535.230.02", 12020), ("550.54.15", 12040), ("560.35.03", 12060),
         ("570.86.10", 12080), ("575.51.03", 12090), ("580.159.04", 13000), ("590.44.01", 13010)],
    )  # fmt: skip
    def test_the_cuda_driver_version_is_the_one_nvidias_driver_of_that_branch_supports(
        self, driver: str, cuda: int
    ) -> None:
        assert cuda_driver_version(driver) == cuda

    def test_overheat_moves_nvml_temperature_and_power(self, small: Lab) -> None:
        cool = nvml_values()
        small.fault("gpu0", "overheat")
        hot = nvml_values()
        assert int(hot["temperature"][0]) > int(cool["temperature"][0])
        assert int(hot["power_mw"][0]) > int(cool["power_mw"][0])
        small.heal("gpu0")
        assert nvml_values()["temperature"] == cool["temperature"]

    def test_an_xid_fault_is_written_with_its_time_and_heal_removes_it(self, small: Lab) -> None:
        small.fault("gpu0", "xid-79")
        (xid,) = nvml_values()["xid"]
        number, _, since = xid.partition("@")
        assert number == "79" and int(since) > 0
        small.heal("gpu0", "xid-79")
        assert "xid" not in nvml_values()

    def test_an_ecc_fault_that_ends_leaves_its_errors_counted(self, small: Lab) -> None:
        small.fault("gpu0", "ecc-dbe")
        assert int(nvml_values()["ecc_dbe_since"][0]) > 0
        small.heal("gpu0")
        values = nvml_values()
        assert values["ecc_dbe_since"] == ["0"]
        assert int(values["ecc_dbe_volatile"][0]) >= 1
        assert int(values["ecc_dbe_aggregate"][0]) >= 1

    def test_fallen_off_bus_and_unplug_mark_the_gpu_lost_until_it_is_back(self, small: Lab) -> None:
        small.fault("gpu0", "fallen-off-bus")
        assert int(nvml_values()["lost_at"][0]) > 0
        small.heal("gpu0")
        assert nvml_values()["lost_at"] == ["0"]
        small.unplug("gpu0")
        assert int(nvml_values()["lost_at"][0]) > 0
        small.plug("gpu0")
        assert nvml_values()["lost_at"] == ["0"]


class TestFaults:
    def test_nvidia_gpus_list_the_nvml_faults(self, small: Lab) -> None:
        with pytest.raises(UsageError) as caught:
            small.fault("gpu0", "melted")
        assert "overheat, ecc-dbe, ecc-sbe, xid-<N>" in str(caught.value)

    @pytest.mark.parametrize(
        "fault", ["xid-0", "xid-x", "xid-70000", "xid-", "xid-<N>", "xid-079", "xid-0079"]
    )
    def test_an_xid_out_of_range_names_the_fault_and_the_range(self, small: Lab, fault: str) -> None:
        with pytest.raises(UsageError) as caught:
            small.fault("gpu0", fault)
        assert f"fault {fault!r}" in str(caught.value)
        assert "1..65535" in str(caught.value)

    @pytest.mark.parametrize("fault", ["xid-79", "ecc-dbe"])
    def test_nvml_faults_do_not_apply_beyond_nvidia_gpus(self, small: Lab, fault: str) -> None:
        with pytest.raises(UsageError) as caught:
            small.fault("fpga0", fault)
        assert f"fault {fault!r} does not apply to fpga0" in str(caught.value)
        assert "expected one of: aer-fatal" in str(caught.value)

    def test_xid_bounds_are_accepted(self, small: Lab) -> None:
        small.fault("gpu0", "xid-1")
        record = small.fault("gpu0", "xid-65535")
        assert record.faults == ("xid-1", "xid-65535")


BAD = [
    (one_gpu(nvidiaKernelModule="closed"), "nvidiaKernelModule", "'open' or 'proprietary'"),
    (one_gpu(nvidiaDriverVersion="latest"), "nvidiaDriverVersion", "should match pattern"),
    (one_gpu(driverRoot="usr/local/nvidia"), "driverRoot", "should match pattern"),
    (
        {"name": "x", "fpgas": [{"model": "intel-pac-n3000", "count": 1}], "driverRoot": "/opt/nvidia"},
        "driverRoot",
        "applies to a node with NVIDIA GPUs",
    ),
    (one_gpu(numaInformation=False, numaNodes=2), "numaInformation", "needs numaNodes: 1"),
    (
        {"name": "x", "iommuGroups": False, "nics": [{"model": "intel-e810", "count": 1}]},
        "iommuGroups",
        "expected true with nics",
    ),
    (
        {
            "name": "x",
            "gpus": [{"model": "nvidia-h100", "count": 1, "devices": [{"pciAddress": "0000:3b:00.0"}]}],
        },
        "gpus[0].devices[0].pciAddress",
        "not on the root bus",
    ),
    (
        {"name": "x", "gpus": [{"model": "nvidia-h100", "count": 1, "devices": [{"pciAddress": "0:0:6.0"}]}]},
        "gpus[0].devices[0].pciAddress",
        "should match pattern",
    ),
    (
        {
            "name": "x",
            "gpus": [
                {
                    "model": "amd-mi300x",
                    "count": 1,
                    "devices": [{"uuid": "GPU-" + "0" * 8 + "-0000-0000-0000-" + "0" * 12}],
                }
            ],
        },
        "gpus[0].devices[0].uuid",
        "applies to NVIDIA GPUs",
    ),
    (
        {"name": "x", "gpus": [{"model": "nvidia-h100", "count": 1, "devices": [{}, {}]}]},
        "gpus[0].devices",
        "expected at most 1",
    ),
    (
        {
            "name": "x",
            "gpus": [
                {
                    "model": "nvidia-h100",
                    "count": 2,
                    "devices": [{"pciAddress": "0000:00:06.0"}, {"pciAddress": "0000:00:06.0"}],
                }
            ],
        },
        "gpus[0].devices[1].pciAddress",
        "is already gpus[0].devices[0]'s",
    ),
]


@pytest.mark.parametrize(("data", "field", "expected"), BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_a_bad_new_key_is_named_with_what_was_expected(
    data: dict[str, Any], field: str, expected: str
) -> None:
    with pytest.raises(ProfileError) as caught:
        parse_profile(data, source="node.yaml")
    message = str(caught.value)
    assert f"{field}:" in message or f"{field} " in message
    assert expected in message


def test_root_bus_gpus_share_the_host_bridge_with_root_ports(fs: FakeFilesystem) -> None:
    """A GPU fixed at 00:01.0 pushes the root ports of the other devices past it."""
    profile = parse_profile(
        {
            "name": "mixed",
            "gpus": [{"model": "nvidia-h100", "count": 1, "devices": [{"pciAddress": "0000:00:01.0"}]}],
            "fpgas": [{"model": "intel-pac-n3000", "count": 1}],
        },
        source="p.yaml",
    )
    node = Lab.create(ROOT, profile)
    assert node.device("gpu0").bdf == "0000:00:01.0"
    assert sorted(os.listdir(f"{ROOT}/sys/devices/pci0000:00")) == ["0000:00:01.0", "0000:00:02.0"]
    assert fidelity.problems(ROOT) == []


def test_the_mi300x_model_reports_its_vram(lab_of: Callable[[str], Lab]) -> None:
    node = lab_of("amd-like")
    mi300 = next(r for r in node.devices() if r.model == "amd-mi300x")
    fn = f"{ROOT}/{mi300.sysfs_path}"
    assert Path(f"{fn}/mem_info_vram_total").read_bytes() == b"206141652992\n"
    assert int(Path(f"{fn}/mem_info_vram_used").read_bytes()) > 0


def test_replacing_a_lab_takes_its_driver_files_away(small: Lab) -> None:
    """--force onto a lab whose driver root differs leaves no stale nvidia-smi or NVML state behind."""
    Lab.create(ROOT, "nvidia-h200-vm", replace=True)
    assert not os.path.exists(f"{ROOT}/usr/bin/nvidia-smi")
    assert os.path.exists(f"{ROOT}/usr/local/nvidia/bin/nvidia-smi")
    assert nvml_values()["uuid"] == ["GPU-2b75dc85-67dc-fd5d-9317-96e28aca4f63"]
