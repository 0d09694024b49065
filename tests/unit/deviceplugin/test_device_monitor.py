"""The device monitor describes the devices it is given, and only once there are some."""

from pathlib import Path

import structlog

from plugvisor.common.hostpaths import HostPaths
from plugvisor.deviceplugin.cell import SnapshotCell
from plugvisor.deviceplugin.device_monitor import DeviceMonitor
from plugvisor.deviceplugin.monitorconfig import MonitorConfig
from plugvisor.deviceplugin.snapshot import Snapshot
from plugvisor.plugins.gpu import KIND as GPU


def test_the_empty_snapshot_before_the_first_scan_is_not_described_and_logs_no_error(tmp_path):
    # The gpu kind's describe() reads its scan data, which the initial snapshot does not have: every gpu
    # plugin used to log describe_failed (level error) at start, then describe_recovered.
    source = GPU.build({}, HostPaths(root=tmp_path), resource="example.com/gpu")
    monitor = DeviceMonitor(
        "example.com/gpu",
        SnapshotCell(Snapshot()),
        source,
        MonitorConfig(enabled=True, owners=False),
        pod_resources_socket=Path("/nonexistent"),
    )
    with structlog.testing.capture_logs() as logs:
        assert monitor._describe(Snapshot()) == {}
    assert [entry["event"] for entry in logs] == []
