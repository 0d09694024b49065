"""The device manager's books: ListAndWatch replacement, capacity, disconnects, grace, restart."""

from __future__ import annotations

import pytest

from plugvisor.api.deviceplugin.v1beta1 import api_pb2
from plugvisor.common import constants
from plugvisor.emulators.kubelet import endpoint, journal, manager, model

GPU = "example.com/gpu"
GRACE = 300.0


def record(device_id: str, health: str = constants.HEALTHY, *numa: int) -> manager.DeviceRecord:
    return manager.DeviceRecord(id=device_id, health=health, numa_nodes=numa)


def connected(devices: manager.DeviceManager, resource: str = GPU) -> endpoint.Endpoint:
    plugin = endpoint.Endpoint(
        resource=resource, socket_path="/tmp/p.sock", stub=None, journal=journal.Journal()
    )
    devices.plugin_connected(resource, plugin, model.PluginOptions())
    return plugin


def counts(devices: manager.DeviceManager, now: float = 0.0, resource: str = GPU) -> tuple[int, int] | None:
    """(allocatable, capacity) as the e2e tests write them, or None when not reported."""
    polled = devices.get_capacity(now=now)
    if resource not in polled.capacity:
        return None
    # Node status derives allocatable from capacity when the device manager gives none (0 here).
    return polled.allocatable.get(resource, 0), polled.capacity[resource]


@pytest.fixture
def devices() -> manager.DeviceManager:
    return manager.DeviceManager(grace_period=GRACE)


class TestListAndWatchUpdate:
    def test_a_connected_resource_is_not_reported_before_its_first_list(
        self, devices: manager.DeviceManager
    ) -> None:
        """Capacity appears with the first ListAndWatch message, not with Register."""
        connected(devices)
        assert counts(devices) is None

    def test_each_message_replaces_the_whole_device_set(self, devices: manager.DeviceManager) -> None:
        """A message is a full replacement: devices missing from it are gone."""
        connected(devices)
        devices.list_and_watch_update(GPU, [record("a"), record("b"), record("c")])
        devices.list_and_watch_update(GPU, [record("c"), record("d")])
        assert devices.healthy[GPU] == {"c", "d"}
        assert counts(devices) == (2, 2)

    def test_an_empty_list_keeps_the_resource_at_zero(self, devices: manager.DeviceManager) -> None:
        """Zero devices is a valid state, not a removal."""
        connected(devices)
        devices.list_and_watch_update(GPU, [record("a")])
        devices.list_and_watch_update(GPU, [])
        assert counts(devices) == (0, 0)

    @pytest.mark.parametrize("health", ["Unhealthy", "healthy", "HEALTHY", "", "Healthy "])
    def test_only_the_exact_string_healthy_counts_as_healthy(
        self, devices: manager.DeviceManager, health: str
    ) -> None:
        """Any health other than exactly "Healthy" is unhealthy."""
        connected(devices)
        devices.list_and_watch_update(GPU, [record("a", health)])
        assert counts(devices) == (0, 1)

    def test_duplicate_ids_with_the_same_health_count_once(self, devices: manager.DeviceManager) -> None:
        """IDs are set members, so a repeated healthy ID is one device."""
        connected(devices)
        devices.list_and_watch_update(GPU, [record("a"), record("a"), record("b")])
        assert counts(devices) == (2, 2)

    def test_duplicate_ids_with_conflicting_health_land_in_both_sets(
        self, devices: manager.DeviceManager
    ) -> None:
        """A conflicting duplicate counts twice in capacity, once in allocatable; the last entry is kept."""
        connected(devices)
        devices.list_and_watch_update(GPU, [record("a", constants.HEALTHY, 0), record("a", "Unhealthy", 1)])
        assert counts(devices) == (1, 2)
        assert devices.all_devices[GPU]["a"] == record("a", "Unhealthy", 1)

    def test_scenario_15_toggling_health_of_four_devices(self, devices: manager.DeviceManager) -> None:
        """(alloc, cap) goes (4,4) -> (3,4) -> (4,4) -> (2,4) -> (3,4) -> (4,4)."""
        connected(devices)
        ids = ["d1", "d2", "d3", "d4"]
        unhealthy_steps: list[set[str]] = [set(), {"d1"}, set(), {"d2", "d3"}, {"d3"}, set()]
        seen = []
        for bad in unhealthy_steps:
            devices.list_and_watch_update(
                GPU, [record(i, "Unhealthy" if i in bad else constants.HEALTHY) for i in ids]
            )
            seen.append(counts(devices))
        assert seen == [(4, 4), (3, 4), (4, 4), (2, 4), (3, 4), (4, 4)]

    def test_resources_may_reuse_the_same_ids(self, devices: manager.DeviceManager) -> None:
        """IDs are unique per resource only."""
        connected(devices, GPU)
        connected(devices, "example.com/fpga")
        devices.list_and_watch_update(GPU, [record("0")])
        devices.list_and_watch_update("example.com/fpga", [record("0"), record("1")])
        assert counts(devices, resource=GPU) == (1, 1)
        assert counts(devices, resource="example.com/fpga") == (2, 2)

    def test_a_resource_is_topology_aware_when_any_device_has_a_numa_node(
        self, devices: manager.DeviceManager
    ) -> None:
        """One device with a NUMA node is enough; the others sit on pseudo node -1."""
        connected(devices)
        devices.list_and_watch_update(GPU, [record("a"), record("b", constants.HEALTHY, 1)])
        assert devices.has_topology_alignment(GPU)
        assert devices.numa_nodes_of(GPU, "a") == (manager.NODE_WITHOUT_TOPOLOGY,)
        assert devices.numa_nodes_of(GPU, "b") == (1,)


