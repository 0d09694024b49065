"""Devices are immutable values: equality is what tells a rescan that nothing changed."""

import pytest

from plugvisor.deviceplugin.devices import Device, DeviceSet, DeviceSpec, Health, InvalidDeviceError, Mount


class TestDevice:
    def test_equal_descriptions_are_equal_devices(self):
        a = Device(
            "gpu0", numa_nodes=[1, 0, 1], envs={"B": "2", "A": "1"}, specs=[DeviceSpec("/dev/a", "/dev/a")]
        )
        b = Device(
            "gpu0", numa_nodes=(0, 1), envs={"A": "1", "B": "2"}, specs=(DeviceSpec("/dev/a", "/dev/a"),)
        )
        assert a == b
        assert a.numa_nodes == (0, 1)

    def test_a_health_change_is_a_change(self):
        device = Device("gpu0")
        assert device.with_health(Health.UNHEALTHY) != device
        assert device.with_health(Health.HEALTHY) is device

    def test_collections_cannot_be_mutated_after_construction(self):
        envs = {"A": "1"}
        device = Device("d", envs=envs)
        envs["A"] = "changed"
        assert device.envs["A"] == "1"
        with pytest.raises(TypeError):
            device.envs["A"] = "2"  # type: ignore[index]

    @pytest.mark.parametrize(
        ("kwargs", "fragment"),
        [
            ({"id": ""}, "non-empty"),
            ({"id": "a b"}, "white space"),
            ({"id": "x" * 64}, "64 characters"),
            ({"id": "ok", "numa_nodes": [-1]}, "NUMA"),
            ({"id": "ok", "numa_nodes": [True]}, "NUMA"),
            ({"id": "ok", "envs": {"A": 1}}, "envs"),
        ],
    )
    def test_rejects_descriptions_the_kubelet_cannot_use(self, kwargs, fragment):
        with pytest.raises(InvalidDeviceError, match=fragment):
            Device(**kwargs)

    @pytest.mark.parametrize(
        ("permissions", "ok"), [("rw", True), ("rwm", True), ("r", True), ("", False), ("rx", False)]
    )
    def test_device_node_permissions_are_cgroup_letters(self, permissions, ok):
        if ok:
            DeviceSpec("/dev/x", "/dev/x", permissions)
        else:
            with pytest.raises(InvalidDeviceError, match="permissions"):
                DeviceSpec("/dev/x", "/dev/x", permissions)

    def test_paths_must_be_absolute(self):
        with pytest.raises(InvalidDeviceError, match="absolute"):
            Mount("relative", "/host")


class TestDeviceSet:
    def test_keeps_scan_order_and_knows_health(self):
        devices = DeviceSet([Device("b"), Device("a", health=Health.UNHEALTHY), Device("c")])
        assert list(devices) == ["b", "a", "c"]
        assert devices.healthy_ids == {"b", "c"}
        assert list(devices.healthy()) == ["b", "c"]

    def test_refuses_duplicate_ids(self):
        with pytest.raises(InvalidDeviceError, match="twice"):
            DeviceSet([Device("a"), Device("a")])

    def test_equality_sees_order_and_content(self):
        assert DeviceSet([Device("a"), Device("b")]) == DeviceSet([Device("a"), Device("b")])
        assert DeviceSet([Device("a"), Device("b")]) != DeviceSet([Device("b"), Device("a")])
        assert DeviceSet([Device("a")]) != DeviceSet([Device("a", health=Health.UNHEALTHY)])

    def test_subset_follows_the_requested_order(self):
        devices = DeviceSet([Device("a"), Device("b"), Device("c")])
        assert list(devices.subset(["c", "a"])) == ["c", "a"]
        with pytest.raises(KeyError):
            devices.subset(["zz"])
        assert list(devices.subset(["zz", "b"], strict=False)) == ["b"]
