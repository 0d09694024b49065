"""How a kind's devices are published by default, and how they are named."""

import pytest

from plugvisor.common.names import dns_label_problem
from plugvisor.deviceplugin.devices import Device, DeviceSpec, Mount
from plugvisor.deviceplugin.snapshot import Snapshot
from plugvisor.dra.devices import NUMA_NODE
from plugvisor.dra.hooks import default_attributes, default_dra_devices, dra_device_name


class TestNames:
    @pytest.mark.parametrize(
        ("device_id", "name"),
        [
            ("GPU-6d3c1f0e-4a8b", "gpu-6d3c1f0e-4a8b"),
            ("0000:3b:00.0", "0000-3b-00-0"),
            ("fuse-3", "fuse-3"),
            ("ttyUSB0", "ttyusb0"),
            ("GPU-1::3", "gpu-1-3"),
            ("--weird__id--", "weird-id"),
            ("::", "device"),
        ],
    )
    def test_ids_become_dns_labels(self, device_id, name):
        assert dra_device_name(device_id) == name
        assert dns_label_problem(name) is None

    def test_long_ids_are_shortened_with_a_hash_so_they_stay_distinct(self):
        first, second = "x" * 62 + "AB", "x" * 62 + "CD"
        names = {dra_device_name(first), dra_device_name(second)}
        assert len(names) == 2
        assert all(len(name) <= 63 and dns_label_problem(name) is None for name in names)

    @pytest.mark.parametrize(
        "device_id",
        [
            "a" * 70 + "\udcff",
            "\udcff" * 100,
            "\u00e9" * 100,
            "-" * 1000,
            "\U0001f600" * 70,
            "a" + "\u0301" * 200,
        ],
    )
    def test_any_string_becomes_a_valid_label(self, device_id):
        """Names read from sysfs are anyone's: undecodable bytes (surrogates), long, all punctuation."""
        assert dns_label_problem(dra_device_name(device_id)) is None

    def test_the_same_id_always_gets_the_same_name(self):
        assert dra_device_name("y" * 80) == dra_device_name("y" * 80)


class TestDefaults:
    def test_a_device_says_its_numa_node_and_its_first_node(self):
        device = Device("ttyUSB0", numa_nodes=[1], specs=[DeviceSpec("/dev/ttyUSB0", "/host/dev/ttyUSB0")])
        assert default_attributes(device) == {NUMA_NODE: 1, "path": "/dev/ttyUSB0"}

    def test_a_mount_only_device_says_its_mount_and_several_numa_nodes_say_nothing(self):
        device = Device("data", numa_nodes=[0, 1], mounts=[Mount("/data", "/srv/data")])
        assert default_attributes(device) == {"path": "/data"}

    def test_every_device_of_the_snapshot_is_published_by_its_id(self):
        snapshot = Snapshot([Device("a"), Device("B_2")])
        published = default_dra_devices(snapshot)
        assert {i: d.name for i, d in published.items()} == {"a": "a", "B_2": "b-2"}
