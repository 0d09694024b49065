"""The Lab API on a fake file system: structure, faults, hot-plug and VF counts."""

from __future__ import annotations

import json
import os

import pytest
from pyfakefs.fake_filesystem import FakeFilesystem

from plugvisor.emulators.lab import (
    DeviceBusyError,
    DeviceKind,
    FaultKind,
    Lab,
    LabExistsError,
    NotALabError,
    UsageError,
    fidelity,
)

R = "/lab/root"


def read(path: str) -> str:
    with open(os.path.join(R, path)) as handle:
        return handle.read().strip()


class TestStructure:
    def test_tree_is_faithful(self, small: Lab) -> None:
        """The fidelity walk finds nothing wrong in a fresh lab."""
        assert fidelity.problems(R) == []

    def test_records_match_tree(self, small: Lab) -> None:
        """Each record's identity and NUMA node are what sysfs says."""
        for rec in small.devices():
            base = f"sys/bus/pci/devices/{rec.bdf}"
            assert rec.vendor == read(f"{base}/vendor")
            assert rec.device == read(f"{base}/device")
            assert str(rec.numa_node) == read(f"{base}/numa_node")
            for node in rec.device_nodes:
                assert os.path.exists(R + node.path)
                assert os.path.realpath(f"{R}/dev/char/{node.major}:{node.minor}") == R + node.path

    def test_state_survives_reopen(self, small: Lab) -> None:
        """A second Lab on the same root (another CLI call) sees the same devices."""
        assert small.devices() == Lab.open(R).devices()

    def test_show_is_json(self, small: Lab) -> None:
        """``show`` data serializes to JSON and names devices, identities and faults."""
        data = json.loads(json.dumps(small.show()))
        assert {"gpu0", "fpga0", "nic0"} <= {d["name"] for d in data["devices"]}
        assert all("faults" in d and "vendor" in d for d in data["devices"])

    def test_create_twice_needs_replace(self, small: Lab) -> None:
        """A second create on a lab is refused unless replacing is asked for."""
        with pytest.raises(LabExistsError):
            Lab.create(R, "small")
        lab = Lab.create(R, "intel-gpu-like", replace=True)
        assert {"gpu0", "gpu1", "gpu2", "gpu3"} == {d.name for d in lab.devices()}
        assert not os.path.exists(f"{R}/dev/nvidiactl")

    def test_open_needs_a_lab(self, fs: FakeFilesystem) -> None:
        """Opening a directory without a lab says so."""
        fs.create_dir("/empty")
        with pytest.raises(NotALabError, match="holds no lab"):
            Lab.open("/empty")


class TestFaults:
    def test_aer_fatal_counter_rises_and_heals(self, small: Lab) -> None:
        """Each aer-fatal raises TOTAL_ERR_FATAL by one; heal brings it back to zero."""
        aer = f"sys/bus/pci/devices/{small.device('gpu0').bdf}/aer_dev_fatal"
        small.fault("gpu0", FaultKind.AER_FATAL)
        small.fault("gpu0", "aer-fatal")
        assert read(aer).endswith("TOTAL_ERR_FATAL 2")
        small.heal("gpu0")
        assert read(aer).endswith("TOTAL_ERR_FATAL 0")

    def test_gpu_falls_off_bus(self, small: Lab) -> None:
        """Fallen off the bus: driver link and node gone, config reads 0xff; heal restores them."""
        rec = small.device("gpu0")
        base = f"{R}/sys/bus/pci/devices/{rec.bdf}"
        small.fault("gpu0", "fallen-off-bus")
        assert not os.path.lexists(f"{base}/driver")
        assert not os.path.exists(f"{R}/dev/nvidia0")
        assert not os.path.lexists(f"{R}/sys/dev/char/195:0")
        with open(f"{base}/config", "rb") as handle:
            assert {0xFF} == set(handle.read())
        assert fidelity.problems(R) == []
        small.heal("gpu0", "fallen-off-bus")
        assert os.path.exists(f"{R}/dev/nvidia0")
        assert os.path.basename(os.readlink(f"{base}/driver")) == "nvidia"

    def test_link_down_reaches_vfs(self, small: Lab) -> None:
        """A PF link-down takes its VFs' links down too."""
        small.fault("nic0", "link-down")
        pf = small.device("nic0")
        assert read(f"sys/class/net/{pf.netdev}/operstate") == "down"
        assert read(f"sys/class/net/{pf.netdev}/carrier") == "0"
        for vf in pf.vfs:
            assert read(f"sys/class/net/{small.device(vf).netdev}/operstate") == "down"
        small.heal("nic0")
        assert read(f"sys/class/net/{small.device('nic0vf0').netdev}/operstate") == "up"

    def test_afu_id_all_f(self, small: Lab) -> None:
        """An FPGA port fault makes afu_id read all f."""
        small.fault("fpga0", "afu-id-invalid")
        assert read("sys/class/fpga_region/region0/dfl-port.0/afu_id") == "f" * 32
        small.heal("fpga0")
        assert read("sys/class/fpga_region/region0/dfl-port.0/afu_id") != "f" * 32

    def test_vfs_reset_and_heal(self, small: Lab) -> None:
        """vfs-reset drops VFs to 0; heal brings the old count back."""
        pf = small.device("nic0")
        small.fault("nic0", "vfs-reset")
        assert read(f"sys/bus/pci/devices/{pf.bdf}/sriov_numvfs") == "0"
        assert small.device("nic0").vfs == ()
        small.heal("nic0")
        assert len(pf.vfs) == len(small.device("nic0").vfs)

    def test_wrong_fault_for_kind(self, small: Lab) -> None:
        """A fault that does not fit the device is a usage error listing what fits."""
        with pytest.raises(UsageError, match=r"does not apply to gpu0.*expected one of"):
            small.fault("gpu0", "link-down")
        with pytest.raises(UsageError, match="unknown fault kind"):
            small.fault("gpu0", "melted")
        with pytest.raises(UsageError, match="no device 'gpu9'"):
            small.fault("gpu9", "aer-fatal")


