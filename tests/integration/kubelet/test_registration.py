"""Register over a real socket: the kubelet's checks, in its order, with its error texts."""

from __future__ import annotations

from collections.abc import Awaitable
from pathlib import Path

import grpc
import pytest

from plugvisor.emulators.kubelet import (
    EmulatedKubelet,
    PluginMethod,
    PluginOptions,
    StubDevicePlugin,
    device,
    devices,
)

from .conftest import PluginFactory, counts

GPU = "example.com/gpu"


async def register_error(registration: Awaitable[None]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await registration
    return caught.value


class TestValidation:
    async def test_an_unsupported_version_is_refused_with_the_kubelets_text(
        self, kubelet: EmulatedKubelet, plugin: PluginFactory
    ) -> None:
        """The supported versions are quoted as Go quotes an array."""
        stub = await plugin(GPU, devices("a"))
        error = await register_error(stub.register(kubelet.socket_path, version="v1alpha1"))
        assert error.code() is grpc.StatusCode.UNKNOWN
        assert error.details() == (
            'requested API version "v1alpha1" is not supported by kubelet. Supported version is ["v1beta1"]'
        )
        assert stub.received == []

    @pytest.mark.parametrize(
        "name",
        ["gpu", "kubernetes.io/gpu", "foo.kubernetes.io/x", "Example.com/gpu", "a/b/c", "requests.x/y"],
    )
    async def test_an_invalid_resource_name_is_refused(
        self, kubelet: EmulatedKubelet, plugin: PluginFactory, name: str
    ) -> None:
        """Only extended resource names may register; the name is quoted as Go's %q."""
        stub = await plugin(GPU, devices("a"))
        error = await register_error(stub.register(kubelet.socket_path, resource_name=name))
        assert error.details() == f'the ResourceName "{name}" is invalid'

    async def test_the_version_is_checked_before_the_name(
        self, kubelet: EmulatedKubelet, plugin: PluginFactory
    ) -> None:
        """With both wrong, the version error wins."""
        stub = await plugin(GPU)
        error = await register_error(stub.register(kubelet.socket_path, version="v2", resource_name="gpu"))
        assert (error.details() or "").startswith("requested API version")

    async def test_attempts_are_counted_before_validation(
        self, kubelet: EmulatedKubelet, plugin: PluginFactory
    ) -> None:
        """The registration metric counts refused attempts too."""
        stub = await plugin(GPU)
        await register_error(stub.register(kubelet.socket_path, version="v2"))
        await register_error(stub.register(kubelet.socket_path, resource_name="gpu"))
        assert kubelet.registration_counts == {GPU: 1, "gpu": 1}
        assert [r.accepted for r in kubelet.registrations] == [False, False]

    async def test_an_endpoint_nobody_serves_fails_the_dial_after_the_deadline(
        self, kubelet: EmulatedKubelet
    ) -> None:
        """The dial blocks until its deadline, then Register fails with grpc-go's context error."""
        stub = StubDevicePlugin(kubelet.socket_dir / "absent.sock", GPU)
        error = await register_error(stub.register(kubelet.socket_path))
        assert error.details() == "failed to dial device plugin: context deadline exceeded"
        assert kubelet.resource(GPU) is None
        assert kubelet.calls == []


class TestOptions:
    async def test_a_failing_options_call_rejects_the_plugin(
        self, kubelet: EmulatedKubelet, plugin: PluginFactory
    ) -> None:
        """Scenario 12: one call, no ListAndWatch, the resource absent from the node."""
        stub = await plugin(GPU, devices("a"))
        stub.errors[PluginMethod.GET_DEVICE_PLUGIN_OPTIONS] = "not today"
        error = await register_error(stub.register(kubelet.socket_path))
        assert error.details() == (
            "failed to get device plugin options: rpc error: code = Unknown desc = not today"
        )
        assert kubelet.calls_for(GPU) == [PluginMethod.GET_DEVICE_PLUGIN_OPTIONS]
        assert kubelet.resource(GPU) is None

    async def test_the_options_reply_decides_not_the_request(
        self, kubelet: EmulatedKubelet, plugin: PluginFactory
    ) -> None:
        """Options sent with Register are ignored; the GetDevicePluginOptions answer is used."""
        stub = await plugin(GPU, devices("a", "b"), pre_start_required=True)
        await stub.register(
            kubelet.socket_path, options=PluginOptions(get_preferred_allocation_available=True)
        )
        await kubelet.wait_for(counts(GPU, 2, 2))
        view = kubelet.resource(GPU)
        assert view is not None
        assert view.options == PluginOptions(
            pre_start_required=True, get_preferred_allocation_available=False
        )
        assert kubelet.registrations[0].requested_options == PluginOptions(
            get_preferred_allocation_available=True
        )
        allocation = await kubelet.allocate(GPU, 1)
        assert not allocation.preferred_called
        assert allocation.pre_start_called


class TestAcceptedRegistration:
    async def test_register_returns_after_options_and_the_stream_opens_next(
        self, kubelet: EmulatedKubelet, plugin: PluginFactory
    ) -> None:
        """The calls are exactly GetDevicePluginOptions then ListAndWatch."""
        stub = await plugin(GPU, devices("a", "b"))
        await stub.register(kubelet.socket_path)
        assert kubelet.calls_for(GPU)[0] is PluginMethod.GET_DEVICE_PLUGIN_OPTIONS
        await kubelet.wait_for(counts(GPU, 2, 2))
        assert kubelet.calls_for(GPU) == [PluginMethod.GET_DEVICE_PLUGIN_OPTIONS, PluginMethod.LIST_AND_WATCH]
        record = kubelet.registrations[0]
        assert (record.resource, record.endpoint, record.version, record.accepted) == (
            GPU,
            stub.socket_path.name,
            "v1beta1",
            True,
        )

    async def test_the_endpoint_is_joined_to_the_socket_directory(
        self, kubelet: EmulatedKubelet, plugin: PluginFactory, socket_dir: Path
    ) -> None:
        """The endpoint is a file name in the kubelet's directory, joined as Go joins it."""
        (socket_dir / "sub").mkdir()
        stub = await plugin(GPU, devices("a"), name="sub/p.sock")
        await stub.register(kubelet.socket_path, endpoint="sub/../sub/p.sock")
        await kubelet.wait_for(counts(GPU, 1, 1))
        view = kubelet.resource(GPU)
        assert view is not None
        assert view.endpoint == str(socket_dir / "sub" / "p.sock")

    async def test_two_resources_are_independent(
        self, kubelet: EmulatedKubelet, plugin: PluginFactory
    ) -> None:
        """Each resource has its own plugin, devices and counts."""
        gpu = await plugin(GPU, devices("a", "b"))
        fpga = await plugin("example.com/fpga", [device("a", numa=[0])])
        await gpu.register(kubelet.socket_path)
        await fpga.register(kubelet.socket_path)
        await kubelet.wait_for(lambda k: counts(GPU, 2, 2)(k) and counts("example.com/fpga", 1, 1)(k))
        assert set(kubelet.resources) == {GPU, "example.com/fpga"}
        fpga_view = kubelet.resources["example.com/fpga"]
        assert fpga_view.topology_aware
        assert fpga_view.devices["a"].numa_nodes == (0,)
