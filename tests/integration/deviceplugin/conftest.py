"""A PluginServer on a real unix socket, and a client for it."""

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc
import pytest

from plugvisor.api.deviceplugin.v1beta1 import api_pb2_grpc
from plugvisor.deviceplugin.cell import SnapshotCell
from plugvisor.deviceplugin.devices import Device, DeviceSet, DeviceSpec
from plugvisor.deviceplugin.endpoint import PluginEndpoint
from plugvisor.deviceplugin.hooks import Hooks, resolve_hooks
from plugvisor.deviceplugin.server import PluginServer
from plugvisor.deviceplugin.snapshot import Snapshot

RESOURCE = "example.com/widget"


def widgets(n: int, **kwargs) -> DeviceSet:
    return DeviceSet(
        Device(f"w{i}", specs=[DeviceSpec(f"/dev/w{i}", f"/dev/w{i}")], envs={"WIDGETS": f"w{i}"}, **kwargs)
        for i in range(n)
    )


@dataclass
class Served:
    cell: SnapshotCell[Snapshot]
    server: PluginServer
    endpoint: PluginEndpoint
    channel: grpc.aio.Channel
    stub: api_pb2_grpc.DevicePluginStub


@pytest.fixture
async def serve(short_dir) -> AsyncIterator:
    started: list[Served] = []

    async def start(
        devices: DeviceSet | None = None, *, plugin: object = None, hooks: Hooks | None = None
    ) -> Served:
        cell = SnapshotCell(Snapshot(devices if devices is not None else widgets(4)))
        server = PluginServer(
            RESOURCE, cell, hooks if hooks is not None else resolve_hooks(plugin or object())
        )
        endpoint = PluginEndpoint(server, short_dir, RESOURCE)
        await endpoint.start()
        channel = grpc.aio.insecure_channel(f"unix:{endpoint.path}")
        served = Served(cell, server, endpoint, channel, api_pb2_grpc.DevicePluginStub(channel))
        started.append(served)
        return served

    yield start
    for served in started:
        await served.channel.close()
        await served.endpoint.stop(grace=0)


def ids(message) -> Sequence[str]:
    return [d.ID for d in message.devices]


@pytest.fixture
def fuzz_server(short_dir):
    """A server on a real socket, driven from synchronous hypothesis tests through one event loop."""
    import asyncio

    from .test_fuzz_server import DEVICES, SameNode

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    cell = loop.run_until_complete(_make_cell(DEVICES))
    server = PluginServer(RESOURCE, cell, resolve_hooks(SameNode()))
    endpoint = PluginEndpoint(server, short_dir, RESOURCE)
    loop.run_until_complete(endpoint.start())
    channel = grpc.aio.insecure_channel(f"unix:{endpoint.path}")
    try:
        yield api_pb2_grpc.DevicePluginStub(channel)
    finally:
        loop.run_until_complete(channel.close())
        loop.run_until_complete(endpoint.stop(grace=0))
        loop.close()
        asyncio.set_event_loop(None)


async def _make_cell(devices):
    return SnapshotCell(Snapshot(devices))
