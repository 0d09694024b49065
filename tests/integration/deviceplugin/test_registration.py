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


async def test_a_registration_the_kubelet_drops_as_it_notices_the_plugin_that_stopped_is_made_again(
    short_dir,
):
    """The race behind test_second_plugin's flakiness, made deterministic. A plugin that another plugin
    of its resource had superseded registers again when that one's socket goes; if the kubelet (up to
    1.35) handles that one's stream end only afterwards, it disconnects its current client: the plugin
    that just registered. Seeing the kubelet drop that registration while it still listens, the plugin
    registers once more, and the resource stays on the node."""
    from plugvisor.common.hostpaths import HostPaths
    from plugvisor.common.sockets import socket_name
    from plugvisor.deviceplugin.devices import Device
    from plugvisor.deviceplugin.registration import KUBELET_DROPPED_US
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
        runtime = DevicePluginRuntime(
            PluginConfig(resource, HostPaths(root=short_dir, kubelet_dir=kubelet_dir)), OneDevice()
        )
        stop = asyncio.Event()
        task = asyncio.create_task(runtime.run(stop))
        other = StubDevicePlugin(
            kubelet_dir / socket_name(resource, "0000aaaa"), resource, devices=[api_pb2.Device(ID="d0")]
        )
        try:
            _, first = await asyncio.wait_for(runtime.registrations.wait_newer(0), 20)
            await other.start()
            await other.register(kubelet.socket_path)  # the kubelet follows the other plugin now
            await kubelet.wait_for(registered_at(other.socket_path.name), timeout=20)
            other.socket_path.unlink()  # the other plugin is going: its socket first...
            _, again = await asyncio.wait_for(runtime.registrations.wait_newer(1), 20)
            assert (again.endpoint, again.reason) == (
                first.endpoint,
                "another plugin of this resource stopped",
            )
            await kubelet.wait_for(registered_at(first.endpoint), timeout=20)
            await other.end_streams()  # ...its stream end reaches the kubelet only now: it drops ours
            _, third = await asyncio.wait_for(runtime.registrations.wait_newer(2), 20)
            assert (third.endpoint, third.reason) == (first.endpoint, KUBELET_DROPPED_US)
            await kubelet.wait_for(registered_at(first.endpoint), timeout=20)
        finally:
            stop.set()
            await asyncio.wait_for(task, 20)
            await other.stop()
