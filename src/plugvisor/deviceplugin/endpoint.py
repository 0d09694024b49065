"""The plugin's own socket and gRPC server: unique per instance, probed before binding.

Three rules from the field (docs/architecture.md, "Plugin sockets"): a fresh socket file name
for every server instance (a kubelet that tracks instances per socket path can
then hand over between an old and a new plugin without a gap, and a stale socket
can never be mistaken for ours); never bind over a socket another live process
serves (grpc would silently steal it); and never leave the socket world-accessible.
A plugin starting up also removes the dead sockets of its resource that an earlier
plugin, killed, left behind (:func:`remove_dead_instances`).

Each endpoint also counts the ListAndWatch streams open on its own socket, and
the times the other side (the kubelet) ended one and left none open: a kubelet
up to 1.36 closes the stream of the plugin it follows when *another* plugin of
the resource stops (kubernetes#121994), and tells it nothing else. The runtime
registers again on such a sign, and keeps an older socket serving while the
kubelet still holds a stream on it (ending that stream would be the same bug).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from pathlib import Path
from typing import Any, cast

import grpc
import structlog

from plugvisor.api.deviceplugin.v1beta1 import api_pb2_grpc
from plugvisor.common.sockets import (
    BIND_TO_LISTEN,
    owner_only,
    socket_answers,
    socket_files,
    socket_name,
    socket_path_problem,
    socket_prefix,
)
from plugvisor.deviceplugin.cell import SnapshotCell
from plugvisor.deviceplugin.errors import ConfigurationError, SocketInUseError
from plugvisor.deviceplugin.server import Context, StreamHandler, add_plugin_servicer


async def socket_is_live(path: Path, timeout: float = 0.5) -> bool:
    """Whether a process accepts connections on the unix socket at ``path``."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_unix_connection(str(path)), timeout)
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


async def remove_dead_instances(
    directory: Path, resource: str, *, answers: Callable[[Path], bool] = socket_answers
) -> list[str]:
    """Delete the sockets of ``resource`` in ``directory`` that no process serves; returns their names.

    A plugin killed (SIGKILL, OOM) leaves its socket file behind, and nothing else
    removes it when no agent supervises the plugin: in ``plugins_registry`` the
    kubelet's plugin watcher then tries to register it again and again (on every
    kubelet start, for ever); in the device-plugin directory the files pile up
    until the kubelet restarts. Only unix sockets named as this resource's
    instances are candidates; one that answers (or is slow to: a live plugin) is
    kept, and one that does not is given until :data:`BIND_TO_LISTEN` seconds
    after it was made, so that a plugin binding right now keeps its socket.
    ``answers``: the probe (tests count its calls).
    """
    candidates = await asyncio.to_thread(socket_files, directory, socket_prefix(resource) + "-")
    removed = await asyncio.gather(*(_remove_if_dead(path, answers) for path in candidates))
    return [path.name for path, gone in zip(candidates, removed, strict=True) if gone]


async def _remove_if_dead(path: Path, answers: Callable[[Path], bool]) -> bool:
    latest = time.time() + BIND_TO_LISTEN  # a file's time in the future (a clock set back) waits no longer
    while True:
        info = await asyncio.to_thread(_unanswered, path, answers)
        if info is None:
            return False
        # ctime: its bind, or its chmod once served, whichever came last.
        wait = min(info.st_ctime_ns / 1e9 + BIND_TO_LISTEN, latest) - time.time()
        if wait <= 0:
            return await asyncio.to_thread(_unlink_if_unchanged, path, info)
        await asyncio.sleep(min(wait, 0.05))


def _unanswered(path: Path, answers: Callable[[Path], bool]) -> os.stat_result | None:
    """The file's status if it is a socket nobody answers on; None if it is gone, not a socket, or served."""
    try:
        info = path.lstat()
    except OSError:
        return None
    return None if not stat.S_ISSOCK(info.st_mode) or answers(path) else info


def _unlink_if_unchanged(path: Path, info: os.stat_result) -> bool:
    """Delete ``path`` if it is still the file ``info`` describes; whether it did."""
    try:
        again = path.lstat()
        if (again.st_ino, again.st_ctime_ns) != (info.st_ino, info.st_ctime_ns):
            return False  # replaced since it was probed: not the file found dead
        path.unlink()
    except OSError:  # gone already, or the directory is read-only: nothing removed
        return False
    return True


def check_socket_path(path: Path) -> None:
    """Refuse a socket path grpc cannot bind (too long), naming the limit."""
    problem = socket_path_problem(path)
    if problem is not None:
        raise ConfigurationError(f"{problem}: use a shorter kubelet directory")


