"""What a plugin serves to the kubelet's plugin watcher: ``pluginregistration.Registration``, any type.

The kubelet's plugin manager finds a socket in ``plugins_registry``, calls
``GetInfo`` and is told the plugin's type (``DRAPlugin``, ``DevicePlugin``,
``CSIPlugin``), its name, its endpoint (empty: this very socket) and the
service versions it serves; it checks them, connects, and says how that went
with ``NotifyRegistrationStatus``. The plugin never calls the kubelet: a
restarted kubelet finds the socket again and dials back, which arrives here as
another successful status. A refusal carries the kubelet's reason, which is
logged; the kubelet tries again by itself.

One service for every plugin type: the DRA driver uses it
(:mod:`plugvisor.dra.runtime`), and it is the same conversation the device
plugin's :mod:`~plugvisor.deviceplugin.watcherregistration` holds for
``DevicePlugin``, which can become an instance of it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import grpc
import structlog

from plugvisor.api.pluginregistration.v1 import api_pb2 as reg_pb2
from plugvisor.common.validation import bounded

MAX_ERROR_LENGTH: Final = 400
"""The characters of a refusal's reason logged: it comes from the other side of a socket."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """One ``NotifyRegistrationStatus``: whether the kubelet registered the plugin, and why not."""

    registered: bool
    error: str
    seconds: float
    """From the kubelet's GetInfo to this status: how long the kubelet's registration took."""


class RegistrationService:
    """Serves ``pluginregistration.Registration`` for one plugin and collects the kubelet's verdicts."""

    def __init__(self, *, plugin_type: str, name: str, endpoint: str, versions: Sequence[str]) -> None:
        self.info = reg_pb2.PluginInfo(
            type=plugin_type, name=name, endpoint=endpoint, supported_versions=list(versions)
        )
        self.verdicts: asyncio.Queue[Verdict] = asyncio.Queue()
        self._info_at: float | None = None
        self._log = structlog.get_logger("plugvisor.registration").bind(name=name, type=plugin_type)

    def handler(self) -> grpc.GenericRpcHandler:
        """The service's handlers, for the registration socket's gRPC server."""
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
        return self.info

    async def _notify(
        self, request: reg_pb2.RegistrationStatus, context: object
    ) -> reg_pb2.RegistrationStatusResponse:
        del context
        started = self._info_at if self._info_at is not None else time.monotonic()
        verdict = Verdict(request.plugin_registered, request.error, round(time.monotonic() - started, 6))
        if not verdict.registered:
            self._log.warning("registration_refused", error=bounded(verdict.error, MAX_ERROR_LENGTH))
        self.verdicts.put_nowait(verdict)
        return reg_pb2.RegistrationStatusResponse()

    async def wait_registered(self) -> Verdict:
        """Return at the kubelet's next successful registration (refusals are logged and skipped)."""
        while True:
            verdict = await self.verdicts.get()
            if verdict.registered:
                return verdict
