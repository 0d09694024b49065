"""The DevicePlugin gRPC servicer for one resource.

A thin layer: it reads the latest :class:`~plugvisor.deviceplugin.snapshot.Snapshot`
from a :class:`~plugvisor.deviceplugin.cell.SnapshotCell`, checks each request
against it, hands the hooks that same snapshot (narrowed to the devices
concerned), delegates decisions to :mod:`plugvisor.deviceplugin.allocation`, and
converts between protobuf messages and domain values. Domain errors become gRPC status
codes here and nowhere else.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Final

import grpc
import structlog

from plugvisor.api.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from plugvisor.common import constants
from plugvisor.common.validation import shorten
from plugvisor.deviceplugin import allocation, metrics
from plugvisor.deviceplugin.cell import CellClosedError, SnapshotCell
from plugvisor.deviceplugin.devices import DeviceSet
from plugvisor.deviceplugin.errors import RequestError
from plugvisor.deviceplugin.hooks import ContainerAllocation, Hooks
from plugvisor.deviceplugin.release import Releases
from plugvisor.deviceplugin.snapshot import Snapshot
from plugvisor.deviceplugin.wire import checked_stream, checked_unary, tolerant_deserializer

Context = grpc.aio.ServicerContext[Any, Any]

_RESPONSE_CACHE_SIZE: Final = 1024
_ANSWER_BYTES: Final = 4 << 20
"""Most memory (estimated, see :meth:`AllocateAnswers.cost`) the Allocate answers of a plugin hold.

A kubelet's request is one container asking for a few IDs: under a kilobyte kept, so the entry count
bounds the table first. A request naming thousands of devices in a new order each time would otherwise
keep megabytes per entry (1.7 MB for 20 000 IDs), gigabytes in all.
"""
_ID_BYTES: Final = 64
"""What one handed-out ID costs in :attr:`AllocateAnswer.ids` (a str object and its tuple slot)."""
SERVICE: Final = "v1beta1.DevicePlugin"


def _malformed_counter(resource: str, method: str) -> Callable[[], None]:
    return metrics.RPC_ERRORS.labels(resource, method, "INVALID_ARGUMENT").inc


_UNARY: Final[dict[str, tuple[Any, Any]]] = {
    "GetDevicePluginOptions": (api_pb2.Empty, api_pb2.DevicePluginOptions),
    "GetPreferredAllocation": (api_pb2.PreferredAllocationRequest, api_pb2.PreferredAllocationResponse),
    "Allocate": (api_pb2.AllocateRequest, api_pb2.AllocateResponse),
    "PreStartContainer": (api_pb2.PreStartContainerRequest, api_pb2.PreStartContainerResponse),
}


StreamHandler = Callable[[Any, Context], AsyncIterator[Any]]


def add_plugin_servicer(
    servicer: api_pb2_grpc.DevicePluginServicer,
    server: grpc.aio.Server,
    *,
    resource: str,
    wrap_stream: Callable[[StreamHandler], StreamHandler] | None = None,
) -> None:
    """Register the five RPCs as the generated ``add_DevicePluginServicer_to_server`` does.

    The one difference: a request that is not valid protobuf is answered
    INVALID_ARGUMENT naming the method and the message type, not UNKNOWN.
    ``wrap_stream`` wraps the ListAndWatch handler of this server only (the
    servicer is shared by every socket of the plugin; an endpoint counts the
    streams on its own socket with it).
    """
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
        name: grpc.unary_unary_rpc_method_handler(
            checked_unary(name, getattr(servicer, name), on_malformed=_malformed_counter(resource, name)),
            request_deserializer=tolerant_deserializer(request),
            response_serializer=response.SerializeToString,
        )
        for name, (request, response) in _UNARY.items()
    }
    stream = checked_stream(
        "ListAndWatch",
        servicer.ListAndWatch,  # type: ignore[arg-type]
        on_malformed=_malformed_counter(resource, "ListAndWatch"),
    )
    handlers["ListAndWatch"] = grpc.unary_stream_rpc_method_handler(
        stream if wrap_stream is None else wrap_stream(stream),
        request_deserializer=tolerant_deserializer(api_pb2.Empty),
        response_serializer=api_pb2.ListAndWatchResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)


def device_list_message(devices: DeviceSet) -> api_pb2.ListAndWatchResponse:
    """Convert a device set to the full-list message every stream sends."""
    message = api_pb2.ListAndWatchResponse()
    add = message.devices.add
    for device in devices.values():
        pb = add(ID=device.id, health=device.health.value)
        if device.numa_nodes:
            pb.topology.nodes.extend(api_pb2.NUMANode(ID=n) for n in device.numa_nodes)
    return message


def allocation_message(alloc: ContainerAllocation) -> api_pb2.ContainerAllocateResponse:
    """Convert one container's allocation to its wire form."""
    return api_pb2.ContainerAllocateResponse(
        envs=dict(alloc.envs),
        annotations=dict(alloc.annotations),
        devices=[
            api_pb2.DeviceSpec(
                container_path=s.container_path, host_path=s.host_path, permissions=s.permissions
            )
            for s in alloc.specs
        ],
        mounts=[
            api_pb2.Mount(container_path=m.container_path, host_path=m.host_path, read_only=m.read_only)
            for m in alloc.mounts
        ],
        cdi_devices=[api_pb2.CDIDevice(name=name) for name in alloc.cdi_devices],
    )


