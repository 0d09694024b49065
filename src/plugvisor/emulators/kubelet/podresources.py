"""The PodResources v1 API: the kubelet's local answer to "which devices does each pod hold?".

Monitoring agents and device plugins themselves (to map a pod to its devices)
query ``<root>/pod-resources/kubelet.sock``; this module serves it from the
emulated kubelet's pods and allocations with the rules of ``server_v1.go``
(docs/kubelet-contract.md, section 9):

* ``List`` first frees devices of pods that are no longer active
  (``UpdateAllocatedDevices``), then lists every *active* pod: restartable init
  containers (sidecars) first, then the app containers; plain init containers
  are not listed.
* ``GetAllocatableResources`` lists every healthy device the kubelet knows,
  allocated or not.
* ``Get`` is refused unless the ``KubeletPodResourcesGet`` gate is on, and names
  a missing pod with ``pod %s in namespace %s not found``.
* Devices are converted one ``ContainerDevices`` per (device, NUMA node), each
  with a single ID; a device without topology gives one entry without
  ``topology`` - so a two-NUMA device appears twice.
* Every call passes a token-bucket rate limiter first (100 QPS, burst 10
  upstream): an excess call fails with ``ResourceExhausted`` "rejected by rate limit".

Errors a Go handler returns as plain errors reach the client as ``Unknown``
with the text. Go builds these answers from maps (random order); the emulator
sorts by resource, device ID and NUMA node.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Final, Protocol

import grpc
from google.protobuf import message as message_

from plugvisor.api.podresources.v1 import api_pb2, api_pb2_grpc
from plugvisor.emulators.kubelet import manager, unixserver

DEFAULT_QPS: Final = 100.0
DEFAULT_BURST: Final = 10
SOCKET_NAME: Final = "kubelet.sock"
RATE_LIMIT_MESSAGE: Final = "rejected by rate limit"

_Context = grpc.aio.ServicerContext[message_.Message, message_.Message]


class RateLimiter:
    """A token bucket like ``golang.org/x/time/rate.Limiter.Allow``: full at start, refilled at ``qps``."""

    def __init__(self, *, qps: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.qps = qps
        self.burst = burst
        self._clock = clock
        self._tokens = float(burst)
        self._last = clock()

    def allow(self) -> bool:
        """Take one token if there is one; tell whether the call may proceed."""
        now = self._clock()
        self._tokens = min(float(self.burst), self._tokens + (now - self._last) * self.qps)
        self._last = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False


class PodView(Protocol):
    """**Protocol:** what PodResources needs of a pod."""

    @property
    def name(self) -> str:
        """The pod's name."""

    @property
    def namespace(self) -> str:
        """The pod's namespace."""

    @property
    def uid(self) -> str:
        """The pod's UID (allocations are keyed by it)."""

    def listed_containers(self) -> Sequence[str]:
        """Container names PodResources lists: sidecars, then app containers."""


class Provider(Protocol):
    """**Protocol:** the kubelet state PodResources answers from."""

    def active_pods(self) -> Sequence[PodView]:
        """Pods that are neither terminated nor deleted, in admission order."""

    def pod_by_name(self, namespace: str, name: str) -> PodView | None:
        """Any pod the kubelet knows by this name, active or not."""

    def update_allocated_devices(self) -> None:
        """Free devices held by pods that are no longer active (``UpdateAllocatedDevices``)."""

    @property
    def device_manager(self) -> manager.DeviceManager:
        """The device manager's books."""


def _topology(nodes: Iterable[int]) -> api_pb2.TopologyInfo:
    return api_pb2.TopologyInfo(nodes=[api_pb2.NUMANode(ID=node) for node in nodes])


def container_devices(
    allocations: Mapping[str, manager.ContainerAllocation],
) -> list[api_pb2.ContainerDevices]:
    """Convert a container's allocations (``getContainerDevices`` then the v1 conversion).

    The topology comes from how the allocation was stored (devices by NUMA node,
    ``-1`` for none), not from the plugin's current list: that is why a
    restarted kubelet can answer before the plugin is back.
    """
    result: list[api_pb2.ContainerDevices] = []
    for resource in sorted(allocations):
        per_device: dict[str, list[int] | None] = {}
        for node, ids in sorted(allocations[resource].devices_by_numa.items()):
            for device_id in ids:
                if node == manager.NODE_WITHOUT_TOPOLOGY:
                    per_device[device_id] = None
                else:
                    previous = per_device.get(device_id) or []
                    per_device[device_id] = [node, *previous]
        for device_id in sorted(per_device):
            nodes = per_device[device_id]
            if nodes is None:
                result.append(api_pb2.ContainerDevices(resource_name=resource, device_ids=[device_id]))
                continue
            result.extend(
                api_pb2.ContainerDevices(
                    resource_name=resource, device_ids=[device_id], topology=_topology([node])
                )
                for node in sorted(nodes)
            )
    return result


