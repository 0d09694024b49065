"""The gpu kind's scan on broken trees, its options, and its information parser."""

import os
import shutil
import tempfile
from pathlib import Path

import pydantic
import pytest
import structlog

from plugvisor.common.hostpaths import HostPaths
from plugvisor.common.validation import describe
from plugvisor.deviceplugin.devices import Device
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
def root(pristine):
    copy = Path(tempfile.mkdtemp(dir=pristine.parent)) / "root"  # /dev/shm: copies take ms, not seconds
    shutil.copytree(pristine, copy, symlinks=True)
    yield copy
    shutil.rmtree(copy.parent, ignore_errors=True)


def scan(root, **options):
    return (
        KIND.build(GpuOptions.model_validate(options), HostPaths(root=root), resource="x.io/gpu")
        .scan()
        .devices
    )


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


def _garbage_aer(path: Path, how: str) -> None:
    path.unlink()
    if how == "garbage":
        path.write_text("TOTAL_ERR_FATAL lots\n")
    elif how == "directory":
        path.mkdir()
    elif how == "fifo":
        os.mkfifo(path)
    elif how == "huge":
        with path.open("wb") as huge:
            huge.truncate(2 << 30)
    else:
        os.symlink("/etc/hostname", path)


class TestUnreadableMeansUnhealthy:
    """The docs' promise: what cannot be read is Unhealthy, with one log line naming device and cause."""

    def _scan_twice(self, root, **options):
        source = KIND.build(
            GpuOptions.model_validate({"deviceIdStrategy": "pci", **options}),
            HostPaths(root=root),
            resource="x",
        )
        with structlog.testing.capture_logs() as logs:
            source.scan()
            devices = source.scan().devices
        return devices, [e for e in logs if e["event"] in ("device_unhealthy", "device_skipped")]

    @pytest.mark.parametrize("how", ["garbage", "directory", "fifo", "huge", "link-out"])
    def test_aer_counters_that_cannot_be_read(self, root, how):
        _garbage_aer(bus(root, "0000:03:00.0") / "aer_dev_fatal", how)
        devices, logs = self._scan_twice(root)
        assert not devices["0000:03:00.0"].healthy
        assert sum(d.healthy for d in devices.values()) == 7
        (line,) = logs
        assert line["device"] == "0000:03:00.0" and "AER fatal counters unreadable" in line["cause"]

    def test_a_looping_driver_link(self, root):
        driver = bus(root, "0000:03:00.0") / "driver"
        driver.unlink()
        os.symlink("driver", driver)
        devices, logs = self._scan_twice(root)
        assert not devices["0000:03:00.0"].healthy
        (line,) = logs
        assert line["cause"].startswith("driver link (driver): symlink loop")

    def test_a_device_node_that_is_a_directory(self, root):
        (root / "dev/nvidia0").unlink()
        (root / "dev/nvidia0").mkdir()
        devices, logs = self._scan_twice(root, deviceIdStrategy="index")
        assert not devices["0"].healthy
        (line,) = logs
        assert "dev/nvidia0 is a directory, not a device node" in line["cause"]

    def test_a_dangling_bus_link_is_logged_not_silently_dropped(self, root):
        link = bus(root, "0000:07:00.0")
        link.unlink()
        os.symlink("../../../devices/nowhere/0000:07:00.0", link)
        devices, logs = self._scan_twice(root)
        assert "0000:07:00.0" not in devices
        (line,) = logs
        assert line["event"] == "device_skipped" and line["device"] == "0000:07:00.0"
        assert "dangling" in line["cause"]


class TestHostRootConfinement:
    def test_the_cdi_spec_lands_inside_the_host_root_through_an_absolute_var_run_link(self, root):
        (root / "run").mkdir()
        (root / "var").mkdir(exist_ok=True)
        (root / "var/run").symlink_to("/run")  # Debian and Ubuntu ship this
        source = KIND.build(
            GpuOptions.model_validate({"cdi": True}), HostPaths(root=root), resource="x.io/gpu"
        )
        written = source.write_cdi_spec(source.scan().data)
        assert written == root / "run/cdi/x.io-gpu.json" and written.is_file()

    def test_no_second_copy_of_the_spec_is_ever_a_file_cdi_reads(self, root, monkeypatch):
        """CDI reads every *.json of the directory, hidden ones too: a temporary copy would be a conflict."""
        source = KIND.build(
            GpuOptions.model_validate({"cdi": True}), HostPaths(root=root), resource="x.io/gpu"
        )
        seen: list[list[str]] = []
        replace = Path.replace

        def spying_replace(self, target):
            seen.append(sorted(p.name for p in self.parent.iterdir() if p.suffix in (".json", ".yaml")))
            return replace(self, target)

        monkeypatch.setattr(Path, "replace", spying_replace)
        written = source.write_cdi_spec(source.scan().data)
        assert seen == [[]] and sorted(p.name for p in written.parent.iterdir()) == ["x.io-gpu.json"]

    def test_a_host_root_whose_dev_links_to_our_own_dev_reads_no_node_of_ours(self, root):
        shutil.rmtree(root / "dev")
        (root / "dev").symlink_to("/dev")  # inside the root this is dev -> dev: a loop, never our /dev
        source = KIND.build(GpuOptions.model_validate({}), HostPaths(root=root), resource="x.io/gpu")
        with pytest.raises(OSError, match="symbolic links"):
            source.scan()


class TestOptions:
    @pytest.mark.parametrize(
        ("options", "message"),
        [
            (
                {"match": {"vendors": ["nvidia"]}},
                "match.vendors[0]: 'nvidia' is not a 16-bit PCI ID",
            ),
            ({"replicas": 0}, "replicas: Input should be greater than or equal to 1"),
            ({"replicas": True}, "replicas: Input should be a valid integer"),
            ({"cdi": "yes"}, "cdi: Input should be a valid boolean"),
            ({"allocationPolicy": "random"}, "allocationPolicy: Input should be 'spread' or 'pack'"),
            ({"visibleDevicesEnv": "A-B"}, "visibleDevicesEnv: String should match pattern"),
            ({"cdiDir": "var/run/cdi"}, "cdiDir: 'var/run/cdi' must be an absolute path"),
            ({"cdiDir": "/var/run/cdi\x00"}, "cdiDir: '/var/run/cdi\\x00' contains a NUL byte"),
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


def test_preferred_allocation_answers_from_the_snapshot_it_is_given(root):
    """The hook reads placements from the snapshot the request was checked against, not a later scan."""
    from plugvisor.deviceplugin.snapshot import Snapshot
    from plugvisor.plugins import topology
    from plugvisor.plugins.gpu import GpuScan

    source = KIND.build(GpuOptions(), HostPaths(root=root), resource="x.io/gpu")
    source.scan()  # a scan of the real tree, which the hook must not consult
    # Two switches: g0+g1 under sw0, g2+g3 under sw1.
    placements = {f"g{i}": topology.Placement(0, ("hb0", f"sw{i // 2}", f"f{i}"), f"g{i}") for i in range(4)}
    snapshot = Snapshot([Device(f"g{i}") for i in range(4)], data=GpuScan(placements, {}, ()))
    assert sorted(source.preferred_allocation(["g0", "g1", "g2", "g3"], ["g2"], 2, snapshot)) == ["g2", "g3"]
