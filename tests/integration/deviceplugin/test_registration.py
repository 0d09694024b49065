"""Register calls: retries reach a kubelet the moment it listens."""

import asyncio
import socket

import grpc
import pytest
import structlog

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


async def test_a_restart_whose_events_are_lost_is_still_seen_by_the_safety_net(short_dir):
    """With the inotify reader never running, the periodic look at the files still notices the wipe."""
    from plugvisor.deviceplugin.registration import KubeletDirState, Registrar

    kubelet_dir = short_dir / "dp"
    kubelet_dir.mkdir()
    # Opened, but no task reads its events: they are "lost".
    watch = KubeletDirState(kubelet_dir, log=structlog.get_logger().bind(resource="x.example/y"))
    watch.open()
    try:
        async with EmulatedKubelet(kubelet_dir, write_view=False) as kubelet:
            plugin = StubDevicePlugin(kubelet_dir / "p.sock", "example.com/x")
            await plugin.start()
            registrar = Registrar(watch, resource="example.com/x", safety_interval=0.05)
            await registrar.register("p.sock", api_pb2.DevicePluginOptions())
            await kubelet.restart()
            reason = await asyncio.wait_for(registrar.wait_for_restart(), 10)
            await plugin.stop()
    finally:
        watch.close()
    assert reason == "plugin socket deleted"
