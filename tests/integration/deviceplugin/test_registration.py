"""Register calls: retries reach a kubelet the moment it listens."""

import asyncio
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


async def test_a_restart_whose_events_are_lost_is_still_seen_by_the_safety_net(short_dir):
    """With the inotify reader never running, the periodic look at the files still notices the wipe."""
    from plugvisor.deviceplugin.registration import KubeletDirState, Registrar

    kubelet_dir = short_dir / "dp"
    kubelet_dir.mkdir()
    watch = KubeletDirState(kubelet_dir)  # opened, but no task reads its events: they are "lost"
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


async def test_a_plugin_the_kubelet_drops_when_an_older_plugin_of_its_resource_stops_registers_again(
    short_dir,
):
    """A kubelet up to 1.35 disconnects the resource's current client whenever any of its streams ends
    (kubernetes#121994): a plugin that registered while an older one was still streaming loses its
    registration when the older one stops. The kubelet ends the newer plugin's stream; the plugin,
    seeing the same kubelet still listening, registers again on the socket it serves."""
    from plugvisor.common.hostpaths import HostPaths
    from plugvisor.deviceplugin.devices import Device
    from plugvisor.deviceplugin.runtime import DevicePluginRuntime, PluginConfig
    from plugvisor.deviceplugin.snapshot import Snapshot

    class OneDevice:
        def scan(self):
            return Snapshot([Device("d0")])

    resource = "example.com/x"
    kubelet_dir = short_dir / "dp"

    def registered_at(endpoint):
        def check(k):
            view = k.resource(resource)
            return view is not None and view.registered and view.endpoint == str(kubelet_dir / endpoint)

        return check

    async with EmulatedKubelet(kubelet_dir, write_view=False, replacement="per-name") as kubelet:
        older = StubDevicePlugin(
            kubelet_dir / "older.sock", resource, devices=[api_pb2.Device(ID="d0", health="Healthy")]
        )
        await older.start()
        await older.register(kubelet.socket_path)
        await kubelet.wait_for(registered_at("older.sock"))
        runtime = DevicePluginRuntime(
            PluginConfig(resource, HostPaths(root=short_dir, kubelet_dir=kubelet_dir)), OneDevice()
        )
        stop = asyncio.Event()
        task = asyncio.create_task(runtime.run(stop))
        try:
            _, first = await asyncio.wait_for(runtime.registrations.wait_newer(0), 20)
            await kubelet.wait_for(registered_at(first.endpoint), timeout=20)
            await older.end_streams()  # the kubelet now disconnects its current client: ours
            _, again = await asyncio.wait_for(runtime.registrations.wait_newer(1), 20)
            assert (again.number, again.endpoint) == (2, first.endpoint)
            await kubelet.wait_for(registered_at(first.endpoint), timeout=20)
        finally:
            stop.set()
            await asyncio.wait_for(task, 20)
            await older.stop()
