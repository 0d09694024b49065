"""Kernel formats and link shapes, checked without any file system."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from plugvisor.emulators.lab import pci
from plugvisor.emulators.lab.pci import Bdf, Identity
from plugvisor.emulators.lab.spec import sysfs_relpath


class TestSysfsRelpath:
    @pytest.mark.parametrize(
        ("link", "target", "expected"),
        [
            (
                "sys/bus/pci/devices/0000:3b:00.0",
                "sys/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0",
                "../../../devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0",
            ),
            ("sys/devices/p/0000:3b:00.0/virtfn0", "sys/devices/p/0000:3b:01.0", "../0000:3b:01.0"),
            (
                "sys/devices/p/0000:00:02.0/drm/card0/device",
                "sys/devices/p/0000:00:02.0",
                "../../../0000:00:02.0",
            ),
            (
                "sys/class/drm/card0",
                "sys/devices/p/0000:00:02.0/drm/card0",
                "../../devices/p/0000:00:02.0/drm/card0",
            ),
            ("dev/char/195:0", "dev/nvidia0", "../nvidia0"),
        ],
        ids=["bus-entry", "virtfn", "link-to-ancestor", "class-link", "dev-char"],
    )
    def test_matches_the_kernel(self, link: str, target: str, expected: str) -> None:
        """Links come out as the kernel writes them, including links to an ancestor."""
        assert expected == sysfs_relpath(link, target)


class TestIdentity:
    def test_modalias_is_ghw_parsable(self) -> None:
        """The modalias is upper-case and fixed width; with its newline it has the 54 bytes ghw needs."""
        alias = Identity(0x8086, 0x1592, 0x8086, 0x0002, 0x020000).modalias
        assert alias == "pci:v00008086d00001592sv00008086sd00000002bc02sc00i00"
        assert len(alias + "\n") >= 54

    @given(st.integers(0, 0xFFFF), st.integers(0, 0xFFFF), st.integers(0, 0xFFFFFF))
    def test_modalias_encodes_identity(self, vendor: int, device: int, cls: int) -> None:
        """Vendor, device and class can be read back from the modalias."""
        alias = Identity(vendor, device, 0, 0, cls).modalias
        assert int(alias[5:13], 16) == vendor
        assert int(alias[14:22], 16) == device
        assert int(alias[-9:-7], 16) << 16 | int(alias[-5:-3], 16) << 8 | int(alias[-2:], 16) == cls


class TestBdf:
    @given(st.integers(0, 0xFFFF))
    def test_routing_id_round_trips(self, rid: int) -> None:
        """VF addresses derived from routing ids map back to the same id."""
        assert rid == Bdf.from_routing_id(0, rid).routing_id

    def test_text_form(self) -> None:
        """``str`` gives the kernel's ``%04x:%02x:%02x.%d``, and parse reads it back."""
        assert str(Bdf(0, 0x3B, 1, 7)) == "0000:3b:01.7"
        assert Bdf(0, 0x3B, 1, 7) == Bdf.parse("0000:3b:01.7")


class TestConfigSpace:
    def _fn(self, **kw: object) -> pci.Function:
        args: dict[str, object] = {
            "bdf": Bdf(0, 1, 0, 0),
            "path": "sys/devices/pci0000:00/0000:01:00.0",
            "identity": Identity(0x10DE, 0x2330, 0x10DE, 0x16C1, 0x030200, 0xA1),
            "driver": "nvidia",
            "numa_node": 0,
            "cpulist": "0-15",
            "iommu_group": 3,
        }
        args.update(kw)
        return pci.Function(**args)  # type: ignore[arg-type]

    def test_header_carries_identity(self) -> None:
        """Vendor, device, revision, class and subsystem sit at their config-space offsets."""
        raw = pci.config_space(self._fn())
        assert (int.from_bytes(raw[0:2], "little"), int.from_bytes(raw[2:4], "little")) == (0x10DE, 0x2330)
        assert raw[8] == 0xA1
        assert int.from_bytes(raw[9:12], "little") == 0x030200
        assert int.from_bytes(raw[0x2E:0x30], "little") == 0x16C1

    def test_fallen_device_reads_all_ones(self) -> None:
        """A device gone from the bus answers config reads with 0xff."""
        assert set(pci.config_space(self._fn(config_readable=False))) == {0xFF}

    def test_aer_counter_shows_in_total(self) -> None:
        """An AER fatal count appears in its TOTAL line, in the kernel's ``name count`` format."""
        spec: dict[str, object] = {}
        pci.render_function(spec, self._fn(aer=(2, 0, 0)))  # type: ignore[arg-type]
        text = spec["sys/devices/pci0000:00/0000:01:00.0/aer_dev_fatal"].content.decode()  # type: ignore[attr-defined]
        assert text.splitlines()[-1] == "TOTAL_ERR_FATAL 2"
        assert all(len(line.split()) == 2 for line in text.splitlines())


def test_lab_imports_no_grpc() -> None:
    """The lab emulates hardware only: importing it (CLI and watcher included) pulls in no gRPC."""
    import subprocess
    import sys

    code = (
        "import sys, plugvisor.emulators.lab, plugvisor.emulators.lab.cli, plugvisor.emulators.lab.watcher;"
        "bad = [m for m in sys.modules if m == 'grpc' or m.startswith(('grpc.', 'plugvisor.api', "
        "'plugvisor.deviceplugin'))];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
