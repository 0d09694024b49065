"""A raw, scriptable device plugin for testing kubelets (and the emulated one).

Like the kubelet's own ``Stub`` (shipped in a non-test file for other packages'
tests), this is deliberately *not* built on the plugvisor framework: it speaks
the wire protocol with a plain ``grpc.aio`` servicer, so a test of the emulated
kubelet cannot pass because framework and emulator share a mistake.

Everything is settable at any time: the device list (every open ListAndWatch
stream gets the full new list), the options *reply* (independent of what
``register`` sends), per-method error injection (the RPC fails with ``UNKNOWN``
and the given text, like the e2e test plugin), and the Allocate /
GetPreferredAllocation behaviour. Every request received is recorded.

Differences from upstream's Stub, on purpose: the default Allocate answers one
empty container response per container request (upstream's default answers an
empty response, which the kubelet rejects), and it does not re-register by
itself - tests decide when to call :meth:`StubDevicePlugin.register`. Like
upstream's, it also serves the plugin-watcher ``pluginregistration.Registration``
service on the same socket (``GetInfo`` from settable fields, every
``NotifyRegistrationStatus`` recorded), so the same stub can be placed in
``plugins_registry``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeAlias

import grpc
from google.protobuf import message as message_

from plugvisor.api.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from plugvisor.api.pluginregistration.v1 import api_pb2 as reg_pb2
from plugvisor.api.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from plugvisor.common import constants
from plugvisor.emulators.kubelet import model, unixserver

AllocateFunc: TypeAlias = Callable[[api_pb2.AllocateRequest], api_pb2.AllocateResponse]
PreferredFunc: TypeAlias = Callable[[api_pb2.PreferredAllocationRequest], api_pb2.PreferredAllocationResponse]
_Context: TypeAlias = grpc.aio.ServicerContext[message_.Message, message_.Message]


def device(device_id: str, health: str = constants.HEALTHY, *, numa: Iterable[int] = ()) -> api_pb2.Device:
    """Build a wire device: ``device("gpu-0", numa=[0])``."""
    nodes = [api_pb2.NUMANode(ID=node) for node in numa]
    topology = api_pb2.TopologyInfo(nodes=nodes) if nodes else None
    return api_pb2.Device(ID=device_id, health=health, topology=topology)


def devices(*ids: str, health: str = constants.HEALTHY) -> list[api_pb2.Device]:
    """Build several devices of one health: ``devices("a", "b")``."""
    return [device(device_id, health) for device_id in ids]


def _default_allocate(request: api_pb2.AllocateRequest) -> api_pb2.AllocateResponse:
    return api_pb2.AllocateResponse(
        container_responses=[api_pb2.ContainerAllocateResponse() for _ in request.container_requests]
    )


def _default_preferred(request: api_pb2.PreferredAllocationRequest) -> api_pb2.PreferredAllocationResponse:
    del request
    return api_pb2.PreferredAllocationResponse()


@dataclass(frozen=True, slots=True)
class ReceivedCall:
    """One RPC the stub received, with its request message."""

    method: model.PluginMethod
    request: message_.Message


class StubDevicePlugin(api_pb2_grpc.DevicePluginServicer):
    """A DevicePlugin server on one unix socket with settable behaviour."""

    def __init__(
        self,
        socket_path: Path,
        resource_name: str,
        *,
        devices: Sequence[api_pb2.Device] = (),
        pre_start_required: bool = False,
        get_preferred_allocation_available: bool = False,
    ) -> None:
        self.socket_path = socket_path
        self.resource_name = resource_name
        self.options = model.PluginOptions(
            pre_start_required=pre_start_required,
            get_preferred_allocation_available=get_preferred_allocation_available,
        )
        """What GetDevicePluginOptions answers (and what ``register`` sends by default)."""
        self.errors: dict[model.PluginMethod, str] = {}
        """Per-method error injection: the RPC fails with UNKNOWN and this text."""
        self.allocate_func: AllocateFunc = _default_allocate
        self.preferred_func: PreferredFunc = _default_preferred
        self.received: list[ReceivedCall] = []
        self._devices = list(devices)
        self._version = 0
        self._stream_end: tuple[int, str | None] = (0, None)
        self._changed = asyncio.Condition()
        self._open_streams = 0
        self._server: grpc.aio.Server | None = None
        self.info_type = constants.DEVICE_PLUGIN_TYPE
        """What GetInfo answers (plugin watcher): the type, ..."""
        self.info_name: str | None = None
        """... the name (``None``: the resource name), ..."""
        self.info_endpoint = ""
        """... the endpoint (empty: this very socket), ..."""
        self.info_versions: tuple[str, ...] = constants.SUPPORTED_VERSIONS
        """... and the supported versions."""
        self.registration_statuses: list[tuple[bool, str]] = []
        """Every NotifyRegistrationStatus received: ``(plugin_registered, error)``."""
        self.status_changed = asyncio.Event()
        """Set at every NotifyRegistrationStatus (clear it to wait for the next)."""

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Remove a stale socket of ours, then serve; the socket exists when this returns."""
        self.socket_path.unlink(missing_ok=True)

        def add(server: grpc.aio.Server) -> None:
            api_pb2_grpc.add_DevicePluginServicer_to_server(self, server)
            reg_grpc.add_RegistrationServicer_to_server(_WatcherRegistration(self), server)

        self._server = await unixserver.serve(self.socket_path, add)

    async def stop(self) -> None:
        """Stop serving: open streams are cut and the socket disappears."""
        server, self._server = self._server, None
        await unixserver.stop(server, self.socket_path)

    async def register(
        self,
        kubelet_socket: Path,
        *,
        version: str = constants.VERSION,
        resource_name: str | None = None,
        endpoint: str | None = None,
        options: model.PluginOptions | None = None,
        send_options: bool = True,
        timeout: float = constants.KUBELET_DIAL_TIMEOUT_SECONDS,
    ) -> None:
        """Register with a kubelet; raises :class:`grpc.aio.AioRpcError` when it refuses.

        Defaults send what a correct plugin sends: ``v1beta1``, the socket's
        base name, our resource name and our options. Each can be overridden
        to exercise the kubelet's checks.
        """
        options = options if options is not None else self.options
        request = api_pb2.RegisterRequest(
            version=version,
            endpoint=endpoint if endpoint is not None else self.socket_path.name,
            resource_name=resource_name if resource_name is not None else self.resource_name,
            options=api_pb2.DevicePluginOptions(
                pre_start_required=options.pre_start_required,
                get_preferred_allocation_available=options.get_preferred_allocation_available,
            )
            if send_options
            else None,
        )
        async with grpc.aio.insecure_channel("unix:" + os.fspath(kubelet_socket)) as channel:
            await asyncio.wait_for(channel.channel_ready(), timeout)
            await api_pb2_grpc.RegistrationStub(channel).Register(request)

    # -- scripting -------------------------------------------------------------------

    async def update(self, new_devices: Sequence[api_pb2.Device]) -> None:
        """Replace the device list; every open ListAndWatch stream sends the full list."""
        async with self._changed:
            self._devices = list(new_devices)
            self._version += 1
            self._changed.notify_all()

    async def end_streams(self, error: str | None = None) -> None:
        """End every open ListAndWatch stream: cleanly, or with UNKNOWN and ``error``."""
        async with self._changed:
            self._stream_end = (self._stream_end[0] + 1, error)
            self._changed.notify_all()

    @property
    def open_streams(self) -> int:
        """How many ListAndWatch streams are being served right now."""
        return self._open_streams

    def calls(self, method: model.PluginMethod) -> list[message_.Message]:
        """Return the requests received for ``method``, in order."""
        return [call.request for call in self.received if call.method is method]

    async def _receive(
        self, method: model.PluginMethod, request: message_.Message, context: _Context
    ) -> None:
        self.received.append(ReceivedCall(method=method, request=request))
        error = self.errors.get(method)
        if error is not None:
            await context.abort(grpc.StatusCode.UNKNOWN, error)

    # -- DevicePlugin ----------------------------------------------------------------

    async def GetDevicePluginOptions(
        self, request: api_pb2.Empty, context: _Context
    ) -> api_pb2.DevicePluginOptions:
        """Answer :attr:`options` (not necessarily what was sent at registration)."""
        await self._receive(model.PluginMethod.GET_DEVICE_PLUGIN_OPTIONS, request, context)
        return api_pb2.DevicePluginOptions(
            pre_start_required=self.options.pre_start_required,
            get_preferred_allocation_available=self.options.get_preferred_allocation_available,
        )

    async def ListAndWatch(
        self, request: api_pb2.Empty, context: _Context
    ) -> AsyncIterator[api_pb2.ListAndWatchResponse]:
        """Send the full list now and after every :meth:`update`, until ended."""
        await self._receive(model.PluginMethod.LIST_AND_WATCH, request, context)
        self._open_streams += 1
        try:
            ended_at = self._stream_end[0]
            sent: int | None = None

            def news() -> bool:
                return self._version != sent or self._stream_end[0] != ended_at

            while True:
                async with self._changed:
                    await self._changed.wait_for(news)
                    if self._stream_end[0] != ended_at:
                        error = self._stream_end[1]
                        if error is not None:
                            await context.abort(grpc.StatusCode.UNKNOWN, error)
                        return
                    current, sent = list(self._devices), self._version
                yield api_pb2.ListAndWatchResponse(devices=current)
        finally:
            self._open_streams -= 1

    async def GetPreferredAllocation(
        self, request: api_pb2.PreferredAllocationRequest, context: _Context
    ) -> api_pb2.PreferredAllocationResponse:
        """Delegate to :attr:`preferred_func` (default: no preference)."""
        await self._receive(model.PluginMethod.GET_PREFERRED_ALLOCATION, request, context)
        return self.preferred_func(request)

    async def Allocate(self, request: api_pb2.AllocateRequest, context: _Context) -> api_pb2.AllocateResponse:
        """Delegate to :attr:`allocate_func` (default: one empty response per container)."""
        await self._receive(model.PluginMethod.ALLOCATE, request, context)
        return self.allocate_func(request)

    async def PreStartContainer(
        self, request: api_pb2.PreStartContainerRequest, context: _Context
    ) -> api_pb2.PreStartContainerResponse:
        """Answer empty (after recording and error injection)."""
        await self._receive(model.PluginMethod.PRE_START_CONTAINER, request, context)
        return api_pb2.PreStartContainerResponse()

    async def __aenter__(self) -> StubDevicePlugin:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()


class _WatcherRegistration(reg_grpc.RegistrationServicer):
    """The plugin-watcher side of the stub: ``GetInfo`` and ``NotifyRegistrationStatus``."""

    def __init__(self, stub: StubDevicePlugin) -> None:
        self._stub = stub

    async def GetInfo(self, request: reg_pb2.InfoRequest, context: _Context) -> reg_pb2.PluginInfo:
        del request, context
        stub = self._stub
        return reg_pb2.PluginInfo(
            type=stub.info_type,
            name=stub.info_name if stub.info_name is not None else stub.resource_name,
            endpoint=stub.info_endpoint,
            supported_versions=list(stub.info_versions),
        )

    async def NotifyRegistrationStatus(
        self, request: reg_pb2.RegistrationStatus, context: _Context
    ) -> reg_pb2.RegistrationStatusResponse:
        del context
        self._stub.registration_statuses.append((request.plugin_registered, request.error))
        self._stub.status_changed.set()
        return reg_pb2.RegistrationStatusResponse()