class AllocateAnswer:
    """A checked Allocate request's reply, and the device IDs it hands out (for releases and metrics)."""

    __slots__ = ("ids", "response")

    def __init__(self, response: api_pb2.AllocateResponse, ids: tuple[str, ...]) -> None:
        self.response = response
        self.ids = ids


class AllocateAnswers:
    """Allocate replies of one device-set version, by request (its encoding: each container's IDs, in order).

    A lookup with another version than the table holds empties it first, so an
    answer can only ever be served for the version it was checked and built
    against; the table is bounded by entries and by bytes (oldest entry out
    first), since IDs come from the network, and an answer bigger than a
    sixteenth of the byte bound is not kept at all.
    """

    __slots__ = ("_answers", "_bytes", "_costs", "_limit", "_max_bytes", "_version")

    def __init__(self, limit: int = _RESPONSE_CACHE_SIZE, max_bytes: int = _ANSWER_BYTES) -> None:
        self._answers: dict[bytes, AllocateAnswer] = {}
        self._costs: dict[bytes, int] = {}
        self._bytes = 0
        self._version = -1
        self._limit = limit
        self._max_bytes = max_bytes

    def __len__(self) -> int:
        return len(self._answers)

    @property
    def held_bytes(self) -> int:
        """The estimated memory the kept answers hold."""
        return self._bytes

    @staticmethod
    def cost(key: bytes, answer: AllocateAnswer) -> int:
        """An answer's estimated memory: its key, its reply's encoding and its IDs."""
        return len(key) + answer.response.ByteSize() + _ID_BYTES * len(answer.ids)

    def _move_to(self, version: int) -> None:
        self._answers.clear()
        self._costs.clear()
        self._bytes = 0
        self._version = version

    def get(self, version: int, key: bytes) -> AllocateAnswer | None:
        """The answer kept for ``key`` at ``version``; None if there is none."""
        if version != self._version:
            self._move_to(version)
        return self._answers.get(key)

    def put(self, version: int, key: bytes, answer: AllocateAnswer) -> None:
        """Keep ``answer`` for ``key`` at ``version`` (dropping every answer of another version)."""
        if version != self._version:
            self._move_to(version)
        cost = self.cost(key, answer)
        if cost > self._max_bytes // 16:
            return
        answers, costs = self._answers, self._costs
        self._bytes += cost - costs.pop(key, 0)
        answers.pop(key, None)
        answers[key] = answer
        costs[key] = cost
        while len(answers) > self._limit or self._bytes > self._max_bytes:
            oldest = next(iter(answers))
            del answers[oldest]
            self._bytes -= costs.pop(oldest)


