"""The kubelet's allocation algorithm for one container, against a scripted endpoint."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from plugvisor.api.deviceplugin.v1beta1 import api_pb2
from plugvisor.common import constants
from plugvisor.emulators.kubelet import allocation, endpoint, errors, journal, manager, model

GPU = "example.com/gpu"


class ScriptedEndpoint(endpoint.Endpoint):
    """An endpoint whose RPCs are answered by the test instead of a plugin."""

    def __init__(self) -> None:
        super().__init__(resource=GPU, socket_path="/tmp/gpu.sock", stub=None, journal=journal.Journal())
        self.preferred: list[str] = []
        self.preferred_requests: list[tuple[list[str], list[str], int]] = []
        self.allocate_requests: list[list[str]] = []
        self.pre_start_requests: list[list[str]] = []
        self.allocate_error: str | None = None
        self.pre_start_error: str | None = None
        self.container_responses = 1

    async def get_preferred_allocation(
        self, *, available: Iterable[str], must_include: Iterable[str], size: int
    ) -> api_pb2.PreferredAllocationResponse:
        self.preferred_requests.append((list(available), list(must_include), size))
        return api_pb2.PreferredAllocationResponse(
            container_responses=[api_pb2.ContainerPreferredAllocationResponse(deviceIDs=self.preferred)]
        )

    async def allocate(self, device_ids: Iterable[str]) -> api_pb2.AllocateResponse:
        if self.is_stopped():
            raise endpoint.EndpointCallError(f"endpoint {self.go_repr()} has been stopped")
        self.allocate_requests.append(list(device_ids))
        if self.allocate_error is not None:
            raise endpoint.EndpointCallError(self.allocate_error)
        responses = [
            api_pb2.ContainerAllocateResponse(envs={"N": str(n)}) for n in range(self.container_responses)
        ]
        return api_pb2.AllocateResponse(container_responses=responses)

    async def pre_start_container(
        self, device_ids: Iterable[str], *, timeout: float
    ) -> api_pb2.PreStartContainerResponse:
        self.pre_start_requests.append(list(device_ids))
        if self.pre_start_error is not None:
            raise endpoint.EndpointCallError(self.pre_start_error)
        return api_pb2.PreStartContainerResponse()


class Node:
    """A device manager with one scripted plugin, and an allocator over it."""

    def __init__(self, *, preferred: bool = False, pre_start: bool = False) -> None:
        self.devices = manager.DeviceManager(grace_period=300.0)
        self.plugin = ScriptedEndpoint()
        self.devices.plugin_connected(
            GPU,
            self.plugin,
            model.PluginOptions(pre_start_required=pre_start, get_preferred_allocation_available=preferred),
        )
        self.journal = journal.Journal()
        self.allocator = allocation.Allocator(
            devices=self.devices, journal=self.journal, pre_start_timeout=30.0
        )

    def list(self, *entries: tuple[str, str, tuple[int, ...]] | str) -> None:
        records = []
        for entry in entries:
            if isinstance(entry, str):
                records.append(manager.DeviceRecord(entry, constants.HEALTHY, ()))
            else:
                records.append(manager.DeviceRecord(*entry))
        self.devices.list_and_watch_update(GPU, records)

    async def allocate(
        self,
        count: int,
        *,
        pod: str = "pod",
        container: str = "app",
        numa: frozenset[int] | None = None,
        kind: allocation.ContainerKind = allocation.ContainerKind.APP,
        resource: str = GPU,
    ) -> model.Allocation:
        return await self.allocator.allocate(
            pod_uid=pod,
            container=container,
            resource=resource,
            count=count,
            numa_affinity=numa,
            kind=kind,
            start=True,
        )


def healthy(device_id: str, *numa: int) -> tuple[str, str, tuple[int, ...]]:
    return (device_id, constants.HEALTHY, numa)


def unhealthy(device_id: str) -> tuple[str, str, tuple[int, ...]]:
    return (device_id, "Unhealthy", ())


class TestChecks:
    async def test_an_unknown_resource_is_not_handled_by_the_device_manager(self) -> None:
        """Never registered nor allocated: the kubelet would skip it, so the emulator refuses plainly."""
        node = Node()
        with pytest.raises(errors.NotDevicePluginResourceError):
            await node.allocate(1, resource="example.com/other")

    async def test_a_changed_request_is_rejected_first(self) -> None:
        """The count of a container that holds devices cannot change."""
        node = Node()
        node.list("a", "b", "c")
        await node.allocate(1)
        with pytest.raises(errors.AllocationError) as caught:
            await node.allocate(2)
        assert caught.value.message == (
            'pod "pod" container "app" changed request for resource "example.com/gpu" from 1 to 2'
        )

    async def test_a_resource_without_healthy_devices_cannot_allocate(self) -> None:
        """Registered but all unhealthy: the "no healthy devices" error."""
        node = Node()
        node.list(unhealthy("a"))
        with pytest.raises(errors.AllocationError) as caught:
            await node.allocate(1)
        assert (
            caught.value.message
            == "no healthy devices present; cannot allocate unhealthy devices example.com/gpu"
        )

    async def test_a_resource_known_only_through_allocations_is_unregistered(self) -> None:
        """After the grace-period drop, a pod holding devices gets the "unregistered" error."""
        node = Node()
        node.list("a", "b")
        await node.allocate(1, pod="p1")
        node.devices.plugin_disconnected(GPU, now=0.0)
        node.devices.get_capacity(now=1000.0)
        with pytest.raises(errors.AllocationError) as caught:
            await node.allocate(1, pod="p2")
        assert caught.value.message == "cannot allocate unregistered device example.com/gpu"

    async def test_previously_allocated_devices_must_still_be_healthy(self) -> None:
        """A container restart with an unhealthy device fails admission."""
        node = Node()
        node.list("a", "b")
        first = await node.allocate(1)
        node.list(unhealthy(first.device_ids[0]), *(d for d in "ab" if d != first.device_ids[0]))
        with pytest.raises(errors.AllocationError) as caught:
            await node.allocate(1)
        assert caught.value.message == (
            "previously allocated devices are no longer healthy; "
            "cannot allocate unhealthy devices example.com/gpu"
        )

    async def test_too_few_available_devices_is_reported_with_counts(self) -> None:
        """Requested and available are the numbers still needed and free."""
        node = Node()
        node.list("a", "b", "c")
        await node.allocate(2, pod="p1")
        with pytest.raises(errors.AllocationError) as caught:
            await node.allocate(2, pod="p2")
        assert caught.value.message == (
            "requested number of devices unavailable for example.com/gpu. Requested: 2, Available: 1"
        )

    async def test_failures_carry_the_pod_status_form(self) -> None:
        """The pod is rejected with UnexpectedAdmissionError and the kubelet's wrapper text."""
        node = Node()
        node.list(unhealthy("a"))
        with pytest.raises(errors.AllocationError) as caught:
            await node.allocate(1)
        assert caught.value.reason == "UnexpectedAdmissionError"
        assert caught.value.status_message == (
            "Allocate failed due to no healthy devices present; cannot allocate unhealthy devices "
            "example.com/gpu, which is unexpected"
        )
        assert caught.value.pod_status_message.startswith("Pod was rejected: Allocate failed due to ")


