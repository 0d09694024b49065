"""The fpga kind's names, options, scans of broken trees, PreStart and import boundary."""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pydantic
import pytest

from plugvisor.common.hostpaths import HostPaths
from plugvisor.common.names import extended_resource_name_problem
from plugvisor.deviceplugin.snapshot import Snapshot
from plugvisor.emulators import lab
from plugvisor.plugins.fpga import (
    KIND,
    FpgaOptions,
    intel_af_resource,
    intel_region_resource,
    suggest_resources,
    xilinx_resource,
)
from plugvisor.plugins.fpga.naming import decode_af_resource, valid_name_part

IFID = "69528db6eb31577a8c3668f9faa081f6"
AFU = "d8424dc4a4a3c413f89e433683f9040b"
PORT = "sys/devices/pci0000:00/0000:00:03.0/0000:09:00.0/fpga_region/region0/dfl-port.0"
USER_PF = "sys/bus/pci/devices/0000:89:00.1"


@pytest.fixture(scope="module")
def pristine():
    base = Path(tempfile.mkdtemp(prefix="/dev/shm/pvl-" if Path("/dev/shm").is_dir() else "/tmp/pvl-"))
    lab.Lab.create(str(base / "root"), "dgx-like")
    yield base / "root"
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def root(pristine):
    base = Path(tempfile.mkdtemp(dir=pristine.parent))
    copy = base / "root"
    shutil.copytree(pristine, copy, symlinks=True)
    yield copy
    shutil.rmtree(base, ignore_errors=True)


def source(root, **options):
    return KIND.build(FpgaOptions.model_validate(options), HostPaths(root=root), resource="x.io/fpga")


def scan(root, **options):
    return source(root, **options).scan().devices


def rewrite(path, text):
    path.unlink()
    path.write_text(text)


class TestNames:
    def test_af_name_is_intels_and_decodes_back_to_both_ids(self):
        name = intel_af_resource(IFID.upper(), "0x" + AFU)
        assert name == "fpga.intel.com/af-695.d84.aVKNtusxV3qMNmj5-qCB9thCTcSko8QT-J5DNoP5BAs"
        assert decode_af_resource(name) == (IFID, AFU)
        assert extended_resource_name_problem(name) is None

    def test_region_and_xilinx_names(self):
        assert intel_region_resource(IFID) == f"fpga.intel.com/region-{IFID}"
        assert xilinx_resource("xilinx_u250_gen3x16_xdma_shell_4_1", "0x5f0e2a62") == (
            "amd.com/xilinx_u250_gen3x16_xdma_shell_4_1-0x5f0e2a62"
        )

    @pytest.mark.parametrize("shell", ["x" * 80, "weird shell/name!", "_leading_"])
    def test_invalid_name_parts_are_shortened_to_distinct_valid_names(self, shell):
        name = xilinx_resource(shell, "0x1")
        assert extended_resource_name_problem(name) is None
        assert name != xilinx_resource(shell + "y", "0x1")

    def test_a_valid_name_part_is_kept(self):
        assert valid_name_part("region-abc") == "region-abc"

    def test_bad_ids_are_refused(self):
        with pytest.raises(ValueError, match="32 hex digits"):
            intel_af_resource("abc", AFU)

    def test_suggestions_cover_every_family_with_pasteable_entries(self, pristine):
        suggestions = {s.entry["name"]: s for s in suggest_resources(pristine)}
        af = intel_af_resource(IFID, AFU)
        assert set(suggestions) == {
            af,
            intel_region_resource(IFID),
            xilinx_resource("xilinx_u250_gen3x16_xdma_shell_4_1", "0x5f0e2a62"),
        }
        assert suggestions[af].devices == ("dfl-port.0",)
        for suggestion in suggestions.values():
            entry = dict(suggestion.entry)
            name, kind = entry.pop("name"), entry.pop("kind")
            assert kind == "fpga" and name
            FpgaOptions.model_validate(entry)


class TestOptions:
    @pytest.mark.parametrize(
        ("options", "message"),
        [
            ({"family": "xilinx", "match": {"afuIds": [AFU]}}, "not family xilinx"),
            ({"match": {"shells": ["s"]}}, "needs family xilinx"),
            ({"family": "region", "match": {"afuIds": [AFU]}}, "needs family af"),
            ({"match": {"afuIds": ["xyz"]}}, "128-bit ID"),
            ({"preStartTimeout": 29}, "less than or equal to 25"),
            ({"preStartCommand": []}, "at least 1"),
            ({"releaseCleanup": {"interval": 2}}, "command"),
            ({"releaseCleanup": {"command": ["x"], "podResourcesSocket": "rel.sock"}}, "absolute"),
            ({"bogus": 1}, "Extra inputs"),
        ],
    )
    def test_bad_options_are_refused_naming_the_problem(self, options, message):
        with pytest.raises(pydantic.ValidationError, match=message):
            FpgaOptions.model_validate(options)

    def test_ids_are_normalised(self):
        options = FpgaOptions.model_validate({"match": {"afuIds": ["0x" + AFU.upper()]}})
        assert options.match.afu_ids == [AFU]


