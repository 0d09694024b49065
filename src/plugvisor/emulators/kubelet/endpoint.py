"""One plugin endpoint as the device manager sees it: RPC wrappers and a stop time.

This mirrors the kubelet's ``endpointImpl``. Its only state besides the stub is
``stop_time``: once set, every RPC fails with ``endpoint %v has been stopped``
and the grace-period clock for dropping the resource runs from that moment.
A restarted kubelet recreates *stopped* endpoints for checkpointed resources
(no stub at all), which is why ``stub`` may be ``None``.

Only PreStartContainer has a deadline; GetPreferredAllocation and Allocate wait
as long as the plugin takes, exactly as upstream (a hung plugin hangs admission).
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc

from plugvisor.api.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from plugvisor.emulators.kubelet import errors, journal, model


class EndpointCallError(Exception):
    """An endpoint RPC failed; ``str()`` is the text Go's ``%v`` of the error would give."""


class Endpoint:
    """RPC access to one registered plugin, with the kubelet's stopped-endpoint rule."""

    def __init__(
        self,
        *,
        resource: str,
        socket_path: str | None,
        stub: api_pb2_grpc.DevicePluginAsyncStub | None,
        journal: journal.Journal,
        channel: grpc.aio.Channel | None = None,
    ) -> None:
        self.resource = resource
        self.socket_path = socket_path
        self._stub = stub
        self._channel = channel
        self._journal = journal
        self.stop_time: float | None = None

    @classmethod
    def stopped(cls, *, resource: str, journal: journal.Journal, now: float) -> Endpoint:
        """Build the placeholder a restarted kubelet keeps for a checkpointed resource."""
        endpoint = cls(resource=resource, socket_path=None, stub=None, journal=journal)
        endpoint.stop_time = now
        return endpoint

    def is_stopped(self) -> bool:
        """Tell whether the plugin behind this endpoint is gone (its stream ended)."""
        return self.stop_time is not None

    def set_stop_time(self, now: float) -> None:
        """Mark the endpoint stopped at ``now``; the grace period counts from here."""
        self.stop_time = now

    def stop_grace_period_expired(self, *, now: float, grace_period: float) -> bool:
        """Apply ``stopGracePeriodExpired``: stopped, and for longer than the grace period."""
        return self.stop_time is not None and now - self.stop_time > grace_period

    def go_repr(self) -> str:
        """Approximate Go's ``%v`` of the endpoint pointer (addresses cannot be reproduced)."""
        return f"&{{{self.resource} {self.socket_path or '<nil>'}}}"

    def _live_stub(self, method: model.PluginMethod) -> api_pb2_grpc.DevicePluginAsyncStub:
        if self.is_stopped() or self._stub is None:
            raise EndpointCallError(f"endpoint {self.go_repr()} has been stopped")
        self._journal.call(self.resource, self.socket_path or "", method)
        return self._stub

    async def get_preferred_allocation(
        self, *, available: Iterable[str], must_include: Iterable[str], size: int
    ) -> api_pb2.PreferredAllocationResponse:
        """Ask the plugin to choose, with exactly one container request."""
        stub = self._live_stub(model.PluginMethod.GET_PREFERRED_ALLOCATION)
        request = api_pb2.PreferredAllocationRequest(
            container_requests=[
                api_pb2.ContainerPreferredAllocationRequest(
                    available_deviceIDs=list(available),
                    must_include_deviceIDs=list(must_include),
                    allocation_size=size,
                )
            ]
        )
        try:
            return await stub.GetPreferredAllocation(request)
        except grpc.aio.AioRpcError as error:
            raise EndpointCallError(errors.go_rpc_error(error)) from error

    async def allocate(self, device_ids: Iterable[str]) -> api_pb2.AllocateResponse:
        """Send one Allocate with exactly one ContainerAllocateRequest."""
        stub = self._live_stub(model.PluginMethod.ALLOCATE)
        request = api_pb2.AllocateRequest(
            container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=list(device_ids))]
        )
        try:
            return await stub.Allocate(request)
        except grpc.aio.AioRpcError as error:
            raise EndpointCallError(errors.go_rpc_error(error)) from error

    async def pre_start_container(
        self, device_ids: Iterable[str], *, timeout: float
    ) -> api_pb2.PreStartContainerResponse:
        """Send PreStartContainer with the kubelet's deadline (30 s upstream)."""
        stub = self._live_stub(model.PluginMethod.PRE_START_CONTAINER)
        request = api_pb2.PreStartContainerRequest(devices_ids=list(device_ids))
        try:
            return await stub.PreStartContainer(request, timeout=timeout)
        except grpc.aio.AioRpcError as error:
            raise EndpointCallError(errors.go_rpc_error(error)) from error

    async def proposed_call(
        self, method: model.PluginMethod, device_ids: Iterable[str], *, timeout: float
    ) -> bool:
        """Call a *proposed* RPC (``PostStopContainer``/``Deallocate``, KEP-20210712 addendum).

        No upstream proto defines them; the emulator sends, on
        ``/v1beta1.DevicePlugin/<method>``, a message shaped like
        ``PreStartContainerRequest`` (``repeated string devices_ids = 1``) and
        expects an empty reply. A plugin that does not implement the method
        answers UNIMPLEMENTED, which counts as "not offered" and is not an error.
        Returns whether the plugin offered the call.
        """
        if self.is_stopped() or self._channel is None:
            raise EndpointCallError(f"endpoint {self.go_repr()} has been stopped")
        self._journal.call(self.resource, self.socket_path or "", method)
        call = self._channel.unary_unary(
            f"/v1beta1.DevicePlugin/{method}",
            request_serializer=api_pb2.PreStartContainerRequest.SerializeToString,
            response_deserializer=api_pb2.PreStartContainerResponse.FromString,
        )
        try:
            await call(api_pb2.PreStartContainerRequest(devices_ids=list(device_ids)), timeout=timeout)
        except grpc.aio.AioRpcError as error:
            if error.code() is grpc.StatusCode.UNIMPLEMENTED:
                return False
            raise EndpointCallError(errors.go_rpc_error(error)) from error
        return True
