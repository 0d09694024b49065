"""The kubelet's client for one registered plugin: dial, hand over, stream.

This mirrors the kubelet's ``client.go``. ``connect`` dials the plugin's socket
*blocking*, with a deadline (10 s upstream), then lets the handler fetch the
plugin's options; ``run`` opens ListAndWatch once and feeds every message to the
handler until the stream ends; ``disconnect`` closes the channel and tells the
handler. Nothing here ever re-dials or re-opens the stream: upstream does not,
and plugins must survive that (kubernetes#92958).

A disconnect can reach a client that is still connecting: up to 1.36 another
instance's end disconnects whatever client the resource name has, and a new one
is in the table from before its dial. Upstream's connection is the client's
only once dialled, so a disconnect during the dial has nothing to close and the
connect goes on (the client no longer in the table); one after the dial closes
the connection, and the calls on it fail as grpc-go's do on a closed connection
(``Canceled``, ``grpc: the client connection is closing``).
"""

from __future__ import annotations

import asyncio
from typing import Final, Protocol

import grpc

from plugvisor.api.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from plugvisor.emulators.kubelet import errors, journal, model

#: grpc-go reports a stream that ended with the server returning nil as io.EOF.
STREAM_EOF: Final = "EOF"
_CLOSING_DETAILS: Final = "grpc: the client connection is closing"
_CLOSING: Final = errors.go_status_error(grpc.StatusCode.CANCELLED, _CLOSING_DETAILS)


def _closing_error() -> grpc.aio.AioRpcError:
    """The error of a call on a connection the kubelet closed (grpc-go's ``ErrClientConnClosing``)."""
    return grpc.aio.AioRpcError(
        grpc.StatusCode.CANCELLED, grpc.aio.Metadata(), grpc.aio.Metadata(), details=_CLOSING_DETAILS
    )


class ConnectError(Exception):
    """Connecting failed; ``str()`` is the error text Register returns to the plugin."""


class ClientHandler(Protocol):
    """**Protocol:** what a plugin client reports to (the device manager's side)."""

    async def plugin_connected(self, resource: str, client: PluginClient) -> None:
        """Fetch options and install an endpoint; raise :class:`ConnectError` to refuse."""

    def plugin_list_and_watch_receiver(self, resource: str, response: api_pb2.ListAndWatchResponse) -> None:
        """Apply one full device list."""

    def plugin_disconnected(self, resource: str, socket_path: str) -> None:
        """The client of ``resource`` at ``socket_path`` was disconnected."""


class PluginClient:
    """One plugin connection, created per Register call, never reused."""

    def __init__(
        self,
        *,
        resource: str,
        socket_path: str,
        handler: ClientHandler,
        journal: journal.Journal,
        dial_timeout: float,
    ) -> None:
        self.resource = resource
        self.socket_path = socket_path
        self._handler = handler
        self._journal = journal
        self._dial_timeout = dial_timeout
        self._channel: grpc.aio.Channel | None = None
        self._closed = False
        self._stub: api_pb2_grpc.DevicePluginAsyncStub | None = None
        self.end_reason: str | None = None
        """Why ListAndWatch ended, in grpc-go's words (``EOF``, ``rpc error: ...``)."""
        self.options: model.PluginOptions | None = None
        """The plugin's GetDevicePluginOptions reply, once the handler fetched it."""

    @property
    def stub(self) -> api_pb2_grpc.DevicePluginAsyncStub:
        """The dialled stub; only valid after :meth:`connect` succeeded in dialling."""
        if self._stub is None:
            raise RuntimeError(f"client for {self.resource} at {self.socket_path} is not connected")
        return self._stub

    @property
    def closed(self) -> bool:
        """Whether the kubelet closed this client (disconnected it, or is going away)."""
        return self._closed

    @property
    def channel(self) -> grpc.aio.Channel | None:
        """The channel to the plugin, while connected (for calls the generated stub lacks)."""
        return self._channel

    async def connect(self) -> None:
        """Dial blocking with the deadline, then hand the client to the handler.

        The channel becomes the client's once dialled (upstream's ``c.grpc``): a
        :meth:`close` meanwhile finds none and changes nothing.
        """
        channel = grpc.aio.insecure_channel(
            "unix:" + self.socket_path,
            options=[
                ("grpc.default_authority", "localhost"),
                # Never share a connection with an older client of the same path:
                # each Register gets a fresh dial, as with grpc-go's DialContext.
                ("grpc.use_local_subchannel_pool", 1),
            ],
        )
        try:
            await asyncio.wait_for(channel.channel_ready(), self._dial_timeout)
        except TimeoutError:
            await channel.close()
            raise ConnectError(f"failed to dial device plugin: {errors.GO_DEADLINE_EXCEEDED}") from None
        except BaseException:
            await channel.close()
            raise
        self._channel = channel
        self._stub = api_pb2_grpc.DevicePluginStub(channel)
        await self._handler.plugin_connected(self.resource, self)

    async def get_device_plugin_options(self) -> api_pb2.DevicePluginOptions:
        """Call GetDevicePluginOptions with no deadline (as upstream).

        On a connection closed before or during the call, fails as grpc-go's
        call does (``Canceled``), not with grpc-python's usage error.
        """
        self._journal.call(self.resource, self.socket_path, model.PluginMethod.GET_DEVICE_PLUGIN_OPTIONS)
        if self._disconnected():
            raise _closing_error()
        try:
            return await self.stub.GetDevicePluginOptions(api_pb2.Empty())
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not self._disconnected() or (task is not None and task.cancelling()):
                raise
            raise _closing_error() from None

    async def run(self) -> None:
        """Consume ListAndWatch until it ends; record why in :attr:`end_reason`.

        Cancellation of this task (the kubelet going away) propagates; a stream
        cancelled because *another* task closed this channel counts as ended.
        """
        self._journal.call(self.resource, self.socket_path, model.PluginMethod.LIST_AND_WATCH)
        if self._disconnected():  # before the stream opened: upstream's call fails at once
            self.end_reason = _CLOSING
            return
        call = self.stub.ListAndWatch(api_pb2.Empty())
        try:
            async for response in call:
                if self._closed:
                    # A message read before the channel closed: a closed client reports nothing more.
                    call.cancel()
                    self.end_reason = _CLOSING
                    return
                self._handler.plugin_list_and_watch_receiver(self.resource, response)
        except grpc.aio.AioRpcError as error:
            self.end_reason = errors.go_rpc_error(error)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            self.end_reason = _CLOSING
        else:
            self.end_reason = STREAM_EOF

    def _disconnected(self) -> bool:
        """Whether :meth:`close` took the connection away (a method: an await may change it)."""
        return self._channel is None

    async def close(self) -> None:
        """Close the channel without telling anyone (the kubelet process is going away).

        A client still dialling has no channel yet, and is left as it is (upstream closes ``c.grpc`` only
        when it is set).
        """
        channel, self._channel = self._channel, None
        if channel is None:
            return
        self._closed = True
        await channel.close()

    async def disconnect(self) -> None:
        """Close the channel, then report the disconnection (``client.Disconnect``)."""
        await self.close()
        self._handler.plugin_disconnected(self.resource, self.socket_path)