class TestHotPlug:
    @pytest.mark.parametrize("name", ["gpu0", "fpga0", "nic0"])
    def test_unplug_and_plug(self, small: Lab, name: str) -> None:
        """A device's subtree, links and nodes go on unplug and come back on plug, identical."""
        before = small.device(name)
        small.unplug(name)
        assert not os.path.lexists(f"{R}/sys/bus/pci/devices/{before.bdf}")
        assert not os.path.lexists(R + "/" + before.sysfs_path)
        for node in before.device_nodes:
            assert not os.path.exists(R + node.path)
        assert small.device(name).state == "unplugged"
        assert fidelity.problems(R) == []
        small.plug(name)
        assert before == small.device(name)
        assert fidelity.problems(R) == []

    def test_unplugging_pf_takes_vfs(self, small: Lab) -> None:
        """VFs vanish with their PF and return with it."""
        vfs = small.device("nic0").vfs
        small.unplug("nic0")
        assert all(small.device(v).state == "unplugged" for v in vfs)
        small.plug("nic0")
        assert all(small.device(v).state == "present" for v in vfs)

    def test_unplug_twice(self, small: Lab) -> None:
        """Unplugging an unplugged device is a usage error."""
        small.unplug("gpu0")
        with pytest.raises(UsageError, match="already unplugged"):
            small.unplug("gpu0")


class TestNumVfs:
    def test_kernel_sequence(self, small: Lab) -> None:
        """0 removes every VF; N from 0 creates N, with virtfn/physfn pairs."""
        small.set_num_vfs("nic0", 0)
        assert [d for d in small.devices() if d.kind is DeviceKind.NIC_VF] == []
        small.set_num_vfs("nic0", 6)
        pf = small.device("nic0")
        assert 6 == len(pf.vfs) == int(read(f"sys/bus/pci/devices/{pf.bdf}/sriov_numvfs"))
        assert fidelity.problems(R) == []

    def test_n_to_m_is_busy(self, small: Lab) -> None:
        """N -> M without 0 in between is refused, as the kernel does (EBUSY)."""
        with pytest.raises(DeviceBusyError, match="write 0 first"):
            small.set_num_vfs("nic0", 2)

    def test_out_of_range(self, small: Lab) -> None:
        """More VFs than sriov_totalvfs is refused naming the range."""
        small.set_num_vfs("nic0", 0)
        with pytest.raises(UsageError, match=r"expected 0\.\.16"):
            small.set_num_vfs("nic0", 17)

    def test_only_pfs(self, small: Lab) -> None:
        """Setting VFs on a GPU is a usage error."""
        with pytest.raises(UsageError, match="not an SR-IOV PF"):
            small.set_num_vfs("gpu0", 1)