class TestBrokenTrees:
    def test_garbage_afu_id_lists_the_port_unhealthy_in_family_af_only(self, root):
        rewrite(root / PORT / "afu_id", "banana\n")
        assert not scan(root)["dfl-port.0"].healthy
        assert scan(root, family="region")["dfl-port.0"].healthy

    def test_an_all_f_interface_id_is_unhealthy_in_both_families(self, root):
        compat = next((root / PORT).parent.glob("dfl-fme.0/dfl-fme-region.0/fpga_region/region*/compat_id"))
        rewrite(compat, "f" * 32 + "\n")
        assert not scan(root)["dfl-port.0"].healthy
        assert not scan(root, family="region")["dfl-port.0"].healthy

    def test_port_errors_make_the_port_unhealthy(self, root):
        (root / PORT / "errors").mkdir()
        (root / PORT / "errors/errors").write_text("0x0\n")
        assert scan(root)["dfl-port.0"].healthy
        rewrite(root / PORT / "errors/errors", "0x10\n")
        assert not scan(root)["dfl-port.0"].healthy

    def test_a_missing_port_node_makes_the_port_unhealthy(self, root):
        (root / "dev/dfl-port.0").unlink()
        assert not scan(root)["dfl-port.0"].healthy

    def test_a_port_is_matched_by_its_last_valid_afu_while_it_reads_all_f(self, root):
        src = source(root, match={"afuIds": [AFU]})
        assert src.scan().devices["dfl-port.0"].healthy
        rewrite(root / PORT / "afu_id", "f" * 32 + "\n")
        assert not src.scan().devices["dfl-port.0"].healthy
        assert "dfl-port.0" not in scan(root, match={"afuIds": [AFU]}), "never seen valid: not a member"

    def test_a_garbage_class_skips_that_function_only(self, root):
        rewrite(root / USER_PF / "class", "zz\n")
        assert len(scan(root, family="xilinx")) == 0
        assert len(scan(root)) == 1

    def test_opae_layout_is_read_too(self, root):
        fn = (root / PORT).parents[2]
        shutil.rmtree(fn / "fpga_region")
        dev = fn / "fpga/intel-fpga-dev.0"
        (dev / "intel-fpga-fme.0/pr").mkdir(parents=True)
        (dev / "intel-fpga-fme.0/pr/interface_id").write_text(IFID + "\n")
        (dev / "intel-fpga-port.0").mkdir()
        (dev / "intel-fpga-port.0/afu_id").write_text(AFU + "\n")
        (root / "dev/intel-fpga-port.0").write_text("")
        devices = scan(root)
        assert list(devices) == ["intel-fpga-port.0"] and devices["intel-fpga-port.0"].healthy

    def test_no_sysfs_at_all_is_an_empty_list(self, tmp_path):
        assert len(scan(tmp_path)) == 0


class TestPreStart:
    def test_a_port_gone_from_sysfs_fails_the_start_naming_it(self, root):
        src = source(root)
        devices = src.scan()
        shutil.rmtree(root / PORT)
        with pytest.raises(RuntimeError, match=r"dfl-port\.0: port dfl-port\.0 missing"):
            src.pre_start_container(devices)

    def test_an_unknown_device_fails_the_start(self, root):
        src = source(root)
        ours = src.scan()
        theirs = source(root, family="xilinx").scan().devices
        with pytest.raises(RuntimeError, match=r"not a device of x\.io/fpga"):
            src.pre_start_container(Snapshot(theirs, data=ours.data))

    def test_a_command_that_outlives_the_budget_is_killed_and_named(self, root):
        src = source(
            root, preStartCommand=[sys.executable, "-c", "import time; time.sleep(60)"], preStartTimeout=0.2
        )
        devices = src.scan()
        with pytest.raises(RuntimeError, match="timed out"):
            src.pre_start_container(devices)

    def test_clearing_writes_back_the_port_error_value(self, root):
        (root / PORT / "errors").mkdir()
        (root / PORT / "errors/errors").write_text("0x10\n")
        src = source(root)
        src.pre_start_container(src.scan())
        assert (root / PORT / "errors/errors").read_text() == "0x10\n"
        assert (root / PORT / "ap1_event").read_text() == "1\n"

    def test_a_fifo_or_a_link_in_place_of_an_event_attribute_fails_the_reset_without_blocking(
        self, root, tmp_path
    ):
        from plugvisor.plugins.fpga.source import clear_port_events

        event = root / PORT / "ap1_event"
        event.unlink()
        os.mkfifo(event)  # opening it for writing would wait for a reader forever
        assert "cannot write ap1_event" in clear_port_events(root / PORT)
        event.unlink()
        outside = tmp_path / "outside"
        outside.write_text("0\n")
        event.symlink_to(outside)
        assert "cannot write ap1_event" in clear_port_events(root / PORT)
        assert outside.read_text() == "0\n"

    def test_xilinx_cards_run_only_the_command(self, root, tmp_path):
        marker = tmp_path / "m"
        src = source(root, family="xilinx", preStartCommand=["touch", str(marker)])
        src.pre_start_container(src.scan())
        assert marker.exists()


PROBE = """
import sys
from plugvisor.plugins import kinds
import plugvisor.plugins.fpga as fpga
kind = kinds.get_kind("fpga")
kind.options_model.model_validate({"family": "af", "releaseCleanup": {"command": ["true"]}})
bad = ("grpc.", "plugvisor.api.podresources", "plugvisor.api.deviceplugin")
print(sorted(m for m in sys.modules if m == "grpc" or m.startswith(bad)))
"""


def test_importing_the_kind_and_validating_options_loads_no_grpc():
    """The supervisor validates configurations by importing kinds; it must not pull in gRPC."""
    result = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, cwd="/"
    )
    assert result.stdout.strip() == "[]"
