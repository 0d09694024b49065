"""What the scheduler allocated to a ResourceClaim, as the driver needs it to prepare the claim.

The kubelet names a claim by namespace, name and UID; the driver reads the
claim from the API server and gets every allocation result (a claim may hold
devices of several drivers; the caller prepares those that name its own).
Three answers are refusals (:class:`ClaimError`, which becomes that claim's
error in NodePrepareResources; the kubelet retries it):

- the claim does not exist (deleted since the kubelet asked);
- its UID differs: the claim was deleted and another of the same name made
  (preparing that one for this pod would hand the pod someone else's devices);
- it is not allocated (yet, or any more).

An API server that is down or slow is retried for a few seconds and then
reported the same way, saying so, since the kubelet's own retry comes soon.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import httpx2
import structlog
from lightkube import ApiError, AsyncClient
from lightkube.resources.resource_v1 import ResourceClaim

from plugvisor.common.validation import shorten

READ_TIMEOUT: Final = 10.0
"""Seconds one claim is tried for while the API server fails (the kubelet waits up to 45 s per call)."""

_log = structlog.get_logger("plugvisor.dra.claims")


class ClaimError(Exception):
    """The claim cannot be prepared; the message names it and says why (one line)."""

    def __init__(self, message: str, *, retriable: bool = False) -> None:
        super().__init__(message)
        self.retriable = retriable
        """The API server failed, not the claim: the same call may succeed later."""


@dataclass(frozen=True, slots=True)
class AllocatedDevice:
    """One allocation result of the claim (``status.allocation.devices.results[i]``)."""

    request: str
    """The claim's request (``gpu``, or ``gpus/first`` for a subrequest) the device was allocated for."""
    driver: str
    pool: str
    device: str
    admin_access: bool = False
    """Allocated for administration (monitoring, reset) without reserving it: no exclusive use."""


class ClaimReader:
    """Reads claims' allocations."""

    def __init__(
        self, client: AsyncClient, *, timeout: float = READ_TIMEOUT, backoff_initial: float = 0.2
    ) -> None:
        self._client = client
        self._timeout = timeout
        self._backoff_initial = backoff_initial

    async def allocated_devices(self, *, namespace: str, name: str, uid: str) -> Sequence[AllocatedDevice]:
        """Every device of the claim's allocation, in the allocation's order (of all drivers).

        Raises :class:`ClaimError` when the claim is gone, replaced, not
        allocated, or the API server cannot be read.
        """
        where = f"resourceclaim {namespace}/{name}"
        claim = await self._read(namespace, name, where)
        metadata = claim.metadata
        if metadata is None or metadata.uid != uid:
            found = None if metadata is None else metadata.uid
            raise ClaimError(
                f"{where}: UID {found} is not the {uid} the kubelet asked for: the claim was replaced"
            )
        allocation = claim.status.allocation if claim.status is not None else None
        if allocation is None or allocation.devices is None:
            raise ClaimError(f"{where}: not allocated")
        return [
            AllocatedDevice(
                request=result.request,
                driver=result.driver,
                pool=result.pool,
                device=result.device,
                admin_access=bool(result.adminAccess),
            )
            for result in allocation.devices.results or ()
        ]

    async def _read(self, namespace: str, name: str, where: str) -> ResourceClaim:
        """GET the claim, retrying transient failures for ``timeout`` seconds."""
        delay = self._backoff_initial
        last = ""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout
        while True:
            try:
                return await self._client.get(ResourceClaim, name, namespace=namespace)
            except ApiError as exc:
                code = exc.status.code
                if code == 404:
                    raise ClaimError(f"{where}: not found (deleted?)") from None
                message = f"HTTP {code} {shorten(str(exc.status.message or exc.status.reason), 200)}"
                if code in (401, 403):
                    raise ClaimError(
                        f"{where}: {message} (the driver's ServiceAccount needs get on resourceclaims)",
                        retriable=True,
                    ) from None
                if code not in (429,) and (code is None or code < 500):
                    raise ClaimError(f"{where}: {message}") from None
                last = message
            except httpx2.HTTPError as exc:
                last = f"{type(exc).__name__}: {shorten(str(exc), 200)}"
            if loop.time() + delay > deadline:
                raise ClaimError(f"{where}: the API server did not answer: {last}", retriable=True)
            _log.warning(
                "claim_read_retry", claim=f"{namespace}/{name}", error=last, retry_in=round(delay, 2)
            )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