class PluginServer(api_pb2_grpc.DevicePluginServicer):
    """Serves the five DevicePlugin RPCs for one resource.

    Any number of ListAndWatch streams may be open at once (the kubelet opens one
    per registration; tools may open more); each gets the full list immediately,
    then every change as a full list. The list message is built once per version
    and shared by all streams, so 10,000 devices cost one conversion, not one per
    stream.
    """

    def __init__(
        self,
        resource: str,
        snapshots: SnapshotCell[Snapshot[Any]],
        hooks: Hooks,
        *,
        releases: Releases | None = None,
    ) -> None:
        self.resource = resource
        self._snapshots = snapshots
        self._hooks = hooks
        self._releases = releases
        self._options = api_pb2.DevicePluginOptions(
            pre_start_required=hooks.pre_start is not None,
            get_preferred_allocation_available=hooks.preferred is not None,
        )
        self._message_version = -1
        self._message = api_pb2.ListAndWatchResponse()
        self._log = structlog.get_logger("plugvisor.server").bind(resource=resource)
        self.open_streams = 0
        # Label lookups resolved once: the Allocate path pays one observe and one inc.
        self._errors = metrics.RPC_ERRORS
        self._allocated = metrics.incrementer(metrics.ALLOCATED_DEVICES.labels(resource))
        self._streams = metrics.STREAMS.labels(resource)
        self._allocate_seconds = metrics.observer(metrics.RPC_SECONDS.labels(resource, "Allocate"))
        self._preferred_seconds = metrics.observer(
            metrics.RPC_SECONDS.labels(resource, "GetPreferredAllocation")
        )
        self._pre_start_seconds = metrics.RPC_SECONDS.labels(resource, "PreStartContainer")
        self._answers = AllocateAnswers()

    @property
    def options(self) -> api_pb2.DevicePluginOptions:
        """The options derived from the resolved hooks (what GetDevicePluginOptions answers)."""
        return self._options

    def _list_message(self, version: int, devices: DeviceSet) -> api_pb2.ListAndWatchResponse:
        if version != self._message_version:
            self._message = device_list_message(devices)
            self._message_version = version
            self._check_size(self._message, len(devices))
        return self._message

    def _check_size(self, message: api_pb2.ListAndWatchResponse, devices: int) -> None:
        """Say so when the list is larger than the kubelet accepts.

        Only the kubelet's side sees the failure (RESOURCE_EXHAUSTED, its stream
        ends, capacity drops to 0); here the stream just closes and the plugin
        registers again, over and over, without this line nobody can tell why.
        """
        size = message.ByteSize()
        if size > constants.KUBELET_MAX_RECEIVE_BYTES:
            self._log.error(
                "device_list_too_large",
                devices=devices,
                bytes=size,
                limit=constants.KUBELET_MAX_RECEIVE_BYTES,
                effect="the kubelet refuses this list and drops every device of the resource",
                hint="serve fewer devices (a smaller count or narrower paths), or split them into resources",
            )

    async def GetDevicePluginOptions(
        self, request: api_pb2.Empty, context: Context
    ) -> api_pb2.DevicePluginOptions:
        """Answer with the capabilities this plugin really has."""
        return self._options

    async def ListAndWatch(
        self, request: api_pb2.Empty, context: Context
    ) -> AsyncIterator[api_pb2.ListAndWatchResponse]:
        """Stream the full device list now and after every change, until the server stops."""
        cell = self._snapshots
        version = cell.version
        sent = cell.value.devices
        self.open_streams += 1
        self._streams.inc()
        self._log.info("list_and_watch_opened", devices=len(sent), streams=self.open_streams)
        try:
            yield self._list_message(version, sent)
            while True:
                try:
                    version, snapshot = await cell.wait_newer(version)
                except CellClosedError:
                    return
                if snapshot.devices == sent:  # only the watch paths or the hooks' data changed
                    continue
                sent = snapshot.devices
                yield self._list_message(version, sent)
        finally:
            self.open_streams -= 1
            self._streams.dec()
            self._log.info("list_and_watch_closed", streams=self.open_streams)

    async def _abort(self, context: Context, method: str, code: grpc.StatusCode, message: str) -> None:
        self._errors.labels(self.resource, method, code.name).inc()
        await context.abort(code, message)

    async def Allocate(self, request: api_pb2.AllocateRequest, context: Context) -> api_pb2.AllocateResponse:
        """Hand out the requested devices, one response per container request, in order.

        The kubelet asks for the same few ID lists again and again, so without a
        post-allocate hook the whole answer (request checks passed, response built)
        is kept per device-set version: a repeated request costs a dictionary
        lookup, and a new version starts from an empty table, so a changed device
        set is always checked and answered afresh.
        """
        started = time.perf_counter()
        cell = self._snapshots
        # The request's own encoding is its cheapest key: equal requests encode to equal bytes,
        # while reading the IDs out of the message costs several times more.
        key = request.SerializeToString()
        answer = self._answers.get(cell.version, key)
        if answer is None:
            answer = await self._allocate(request, key, cell.version, cell.value, context)
        if self._releases is not None:
            self._releases.used(answer.ids)
        self._allocated(len(answer.ids))
        self._allocate_seconds(time.perf_counter() - started)
        self._log.debug("allocated", devices=answer.ids)
        return answer.response

    async def _allocate(
        self,
        request: api_pb2.AllocateRequest,
        key: bytes,
        version: int,
        snapshot: Snapshot[Any],
        context: Context,
    ) -> AllocateAnswer:
        """Check and answer a request that has no answer kept for this version (remembered if it can be)."""
        devices = snapshot.devices
        containers = [tuple(c.devices_ids) for c in request.container_requests]
        try:
            allocation.check_allocate(containers, devices, resource=self.resource)
        except RequestError as err:
            self._log.warning("allocate_rejected", code=err.code.name, reason=err.message)
            await self._abort(context, "Allocate", err.code, err.message)
        response = api_pb2.AllocateResponse()
        post = self._hooks.post_allocate
        for ids in containers:
            if post is None:
                alloc = allocation.build_allocation(devices.subset(ids))
            else:
                chosen = snapshot.only(ids)
                try:
                    alloc = post.post_allocate(allocation.build_allocation(chosen.devices), chosen)
                except Exception as exc:  # a hook bug must fail the call, not the server
                    self._log.exception("post_allocate_failed", devices=ids)
                    await self._abort(
                        context,
                        "Allocate",
                        grpc.StatusCode.INTERNAL,
                        f"post-allocate hook failed for {list(ids)}: {exc}",
                    )
            response.container_responses.append(allocation_message(alloc))
        answer = AllocateAnswer(response, tuple(i for ids in containers for i in ids))
        if post is None:  # a hook may answer differently each time: only the framework's own answer is kept
            self._answers.put(version, key, answer)
        return answer

    async def GetPreferredAllocation(
        self, request: api_pb2.PreferredAllocationRequest, context: Context
    ) -> api_pb2.PreferredAllocationResponse:
        """Choose devices per container request: the plugin's hook if it has one, else the default."""
        started = time.perf_counter()
        snapshot = self._snapshots.value
        devices = snapshot.devices
        response = api_pb2.PreferredAllocationResponse()
        if not request.container_requests:
            await self._abort(
                context,
                "GetPreferredAllocation",
                grpc.StatusCode.INVALID_ARGUMENT,
                f"GetPreferredAllocation for {self.resource}: the request has no container requests",
            )
        for index, creq in enumerate(request.container_requests):
            available = list(creq.available_deviceIDs)
            must = list(creq.must_include_deviceIDs)
            size = creq.allocation_size
            try:
                allocation.check_preferred(
                    available, must, size, devices, index=index, resource=self.resource
                )
            except RequestError as err:
                self._log.warning("preferred_allocation_rejected", code=err.code.name, reason=err.message)
                await self._abort(context, "GetPreferredAllocation", err.code, err.message)
            chosen = self._prefer(available, must, size, snapshot)
            response.container_responses.append(
                api_pb2.ContainerPreferredAllocationResponse(deviceIDs=chosen)
            )
        self._preferred_seconds(time.perf_counter() - started)
        return response

    def _prefer(self, available: list[str], must: list[str], size: int, snapshot: Snapshot[Any]) -> list[str]:
        hook = self._hooks.preferred
        if hook is not None:
            try:
                answer = list(hook.preferred_allocation(available, must, size, snapshot))
            except Exception:  # fall back: the preference is advisory, the kubelet must still get an answer
                self._log.exception("preferred_allocation_hook_failed")
            else:
                if allocation.is_valid_preferred(answer, available, must, size):
                    return answer
                self._log.error(
                    "preferred_allocation_hook_invalid_answer", answer=answer, size=size, must_include=must
                )
        return allocation.default_preferred(available, must, size)

    def proposed_handler(self) -> grpc.GenericRpcHandler | None:
        """Serve the proposed calls this plugin implements; None if none (they then answer UNIMPLEMENTED).

        ``PostStopContainer`` and ``Deallocate`` are the KEP-20210712 addendum's calls
        (never merged upstream). They travel as ``/v1beta1.DevicePlugin/<method>`` with a
        message shaped like PreStartContainerRequest (``repeated string devices_ids = 1``)
        and an empty reply, so they are served with those two messages rather than by
        changing the faithful v1beta1 proto.
        """
        hooks = {
            "PostStopContainer": self._hooks.post_stop,
            "Deallocate": self._hooks.deallocate or self._hooks.release,
        }
        handlers = {
            method: grpc.unary_unary_rpc_method_handler(
                checked_unary(
                    method, self._proposed(method), on_malformed=_malformed_counter(self.resource, method)
                ),
                request_deserializer=tolerant_deserializer(api_pb2.PreStartContainerRequest),
                response_serializer=api_pb2.PreStartContainerResponse.SerializeToString,
            )
            for method, hook in hooks.items()
            if hook is not None
        }
        if not handlers:
            return None
        return grpc.method_handlers_generic_handler(SERVICE, handlers)

    def _proposed(
        self, method: str
    ) -> Callable[[api_pb2.PreStartContainerRequest, Context], Awaitable[api_pb2.PreStartContainerResponse]]:
        async def handle(
            request: api_pb2.PreStartContainerRequest, context: Context
        ) -> api_pb2.PreStartContainerResponse:
            ids = list(request.devices_ids)
            known = self._snapshots.value.only(ids)
            gone = [i for i in ids if i not in known.devices]
            if gone:
                self._log.info("proposed_call_for_vanished_devices", method=method, devices=gone)
            try:
                if method == "PostStopContainer" and self._hooks.post_stop is not None:
                    await asyncio.to_thread(self._hooks.post_stop.post_stop_container, known)
                elif method == "Deallocate":
                    if self._hooks.deallocate is not None:
                        await asyncio.to_thread(self._hooks.deallocate.deallocate, known)
                    if self._releases is not None:
                        await self._releases.release(ids)
            except Exception as exc:  # the hook's failure is reported to the caller by name
                self._log.exception("proposed_call_failed", method=method, devices=ids)
                await self._abort(
                    context,
                    method,
                    grpc.StatusCode.INTERNAL,
                    f"{method} of {allocation.format_ids(ids)} failed: {shorten(str(exc), 300)}",
                )
            self._log.info("proposed_call", method=method, devices=ids)
            return api_pb2.PreStartContainerResponse()

        return handle

    async def PreStartContainer(
        self, request: api_pb2.PreStartContainerRequest, context: Context
    ) -> api_pb2.PreStartContainerResponse:
        """Run the plugin's pre-start hook within the kubelet's 30 s budget."""
        ids = list(request.devices_ids)
        snapshot = self._snapshots.value
        try:
            allocation.check_pre_start(ids, snapshot.devices, resource=self.resource)
        except RequestError as err:
            await self._abort(context, "PreStartContainer", err.code, err.message)
        if self._releases is not None:
            self._releases.used(ids)
        hook = self._hooks.pre_start
        if hook is None:
            return api_pb2.PreStartContainerResponse()
        remaining = context.time_remaining()
        budget = float(constants.PRE_START_CONTAINER_TIMEOUT_SECONDS)
        if remaining is not None:
            budget = min(budget, remaining)
        started = time.monotonic()
        try:
            await asyncio.wait_for(asyncio.to_thread(hook.pre_start_container, snapshot.only(ids)), budget)
        except TimeoutError:
            await self._abort(
                context,
                "PreStartContainer",
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"pre-start of {allocation.format_ids(ids)} did not finish within {budget:.1f} s",
            )
        except Exception as exc:  # the hook's failure is the container's failure, reported by name
            self._log.exception("pre_start_failed", devices=ids)
            await self._abort(
                context,
                "PreStartContainer",
                grpc.StatusCode.INTERNAL,
                f"pre-start of {allocation.format_ids(ids)} failed: {shorten(str(exc), 300)}",
            )
        elapsed = time.monotonic() - started
        self._pre_start_seconds.observe(elapsed)
        self._log.info("pre_started", devices=ids, seconds=round(elapsed, 4))
        return api_pb2.PreStartContainerResponse()
