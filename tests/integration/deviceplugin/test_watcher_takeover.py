"""Plugin-watcher registration on a kubelet up to 1.36 when the plugin it took the resource over from stops.

That plugin's stream ends and it stops listening, but its socket stays in
``plugins_registry`` a while (a server that leaves its socket file to be removed
later, or a killed plugin's socket that someone removes later). The stream's end
makes the kubelet cut the stream of the plugin it follows (ours,
kubernetes#121994), which serves a fresh socket; the removal makes it disconnect
whatever plugin it follows for the resource once more. Were the fresh socket
registered before that removal reached the kubelet, the fresh one would be the
plugin disconnected.
"""

import asyncio
from pathlib import Path

from plugvisor.common.hostpaths import HostPaths
from plugvisor.common.sockets import socket_name
from plugvisor.deviceplugin.cell import SnapshotCell
from plugvisor.deviceplugin.devices import Device
from plugvisor.deviceplugin.hooks import resolve_hooks
from plugvisor.deviceplugin.runtime import DevicePluginRuntime, PluginConfig
from plugvisor.deviceplugin.server import PluginServer, add_plugin_servicer
from plugvisor.deviceplugin.snapshot import Snapshot
from plugvisor.deviceplugin.watcherregistration import WatcherRegistrar
from plugvisor.emulators.kubelet import EmulatedKubelet, EventKind, unixserver

RESOURCE = "example.com/widget"


class OneWidget:
    def scan(self) -> Snapshot:
        return Snapshot([Device("w0")])


class PluginThatRemovesItsSocketLast:
    """A plugin of RESOURCE in ``plugins_registry``, whose stop and socket removal the test times.

    Its server binds a private path and the registry name is a hard link to it,
    so that stopping the server leaves the registry name in place, dead, until
    :meth:`remove_socket`.
    """

    def __init__(self, registry: Path, private: Path) -> None:
        self.path = registry / socket_name(RESOURCE, "00000001")
        self._private = private
        self._devices = SnapshotCell(Snapshot([Device("w0")]))
        self._server = None

    async def serve(self) -> None:
        servicer = PluginServer(RESOURCE, self._devices, resolve_hooks(object()))

        def add(server) -> None:
            add_plugin_servicer(servicer, server, resource=RESOURCE)
            server.add_generic_rpc_handlers((WatcherRegistrar(RESOURCE).handler(),))

        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._server = await unixserver.serve(self.path, add, bound_at=self._private)

    async def stop_listening(self) -> None:
        """End the stream as a stopping plugin does, then stop serving; the registry socket stays."""
        self._devices.close()
        server, self._server = self._server, None
        await unixserver.stop(server, self.path, unlink=False)

    def remove_socket(self) -> None:
        self.path.unlink(missing_ok=True)


def endpoint(kubelet: EmulatedKubelet) -> str | None:
    view = kubelet.resource(RESOURCE)
    return None if view is None or not view.registered else view.endpoint


def counts(kubelet: EmulatedKubelet):
    view = kubelet.resource(RESOURCE)
    return None if view is None else (view.allocatable, view.capacity)


async def test_the_fresh_socket_is_not_disconnected_by_the_late_removal_of_the_stopped_plugins_socket(
    short_dir,
):
    kubelet_dir = short_dir / "kubelet" / "device-plugins"
    async with EmulatedKubelet(kubelet_dir, grace_period=60, kubelet_version="1.35") as kubelet:
        registry = kubelet.plugins_registry
        assert registry is not None
        first = PluginThatRemovesItsSocketLast(registry, short_dir / "first.sock")
        await first.serve()
        await kubelet.wait_for(lambda k: endpoint(k) == str(first.path) and counts(k) == (1, 1))
        paths = HostPaths(root=Path("/"), kubelet_dir=kubelet_dir)
        config = PluginConfig(RESOURCE, paths, registration="plugin-watcher", plugins_registry=registry)
        runtime = DevicePluginRuntime(config, OneWidget())
        stop = asyncio.Event()
        plugin = asyncio.create_task(runtime.run(stop))
        try:
            await kubelet.wait_for(
                lambda k: endpoint(k) not in (None, str(first.path)) and counts(k) == (1, 1),
                what="the plugin took the resource over",
            )
            took_over = endpoint(kubelet)
            await first.stop_listening()
            await kubelet.wait_for(
                lambda k: endpoint(k) not in (None, str(first.path), took_over) and counts(k) == (1, 1),
                timeout=20,
                what="the plugin registered again from a fresh socket",
            )
            fresh = endpoint(kubelet)
            first.remove_socket()  # the stopping process gets round to it
            await kubelet.wait_for(
                lambda k: any(
                    e.kind is EventKind.PLUGIN_DEREGISTERED and e.fields.get("path") == str(first.path)
                    for e in k.events
                ),
                what="the kubelet handled the removal of the first plugin's socket",
            )
            events = list(kubelet.events)
            after = endpoint(kubelet), counts(kubelet)
        finally:
            stop.set()
            await asyncio.wait_for(plugin, 10)
            await first.stop_listening()
    registered = max(
        i
        for i, e in enumerate(events)
        if e.kind is EventKind.REGISTERED and e.fields.get("endpoint") == fresh
    )
    stopped = [e for e in events[registered:] if e.kind is EventKind.ENDPOINT_STOPPED]
    assert not stopped, stopped
    assert after == (fresh, (1, 1))
    assert all(r.accepted for r in kubelet.registrations), kubelet.registrations
