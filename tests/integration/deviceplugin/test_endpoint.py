"""A plugin's endpoint (its socket and gRPC server) when stopped at awkward moments."""

import asyncio
import contextlib
import gc

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
