"""A generic resource whose paths match nothing says so, naming where it looked."""

from __future__ import annotations

from pathlib import Path

from pyfakefs.fake_filesystem import FakeFilesystem
from structlog.testing import capture_logs

from plugvisor.common.hostpaths import HostPaths
from plugvisor.plugins.generic import KIND


def test_a_path_matching_nothing_is_a_warning_naming_the_directory(fs: FakeFilesystem) -> None:
    """Under a lab host root without dev/fuse, the start logs the path, where it looked and why it matters."""
    fs.create_file("/lab/dev/ttyUSB0")
    with capture_logs() as logs:
        source = KIND.build(
            {"groups": [{"paths": ["/dev/fuse"]}, {"paths": ["/dev/ttyUSB*"]}]},
            HostPaths(Path("/lab")),
            resource="example.com/x",
        )
    warnings = [entry for entry in logs if entry["event"] == "path_matches_nothing"]
    assert [(w["log_level"], w["path"], w["looked_in"]) for w in warnings] == [
        ("warning", "/dev/fuse", "/lab/dev/fuse")
    ]
    assert warnings[0]["resource"] == "example.com/x"
    assert len(source.scan().devices) == 1


def test_paths_that_all_match_log_nothing(fs: FakeFilesystem) -> None:
    """A resource whose every path is there starts quietly."""
    fs.create_file("/dev/fuse")
    with capture_logs() as logs:
        KIND.build({"paths": ["/dev/fuse"], "count": 2}, HostPaths(Path("/")), resource="example.com/fuse")
    assert [entry for entry in logs if entry["event"] == "path_matches_nothing"] == []