class TestAllocate:
    async def test_one_allocate_with_the_chosen_devices(self) -> None:
        """Exactly one Allocate call carries exactly the chosen IDs; the first response is kept."""
        node = Node()
        node.list("a", "b", "c")
        node.plugin.container_responses = 2
        result = await node.allocate(2)
        assert node.plugin.allocate_requests == [list(result.device_ids)]
        assert len(result.device_ids) == 2
        assert result.response is not None
        assert dict(result.response.envs) == {"N": "0"}
        assert result.allocate_called
        assert not result.reused

    async def test_a_second_call_for_the_same_container_reuses_its_devices(self) -> None:
        """No second Allocate: the cached response and the same devices come back."""
        node = Node()
        node.list("a", "b", "c")
        first = await node.allocate(2)
        second = await node.allocate(2)
        assert second.device_ids == first.device_ids
        assert second.reused
        assert not second.allocate_called
        assert len(node.plugin.allocate_requests) == 1

    async def test_app_containers_never_share_devices(self) -> None:
        """Two app containers of one pod get disjoint devices."""
        node = Node()
        node.list("a", "b", "c", "d")
        first = await node.allocate(2, container="one")
        second = await node.allocate(2, container="two")
        assert not set(first.device_ids) & set(second.device_ids)

    async def test_an_init_container_hands_its_devices_to_the_app_container(self) -> None:
        """Devices of a regular init container are reused by the next container of the pod."""
        node = Node()
        node.list("a", "b", "c")
        init = await node.allocate(1, container="init", kind=allocation.ContainerKind.INIT)
        app = await node.allocate(1, container="app")
        assert app.device_ids == init.device_ids

    async def test_an_empty_allocate_response_fails_and_keeps_the_devices_in_use(self) -> None:
        """As upstream, devices taken before an empty response stay in use until pods are recomputed."""
        node = Node()
        node.list("a", "b")
        node.plugin.container_responses = 0
        with pytest.raises(errors.AllocationError) as caught:
            await node.allocate(1, pod="p1")
        assert caught.value.message == "no containers return in allocation response "
        assert node.devices.allocated_devices[GPU] == {"a"}

    async def test_an_allocate_rpc_error_is_returned_verbatim_and_frees_the_devices(self) -> None:
        """The error text is the plugin's gRPC error as Go prints it; the in-use set is restored."""
        node = Node()
        node.list("a", "b")
        node.plugin.allocate_error = "rpc error: code = Unknown desc = boom"
        with pytest.raises(errors.AllocationError) as caught:
            await node.allocate(1)
        assert caught.value.message == "rpc error: code = Unknown desc = boom"
        assert node.devices.allocated_devices == {}

    async def test_devices_are_grouped_by_numa_node(self) -> None:
        """A multi-NUMA device appears under each of its nodes; no topology is node -1."""
        node = Node()
        node.list(healthy("a", 0, 1), healthy("b"))
        result = await node.allocate(2)
        assert dict(result.devices_by_numa) == {-1: ("b",), 0: ("a",), 1: ("a",)}


