"""The nic kind's options and naming rules."""

import shutil
import tempfile
from pathlib import Path

import pydantic
import pytest
import structlog

from plugvisor.common.hostpaths import HostPaths
from plugvisor.common.validation import describe
from plugvisor.emulators import lab
from plugvisor.plugins.nic import KIND, NicOptions, env_name


def test_env_name_follows_the_sriov_plugin():
    assert env_name("intel.com/intel_sriov_netdevice") == "PCIDEVICE_INTEL_COM_INTEL_SRIOV_NETDEVICE"
    assert env_name("example.com/nic-a") == "PCIDEVICE_EXAMPLE_COM_NIC_A"


def test_pf_names_with_vf_ranges():
    match = NicOptions.model_validate({"match": {"pfNames": ["ens1f0#0-2,7", "ens1f1"]}}).match
    assert match.pf_ranges() == {"ens1f0": frozenset({0, 1, 2, 7}), "ens1f1": None}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"match": {"pfNames": ["ens1f0#3-1"]}},
            "match.pfNames[0]: 'ens1f0#3-1': VF range 3-1 runs backwards",
        ),
        ({"match": {"rootDevices": ["zz"]}}, "match.rootDevices[0]: 'zz' is not a PCI address"),
        ({"match": {"linkTypes": ["ether"]}}, "match.linkTypes: unknown key"),
    ],
)
def test_bad_options_name_the_field(options, message):
    with pytest.raises(pydantic.ValidationError) as info:
        NicOptions.model_validate(options)
    assert message in describe(info.value, source="node.yaml")


@pytest.fixture(scope="module")
def pristine():
    base = Path(tempfile.mkdtemp(prefix="/dev/shm/pvl-" if Path("/dev/shm").is_dir() else "/tmp/pvl-"))
    lab.Lab.create(str(base / "root"), "dgx-like")
    yield base / "root"
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def root(pristine):
    copy = Path(tempfile.mkdtemp(dir=pristine.parent)) / "root"
    shutil.copytree(pristine, copy, symlinks=True)
    yield copy
    shutil.rmtree(copy.parent, ignore_errors=True)


class TestBrokenTrees:
    """What cannot be read is Unhealthy or skipped, with one log line naming the device and the cause."""

    PF = "0000:0a:00.0"

    def _scan_twice(self, root):
        options = NicOptions.model_validate({"match": {"pfNames": ["enp10s0f0"]}})
        source = KIND.build(options, HostPaths(root=root), resource="x.io/nic")
        with structlog.testing.capture_logs() as logs:
            source.scan()
            devices = source.scan().devices
        return devices, [e for e in logs if e["event"] in ("device_unhealthy", "device_skipped")]

    def test_a_pf_whose_operstate_is_garbage_makes_its_vfs_unhealthy(self, root):
        operstate = root / "sys/bus/pci/devices" / self.PF / "net/enp10s0f0/operstate"
        operstate.unlink()
        operstate.write_text("sideways\n")
        devices, logs = self._scan_twice(root)
        assert len(devices) == 8 and not any(d.healthy for d in devices.values())
        assert len(logs) == 8  # one per VF, not one per scan
        assert all(
            "PF enp10s0f0 operstate unreadable" in e["cause"] and "sideways" in e["cause"] for e in logs
        )

    def test_a_virtfn_link_that_loops_names_its_target_in_the_cause(self, root):
        link = root / "sys/bus/pci/devices" / self.PF / "virtfn0"
        link.unlink()
        link.symlink_to("virtfn0")
        devices, logs = self._scan_twice(root)
        assert len(devices) == 7
        (line,) = logs
        assert line["device"] == f"{self.PF}/virtfn0"
        assert line["cause"].endswith("virtfn0: points to 'virtfn0', not a PCI function")


class TestSelectorsThatMatchNothing:
    """0/0 devices used to come with no word: a mistyped PF name or vendor, or VFs not created yet."""

    @staticmethod
    def _scans(source, count):
        with structlog.testing.capture_logs() as logs:
            sizes = [len(source.scan().devices) for _ in range(count)]
        return sizes, [e for e in logs if e["event"] == "selector_matches_nothing"]

    def test_a_selector_matching_nothing_is_said_once_with_what_the_scan_saw(self, root):
        options = NicOptions.model_validate({"match": {"pfNames": ["enp10s0f9"]}})
        source = KIND.build(options, HostPaths(root=root), resource="x.io/nic")
        sizes, logs = self._scans(source, 3)
        assert sizes == [0, 0, 0]
        (line,) = logs
        assert line["log_level"] == "warning"
        assert line["match"] == {"pfNames": ["enp10s0f9"]}
        assert line["vfs_seen"] == 0
        assert line["looked_in"] == str(root / "sys/bus/pci/devices")

    def test_a_selector_that_matches_logs_nothing(self, root):
        options = NicOptions.model_validate({"match": {"pfNames": ["enp10s0f0"]}})
        sizes, logs = self._scans(KIND.build(options, HostPaths(root=root), resource="x.io/nic"), 2)
        assert sizes == [8, 8]
        assert logs == []
