"""A kubelet that restarts the instant each registration is answered: the worst timing a plugin meets.

A kubelet that crash-loops at start accepts a registration and, milliseconds
later, is gone: every socket in its directory deleted, a new ``kubelet.sock``
listening. A plugin that misses that second restart stays unregistered for
good, so this is the test that must not fail. :class:`CrashLoopingKubelet`
does exactly that, with no pause at all: it answers Register the way a kubelet
does (the plugin's options and its first device list are read back inside the
call, over the plugin's own socket) and begins the next restart from the RPC's
done callback, before the plugin has even read the answer.

It keeps no device manager and admits no pods; :class:`EmulatedKubelet` is the
faithful kubelet. This one is a timing harness, used by the integration tests
and by ``bench/bench_restarts.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from plugvisor.api.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from plugvisor.common import constants
from plugvisor.emulators.kubelet.registration import cleanup_plugin_directory


@dataclass(frozen=True, slots=True)
class Registered:
    """One accepted registration: who, on which socket, with which devices, when (monotonic)."""

    resource: str
    endpoint: str
    devices: tuple[str, ...]
    at: float


class CrashLoopingKubelet(api_pb2_grpc.RegistrationServicer):
    """Serves Registration on ``<dir>/kubelet.sock`` and restarts after each of the first ``restarts`` calls.

    ``registrations`` lists every accepted call; :meth:`wait_for` awaits a count.
    A restart is what a starting kubelet does: stop listening, delete every file
    in the directory but the checkpoint, listen on a new ``kubelet.sock``.
    """

    def __init__(self, directory: Path, *, restarts: int, dial_timeout: float = 10.0) -> None:
        self.directory = directory
        self.socket = directory / constants.KUBELET_SOCKET_NAME
        self.restarts_left = restarts
        self.restarts_done = 0
        self._dial_timeout = dial_timeout
        self.registrations: list[Registered] = []
        self.restarted_at: list[float] = []
        self._server: grpc.aio.Server | None = None
        self._changed = asyncio.Condition()
        self._restarting: asyncio.Task[None] | None = None
        self._channels: list[grpc.aio.Channel] = []
        """The plugins' connections this kubelet process holds (their ListAndWatch streams open)."""

    async def start(self) -> None:
        """Wipe the directory and listen, as a kubelet's start does."""
        self.directory.mkdir(parents=True, exist_ok=True)
        cleanup_plugin_directory(self.directory)
        server = grpc.aio.server()
        api_pb2_grpc.add_RegistrationServicer_to_server(self, server)
        if not server.add_insecure_port(f"unix:{self.socket}"):
            raise OSError(f"cannot listen on {self.socket}")
        await server.start()
        self._server = server

    async def stop(self) -> None:
        """Stop listening (kubelet.sock is left in place, as a stopping kubelet leaves it)."""
        if self._restarting is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._restarting
        server, self._server = self._server, None
        if server is not None:
            await server.stop(0)
        await self._close_channels()

    async def __aenter__(self) -> CrashLoopingKubelet:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def wait_for(self, count: int, timeout: float) -> list[Registered]:
        """Wait until ``count`` registrations were accepted; raises TimeoutError naming how far it got."""

        def reached() -> bool:
            return len(self.registrations) >= count

        try:
            async with self._changed:
                await asyncio.wait_for(self._changed.wait_for(reached), timeout)
        except TimeoutError:
            raise TimeoutError(
                f"{len(self.registrations)} of {count} registrations after {timeout} s "
                f"({self.restarts_done} restarts)"
            ) from None
        return self.registrations[:count]

    async def Register(
        self,
        request: api_pb2.RegisterRequest,
        context: grpc.aio.ServicerContext[api_pb2.RegisterRequest, api_pb2.Empty],
    ) -> api_pb2.Empty:
        """Accept, read the devices back over the plugin's socket, restart once the answer is out."""
        if request.version != constants.VERSION:
            await context.abort(grpc.StatusCode.UNKNOWN, f"unsupported version {request.version!r}")
        devices = await self._read_devices(self.directory / request.endpoint)
        self.registrations.append(
            Registered(request.resource_name, request.endpoint, devices, time.monotonic())
        )
        async with self._changed:
            self._changed.notify_all()
        if self.restarts_left > 0:
            self.restarts_left -= 1
            loop = asyncio.get_running_loop()

            def restart_now(_: object) -> None:
                loop.call_soon(self._begin_restart)

            # The stub types the callback as a callable class; grpc takes any callable.
            context.add_done_callback(restart_now)  # type: ignore[arg-type]
        return api_pb2.Empty()

    async def _read_devices(self, socket: Path) -> tuple[str, ...]:
        """The plugin's first device list, over a stream held open until this kubelet goes, as a kubelet's.

        Ended early (it used to be cancelled once read), the stream looked to the
        plugin like a running kubelet cutting it, which a plugin must answer by
        registering again, paced: not the restart this harness is about.
        """
        channel = grpc.aio.insecure_channel(f"unix:{socket}", options=[("grpc.use_local_subchannel_pool", 1)])
        self._channels.append(channel)
        stub = api_pb2_grpc.DevicePluginStub(channel)
        await stub.GetDevicePluginOptions(api_pb2.Empty(), timeout=self._dial_timeout)
        stream = stub.ListAndWatch(api_pb2.Empty())
        first = await asyncio.wait_for(stream.read(), self._dial_timeout)
        if not isinstance(first, api_pb2.ListAndWatchResponse):
            return ()
        return tuple(sorted(device.ID for device in first.devices))

    async def _close_channels(self) -> None:
        """End every stream held, all at once, as a dying kubelet process's connections end."""
        channels, self._channels = self._channels, []
        await asyncio.gather(*(channel.close() for channel in channels), return_exceptions=True)

    def _begin_restart(self) -> None:
        self._restarting = asyncio.get_running_loop().create_task(self._restart())

    async def _restart(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            await server.stop(0)
        await self._close_channels()
        self.restarted_at.append(time.monotonic())
        await self.start()
        self.restarts_done += 1