def allocatable_devices(devices: manager.DeviceManager) -> list[api_pb2.ContainerDevices]:
    """Convert every healthy device the kubelet knows (``GetAllocatableDevices``)."""
    result: list[api_pb2.ContainerDevices] = []
    for resource in sorted(devices.all_devices):
        healthy = devices.healthy.get(resource, set())
        records = devices.all_devices[resource]
        for device_id in sorted(records):
            if device_id not in healthy:
                continue
            record = records[device_id]
            if not record.topology_present:
                result.append(api_pb2.ContainerDevices(resource_name=resource, device_ids=[device_id]))
                continue
            # A topology without nodes yields no entry at all, as upstream.
            result.extend(
                api_pb2.ContainerDevices(
                    resource_name=resource, device_ids=[device_id], topology=_topology([node])
                )
                for node in record.numa_nodes
            )
    return result


def pod_resources(pod: PodView, devices: manager.DeviceManager) -> api_pb2.PodResources:
    """Describe one pod: its listed containers with their devices (no CPUs or memory: not emulated)."""
    return api_pb2.PodResources(
        name=pod.name,
        namespace=pod.namespace,
        containers=[
            api_pb2.ContainerResources(
                name=container,
                devices=container_devices(devices.pod_devices.container_resources(pod.uid, container)),
            )
            for container in pod.listed_containers()
        ],
    )


class PodResourcesServer(api_pb2_grpc.PodResourcesListerServicer):
    """Serves ``v1.PodResourcesLister`` on one unix socket, rate-limited like the kubelet."""

    def __init__(
        self,
        *,
        socket_path: Path,
        provider: Provider,
        get_enabled: bool,
        qps: float = DEFAULT_QPS,
        burst: int = DEFAULT_BURST,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.socket_path = socket_path
        self._provider = provider
        self._get_enabled = get_enabled
        self.limiter = RateLimiter(qps=qps, burst=burst, clock=clock)
        self._server: grpc.aio.Server | None = None
        self._created_dir = False
        self.rejected = 0
        """How many calls the rate limiter refused (the kubelet counts them in a metric)."""

    async def start(self) -> None:
        """Create the socket's directory if needed, replace a stale socket, listen."""
        directory = self.socket_path.parent
        if not directory.exists():
            directory.mkdir(mode=0o750, parents=True)
            self._created_dir = True
        self.socket_path.unlink(missing_ok=True)
        self._server = await unixserver.serve(
            self.socket_path,
            lambda server: api_pb2_grpc.add_PodResourcesListerServicer_to_server(self, server),
        )

    async def stop(self) -> None:
        """Stop serving, remove the socket, and the directory if this server created it and it is empty."""
        server, self._server = self._server, None
        await unixserver.stop(server, self.socket_path)
        if self._created_dir:
            try:
                self.socket_path.parent.rmdir()
            except OSError:
                pass
            else:
                self._created_dir = False

    async def _admit(self, context: _Context) -> None:
        if not self.limiter.allow():
            self.rejected += 1
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, RATE_LIMIT_MESSAGE)

    async def List(
        self, request: api_pb2.ListPodResourcesRequest, context: _Context
    ) -> api_pb2.ListPodResourcesResponse:
        """List active pods with their devices, after freeing devices of inactive pods."""
        await self._admit(context)
        provider = self._provider
        provider.update_allocated_devices()
        devices = provider.device_manager
        return api_pb2.ListPodResourcesResponse(
            pod_resources=[pod_resources(pod, devices) for pod in provider.active_pods()]
        )

    async def GetAllocatableResources(
        self, request: api_pb2.AllocatableResourcesRequest, context: _Context
    ) -> api_pb2.AllocatableResourcesResponse:
        """List every healthy device known, allocated or not."""
        await self._admit(context)
        return api_pb2.AllocatableResourcesResponse(
            devices=allocatable_devices(self._provider.device_manager)
        )

    async def Get(
        self, request: api_pb2.GetPodResourcesRequest, context: _Context
    ) -> api_pb2.GetPodResourcesResponse:
        """Describe one pod by namespace and name (only with the ``KubeletPodResourcesGet`` gate)."""
        await self._admit(context)
        if not self._get_enabled:
            await context.abort(grpc.StatusCode.UNKNOWN, "PodResources API Get method disabled")
        pod = self._provider.pod_by_name(request.pod_namespace, request.pod_name)
        if pod is None:
            await context.abort(
                grpc.StatusCode.UNKNOWN,
                f"pod {request.pod_name} in namespace {request.pod_namespace} not found",
            )
        assert pod is not None  # abort raises
        return api_pb2.GetPodResourcesResponse(
            pod_resources=pod_resources(pod, self._provider.device_manager)
        )
