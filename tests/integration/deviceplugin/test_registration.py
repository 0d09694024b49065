"""Register calls: retries reach a kubelet the moment it listens."""

import socket

import grpc
import pytest

from plugvisor.api.deviceplugin.v1beta1 import api_pb2
from plugvisor.deviceplugin.registration import register
from plugvisor.emulators.kubelet import EmulatedKubelet, StubDevicePlugin


async def test_a_refused_connection_does_not_delay_the_next_attempt(short_dir):
    """gRPC's shared reconnect backoff must not make the retry fail fast once the kubelet listens."""
    kubelet_dir = short_dir / "dp"
    kubelet_dir.mkdir()
    kubelet_sock = kubelet_dir / "kubelet.sock"
    not_listening = socket.socket(socket.AF_UNIX)
    not_listening.bind(str(kubelet_sock))  # the file exists; connecting is refused
    options = api_pb2.DevicePluginOptions()
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await register(kubelet_sock, endpoint="p.sock", resource="example.com/x", options=options, timeout=5)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    not_listening.close()

    async with EmulatedKubelet(kubelet_dir, write_view=False):  # deletes the stale file, then listens
        plugin = StubDevicePlugin(kubelet_dir / "p.sock", "example.com/x")
        await plugin.start()
        try:
            await register(
                kubelet_sock, endpoint="p.sock", resource="example.com/x", options=options, timeout=5
            )
        finally:
            await plugin.stop()