class PluginEndpoint:
    """One running gRPC server instance on one socket file."""

    def __init__(
        self,
        servicer: api_pb2_grpc.DevicePluginServicer,
        socket_dir: Path,
        resource: str,
        *,
        extra_handlers: tuple[grpc.GenericRpcHandler, ...] = (),
    ) -> None:
        self._servicer = servicer
        self._extra_handlers = extra_handlers
        self._resource = resource
        self.path = socket_dir / socket_name(resource)
        self._server: grpc.aio.Server | None = None
        self._inode: int | None = None
        self._stopping = False
        self.streams: SnapshotCell[int] = SnapshotCell(0)
        """ListAndWatch streams open on this socket now (the kubelet holds one per registration)."""
        self.drops: SnapshotCell[int] = SnapshotCell(0)
        """How often the other side ended a stream here and left none open (see the module docstring)."""
        self.streamed = asyncio.Event()
        """Set once the kubelet opened a ListAndWatch stream here (a registration it kept)."""
        self._unfinished = 0
        """ListAndWatch calls not yet terminated (their status sent, or the connection gone)."""
        self._all_finished = asyncio.Event()
        self._all_finished.set()
        self._log = structlog.get_logger("plugvisor.endpoint").bind(resource=resource, socket=self.path.name)

    @property
    def name(self) -> str:
        """The socket's bare file name: what Register sends as the endpoint."""
        return self.path.name

    async def start(self) -> None:
        """Bind and serve; raises SocketInUseError if a live process already serves there."""
        check_socket_path(self.path)
        if self.path.exists() or self.path.is_symlink():
            if await socket_is_live(self.path):
                raise SocketInUseError(
                    f"{self.path} is served by another live process; refusing to take it over"
                )
            self.path.unlink()
        server = grpc.aio.server()
        add_plugin_servicer(self._servicer, server, resource=self._resource, wrap_stream=self._counted)
        if self._extra_handlers:
            server.add_generic_rpc_handlers(self._extra_handlers)
        with owner_only():
            try:
                bound = server.add_insecure_port(f"unix:{self.path}")
            except RuntimeError:  # grpcio >= 1.60 raises "Failed to bind" where older ones returned 0
                bound = 0
        if not bound:
            raise ConfigurationError(
                f"cannot create the plugin socket {self.path}: {_bind_problem(self.path)}"
            )
        self._server = server  # from here on stop() stops it, whatever happens to this start
        await _start_uncancelled(server)
        try:
            self._inode = self.path.lstat().st_ino
            self.path.chmod(stat.S_IRUSR | stat.S_IWUSR)
        except FileNotFoundError:
            # A restarting kubelet wiped its directory between our bind and now. Not an
            # error of ours: the registrar finds the socket gone (EndpointLostError) and
            # the runtime serves a fresh one. Raising here ended the plugin (exit 1).
            self._log.info("socket_deleted_while_starting")
            return
        self._log.info("serving")

    def _counted(self, handler: StreamHandler) -> StreamHandler:
        """``handler``, counted in :attr:`streams`; the last one cut while we serve, in :attr:`drops`."""
        streams = self.streams

        async def list_and_watch(request: object, context: Context) -> AsyncIterator[object]:
            streams.publish(streams.value + 1)
            self.streamed.set()
            self._unfinished += 1
            self._all_finished.clear()
            # The stubs type the callback as a class of theirs that no function is; gRPC takes any callable.
            context.add_done_callback(cast(Any, self._call_finished))
            stream = handler(request, context)
            cut = False
            try:
                async for message in stream:
                    yield message
            except (asyncio.CancelledError, GeneratorExit):
                cut = not self._stopping  # our own stop cancels streams too
                raise
            finally:
                if isinstance(stream, AsyncGenerator):  # left at a yield: close it now, not at collection
                    await stream.aclose()
                streams.publish(streams.value - 1)
                if cut and streams.value == 0:
                    self.drops.publish(self.drops.value + 1)

        return list_and_watch

    def _call_finished(self, _context: object) -> None:
        """Called by gRPC once a ListAndWatch call terminated: its end is on its way to the kubelet."""
        self._unfinished -= 1
        if self._unfinished <= 0:
            self._unfinished = 0
            self._all_finished.set()

    async def until_idle(self) -> None:
        """Return once no ListAndWatch stream is open on this socket."""
        while self.streams.value:
            await self.streams.wait_newer(self.streams.version)

    def is_ours(self) -> bool:
        """Whether the file at :attr:`path` is still the socket this server bound."""
        try:
            info = self.path.lstat()
        except OSError:
            return False
        return stat.S_ISSOCK(info.st_mode) and info.st_ino == self._inode

    async def stop(self, grace: float | None = 0.5) -> None:
        """Stop serving and remove the socket file if it is still ours (a file put there since is kept).

        RPCs still running after ``grace`` seconds are cancelled; close the device
        cell first so that ListAndWatch streams end normally within the grace.

        With a grace, the server stops only once every stream has ended and its
        end was sent (or the grace ran out): gRPC removes the socket file as it
        stops listening, before the statuses of the calls it lets finish go out,
        so the kubelet saw the socket go first and the stream end after. Up to
        1.36 each of the two makes the kubelet drop the plugin it then follows
        for the resource; the second one, arriving late, could fall on the fresh
        socket another plugin of the resource had just registered on seeing the
        first (the plugin watcher then forgot it half-connected). Ended in
        this order, both come before anyone reacts to the socket going.
        """
        server = self._server
        if server is None:
            return
        if grace:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(grace):
                    await self._all_finished.wait()
        if self._server is not server:
            return  # stopped meanwhile by another caller
        self._server = None
        self._stopping = True
        await server.stop(grace)
        if self.is_ours():
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        self._log.info("stopped")


async def _start_uncancelled(server: grpc.aio.Server) -> None:
    """``server.start()``, which must not be cancelled half-way (a stop during start-up: a SIGTERM).

    grpc.aio's start waits on a future that its own serving task completes; cancelled,
    that task later fails with ``InvalidStateError`` and grpc's crash handler leaves a
    "Task exception was never retrieved" traceback in the log (seen in SIGHUP storms,
    children stopped an instant after they began). So the start is shielded and
    finished before the cancellation goes on; :meth:`PluginEndpoint.stop` then stops it.
    """
    starting = asyncio.ensure_future(server.start())
    try:
        await asyncio.shield(starting)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await starting
        raise


def _bind_problem(path: Path) -> str:
    """Why a socket cannot be bound at ``path``, as an operator can act on it."""
    directory = path.parent
    if not directory.is_dir():
        return f"{directory} is not a directory"
    if not os.access(directory, os.W_OK | os.X_OK):
        read_only = os.statvfs(directory).f_flag & os.ST_RDONLY
        return (
            f"{directory} is {'on a read-only filesystem' if read_only else 'not writable by this process'}"
        )
    return "gRPC could not bind it"
