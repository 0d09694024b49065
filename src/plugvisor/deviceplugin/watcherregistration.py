"""Plugin-watcher registration: the plugin's socket sits in ``plugins_registry`` and the kubelet dials back.

The kubelet's plugin manager watches ``<root>/plugins_registry``; for each new
socket it calls ``pluginregistration.Registration/GetInfo`` (answered here with
type ``DevicePlugin``, the resource name, an empty endpoint meaning "this very
socket", and ``v1beta1``), validates, connects to the DevicePlugin service on the
same socket, and tells the plugin the outcome with ``NotifyRegistrationStatus``.

So in this mode the plugin never calls Register and has nothing to do when the
kubelet restarts: the restarted kubelet finds the socket again and dials back,
which arrives here as another successful status. A refusal arrives as a status
with the kubelet's error text; the kubelet retries on its own (with back-off), so
it is logged and the plugin keeps serving.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import grpc
import structlog

from plugvisor.api.pluginregistration.v1 import api_pb2 as reg_pb2
from plugvisor.common import constants


@dataclass(frozen=True, slots=True)
class Verdict:
    """One ``NotifyRegistrationStatus``: whether the kubelet registered the plugin, and why not."""

    registered: bool
    error: str
    seconds: float
    """From the kubelet's GetInfo to this status: how long the kubelet's registration took."""


class WatcherRegistrar:
    """Serves ``pluginregistration.Registration`` for one resource and collects the kubelet's verdicts."""

    def __init__(self, resource: str) -> None:
        self.resource = resource
        self._verdicts: asyncio.Queue[Verdict] = asyncio.Queue()
        self._info_at: float | None = None
        self._log = structlog.get_logger("plugvisor.registration").bind(
            resource=resource, mode="plugin-watcher"
        )

    def handler(self) -> grpc.GenericRpcHandler:
        """The service's handlers, to add to the plugin's own gRPC server."""
        return grpc.method_handlers_generic_handler(
            "pluginregistration.Registration",
            {
                "GetInfo": grpc.unary_unary_rpc_method_handler(
                    self._get_info,
                    request_deserializer=reg_pb2.InfoRequest.FromString,
                    response_serializer=reg_pb2.PluginInfo.SerializeToString,
                ),
                "NotifyRegistrationStatus": grpc.unary_unary_rpc_method_handler(
                    self._notify,
                    request_deserializer=reg_pb2.RegistrationStatus.FromString,
                    response_serializer=reg_pb2.RegistrationStatusResponse.SerializeToString,
                ),
            },
        )

    async def _get_info(self, request: reg_pb2.InfoRequest, context: object) -> reg_pb2.PluginInfo:
        del request, context
        self._info_at = time.monotonic()
        return reg_pb2.PluginInfo(
            type=constants.DEVICE_PLUGIN_TYPE,
            name=self.resource,
            endpoint="",  # the kubelet then dials this very socket
            supported_versions=list(constants.SUPPORTED_VERSIONS),
        )

    async def _notify(
        self, request: reg_pb2.RegistrationStatus, context: object
    ) -> reg_pb2.RegistrationStatusResponse:
        del context
        started = self._info_at if self._info_at is not None else time.monotonic()
        verdict = Verdict(request.plugin_registered, request.error, round(time.monotonic() - started, 6))
        if not verdict.registered:
            self._log.warning("registration_refused", error=verdict.error)
        self._verdicts.put_nowait(verdict)
        return reg_pb2.RegistrationStatusResponse()

    async def wait_registered(self) -> Verdict:
        """Return at the kubelet's next successful registration (refusals are logged and skipped)."""
        while True:
            verdict = await self._verdicts.get()
            if verdict.registered:
                return verdict
