"""A stream the kubelet cuts before the plugin has read Register's answer: the plugin still registers again.

Register's answer comes back on ``kubelet.sock``'s connection; the kubelet opens
ListAndWatch on the plugin's own socket while Register returns, and a kubelet up
to 1.36 cuts that stream as soon as another plugin of the resource ends
(kubernetes#121994). The two travel on different connections, so a plugin that
is slow for a moment (a loaded node) can read the cut first. The fake kubelet
here makes that order certain: it cuts the first stream, waits until the plugin
has counted the cut, and only then answers.
"""

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
from structlog.testing import capture_logs

from plugvisor.api.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from plugvisor.common.hostpaths import HostPaths
from plugvisor.deviceplugin.devices import Device
from plugvisor.deviceplugin.runtime import STREAM_CUT, DevicePluginRuntime, PluginConfig
from plugvisor.deviceplugin.snapshot import Snapshot

RESOURCE = "example.com/widget"


class TwoWidgets:
    def scan(self) -> Snapshot:
        return Snapshot([Device("w0"), Device("w1")])


class KubeletThatCutsBeforeItAnswers(api_pb2_grpc.RegistrationServicer):
    """Opens ListAndWatch inside every Register; cuts the first one and answers only once the plugin saw it.

    Every later stream is kept open, as a kubelet that follows the plugin keeps it.
    """

    def __init__(self, kubelet_dir: Path, cut_seen: Callable[[], Awaitable[object]]) -> None:
        self.kubelet_dir = kubelet_dir
        self.cut_seen = cut_seen
        self.endpoints: list[str] = []
        self.kept: list[grpc.aio.Channel] = []

    async def Register(self, request, context):
        self.endpoints.append(request.endpoint)
        channel = grpc.aio.insecure_channel(f"unix:{self.kubelet_dir / request.endpoint}")
        stream = api_pb2_grpc.DevicePluginStub(channel).ListAndWatch(api_pb2.Empty())
        await stream.read()  # the first device list: the kubelet follows this socket now
        if len(self.endpoints) > 1:
            self.kept.append(channel)
            return api_pb2.Empty()
        await channel.close()  # another plugin of the resource ended: up to 1.36 ours is cut with it
        await self.cut_seen()
        return api_pb2.Empty()


async def test_a_cut_read_before_the_register_answer_makes_the_plugin_register_again(short_dir):
    kubelet_dir = short_dir / "dp"
    kubelet_dir.mkdir()
    paths = HostPaths(root=Path("/"), kubelet_dir=kubelet_dir)
    runtime = DevicePluginRuntime(PluginConfig(RESOURCE, paths), TwoWidgets())

    async def cut_seen():
        assert runtime.endpoint is not None
        return await runtime.endpoint.drops.wait_newer(0)

    fake = KubeletThatCutsBeforeItAnswers(kubelet_dir, cut_seen)
    server = grpc.aio.server()
    api_pb2_grpc.add_RegistrationServicer_to_server(fake, server)
    server.add_insecure_port(f"unix:{kubelet_dir / 'kubelet.sock'}")
    await server.start()
    stop = asyncio.Event()
    try:
        with capture_logs() as logs:
            plugin = asyncio.create_task(runtime.run(stop))
            try:
                async with asyncio.timeout(20):
                    while len(fake.endpoints) < 2 and not plugin.done():
                        await asyncio.sleep(0.05)
            finally:
                stop.set()
                await asyncio.wait_for(plugin, 10)
    finally:
        for channel in fake.kept:
            await channel.close()
        await server.stop(0)
    first, second = fake.endpoints[:2]
    assert second != first, "registered twice from one socket"
    again = [e for e in logs if e["event"] == "registering_again"]
    assert again and again[0]["reason"] == STREAM_CUT and again[0]["endpoint"] == first, logs
    assert not [e for e in logs if e["event"] == "no_stream_after_registration"], logs
