"""The kubelet's Registration server on ``<dir>/kubelet.sock``, and its start-up cleanup.

This mirrors the kubelet's ``server.go``/``handler.go`` of v1.31-v1.35, in order,
inside one synchronous Register call:

1. count the attempt (before any validation, as the kubelet's metric does);
2. the version must be supported -
   ``requested API version %q is not supported by kubelet. Supported version is %q``
   (``%q`` of the supported-versions *array*, so ``["v1beta1"]``);
3. the name must be an extended resource name - ``the ResourceName %q is invalid``;
4. the new client is stored under the name, replacing any previous one
   *without closing it*;
5. a blocking dial of ``join(dir, endpoint)`` - ``failed to dial device plugin: ...``;
6. GetDevicePluginOptions - ``failed to get device plugin options: ...``;
7. the endpoint is installed and ListAndWatch opened in the background while
   Register returns.

Errors reach the plugin as gRPC ``UNKNOWN`` with the text, as a Go handler that
returns a plain error does.

Two client tables, selectable because plugins must survive both kubelet
generations (docs/kubelet-contract.md, section 8):

* ``"per-name"`` (v1.31-v1.35, the default): one client per resource name. It
  keeps upstream's quirks: a new Register replaces the client without closing
  the old one, so both streams feed the resource; a failed Register removes
  *whatever* client the name had; and when any client's stream ends, the
  *current* client of that name is disconnected - the old plugin's exit zeroes
  the new plugin's resource (kubernetes#121994).
* ``"per-socket"`` (kubernetes PR #135437): instances are tracked per socket
  path. The newest live instance is the resource's endpoint and only its list
  counts; a failed Register leaves the others alone; when an instance ends, the
  newest remaining one takes over again (its last list applied, no capacity
  dip) and only the last one's end disconnects the resource. A second Register
  from a socket that is connected is refused, as 1.37 refuses it (``device
  plugin already connected: <path>``), and it makes the kubelet forget that
  instance while its stream runs on: when the stream ends nothing is
  disconnected, and the resource keeps the devices it last listed (seen on the
  real v1.37.2 kubelet; upstream's failed connect deregisters every client of
  that socket path, the running one included).

At start, every unix socket in the directory is deleted (following symlinks,
as ``os.Stat`` does) - directories, regular files and the checkpoint stay. That
deletion is how plugins learn the kubelet restarted.
"""

from __future__ import annotations

import asyncio
import collections
import os
import stat
from pathlib import Path
from typing import Literal, TypeAlias

import grpc
import structlog

from plugvisor.api.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from plugvisor.common import constants
from plugvisor.emulators.kubelet import client as client_
from plugvisor.emulators.kubelet import errors, journal, model, names, unixserver

_log = structlog.get_logger(__name__)

SOCKET_DIR_MODE = 0o750

Replacement: TypeAlias = Literal["per-name", "per-socket"]
"""How a second plugin instance for a registered resource is handled (see the module docstring)."""
REPLACEMENTS: tuple[Replacement, ...] = ("per-name", "per-socket")


class _InstanceHandler:
    """Stands between one client and the kubelet: drops the lists of instances that are not current."""

    def __init__(self, server: RegistrationServer, handler: client_.ClientHandler) -> None:
        self._server = server
        self._handler = handler
        self.client: client_.PluginClient | None = None

    async def plugin_connected(self, resource: str, client: client_.PluginClient) -> None:
        await self._handler.plugin_connected(resource, client)

    def plugin_list_and_watch_receiver(self, resource: str, response: api_pb2.ListAndWatchResponse) -> None:
        if self._server.is_current(resource, self.client):
            self._handler.plugin_list_and_watch_receiver(resource, response)

    def plugin_disconnected(self, resource: str) -> None:
        self._handler.plugin_disconnected(resource)

    def plugin_resumed(self, resource: str, client: client_.PluginClient) -> None:
        self._handler.plugin_resumed(resource, client)


