"""The DRA driver's gRPC services for the kubelet: DRAPlugin and DRAResourceHealth.

A thin layer over :class:`~plugvisor.dra.preparer.ClaimPreparer`: each claim
of a request is prepared on its own and gets its own answer, so one bad claim
never fails the others, and nothing a claim does can fail the call: the
kubelet's per-claim error is the only channel, and the one it retries on.

Versions: the v1beta1 DRAPlugin messages are v1's, field for field, minus
``Device.share_id`` (which this driver never sets); the v1alpha1 health
messages are v1's. So one implementation answers every version, registered
under each version's service name with the v1 message classes: the bytes on
the wire are the same.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, Final

import grpc
import structlog

from plugvisor.api.dra.v1 import api_pb2 as dra_pb2
from plugvisor.api.drahealth.v1 import api_pb2 as health_pb2
from plugvisor.common import constants
from plugvisor.common.validation import shorten
from plugvisor.deviceplugin.cell import CellClosedError, SnapshotCell
from plugvisor.deviceplugin.wire import checked_stream, checked_unary, tolerant_deserializer
from plugvisor.dra.checkpoint import PreparedClaim
from plugvisor.dra.cluster import ClaimRef
from plugvisor.dra.pool import Pool
from plugvisor.dra.preparer import ClaimPreparer, PrepareError

Context = grpc.aio.ServicerContext[Any, Any]

DRA_SERVICES: Final = {
    constants.DRA_SERVICE_V1: "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin",
    constants.DRA_SERVICE_V1BETA1: "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin",
}
"""The version the registration names -> the gRPC service the kubelet then dials."""
HEALTH_SERVICES: Final = {
    constants.DRA_HEALTH_SERVICE_V1: "v1.DRAResourceHealth",
    constants.DRA_HEALTH_SERVICE_V1ALPHA1: "v1alpha1.DRAResourceHealth",
}
HEALTH_MESSAGE_MAX: Final = 1024
"""The kubelet keeps this many characters of a health message."""


def claim_ref(claim: dra_pb2.Claim) -> ClaimRef:
    """The kubelet's claim message as a value."""
    return ClaimRef(claim.namespace, claim.name, claim.uid)


def prepared_message(prepared: PreparedClaim) -> dra_pb2.NodePrepareResourceResponse:
    """A prepared claim as its answer: each device with its requests and CDI device IDs."""
    return dra_pb2.NodePrepareResourceResponse(
        devices=[
            dra_pb2.Device(
                request_names=list(device.request_names),
                pool_name=device.pool,
                device_name=device.device,
                cdi_device_ids=list(device.cdi_device_ids),
            )
            for device in prepared.devices
        ]
    )


