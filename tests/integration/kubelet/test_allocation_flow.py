"""Allocation through a real plugin: the RPCs the kubelet makes, and their failures as it reports them."""

from __future__ import annotations

import pytest

from plugvisor.api.deviceplugin.v1beta1 import api_pb2
from plugvisor.emulators.kubelet import (
    AllocationError,
    EmulatedKubelet,
    PluginMethod,
    PreStartError,
    device,
    devices,
)

from .conftest import PluginFactory, counts

GPU = "example.com/gpu"


class TestAllocationOverTheWire:
    async def test_preferred_then_allocate_then_pre_start(
        self, kubelet: EmulatedKubelet, plugin: PluginFactory
    ) -> None:
        """With both options, the plugin sees exactly those three calls, in order, with one container each."""
        stub = await plugin(
            GPU, devices("a", "b", "c", "d"), pre_start_required=True, get_preferred_allocation_available=True
        )
        stub.preferred_func = lambda request: api_pb2.PreferredAllocationResponse(
            container_responses=[api_pb2.ContainerPreferredAllocationResponse(deviceIDs=["d", "b"])]
        )
        await stub.register(kubelet.socket_path)
        await kubelet.wait_for(counts(GPU, 4, 4))
        allocation = await kubelet.allocate(GPU, 2, pod_uid="p", container="c")
        assert allocation.device_ids == ("b", "d")
        assert kubelet.calls_for(GPU)[2:] == [
            PluginMethod.GET_PREFERRED_ALLOCATION,
            PluginMethod.ALLOCATE,
            PluginMethod.PRE_START_CONTAINER,
        ]
        (preferred,) = stub.calls(PluginMethod.GET_PREFERRED_ALLOCATION)
        assert isinstance(preferred, api_pb2.PreferredAllocationRequest)
        assert len(preferred.container_requests) == 1
        assert preferred.container_requests[0].allocation_size == 2
        (allocate,) = stub.calls(PluginMethod.ALLOCATE)
        assert isinstance(allocate, api_pb2.AllocateRequest)
        assert [sorted(r.devices_ids) for r in allocate.container_requests] == [["b", "d"]]
        (pre_start,) = stub.calls(PluginMethod.PRE_START_CONTAINER)
        assert isinstance(pre_start, api_pb2.PreStartContainerRequest)
        assert sorted(pre_start.devices_ids) == ["b", "d"]
        assert kubelet.allocated(GPU, pod_uid="p", container="c") == ("b", "d")

    async def test_an_allocate_error_rejects_the_pod_with_the_plugins_text(
        self, kubelet: EmulatedKubelet, plugin: PluginFactory
    ) -> None:
        """The plugin's error reaches the pod status inside the kubelet's wrapper."""
        stub = await plugin(GPU, devices("a"))
        stub.errors[PluginMethod.ALLOCATE] = "invalid allocation request with unhealthy device: a"
        await stub.register(kubelet.socket_path)
        await kubelet.wait_for(counts(GPU, 1, 1))
        with pytest.raises(AllocationError) as caught:
            await kubelet.allocate(GPU, 1)
        assert caught.value.status_message == (
            "Allocate failed due to rpc error: code = Unknown desc = invalid allocation request "
            "with unhealthy device: a, which is unexpected"
        )
        assert kubelet.allocated(GPU, pod_uid="pod-0", container="container-0") is None

    async def test_an_empty_allocate_response_is_rejected(
        self, kubelet: EmulatedKubelet, plugin: PluginFactory
    ) -> None:
        """Upstream's own Stub default (an empty response) fails admission."""
        stub = await plugin(GPU, devices("a"))
        stub.allocate_func = lambda request: api_pb2.AllocateResponse()
        await stub.register(kubelet.socket_path)
        await kubelet.wait_for(counts(GPU, 1, 1))
        with pytest.raises(AllocationError) as caught:
            await kubelet.allocate(GPU, 1)
        assert caught.value.message == "no containers return in allocation response "

    async def test_a_pre_start_error_fails_the_start_not_the_admission(
        self, kubelet: EmulatedKubelet, plugin: PluginFactory
    ) -> None:
        """The container keeps its devices; the start error carries the kubelet's wrapper."""
        stub = await plugin(GPU, devices("a"), pre_start_required=True)
        stub.errors[PluginMethod.PRE_START_CONTAINER] = "firmware not loaded"
        await stub.register(kubelet.socket_path)
        await kubelet.wait_for(counts(GPU, 1, 1))
        with pytest.raises(PreStartError) as caught:
            await kubelet.allocate(GPU, 1)
        assert caught.value.message == (
            "device plugin PreStartContainer rpc failed with err: "
            "rpc error: code = Unknown desc = firmware not loaded"
        )
        assert kubelet.allocated(GPU, pod_uid="pod-0", container="container-0") == ("a",)
        del stub.errors[PluginMethod.PRE_START_CONTAINER]
        assert await kubelet.start_container(GPU)

    async def test_a_dead_plugins_resource_cannot_be_allocated(
        self, kubelet: EmulatedKubelet, plugin: PluginFactory
    ) -> None:
        """After the stream ends every device is unhealthy, so admission fails."""
        stub = await plugin(GPU, [device("a")])
        await stub.register(kubelet.socket_path)
        await kubelet.wait_for(counts(GPU, 1, 1))
        await stub.stop()
        await kubelet.wait_for(counts(GPU, 0, 1))
        with pytest.raises(AllocationError) as caught:
            await kubelet.allocate(GPU, 1)
        assert (
            caught.value.message
            == "no healthy devices present; cannot allocate unhealthy devices example.com/gpu"
        )

    async def test_removing_a_pod_frees_its_devices(
        self, kubelet: EmulatedKubelet, plugin: PluginFactory
    ) -> None:
        """Devices of a removed pod are available again."""
        stub = await plugin(GPU, devices("a"))
        await stub.register(kubelet.socket_path)
        await kubelet.wait_for(counts(GPU, 1, 1))
        await kubelet.allocate(GPU, 1, pod_uid="first")
        with pytest.raises(AllocationError):
            await kubelet.allocate(GPU, 1, pod_uid="second")
        kubelet.remove_pod("first")
        allocation = await kubelet.allocate(GPU, 1, pod_uid="second")
        assert allocation.device_ids == ("a",)
