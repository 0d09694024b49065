"""Snapshots: one scan's devices, watch paths and hook data, immutable and compared by value."""

from pathlib import Path

import pytest

from plugvisor.deviceplugin.devices import Device, DeviceSet
from plugvisor.deviceplugin.release import ReleaseTracker
from plugvisor.deviceplugin.snapshot import Snapshot


def test_equal_scans_make_equal_snapshots_so_a_rescan_wakes_nobody():
    a = Snapshot([Device("a"), Device("b")], watch=[Path("/dev")], data={"a": 1})
    b = Snapshot(DeviceSet([Device("a"), Device("b")]), watch=["/dev"], data={"a": 1})
    assert a == b
    assert a != Snapshot([Device("a"), Device("b")], watch=[Path("/dev")], data={"a": 2})
    assert a != Snapshot([Device("a")], watch=[Path("/dev")], data={"a": 1})


def test_a_snapshot_cannot_be_changed():
    snapshot = Snapshot([Device("a")])
    with pytest.raises(AttributeError, match="immutable"):
        snapshot.data = 1  # type: ignore[misc]


def test_narrowing_keeps_the_scan_data_and_drops_vanished_ids():
    snapshot = Snapshot([Device("a"), Device("b"), Device("c")], watch=[Path("/x")], data="scan-1")
    narrowed = snapshot.only(["c", "gone", "a"])
    assert list(narrowed.devices) == ["c", "a"]
    assert narrowed.data == "scan-1"
    assert narrowed.watch == (Path("/x"),)


class TestOncePerUse:
    def test_a_release_seen_twice_is_handled_once(self):
        tracker = ReleaseTracker()
        assert tracker.releasing(["a", "b"]) == ["a", "b"]
        assert tracker.releasing(["a"]) == []

    def test_a_device_used_again_is_handled_at_its_next_release(self):
        tracker = ReleaseTracker()
        tracker.releasing(["a"])
        tracker.used(["a"])
        assert tracker.releasing(["a"]) == ["a"]

    def test_a_failed_cleanup_may_be_tried_again(self):
        tracker = ReleaseTracker()
        tracker.releasing(["a"])
        tracker.failed(["a"])
        assert tracker.releasing(["a", "a"]) == ["a"]