class DraServer:
    """Serves DRAPlugin (v1, v1beta1) and DRAResourceHealth (v1, v1alpha1) for one driver."""

    def __init__(
        self,
        preparer: ClaimPreparer,
        pools: SnapshotCell[Pool],
        *,
        causes: Callable[[], Mapping[str, str]] | None = None,
        health_interval: float = constants.DRA_HEALTH_TIMEOUT_SECONDS / 3,
    ) -> None:
        self.preparer = preparer
        self._pools = pools
        self._causes = causes
        self._health_interval = health_interval
        self.open_health_streams = 0
        self._log = structlog.get_logger("plugvisor.dra").bind(driver=preparer.driver)

    def handlers(self) -> tuple[grpc.GenericRpcHandler, ...]:
        """Every version's service, to add to the driver's gRPC server."""
        unary: dict[str, tuple[Callable[[Any, Context], Awaitable[Any]], Any, Any]] = {
            "NodePrepareResources": (
                self.NodePrepareResources,
                dra_pb2.NodePrepareResourcesRequest,
                dra_pb2.NodePrepareResourcesResponse,
            ),
            "NodeUnprepareResources": (
                self.NodeUnprepareResources,
                dra_pb2.NodeUnprepareResourcesRequest,
                dra_pb2.NodeUnprepareResourcesResponse,
            ),
        }
        dra = {
            method: grpc.unary_unary_rpc_method_handler(
                checked_unary(method, behaviour),
                request_deserializer=tolerant_deserializer(request),
                response_serializer=response.SerializeToString,
            )
            for method, (behaviour, request, response) in unary.items()
        }
        health = {
            "NodeWatchResources": grpc.unary_stream_rpc_method_handler(
                checked_stream("NodeWatchResources", self.NodeWatchResources),
                request_deserializer=tolerant_deserializer(health_pb2.NodeWatchResourcesRequest),
                response_serializer=health_pb2.NodeWatchResourcesResponse.SerializeToString,
            )
        }
        return (
            *(grpc.method_handlers_generic_handler(service, dra) for service in DRA_SERVICES.values()),
            *(grpc.method_handlers_generic_handler(service, health) for service in HEALTH_SERVICES.values()),
        )

    # -- DRAPlugin ---------------------------------------------------------------------

    async def NodePrepareResources(
        self, request: dra_pb2.NodePrepareResourcesRequest, context: Context
    ) -> dra_pb2.NodePrepareResourcesResponse:
        """Prepare every claim of the request, each answered on its own."""
        budget = _budget(context)
        claims = _distinct(request.claims)
        outcomes = await asyncio.gather(*(self._prepare(claim, budget) for claim in claims))
        response = dra_pb2.NodePrepareResourcesResponse()
        for claim, outcome in zip(claims, outcomes, strict=True):
            response.claims[claim.uid].CopyFrom(outcome)
        return response

    async def _prepare(self, claim: dra_pb2.Claim, budget: float) -> dra_pb2.NodePrepareResourceResponse:
        ref = claim_ref(claim)
        try:
            prepared = await self.preparer.prepare(ref, budget=budget)
        except PrepareError as exc:
            self._log.warning("claim_not_prepared", claim=str(ref), error=str(exc))
            return dra_pb2.NodePrepareResourceResponse(error=str(exc))
        except Exception as exc:  # a bug here must be this claim's error, never the driver's end
            self._log.exception("prepare_failed", claim=str(ref))
            return dra_pb2.NodePrepareResourceResponse(
                error=f"claim {ref}: internal error: {type(exc).__name__}: {shorten(str(exc), 300)}"
            )
        return prepared_message(prepared)

    async def NodeUnprepareResources(
        self, request: dra_pb2.NodeUnprepareResourcesRequest, context: Context
    ) -> dra_pb2.NodeUnprepareResourcesResponse:
        """Unprepare every claim of the request, each answered on its own."""
        budget = _budget(context)
        claims = _distinct(request.claims)
        outcomes = await asyncio.gather(*(self._unprepare(claim, budget) for claim in claims))
        response = dra_pb2.NodeUnprepareResourcesResponse()
        for claim, error in zip(claims, outcomes, strict=True):
            response.claims[claim.uid].error = error
        return response

    async def _unprepare(self, claim: dra_pb2.Claim, budget: float) -> str:
        ref = claim_ref(claim)
        try:
            await self.preparer.unprepare(ref, budget=budget)
        except PrepareError as exc:
            self._log.warning("claim_not_unprepared", claim=str(ref), error=str(exc))
            return str(exc)
        except Exception as exc:  # as for prepare: this claim's error
            self._log.exception("unprepare_failed", claim=str(ref))
            return f"claim {ref}: internal error: {type(exc).__name__}: {shorten(str(exc), 300)}"
        return ""

    # -- DRAResourceHealth -------------------------------------------------------------

    async def NodeWatchResources(
        self, request: health_pb2.NodeWatchResourcesRequest, context: Context
    ) -> AsyncIterator[health_pb2.NodeWatchResourcesResponse]:
        """The pool's devices and their health: now, after every change, and every interval in between.

        The kubelet takes a device's health as Unknown when no report came for
        its timeout, so the full list is sent again well within it.
        """
        del request, context
        cell = self._pools
        version = cell.version
        self.open_health_streams += 1
        try:
            yield self.health_message(cell.value)
            while True:
                try:
                    version, pool = await asyncio.wait_for(cell.wait_newer(version), self._health_interval)
                except TimeoutError:
                    pool = cell.value
                except CellClosedError:
                    return
                yield self.health_message(pool)
        finally:
            self.open_health_streams -= 1

    def health_message(self, pool: Pool) -> health_pb2.NodeWatchResourcesResponse:
        """Every published device of ``pool`` with its health, and the cause when monitoring knows it."""
        now = int(time.time())
        causes = self._causes() if self._causes is not None else {}
        message = health_pb2.NodeWatchResourcesResponse()
        for name, device_id in pool.ids.items():
            healthy = pool.is_healthy(name)
            cause = "" if healthy else causes.get(device_id) or "the device's checks failed"
            message.devices.add(
                device=health_pb2.DeviceIdentifier(pool_name=self.preparer.pool_name, device_name=name),
                health=health_pb2.HEALTHY if healthy else health_pb2.UNHEALTHY,
                last_updated_time=now,
                health_check_timeout_seconds=constants.DRA_HEALTH_TIMEOUT_SECONDS,
                message=cause[:HEALTH_MESSAGE_MAX],
            )
        return message


def _budget(context: Context) -> float:
    remaining: float | None = context.time_remaining()
    return float(constants.DRA_CALL_TIMEOUT_SECONDS) if remaining is None else max(0.0, remaining)


def _distinct(claims: Any) -> list[dra_pb2.Claim]:
    """The request's claims, each UID once (the answer is a map by UID)."""
    seen: dict[str, dra_pb2.Claim] = {}
    for claim in claims:
        seen.setdefault(claim.uid, claim)
    return list(seen.values())
