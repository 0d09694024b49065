"""Who holds which device: one PodResources ``List`` poller per agent, shared through a file.

The kubelet's PodResources v1 API has no watch (``List``, ``Get`` and
``GetAllocatableResources`` only), so "watching" is polling ``List`` at a bounded
interval and publishing only what changed. The kubelet rate-limits the socket
(100 calls/s, burst 10, for every client on the node together); the default here
is one call every 5 s for the whole agent, 12 calls a minute.

**One poller per agent, no gRPC in the supervisor.** Every plugin process of an
agent runs an :class:`OwnerWatch`, but only the one holding an exclusive
``flock`` on ``<monitor dir>/pod-resources.lock`` calls the kubelet; the others
read what it writes to ``owners.json``. The kernel drops the lock when its
holder exits or is killed, and another child takes over at its next tick, so
the agent keeps exactly one poller while any child runs, with no process of its
own and no election protocol. A standalone ``plugvisor plugin`` has no monitor
directory and polls for itself.

**A missing, slow or rate-limited endpoint** never stops device monitoring:
each call has a deadline, a missing socket is not even dialled, a refusal by the
rate limiter doubles the interval (up to 8x) until a call succeeds, and the last
known owners stay published (marked ``up=false``) so a kubelet restart does not
look like every pod leaving. Each change of condition is logged once.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Final

import grpc
import structlog

from plugvisor.common import monitoring
from plugvisor.deviceplugin.cell import SnapshotCell
from plugvisor.deviceplugin.monitorconfig import DEFAULT_POD_RESOURCES_INTERVAL

if TYPE_CHECKING:
    from plugvisor.api.podresources.v1 import api_pb2

CALL_TIMEOUT: Final = 5.0
MAX_BACKOFF_FACTOR: Final = 8
MAX_ANSWER_BYTES: Final = 64 << 20
"""The largest ``List`` answer taken (gRPC's default is 4 MiB). A node of thousands of devices held by
hundreds of containers answers megabytes; 64 MiB is a node no kubelet serves, and still bounded."""


def holders_from(
    response: api_pb2.ListPodResourcesResponse,
) -> dict[tuple[str, str], tuple[monitoring.Holder, ...]]:
    """``(resource, device ID) -> holders`` from a ``List`` answer.

    Devices a DRA driver prepared for a claim (``dynamic_resources``, on by
    default since Kubernetes 1.34) are keyed by the driver's name and the
    device's name in its pool, as the driver's own device report names them.
    """
    found: dict[tuple[str, str], list[monitoring.Holder]] = {}
    for pod in response.pod_resources:
        for container in pod.containers:
            holder = monitoring.Holder(pod.namespace, pod.name, container.name)
            for devices in container.devices:
                for device_id in devices.device_ids:
                    found.setdefault((devices.resource_name, device_id), []).append(holder)
            for claim in container.dynamic_resources:
                for claimed in claim.claim_resources:
                    found.setdefault((claimed.driver_name, claimed.device_name), []).append(holder)
    return {key: tuple(value) for key, value in found.items()}


def _condition(error: grpc.RpcError) -> str:
    code = error.code() if isinstance(error, grpc.aio.AioRpcError | grpc.Call) else None
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        # gRPC says the same of an answer larger than the client takes as the kubelet says of its
        # rate limiter; only the text tells them apart (a too-large answer is no reason to back off).
        details = error.details() if isinstance(error, grpc.aio.AioRpcError | grpc.Call) else ""
        return "too-large" if "larger than max" in (details or "") else "rate-limited"
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return "slow"
    if code is grpc.StatusCode.UNAVAILABLE:
        return "unavailable"
    return str(code.name if code is not None else "error").lower()


class _Leadership:
    """The exclusive lock that makes one process of the agent the poller."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: IO[bytes] | None = None

    @property
    def held(self) -> bool:
        return self._file is not None

    def try_acquire(self) -> bool:
        if self._file is not None:
            return True
        try:
            handle = self.path.open("ab")
        except OSError:
            return False
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.close()
            return False
        self._file = handle
        return True

    def release(self) -> None:
        handle, self._file = self._file, None
        if handle is not None:
            handle.close()


class OwnerWatch:
    """Polls PodResources (when elected) and publishes :class:`~plugvisor.common.monitoring.Owners`."""

    def __init__(
        self,
        *,
        socket: Path,
        interval: float = DEFAULT_POD_RESOURCES_INTERVAL,
        monitor_dir: Path | None = None,
        timeout: float = CALL_TIMEOUT,
        max_answer_bytes: int = MAX_ANSWER_BYTES,
    ) -> None:
        if interval <= 0:
            raise ValueError(f"PodResources poll interval must be positive, got {interval}")
        self.socket = socket
        self.interval = interval
        self.monitor_dir = monitor_dir
        self.timeout = timeout
        self.max_answer_bytes = max_answer_bytes
        self.owners: SnapshotCell[monitoring.Owners] = SnapshotCell(monitoring.Owners(pid=os.getpid()))
        self._leadership = None if monitor_dir is None else _Leadership(monitor_dir / monitoring.LEADER_LOCK)
        self._condition: str | None = None
        self._write_failed = False
        self._log = structlog.get_logger("plugvisor.owners").bind(socket=str(socket))

    @property
    def leader(self) -> bool:
        """Whether this process calls the kubelet (always, without a monitor directory)."""
        return self._leadership is None or self._leadership.held

    async def run(self) -> None:
        """Poll until cancelled."""
        factor = 1
        try:
            while True:
                if self._leadership is not None and not self._leadership.try_acquire():
                    self._follow()
                    await asyncio.sleep(self.interval)
                    continue
                factor = await self.poll_once(factor)
                await asyncio.sleep(self.interval * factor)
        finally:
            if self._leadership is not None:
                self._leadership.release()

    def _follow(self) -> None:
        """Not the poller: publish what the poller wrote (a cheap file read)."""
        assert self.monitor_dir is not None
        owners = monitoring.read_owners(self.monitor_dir)
        if owners is not None:
            self.owners.publish(owners)

    async def poll_once(self, factor: int = 1) -> int:
        """One ``List`` call; returns the backoff factor for the next wait (1 after a success)."""
        current = self.owners.value
        if not self.socket.exists():
            owners = self._failed(current, "missing", f"{self.socket} does not exist")
            self._publish(owners)
            return 1
        try:
            response = await self._list()
        except grpc.RpcError as error:
            condition = _condition(error)
            details = error.details() if isinstance(error, grpc.aio.AioRpcError) else str(error)
            if condition == "too-large":
                limit = f"{self.max_answer_bytes >> 20} MiB"
                details = f"the kubelet's answer is larger than this client takes ({limit}): {details}"
            self._publish(self._failed(current, condition, str(details)))
            if condition == "rate-limited":
                return min(factor * 2, MAX_BACKOFF_FACTOR)
            return 1
        if self._condition is not None:
            self._log.info("pod_resources_available", after=self._condition)
            self._condition = None
        self._publish(
            monitoring.Owners(
                holders=holders_from(response),
                up=True,
                last_success=time.time(),
                error=None,
                calls_ok=current.calls_ok + 1,
                calls_failed=current.calls_failed,
                pid=os.getpid(),
            )
        )
        return 1

    async def _list(self) -> api_pb2.ListPodResourcesResponse:
        # Imported at the first poll: a plugin without monitoring never loads these descriptors.
        from plugvisor.api.podresources.v1 import api_pb2, api_pb2_grpc  # noqa: PLC0415

        # A fresh channel per call with a private subchannel pool: a socket that was missing a
        # moment ago must not keep failing for gRPC's reconnect backoff (up to two minutes).
        options = [
            ("grpc.use_local_subchannel_pool", 1),
            ("grpc.max_receive_message_length", self.max_answer_bytes),
        ]
        async with grpc.aio.insecure_channel(f"unix:{self.socket}", options=options) as channel:
            stub = api_pb2_grpc.PodResourcesListerStub(channel)
            response: api_pb2.ListPodResourcesResponse = await stub.List(
                api_pb2.ListPodResourcesRequest(), timeout=self.timeout
            )
            return response

    def _failed(self, current: monitoring.Owners, condition: str, detail: str) -> monitoring.Owners:
        if condition != self._condition:
            self._log.warning(
                "pod_resources_unavailable",
                condition=condition,
                error=detail,
                effect="device metrics go on; owners keep their last known value",
            )
            self._condition = condition
        return monitoring.Owners(
            holders=current.holders,
            up=False,
            last_success=current.last_success,
            error=f"{condition}: {detail}",
            calls_ok=current.calls_ok,
            calls_failed=current.calls_failed + (0 if condition == "missing" else 1),
            pid=os.getpid(),
        )

    def _publish(self, owners: monitoring.Owners) -> None:
        self.owners.publish(owners)
        if self.monitor_dir is None:
            return
        try:
            monitoring.write_owners(self.monitor_dir, owners)
        except OSError as exc:
            if not self._write_failed:
                self._log.warning("owners_file_unwritable", dir=str(self.monitor_dir), error=str(exc))
                self._write_failed = True
            return
        self._write_failed = False


def holders_of(owners: monitoring.Owners, resource: str) -> Mapping[str, tuple[monitoring.Holder, ...]]:
    """The holders of one resource's devices, by device ID."""
    return {device: holders for (name, device), holders in owners.holders.items() if name == resource}