class TestPreferredAllocation:
    async def test_not_called_when_the_options_reply_does_not_offer_it(self) -> None:
        """The options reply decides; no preference call without it."""
        node = Node(preferred=False)
        node.list("a", "b", "c")
        result = await node.allocate(1)
        assert node.plugin.preferred_requests == []
        assert not result.preferred_called

    async def test_called_without_a_hint_with_all_available_devices(self) -> None:
        """Condition (b): no aligned devices, so the whole available set is offered."""
        node = Node(preferred=True)
        node.list("a", "b", "c", "d")
        node.plugin.preferred = ["d", "c"]
        result = await node.allocate(2)
        assert node.plugin.preferred_requests == [(["a", "b", "c", "d"], [], 2)]
        assert result.device_ids == ("c", "d")
        assert result.preferred_called

    async def test_an_answer_outside_the_allowed_set_is_ignored_and_the_shortfall_filled(self) -> None:
        """The answer is intersected with what is allowed; the kubelet fills the rest itself."""
        node = Node(preferred=True)
        node.list("a", "b", "c")
        node.plugin.preferred = ["zzz", "c"]
        result = await node.allocate(2)
        assert "c" in result.device_ids
        assert "zzz" not in result.device_ids
        assert len(result.device_ids) == 2

    async def test_called_with_the_aligned_devices_when_more_are_aligned_than_needed(self) -> None:
        """Condition (a): needed < |aligned|, so only the aligned devices are offered."""
        node = Node(preferred=True)
        node.list(healthy("a", 0), healthy("b", 0), healthy("c", 0), healthy("d", 1))
        node.plugin.preferred = ["b", "d"]
        result = await node.allocate(2, numa=frozenset({0}))
        assert node.plugin.preferred_requests == [(["a", "b", "c"], [], 2)]
        assert result.device_ids == ("a", "b")

    async def test_not_called_when_the_aligned_devices_are_exactly_enough(self) -> None:
        """needed == |aligned|: all aligned devices are taken and nothing is left to choose."""
        node = Node(preferred=True)
        node.list(healthy("a", 0), healthy("b", 0), healthy("c", 1))
        result = await node.allocate(2, numa=frozenset({0}))
        assert node.plugin.preferred_requests == []
        assert result.device_ids == ("a", "b")

    async def test_called_with_the_aligned_devices_as_must_include_when_they_are_too_few(self) -> None:
        """Condition (b) after taking every aligned device: those are must-include."""
        node = Node(preferred=True)
        node.list(healthy("a", 0), healthy("b", 1), healthy("c", 1))
        node.plugin.preferred = ["a", "c"]
        result = await node.allocate(2, numa=frozenset({0}))
        assert node.plugin.preferred_requests == [(["a", "b", "c"], ["a"], 2)]
        assert result.device_ids == ("a", "c")

    async def test_without_a_hint_topology_is_ignored(self) -> None:
        """No hint: every device is "no topology", so preference sees them all."""
        node = Node(preferred=True)
        node.list(healthy("a", 0), healthy("b", 1))
        await node.allocate(1)
        assert node.plugin.preferred_requests == [(["a", "b"], [], 1)]


class TestPreStart:
    async def test_called_with_all_devices_of_the_container_when_required(self) -> None:
        """PreStartContainer follows Allocate, with the container's devices."""
        node = Node(pre_start=True)
        node.list("a", "b", "c")
        result = await node.allocate(2)
        assert node.plugin.pre_start_requests == [list(result.device_ids)]
        assert result.pre_start_called

    async def test_not_called_when_not_required(self) -> None:
        """No pre_start_required in the options reply, no call."""
        node = Node(pre_start=False)
        node.list("a")
        result = await node.allocate(1)
        assert node.plugin.pre_start_requests == []
        assert not result.pre_start_called

    async def test_a_failure_is_wrapped_and_the_allocation_stands(self) -> None:
        """The container does not start, but its devices stay allocated."""
        node = Node(pre_start=True)
        node.list("a")
        node.plugin.pre_start_error = "rpc error: code = Unknown desc = no"
        with pytest.raises(errors.PreStartError) as caught:
            await node.allocate(1)
        assert caught.value.message == (
            "device plugin PreStartContainer rpc failed with err: rpc error: code = Unknown desc = no"
        )
        assert caught.value.allocation is not None
        assert caught.value.allocation.device_ids == ("a",)
        assert node.devices.pod_devices.container_devices("pod", "app", GPU) == {"a"}
