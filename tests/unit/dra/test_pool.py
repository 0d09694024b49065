"""The pool of one scan: what the kind's hook says, checked, with the way back from names to devices."""

import structlog

from plugvisor.deviceplugin.devices import Device, Health
from plugvisor.deviceplugin.snapshot import Snapshot
from plugvisor.dra.devices import PublishedDevice
from plugvisor.dra.pool import build_pool


class Describer:
    def __init__(self, answer):
        self.answer = answer

    def dra_devices(self, snapshot):
        return self.answer


SNAPSHOT = Snapshot([Device("a"), Device("b", health=Health.UNHEALTHY), Device("c")])


class TestBuildPool:
    def test_the_hook_names_the_devices_and_leaves_some_out(self):
        pool = build_pool(
            SNAPSHOT, Describer({"a": PublishedDevice("dev-a"), "b": PublishedDevice("dev-b")}), driver="d"
        )
        assert list(pool.devices) == ["dev-a", "dev-b"]
        assert dict(pool.ids) == {"dev-a": "a", "dev-b": "b"}

    def test_only_healthy_devices_are_offered_in_the_slice(self):
        pool = build_pool(SNAPSHOT, None, driver="d")
        assert [d.name for d in pool.healthy()] == ["a", "c"]
        assert not pool.is_healthy("b")

    def test_a_second_device_with_a_taken_name_is_left_out_and_logged(self):
        answer = {"a": PublishedDevice("same"), "c": PublishedDevice("same")}
        with structlog.testing.capture_logs() as logs:
            pool = build_pool(SNAPSHOT, Describer(answer), driver="d")
        assert dict(pool.ids) == {"same": "a"}
        assert [entry["event"] for entry in logs] == ["dra_device_name_taken"]
        assert logs[0]["taken_by"] == "a"

    def test_entries_for_devices_the_scan_does_not_have_are_left_out(self):
        answer = {"a": PublishedDevice("a"), "zzz": PublishedDevice("z")}
        with structlog.testing.capture_logs() as logs:
            pool = build_pool(SNAPSHOT, Describer(answer), driver="d")
        assert list(pool.devices) == ["a"]
        assert logs[0]["event"] == "dra_devices_unknown"

    def test_what_is_not_a_published_device_is_refused_by_name(self):
        with structlog.testing.capture_logs() as logs:
            pool = build_pool(SNAPSHOT, Describer({"a": {"name": "a"}}), driver="d")
        assert not pool.devices
        assert logs[0]["event"] == "dra_device_invalid"

    def test_an_empty_scan_asks_the_kind_nothing(self):
        class Exploding:
            def dra_devices(self, snapshot):
                raise AssertionError("asked")

        assert not build_pool(Snapshot(), Exploding(), driver="d").devices