def cleanup_plugin_directory(directory: Path, *, keep: frozenset[str] = frozenset()) -> list[Path]:
    """Delete every unix socket in ``directory`` (not ``keep``), like ``CleanupPluginDirectory``.

    Entries that cannot be stat'ed (dangling links) are skipped. Returns the
    removed paths; raises :class:`OSError` naming every entry it failed to remove.
    """
    removed: list[Path] = []
    failures: list[str] = []
    for entry in sorted(directory.iterdir()):
        if entry.name in keep:
            continue
        try:
            mode = entry.stat().st_mode
        except OSError:
            continue
        if stat.S_ISDIR(mode) or not stat.S_ISSOCK(mode):
            continue
        try:
            entry.unlink()
        except FileNotFoundError:
            continue
        except OSError as error:
            failures.append(f"{entry}: {error.strerror}")
            continue
        removed.append(entry)
    if failures:
        raise OSError("failed to clean up the device plugin directory: " + "; ".join(failures))
    return removed


class RegistrationServer(api_pb2_grpc.RegistrationServicer):
    """Serves ``v1beta1.Registration`` and owns the plugin clients it connected."""

    def __init__(
        self,
        *,
        socket_dir: Path,
        handler: client_.ClientHandler,
        journal: journal.Journal,
        dial_timeout: float,
        replacement: Replacement = "per-name",
    ) -> None:
        if replacement not in REPLACEMENTS:
            raise ValueError(f"replacement must be one of {REPLACEMENTS}, got {replacement!r}")
        self.replacement = replacement
        self.socket_dir = socket_dir
        self.socket_path = socket_dir / constants.KUBELET_SOCKET_NAME
        self._handler = handler
        self._journal = journal
        self._dial_timeout = dial_timeout
        self.clients: dict[str, client_.PluginClient] = {}
        """The current client per resource name (``server.clients``)."""
        self.instances: dict[str, dict[str, client_.PluginClient]] = {}
        """Per-socket mode: live instances per resource, by socket path, oldest first."""
        self.forgotten: set[client_.PluginClient] = set()
        """Per-socket mode: instances whose socket registered again; their stream's end changes nothing."""
        self.registration_counts: collections.Counter[str] = collections.Counter()
        """Register attempts per resource name, valid or not (the kubelet's metric)."""
        self._server: grpc.aio.Server | None = None
        self._runs: dict[asyncio.Task[None], client_.PluginClient] = {}

    async def start(self) -> list[Path]:
        """Create the directory, delete its sockets, then listen; return the removed sockets."""
        self.socket_dir.mkdir(mode=SOCKET_DIR_MODE, parents=True, exist_ok=True)
        removed = cleanup_plugin_directory(self.socket_dir, keep=frozenset({constants.CHECKPOINT_NAME}))
        self._server = await unixserver.serve(
            self.socket_path,
            lambda server: api_pb2_grpc.add_RegistrationServicer_to_server(self, server),
            # kubelet.sock must outlive this server, as a dying kubelet's does.
            bound_at=self.socket_dir.with_name(f"{self.socket_dir.name}.{constants.KUBELET_SOCKET_NAME}"),
        )
        return removed

    async def stop(self) -> None:
        """Stop as a dying kubelet process would: streams cut, no state change reported."""
        server, self._server = self._server, None
        # The socket stays: a dying kubelet leaves it behind, and the next start's cleanup removes it.
        await unixserver.stop(server, self.socket_path, unlink=False)
        runs = dict(self._runs)
        for task in runs:
            task.cancel()
        await asyncio.gather(*runs, return_exceptions=True)
        for plugin_client in runs.values():
            await plugin_client.close()
        self._runs.clear()
        self.clients.clear()
        self.instances.clear()
        self.forgotten.clear()

    def is_current(self, name: str, plugin_client: client_.PluginClient | None) -> bool:
        """Tell whether a client's ListAndWatch messages count for the resource."""
        if self.replacement == "per-name":
            return True  # every stream feeds the resource, as upstream before the fix
        return self.clients.get(name) is plugin_client

    async def Register(
        self,
        request: api_pb2.RegisterRequest,
        context: grpc.aio.ServicerContext[api_pb2.RegisterRequest, api_pb2.Empty],
    ) -> api_pb2.Empty:
        """Handle one registration synchronously; answer UNKNOWN with the kubelet's text on error."""
        received_at = self._journal.clock()
        self.registration_counts[request.resource_name] += 1
        error = await self._register(request)
        self._journal.registration(
            model.RegistrationRecord(
                resource=request.resource_name,
                endpoint=request.endpoint,
                version=request.version,
                requested_options=(
                    model.PluginOptions.from_proto(request.options) if request.HasField("options") else None
                ),
                accepted=error is None,
                error=error,
                received_at=received_at,
                finished_at=self._journal.clock(),
                generation=self._journal.generation,
            )
        )
        if error is not None:
            self._journal.event(
                model.EventKind.REGISTRATION_FAILED,
                error,
                resource=request.resource_name,
                endpoint=request.endpoint,
                version=request.version,
            )
            await context.abort(grpc.StatusCode.UNKNOWN, error)
        self._journal.event(
            model.EventKind.REGISTERED,
            f"{request.resource_name} registered at {request.endpoint}",
            resource=request.resource_name,
            endpoint=request.endpoint,
        )
        return api_pb2.Empty()

    async def _register(self, request: api_pb2.RegisterRequest) -> str | None:
        if request.version not in constants.SUPPORTED_VERSIONS:
            return (
                f"requested API version {names.go_quote(request.version)} is not supported by kubelet. "
                f"Supported version is {names.go_quote_list(constants.SUPPORTED_VERSIONS)}"
            )
        if not names.is_extended_resource_name(request.resource_name):
            return f"the ResourceName {names.go_quote(request.resource_name)} is invalid"
        socket_path = errors.go_join(os.fspath(self.socket_dir), request.endpoint)
        try:
            await self._connect_client(request.resource_name, socket_path)
        except client_.ConnectError as error:
            return str(error)
        return None

    # -- the plugin watcher's DevicePlugin handler (handler.go) ------------------------

    def validate_plugin(self, name: str, endpoint: str, versions: list[str]) -> str | None:
        """``ValidatePlugin``: a supported version and an extended resource name, else the kubelet's text."""
        if not any(version in constants.SUPPORTED_VERSIONS for version in versions):
            return (
                f"manager version, {constants.VERSION}, is not among plugin supported versions "
                f"{names.go_list(versions)}"
            )
        if not names.is_extended_resource_name(name):
            return f"invalid name of device plugin socket: the ResourceName {names.go_quote(name)} is invalid"
        return None

    async def register_plugin(self, name: str, endpoint: str, versions: list[str]) -> None:
        """``RegisterPlugin``: connect the client at ``endpoint`` (a full socket path), as Register does.

        Raises :class:`~plugvisor.emulators.kubelet.client.ConnectError` with the
        kubelet's text when the dial or GetDevicePluginOptions fails.
        """
        await self._connect_client(name, endpoint)

    async def deregister_plugin(self, name: str, endpoint: str) -> None:
        """``DeRegisterPlugin``: disconnect the resource's client (per-socket: the one at ``endpoint``)."""
        if self.replacement == "per-socket":
            plugin_client = self.instances.get(name, {}).get(endpoint)
            if plugin_client is None:
                return
            del self.instances[name][endpoint]
            if self.clients.get(name) is plugin_client:
                self._restore_current(name, None)
                if self.instances.get(name):
                    successor = list(self.instances[name].values())[-1]
                    self.clients[name] = successor
                    await plugin_client.close()
                    self._handler.plugin_resumed(name, successor)
                    return
            await plugin_client.disconnect()
            return
        plugin_client = self.clients.pop(name, None)
        if plugin_client is not None:
            await plugin_client.disconnect()

    async def _connect_client(self, name: str, socket_path: str) -> None:
        adapter = _InstanceHandler(self, self._handler)
        plugin_client = client_.PluginClient(
            resource=name,
            socket_path=socket_path,
            handler=adapter,
            journal=self._journal,
            dial_timeout=self._dial_timeout,
        )
        adapter.client = plugin_client
        per_socket = self.replacement == "per-socket"
        if per_socket and socket_path in self.instances.get(name, {}):
            self.forgotten.add(self.instances[name].pop(socket_path))
            _log.info("failed to connect to new client", resource=name, socket=socket_path)
            raise client_.ConnectError(f"device plugin already connected: {socket_path}")
        previous = self.clients.get(name)
        self.clients[name] = plugin_client
        try:
            await plugin_client.connect()
        except client_.ConnectError as error:
            if per_socket:
                # The fix: a failed instance leaves the working one in place.
                self._restore_current(name, previous)
            else:
                self.clients.pop(name, None)
            _log.info("failed to connect to new client", resource=name, err=str(error))
            await plugin_client.close()
            raise
        except BaseException:
            # Cancelled (the kubelet is stopping): leave no channel behind.
            if self.clients.get(name) is plugin_client:
                del self.clients[name]
            await plugin_client.close()
            raise
        if per_socket:
            instances = self.instances.setdefault(name, {})
            replaced = instances.pop(socket_path, None)
            instances[socket_path] = plugin_client
            if replaced is not None:
                await self._drop(replaced)
        task = asyncio.create_task(self._run_client(name, plugin_client), name=f"ListAndWatch {name}")
        self._runs[task] = plugin_client
        task.add_done_callback(lambda done: self._runs.pop(done, None))

    def _restore_current(self, name: str, previous: client_.PluginClient | None) -> None:
        if previous is not None and previous in self.instances.get(name, {}).values():
            self.clients[name] = previous
        else:
            self.clients.pop(name, None)

    async def _drop(self, plugin_client: client_.PluginClient) -> None:
        """Forget an instance silently: its stream's end must not count as a disconnect."""
        for task, owner in list(self._runs.items()):
            if owner is plugin_client:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await plugin_client.close()

    async def _run_client(self, name: str, plugin_client: client_.PluginClient) -> None:
        await plugin_client.run()
        self._journal.event(
            model.EventKind.STREAM_ENDED,
            f"ListAndWatch ended unexpectedly for device plugin {name}: {plugin_client.end_reason}",
            resource=name,
            endpoint=plugin_client.socket_path,
            error=plugin_client.end_reason,
        )
        if self.replacement == "per-socket":
            await self._instance_ended(name, plugin_client)
            return
        current = self.clients.get(name)
        if current is None:
            return
        self.clients.pop(name, None)
        await current.disconnect()

    async def _instance_ended(self, name: str, plugin_client: client_.PluginClient) -> None:
        if plugin_client in self.forgotten:
            self.forgotten.discard(plugin_client)
            await plugin_client.close()
            self._journal.event(
                model.EventKind.PLUGIN_INSTANCE_ENDED,
                f"{name}: the instance at {plugin_client.socket_path} ended after its socket registered "
                "again; the kubelet had forgotten it, so the resource keeps its devices",
                resource=name,
                endpoint=plugin_client.socket_path,
            )
            return
        instances = self.instances.get(name, {})
        if instances.get(plugin_client.socket_path) is plugin_client:
            del instances[plugin_client.socket_path]
        if self.clients.get(name) is not plugin_client:
            await plugin_client.close()
            self._journal.event(
                model.EventKind.PLUGIN_INSTANCE_ENDED,
                f"{name}: replaced instance at {plugin_client.socket_path} ended; the resource is unaffected",
                resource=name,
                endpoint=plugin_client.socket_path,
            )
            return
        if instances:
            successor = list(instances.values())[-1]
            self.clients[name] = successor
            await plugin_client.close()
            self._handler.plugin_resumed(name, successor)
            return
        self.clients.pop(name, None)
        self.instances.pop(name, None)
        await plugin_client.disconnect()
