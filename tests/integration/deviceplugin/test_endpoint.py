"""A plugin's endpoint (its socket and gRPC server): stopped at awkward moments, and its streams counted."""

import asyncio
import contextlib
import gc

import grpc

from plugvisor.api.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from plugvisor.deviceplugin.cell import SnapshotCell
from plugvisor.deviceplugin.endpoint import PluginEndpoint
from plugvisor.deviceplugin.hooks import resolve_hooks
from plugvisor.deviceplugin.server import PluginServer
from plugvisor.deviceplugin.snapshot import Snapshot

RESOURCE = "example.com/x"


class Nothing:
    def scan(self) -> Snapshot:
        return Snapshot()


def endpoint(directory) -> PluginEndpoint:
    server = PluginServer(RESOURCE, SnapshotCell(Snapshot()), resolve_hooks(Nothing()))
    return PluginEndpoint(server, directory, RESOURCE)


async def test_a_stop_while_the_server_starts_leaves_no_stray_task_error(short_dir):
    """A SIGHUP storm stopped children an instant after they began: gRPC's own task then failed with
    InvalidStateError, printed as 'Task exception was never retrieved'."""
    errors = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context))
    for steps in range(6):  # cancelled at different points of the start
        plugin = endpoint(short_dir)
        starting = asyncio.create_task(plugin.start())
        for _ in range(steps):
            await asyncio.sleep(0)
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting
        await plugin.stop(grace=0)
    await asyncio.sleep(0.2)
    gc.collect()
    await asyncio.sleep(0.1)
    assert [context.get("message") for context in errors] == []
    assert not list(short_dir.glob("plugvisor-*.sock"))


async def test_a_file_put_where_the_socket_was_is_not_removed_at_stop(short_dir):
    plugin = endpoint(short_dir)
    await plugin.start()
    plugin.path.unlink()
    plugin.path.write_text("an operator's file\n")
    await plugin.stop(grace=0)
    assert plugin.path.read_text() == "an operator's file\n"


async def _stream(plugin: PluginEndpoint) -> tuple[grpc.aio.Channel, object]:
    """A ListAndWatch stream on ``plugin``'s socket, its first message read (so it counts as open)."""
    channel = grpc.aio.insecure_channel(f"unix:{plugin.path}")
    call = api_pb2_grpc.DevicePluginStub(channel).ListAndWatch(api_pb2.Empty())
    await call.read()
    return channel, call


async def until(predicate) -> None:
    async with asyncio.timeout(10):
        while not predicate():
            await asyncio.sleep(0.01)


async def test_a_stream_the_other_side_closes_is_counted_as_a_drop_once_none_is_left(short_dir):
    """Up to 1.36 the kubelet closes the stream of the plugin it follows when another plugin of the resource
    ends, and says nothing else: the endpoint counts it, but not while another stream is still open."""
    plugin = endpoint(short_dir)
    await plugin.start()
    try:
        kubelet, _ = await _stream(plugin)
        tool, _ = await _stream(plugin)
        await until(lambda: plugin.streams.value == 2)
        await tool.close()
        await until(lambda: plugin.streams.value == 1)
        assert plugin.drops.value == 0, "one stream is still open"
        await kubelet.close()
        await until(lambda: plugin.streams.value == 0)
        assert plugin.drops.value == 1
        await plugin.until_idle()
    finally:
        await plugin.stop(grace=0)


async def test_our_own_stop_ending_a_stream_is_no_drop(short_dir):
    plugin = endpoint(short_dir)
    await plugin.start()
    kubelet, _ = await _stream(plugin)
    try:
        await until(lambda: plugin.streams.value == 1)
        await plugin.stop(grace=0)
        await until(lambda: plugin.streams.value == 0)
        assert plugin.drops.value == 0
    finally:
        await kubelet.close()


async def test_a_stop_keeps_the_socket_until_the_streams_it_ends_have_ended(short_dir):
    """gRPC removes the socket as it stops listening, before the ends of the calls it lets finish: the
    kubelet saw the socket go, then the stream end, and up to 1.36 each drops the plugin it follows, the
    late one a fresh socket another plugin of the resource had just registered. The ends go first now."""
    cell = SnapshotCell(Snapshot())
    plugin = PluginEndpoint(PluginServer(RESOURCE, cell, resolve_hooks(Nothing())), short_dir, RESOURCE)
    await plugin.start()
    kubelet, call = await _stream(plugin)
    try:
        await until(lambda: plugin.streams.value == 1)
        stopping = asyncio.create_task(plugin.stop(grace=30))
        await asyncio.sleep(0.2)
        assert plugin.path.exists() and not stopping.done(), "the socket went while the stream was open"
        cell.close()  # what the runtime does before stopping: every stream ends normally
        assert await call.read() == grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK
        await asyncio.wait_for(stopping, 10)
        assert not plugin.path.exists()
    finally:
        await kubelet.close()
        await plugin.stop(grace=0)