class TestReplacement:
    def test_a_new_endpoint_keeps_the_old_devices_until_its_first_message(
        self, devices: manager.DeviceManager
    ) -> None:
        """Re-registration causes no capacity dip: the sets stay until the new plugin lists."""
        connected(devices)
        devices.list_and_watch_update(GPU, [record("a"), record("b")])
        replacement = connected(devices)
        assert counts(devices) == (2, 2)
        assert devices.endpoints[GPU].endpoint is replacement


class TestDisconnect:
    def test_every_healthy_device_becomes_unhealthy(self, devices: manager.DeviceManager) -> None:
        """Capacity stays, allocatable drops to zero."""
        connected(devices)
        devices.list_and_watch_update(GPU, [record("a"), record("b"), record("c", "Unhealthy")])
        assert devices.plugin_disconnected(GPU, now=10.0)
        assert counts(devices, now=10.0) == (0, 3)

    def test_the_endpoint_is_stopped_at_that_moment(self, devices: manager.DeviceManager) -> None:
        """The stop time starts the grace period."""
        plugin = connected(devices)
        devices.list_and_watch_update(GPU, [record("a")])
        devices.plugin_disconnected(GPU, now=42.0)
        assert plugin.stop_time == 42.0
        assert plugin.is_stopped()

    def test_a_stream_that_ends_before_any_message_shows_zero_of_zero(
        self, devices: manager.DeviceManager
    ) -> None:
        """Scenario 16: the disconnect creates an empty unhealthy set, so the resource reports (0, 0)."""
        connected(devices)
        devices.plugin_disconnected(GPU, now=0.0)
        assert counts(devices) == (0, 0)
        assert GPU not in devices.healthy

    def test_disconnecting_an_unknown_resource_changes_nothing(self, devices: manager.DeviceManager) -> None:
        """Without an endpoint there is nothing to stop."""
        assert not devices.plugin_disconnected(GPU, now=0.0)
        assert counts(devices) is None

    def test_a_conflicting_duplicate_is_counted_once_after_the_move(
        self, devices: manager.DeviceManager
    ) -> None:
        """The union of the two sets collapses the ID that was in both."""
        connected(devices)
        devices.list_and_watch_update(GPU, [record("a"), record("a", "Unhealthy")])
        devices.plugin_disconnected(GPU, now=0.0)
        assert counts(devices) == (0, 1)


class TestGracePeriod:
    def test_a_stopped_resource_is_kept_during_the_grace_period(self, devices: manager.DeviceManager) -> None:
        """At exactly the grace period the resource is still there ("older than" is strict)."""
        connected(devices)
        devices.list_and_watch_update(GPU, [record("a"), record("b")])
        devices.plugin_disconnected(GPU, now=100.0)
        assert counts(devices, now=100.0 + GRACE) == (0, 2)

    def test_a_stopped_resource_is_dropped_after_the_grace_period(
        self, devices: manager.DeviceManager
    ) -> None:
        """The poll after expiry deletes sets and endpoint and reports the deletion once."""
        connected(devices)
        devices.list_and_watch_update(GPU, [record("a"), record("b")])
        devices.plugin_disconnected(GPU, now=100.0)
        polled = devices.get_capacity(now=100.0 + GRACE + 0.5)
        assert polled.deleted == {GPU}
        assert GPU not in polled.capacity
        assert GPU not in devices.endpoints
        assert devices.get_capacity(now=1000.0).deleted == frozenset()

    def test_next_expiry_is_stop_time_plus_grace(self, devices: manager.DeviceManager) -> None:
        """The emulator arms its timer from this."""
        connected(devices)
        assert devices.next_expiry() is None
        devices.plugin_disconnected(GPU, now=5.0)
        assert devices.next_expiry() == 5.0 + GRACE


class TestRestore:
    def test_registered_resources_come_back_at_zero_with_a_stopped_endpoint(
        self, devices: manager.DeviceManager
    ) -> None:
        """A restarted kubelet reports checkpointed resources at capacity 0 and drops them after grace."""
        connected(devices)
        devices.list_and_watch_update(GPU, [record("a"), record("b")])
        restored = manager.DeviceManager.restored(
            devices.checkpoint(), grace_period=GRACE, now=50.0, journal=journal.Journal()
        )
        assert counts(restored, now=50.0) == (0, 0)
        info = restored.endpoints[GPU]
        assert info.endpoint.stop_time == 50.0
        assert info.options is None
        assert info.endpoint.socket_path is None
        assert restored.get_capacity(now=50.0 + GRACE + 1).deleted == {GPU}

    def test_pod_allocations_survive_and_stay_in_use(self, devices: manager.DeviceManager) -> None:
        """Pod devices are checkpointed, so the in-use set is rebuilt from them."""
        connected(devices)
        devices.list_and_watch_update(GPU, [record("a"), record("b")])
        devices.pod_devices.insert(
            "pod",
            "ctr",
            GPU,
            manager.ContainerAllocation(
                devices_by_numa={-1: ("a",)}, response=api_pb2.ContainerAllocateResponse(envs={"A": "a"})
            ),
        )
        restored = manager.DeviceManager.restored(
            devices.checkpoint(), grace_period=GRACE, now=0.0, journal=journal.Journal()
        )
        assert restored.allocated_devices == {GPU: {"a"}}
        assert restored.pod_devices.container_devices("pod", "ctr", GPU) == {"a"}

    def test_an_allocation_without_a_cached_response_is_not_checkpointed(
        self, devices: manager.DeviceManager
    ) -> None:
        """Upstream skips entries whose response is missing when it writes the checkpoint."""
        connected(devices)
        devices.pod_devices.insert(
            "pod", "ctr", GPU, manager.ContainerAllocation(devices_by_numa={-1: ("a",)}, response=None)
        )
        assert devices.checkpoint().pod_device_entries is None
