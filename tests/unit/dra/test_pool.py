"""The pool of one scan: what the kind's hook says, checked, with the way back from names to devices."""

import itertools

import pytest
import structlog

from plugvisor.common.names import dns_label_problem
from plugvisor.deviceplugin.devices import Device, Health
from plugvisor.deviceplugin.snapshot import Snapshot
from plugvisor.dra.devices import DeviceTaint, PublishedDevice
from plugvisor.dra.hooks import with_hash
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

    def test_an_unhealthy_device_the_kind_tainted_is_listed_with_its_taint_and_an_untainted_one_withdrawn(
        self,
    ):
        taint = DeviceTaint("gpu.plugvisor.io/xid", "79")
        snapshot = Snapshot(
            [Device("a"), Device("b", health=Health.UNHEALTHY), Device("c", health=Health.UNHEALTHY)]
        )
        answer = {
            "a": PublishedDevice("a"),
            "b": PublishedDevice("b", taints=(taint,)),
            "c": PublishedDevice("c"),
        }
        pool = build_pool(snapshot, Describer(answer), driver="d")
        assert [(d.name, d.taints) for d in pool.listed()] == [("a", ()), ("b", (taint,))]
        assert [d.name for d in pool.healthy()] == ["a"]
        assert not pool.is_healthy("b")

    def test_a_taint_that_keeps_no_claim_off_does_not_list_an_unhealthy_device(self):
        snapshot = Snapshot([Device("b", health=Health.UNHEALTHY)])
        soft = PublishedDevice("b", taints=(DeviceTaint("example.com/note", effect="None"),))
        assert build_pool(snapshot, Describer({"b": soft}), driver="d").listed() == []

    def test_two_devices_the_kind_names_alike_are_both_offered_under_distinct_names(self):
        answer = {"a": PublishedDevice("same"), "b": PublishedDevice("other"), "c": PublishedDevice("same")}
        with structlog.testing.capture_logs() as logs:
            pool = build_pool(SNAPSHOT, Describer(answer), driver="d")
        names = pool.names
        assert names["b"] == "other"
        assert names["a"] != names["c"] and {names["a"][:5], names["c"][:5]} == {"same-"}
        assert [entry["event"] for entry in logs] == ["dra_device_names_disambiguated"]

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


def names(device_ids, pinned=None):
    """The pool's name of each device of a default-described scan of ``device_ids``."""
    snapshot = Snapshot([Device(i) for i in device_ids])
    if pinned is None:
        return build_pool(snapshot, None, driver="d").names
    return build_pool(snapshot, None, driver="d", pinned=pinned).names


class TestDistinctNames:
    """Every device gets a distinct, valid name that depends on the device set only, never on its order."""

    def test_ids_that_differ_only_in_case_or_punctuation_get_distinct_names(self):
        got = names(["AB-1", "ab_1", "ab.2"])
        assert got["ab.2"] == "ab-2"  # no look-alike: the readable name
        assert got["AB-1"] != got["ab_1"]
        assert got["AB-1"].startswith("ab-1-") and got["ab_1"].startswith("ab-1-")
        assert all(dns_label_problem(name) is None for name in got.values())

    @pytest.mark.parametrize("order", list(itertools.permutations(["AB-1", "ab_1", "Ab:1", "c"])))
    def test_the_names_do_not_depend_on_the_order_of_discovery(self, order):
        assert names(order) == names(["AB-1", "ab_1", "Ab:1", "c"])

    def test_a_device_of_a_prepared_claim_keeps_its_name_when_a_look_alike_appears(self):
        before = names(["AB-1"])
        assert before == {"AB-1": "ab-1"}
        after = names(["AB-1", "ab_1"], pinned=before)
        assert after["AB-1"] == "ab-1" and after["ab_1"].startswith("ab-1-")
        assert names(["ab_1", "AB-1"], pinned=before) == after  # a restart reads the same claims back

    def test_a_pinned_name_that_is_no_dns_label_is_ignored(self):
        """Pins come from the checkpoint, or from the CDI specs' annotations if it is lost: any text."""
        assert names(["AB-1"], pinned={"AB-1": "Not/A label"}) == {"AB-1": "ab-1"}

    def test_a_name_made_to_look_like_a_disambiguated_one_does_not_take_it(self):
        fair = names(["AB-1", "ab_1"])
        crafted = fair["AB-1"]  # a device whose own ID is what another's disambiguated name would be
        got = names(["AB-1", "ab_1", crafted])
        assert got[crafted] == crafted
        assert len(set(got.values())) == 3 and all(dns_label_problem(n) is None for n in got.values())

    @pytest.mark.parametrize(
        "device_ids",
        [
            ["::", "--", "..", "__", "~"],  # all punctuation: every one of them "device"
            ["x" * 63, "X" * 63, "x" * 62 + "_", "x" * 62 + "-"],  # the longest IDs, alike
            ["\u00e9t\u00e9-1", "\u00c9T\u00c9-1", "\u0442\u0435\u0441\u0442", "\u6f22\u5b57"],  # unicode
        ],
    )
    def test_hostile_ids_get_valid_distinct_names(self, device_ids):
        got = names(device_ids)
        assert sorted(got) == sorted(device_ids)
        assert len(set(got.values())) == len(device_ids)
        assert all(dns_label_problem(name) is None for name in got.values()), got

    def test_names_made_to_meet_every_hash_of_a_device_leave_it_out_with_an_error(self):
        """Every hashed form of a device ID is computable: one device can be crowded out, never crash."""
        victim = "AB-1"
        crafted = [with_hash("ab-1", victim, length) for length in (6, 12, 24, 40)]
        with structlog.testing.capture_logs() as logs:
            got = names([victim, "ab_1", *crafted])
        assert victim not in got and all(got[name] == name for name in crafted)
        assert [e["event"] for e in logs if e["log_level"] == "error"] == ["dra_device_name_taken"]
