"""A plugin client disconnected while it connects, as upstream's ``client.go`` is.

Up to 1.36 another instance's end disconnects whatever client the resource name
has, a new one included from before its dial. Upstream's client owns a
connection only once dialled: a disconnect during the dial closes nothing and the
connect goes on; one after it closes the connection, and the calls on it fail
with grpc-go's ``Canceled`` (``grpc: the client connection is closing``).
"""

import asyncio

import grpc
import pytest

from plugvisor.emulators.kubelet.client import PluginClient
from plugvisor.emulators.kubelet.journal import Journal
from plugvisor.emulators.kubelet.stub import StubDevicePlugin, devices

RESOURCE = "example.com/widget"
CLOSING = "rpc error: code = Canceled desc = grpc: the client connection is closing"


class Handler:
    """Records what the client reports; ``before_options`` runs before the options call."""

    def __init__(self, before_options=None) -> None:
        self.connected: list[str] = []
        self.disconnected: list[str] = []
        self.lists = 0
        self.before_options = before_options

    async def plugin_connected(self, resource, client):
        if self.before_options is not None:
            await self.before_options(client)
        await client.get_device_plugin_options()
        self.connected.append(resource)

    def plugin_list_and_watch_receiver(self, resource, response):
        self.lists += 1

    def plugin_disconnected(self, resource, socket_path):
        self.disconnected.append(socket_path)


def client_for(path, handler) -> PluginClient:
    return PluginClient(
        resource=RESOURCE, socket_path=str(path), handler=handler, journal=Journal(), dial_timeout=10.0
    )


async def test_a_disconnect_while_dialling_closes_nothing_and_the_connect_goes_on(socket_dir):
    path = socket_dir / "plugin.sock"
    handler = Handler()
    client = client_for(path, handler)
    connecting = asyncio.create_task(client.connect())
    await asyncio.sleep(0)  # into the dial, which waits: nothing listens yet
    assert not connecting.done()
    await client.disconnect()
    assert handler.disconnected == [str(path)] and not client.closed
    async with StubDevicePlugin(path, RESOURCE, devices=devices("w0")):
        await asyncio.wait_for(connecting, 10)
        assert handler.connected == [RESOURCE]
        running = asyncio.create_task(client.run())
        async with asyncio.timeout(10):
            while not handler.lists:
                await asyncio.sleep(0.01)
        await client.close()
        await asyncio.wait_for(running, 10)


async def test_a_disconnect_after_the_dial_fails_the_options_call_as_grpc_go_does(socket_dir):
    path = socket_dir / "plugin.sock"
    handler = Handler(before_options=lambda client: client.disconnect())
    client = client_for(path, handler)
    async with StubDevicePlugin(path, RESOURCE, devices=devices("w0")):
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await client.connect()
    assert failure.value.code() is grpc.StatusCode.CANCELLED
    assert failure.value.details() == "grpc: the client connection is closing"
    assert handler.disconnected == [str(path)] and handler.connected == []


async def test_a_stream_on_a_disconnected_client_ends_at_once_as_closing(socket_dir):
    path = socket_dir / "plugin.sock"
    handler = Handler()
    client = client_for(path, handler)
    async with StubDevicePlugin(path, RESOURCE, devices=devices("w0")):
        await client.connect()
        await client.disconnect()
        await asyncio.wait_for(client.run(), 10)
    assert client.end_reason == CLOSING
    assert handler.lists == 0
