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

* ``"per-name"`` (v1.31-v1.36): one client per resource name. It keeps
  upstream's quirks: a new Register replaces the client without closing the
  old one, so both streams feed the resource; a failed Register removes
  *whatever* client the name had; and when any client's stream ends, the
  *current* client of that name is disconnected - the old plugin's exit zeroes
  the new plugin's resource (kubernetes#121994) and closes its stream.
* ``"per-socket"`` (kubernetes PR #135437, v1.37): a list of clients per name,
  and the device manager keeps every connected instance by socket path. Every
  instance's stream still feeds the resource; the newest is the endpoint; a
  failed Register removes the clients of its own socket path only; when an
  instance ends, another one becomes the endpoint and the devices stay, and only
  the last one's end disconnects the resource. A second Register from a socket
  that is connected is refused after the dial and the options call (``device
  plugin already connected: <path>``), and the failed connect removes every
  client of that path, the running one included, while the device manager keeps
  its entry: when that stream ends nothing is disconnected, and the resource
  keeps its devices with no plugin behind them (seen on the real v1.37.2
  kubelet).

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
        self.clients: dict[str, list[client_.PluginClient]] = {}
        """The clients per resource name (``server.clients``): at most one per name up to 1.36."""
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
        # All at once, as a dying process's connections close: one after the other, 256 of them
        # took seconds, the restart's own time before the new kubelet could listen. A close that
        # fails is said and passed over: a dying process's connections end whatever their state,
        # and one raising here stopped the restart half-way (the books of the old kubelet kept).
        closed = await asyncio.gather(
            *(plugin_client.close() for plugin_client in runs.values()), return_exceptions=True
        )
        for plugin_client, outcome in zip(runs.values(), closed, strict=True):
            if isinstance(outcome, BaseException) and not isinstance(outcome, asyncio.CancelledError):
                _log.warning(
                    "plugin connection close failed",
                    resource=plugin_client.resource,
                    socket=str(plugin_client.socket_path),
                    err=f"{type(outcome).__name__}: {outcome}",
                )
        self._runs.clear()
        self.clients.clear()

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
        """``DeRegisterPlugin``: disconnect the resource's client (from 1.37: the one at ``endpoint``)."""
        plugin_client = self._get_client(name, endpoint)
        if plugin_client is not None:
            await self._disconnect_client(name, plugin_client)

    # -- the client table (``registerClient``, ``deregisterClient``, ``getClient``) -------

    def _register_client(self, name: str, plugin_client: client_.PluginClient) -> None:
        if self.replacement == "per-name":
            self.clients[name] = [plugin_client]  # the previous one is dropped, not closed
        else:
            self.clients.setdefault(name, []).append(plugin_client)

    def _deregister_client(self, name: str, socket_path: str) -> None:
        """Forget the name's client (from 1.37: every client of ``socket_path``)."""
        if self.replacement == "per-name":
            self.clients.pop(name, None)
            return
        kept = [c for c in self.clients.get(name, []) if c.socket_path != socket_path]
        if kept:
            self.clients[name] = kept
        else:
            self.clients.pop(name, None)

    def _get_client(self, name: str, socket_path: str) -> client_.PluginClient | None:
        """The name's client (from 1.37: the one of ``socket_path``), if any."""
        for plugin_client in self.clients.get(name, []):
            if self.replacement == "per-name" or plugin_client.socket_path == socket_path:
                return plugin_client
        return None

    async def _disconnect_client(self, name: str, plugin_client: client_.PluginClient) -> None:
        self._deregister_client(name, plugin_client.socket_path)
        await plugin_client.disconnect()

    async def _connect_client(self, name: str, socket_path: str) -> None:
        plugin_client = client_.PluginClient(
            resource=name,
            socket_path=socket_path,
            handler=self._handler,
            journal=self._journal,
            dial_timeout=self._dial_timeout,
        )
        self._register_client(name, plugin_client)
        try:
            await plugin_client.connect()
        except client_.ConnectError as error:
            self._deregister_client(name, socket_path)
            _log.info("failed to connect to new client", resource=name, socket=socket_path, err=str(error))
            await plugin_client.close()
            raise
        except BaseException:
            # Cancelled (the kubelet is stopping): leave no channel behind.
            if plugin_client in self.clients.get(name, []):
                self.clients[name].remove(plugin_client)
            await plugin_client.close()
            raise
        task = asyncio.create_task(self._run_client(name, plugin_client), name=f"ListAndWatch {name}")
        self._runs[task] = plugin_client
        task.add_done_callback(lambda done: self._runs.pop(done, None))

    async def _run_client(self, name: str, plugin_client: client_.PluginClient) -> None:
        """Consume the stream; at its end disconnect the name's client (from 1.37: this socket's), if any."""
        await plugin_client.run()
        self._journal.event(
            model.EventKind.STREAM_ENDED,
            f"ListAndWatch ended unexpectedly for device plugin {name}: {plugin_client.end_reason}",
            resource=name,
            endpoint=plugin_client.socket_path,
            error=plugin_client.end_reason,
        )
        current = self._get_client(name, plugin_client.socket_path)
        forgotten = current is None and self.replacement == "per-socket" and not plugin_client.closed
        if current is not plugin_client:
            await plugin_client.close()
        if current is not None:
            await self._disconnect_client(name, current)
        elif forgotten:
            self._journal.event(
                model.EventKind.PLUGIN_INSTANCE_ENDED,
                f"{name}: the instance at {plugin_client.socket_path} ended after its socket registered "
                "again; the kubelet had forgotten it, so the resource keeps its devices",
                resource=name,
                endpoint=plugin_client.socket_path,
            )
