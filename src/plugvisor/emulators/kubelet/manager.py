"""Per-resource device state, capacity and the grace period: the device manager's books.

This is plain, synchronous state with the kubelet's exact rules, so it is
unit-tested without sockets and the time is always passed in:

* A ListAndWatch message *replaces* a resource's healthy and unhealthy sets;
  only ``health == "Healthy"`` counts as healthy. IDs are keys, so duplicates
  collapse - but an ID sent once healthy and once not lands in *both* sets,
  counted twice in capacity and once in allocatable (docs/kubelet-contract.md, section 3).
* ``capacity = |healthy| + |unhealthy|``, ``allocatable = |healthy|``.
* A disconnect moves every healthy ID to unhealthy and stops the endpoint;
  after the grace period (5 min upstream) the resource is dropped at the next
  capacity poll and reported as removed.
* Pod allocations (``PodDevices``) and the in-use set (``allocated_devices``) are
  kept the kubelet's way, including its quirk: devices taken during a failed
  admission stay "in use" until pod allocations are recomputed.
* A restart keeps what the kubelet checkpoints - the registered resource names and
  pod allocations - and nothing else: :meth:`DeviceManager.checkpoint` builds the
  file's data the kubelet's way (``writeCheckpoint``) and
  :meth:`DeviceManager.restored` reads it back the kubelet's way (``readCheckpoint``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

from google.protobuf import message as message_

from plugvisor.api.deviceplugin.v1beta1 import api_pb2
from plugvisor.common import constants
from plugvisor.emulators.kubelet import checkpoint as checkpoint_
from plugvisor.emulators.kubelet import endpoint as endpoint_
from plugvisor.emulators.kubelet import journal, model

NODE_WITHOUT_TOPOLOGY: Final = -1
"""The pseudo NUMA node of a device that reports no topology."""


@dataclass(frozen=True, slots=True)
class DeviceRecord:
    """One device entry of a ListAndWatch message, as the kubelet keeps it in ``allDevices``."""

    id: str
    health: str
    numa_nodes: tuple[int, ...]
    has_topology: bool = False
    """Whether the message carried a ``topology`` field at all (even one without nodes).

    PodResources tells the two apart: no topology gives one entry without
    topology, an empty topology gives no entry at all (upstream's conversion).
    """

    @classmethod
    def from_proto(cls, device: api_pb2.Device) -> DeviceRecord:
        """Copy one wire device (NUMA IDs are not validated, as upstream)."""
        return cls(
            id=device.ID,
            health=device.health,
            numa_nodes=tuple(node.ID for node in device.topology.nodes),
            has_topology=device.HasField("topology"),
        )

    @property
    def topology_present(self) -> bool:
        """Tell whether the device reported a topology (possibly with no nodes)."""
        return self.has_topology or bool(self.numa_nodes)


@dataclass(slots=True)
class EndpointInfo:
    """The current endpoint of a resource and the options its plugin answered with."""

    endpoint: endpoint_.Endpoint
    options: model.PluginOptions | None


@dataclass(frozen=True, slots=True)
class ContainerAllocation:
    """What the kubelet stores per (pod, container, resource): devices by NUMA node, response."""

    devices_by_numa: Mapping[int, tuple[str, ...]]
    response: api_pb2.ContainerAllocateResponse | None

    def device_ids(self) -> set[str]:
        """Return every device ID, once each."""
        return {device for ids in self.devices_by_numa.values() for device in ids}


@dataclass(slots=True)
class PodDevices:
    """Allocations keyed by pod UID, then container name, then resource (``podDevices``)."""

    entries: dict[str, dict[str, dict[str, ContainerAllocation]]] = field(default_factory=dict)

    def insert(self, pod_uid: str, container: str, resource: str, allocation: ContainerAllocation) -> None:
        """Store (or replace) one container's allocation of one resource."""
        self.entries.setdefault(pod_uid, {}).setdefault(container, {})[resource] = allocation

    def get(self, pod_uid: str, container: str, resource: str) -> ContainerAllocation | None:
        """Return the stored allocation, if any."""
        return self.entries.get(pod_uid, {}).get(container, {}).get(resource)

    def container_devices(self, pod_uid: str, container: str, resource: str) -> set[str] | None:
        """Return the container's device IDs for the resource, ``None`` when it holds none."""
        allocation = self.get(pod_uid, container, resource)
        return None if allocation is None else allocation.device_ids()

    def has_resource(self, resource: str) -> bool:
        """Tell whether any pod holds devices of ``resource``."""
        return any(resource in per_container for _, per_container in self._containers())

    def devices(self) -> dict[str, set[str]]:
        """Return every allocated device per resource (``podDevices.devices()``)."""
        result: dict[str, set[str]] = {}
        for _, per_container in self._containers():
            for resource, allocation in per_container.items():
                result.setdefault(resource, set()).update(allocation.device_ids())
        return result

    def pods(self) -> set[str]:
        """Return the UIDs of every pod holding an allocation."""
        return {uid for uid, per_pod in self.entries.items() if per_pod}

    def container_resources(self, pod_uid: str, container: str) -> Mapping[str, ContainerAllocation]:
        """Return the container's allocations by resource (empty when none)."""
        return MappingProxyType(dict(self.entries.get(pod_uid, {}).get(container, {})))

    def remove_pods(self, pod_uids: Iterable[str]) -> None:
        """Forget every allocation of the given pods."""
        for pod_uid in pod_uids:
            self.entries.pop(pod_uid, None)

    def add_container_allocated_resources(
        self, pod_uid: str, container: str, pool: dict[str, set[str]]
    ) -> None:
        """Add the container's devices to a reuse pool (after a regular init container)."""
        for resource, allocation in self.entries.get(pod_uid, {}).get(container, {}).items():
            pool.setdefault(resource, set()).update(allocation.device_ids())

    def remove_container_allocated_resources(
        self, pod_uid: str, container: str, pool: dict[str, set[str]]
    ) -> None:
        """Take the container's devices out of a reuse pool (app and sidecar containers)."""
        for resource, allocation in self.entries.get(pod_uid, {}).get(container, {}).items():
            if resource in pool:
                pool[resource] -= allocation.device_ids()

    def _containers(self) -> Iterator[tuple[str, dict[str, ContainerAllocation]]]:
        for per_pod in self.entries.values():
            yield from per_pod.items()


@dataclass(frozen=True, slots=True)
class Capacity:
    """One capacity poll: per-resource counts, and the resources dropped by this poll."""

    capacity: Mapping[str, int]
    allocatable: Mapping[str, int]
    deleted: frozenset[str]


class DeviceManager:
    """The device manager's state for every resource, with its update rules."""

    def __init__(self, *, grace_period: float) -> None:
        self.grace_period = grace_period
        self.healthy: dict[str, set[str]] = {}
        self.unhealthy: dict[str, set[str]] = {}
        self.all_devices: dict[str, dict[str, DeviceRecord]] = {}
        self.endpoints: dict[str, EndpointInfo] = {}
        self.endpoint_store: dict[str, dict[str, EndpointInfo]] = {}
        """From 1.37: every connected instance of a resource, by socket path (``endpointStore``)."""
        self.pod_devices = PodDevices()
        self.allocated_devices: dict[str, set[str]] = {}
        self.devices_to_reuse: dict[str, dict[str, set[str]]] = {}

    # -- plugin lifecycle -------------------------------------------------------------

    def plugin_connected(
        self, resource: str, endpoint: endpoint_.Endpoint, options: model.PluginOptions
    ) -> None:
        """Install a new endpoint; the old one is replaced, not stopped, and devices stay."""
        self.endpoints[resource] = EndpointInfo(endpoint=endpoint, options=options)

    def instance_connected(
        self, resource: str, endpoint: endpoint_.Endpoint, options: model.PluginOptions
    ) -> bool:
        """1.37's ``PluginConnected``: store the instance, make it the endpoint; False if its socket is taken.

        An instance whose socket path is in the store already is refused and the
        store left as it is: the entry of the running instance stays.
        """
        store = self.endpoint_store.setdefault(resource, {})
        if endpoint.socket_path is None or endpoint.socket_path in store:
            return False
        info = EndpointInfo(endpoint=endpoint, options=options)
        store[endpoint.socket_path] = info
        self.endpoints[resource] = info
        return True

    def instance_disconnected(self, resource: str, socket_path: str, *, now: float) -> bool | None:
        """1.37's ``PluginDisconnected``: stop the instance at ``socket_path``.

        Returns None when the store has no such instance (nothing changes), True
        when it was the last one (every device unhealthy, as a disconnect before
        1.37), False when others remain: one of them becomes the endpoint (upstream
        takes any; here the newest) and the device sets stay as they are.
        """
        store = self.endpoint_store.get(resource, {})
        info = store.get(socket_path)
        if info is None:
            return None
        info.endpoint.set_stop_time(now)
        if len(store) == 1:
            del self.endpoint_store[resource]
            self.mark_resource_unhealthy(resource)
            return True
        del store[socket_path]
        self.endpoints[resource] = list(store.values())[-1]
        return False

    def list_and_watch_update(self, resource: str, devices: Iterable[DeviceRecord]) -> None:
        """Replace the resource's device sets with one full ListAndWatch message."""
        healthy: set[str] = set()
        unhealthy: set[str] = set()
        everything: dict[str, DeviceRecord] = {}
        for device in devices:
            everything[device.id] = device
            if device.health == constants.HEALTHY:
                healthy.add(device.id)
            else:
                unhealthy.add(device.id)
        self.healthy[resource] = healthy
        self.unhealthy[resource] = unhealthy
        self.all_devices[resource] = everything

    def plugin_disconnected(self, resource: str, *, now: float) -> bool:
        """Move every healthy device to unhealthy and stop the current endpoint.

        Returns whether there was an endpoint to stop (otherwise nothing changes).
        """
        info = self.endpoints.get(resource)
        if info is None:
            return False
        self.mark_resource_unhealthy(resource)
        info.endpoint.set_stop_time(now)
        return True

    def mark_resource_unhealthy(self, resource: str) -> None:
        """Union the healthy set into the unhealthy one and empty the healthy set."""
        moved = self.healthy.get(resource, set())
        if resource in self.healthy:
            self.healthy[resource] = set()
        self.unhealthy[resource] = self.unhealthy.get(resource, set()) | moved

    # -- capacity ---------------------------------------------------------------------

    def get_capacity(self, *, now: float) -> Capacity:
        """Poll capacity the kubelet's way, dropping resources whose grace period has run out.

        A resource with no endpoint at all is dropped too (upstream logs it as
        "out of sync"). Dropped resources lose their sets and endpoint; their
        device records and pod allocations stay, as upstream.
        """
        capacity: dict[str, int] = {}
        allocatable: dict[str, int] = {}
        deleted: set[str] = set()
        for resource in list(self.healthy):
            if self._expired(resource, now):
                self.endpoints.pop(resource, None)
                del self.healthy[resource]
                deleted.add(resource)
            else:
                capacity[resource] = len(self.healthy[resource])
                allocatable[resource] = len(self.healthy[resource])
        for resource in list(self.unhealthy):
            if self._expired(resource, now):
                self.endpoints.pop(resource, None)
                del self.unhealthy[resource]
                deleted.add(resource)
            else:
                capacity[resource] = capacity.get(resource, 0) + len(self.unhealthy[resource])
        return Capacity(capacity=capacity, allocatable=allocatable, deleted=frozenset(deleted))

    def counts(self, resource: str) -> tuple[int, int] | None:
        """``(capacity, allocatable)`` of one resource as :meth:`get_capacity` counts them, expiry aside.

        None when the resource has no device sets (the poll leaves its figures as they were).
        """
        healthy, unhealthy = self.healthy.get(resource), self.unhealthy.get(resource)
        if healthy is None and unhealthy is None:
            return None
        return len(healthy or ()) + len(unhealthy or ()), len(healthy or ())

    def _expired(self, resource: str, now: float) -> bool:
        info = self.endpoints.get(resource)
        return info is None or info.endpoint.stop_grace_period_expired(
            now=now, grace_period=self.grace_period
        )

    def next_expiry(self) -> float | None:
        """Return the earliest time at which a stopped endpoint's grace period runs out."""
        times = [
            info.endpoint.stop_time + self.grace_period
            for info in self.endpoints.values()
            if info.endpoint.stop_time is not None
        ]
        return min(times, default=None)

    # -- queries ----------------------------------------------------------------------

    def is_device_plugin_resource(self, resource: str) -> bool:
        """Tell whether admission must go through the device manager for ``resource``."""
        return resource in self.healthy or self.pod_devices.has_resource(resource)

    def has_topology_alignment(self, resource: str) -> bool:
        """Tell whether any device of ``resource`` reports a NUMA node."""
        return any(device.numa_nodes for device in self.all_devices.get(resource, {}).values())

    def numa_nodes_of(self, resource: str, device_id: str) -> tuple[int, ...]:
        """Return a device's NUMA nodes, or ``(-1,)`` when it has none."""
        record = self.all_devices.get(resource, {}).get(device_id)
        if record is None or not record.numa_nodes:
            return (NODE_WITHOUT_TOPOLOGY,)
        return record.numa_nodes

    # -- restart ----------------------------------------------------------------------

    def checkpoint(self) -> checkpoint_.CheckpointData:
        """Return what ``writeCheckpoint`` would write right now.

        ``RegisteredDevices`` holds the *healthy* IDs of every resource in the
        healthy map (so a resource whose plugin died is kept with ``[]``).
        Entries without a cached response are skipped, as upstream; Go's map
        order is random, here entries are sorted by pod, container, resource.
        """
        entries: list[checkpoint_.PodDevicesEntry] = []
        for pod_uid, per_pod in sorted(self.pod_devices.entries.items()):
            for container, per_container in sorted(per_pod.items()):
                for resource, allocation in sorted(per_container.items()):
                    if allocation.response is None:
                        continue
                    entries.append(
                        checkpoint_.PodDevicesEntry(
                            pod_uid=pod_uid,
                            container_name=container,
                            resource_name=resource,
                            device_ids={node: list(ids) for node, ids in allocation.devices_by_numa.items()},
                            alloc_resp=allocation.response.SerializeToString(deterministic=True),
                        )
                    )
        return checkpoint_.CheckpointData(
            # A Go nil slice when nothing was appended: JSON null.
            pod_device_entries=entries or None,
            registered_devices={resource: sorted(ids) for resource, ids in self.healthy.items()},
        )

    @classmethod
    def restored(
        cls,
        data: checkpoint_.CheckpointData,
        *,
        grace_period: float,
        now: float,
        journal: journal.Journal,
    ) -> DeviceManager:
        """Build the state of a freshly started kubelet from a checkpoint (``readCheckpoint``).

        Each registered resource gets empty sets and a stopped endpoint (stopped
        now), so it reports capacity 0 until its plugin registers again and is
        dropped after the grace period if none does. An entry whose response
        does not parse is skipped (upstream logs it and goes on).
        """
        manager = cls(grace_period=grace_period)
        for entry in data.pod_device_entries or ():
            response = api_pb2.ContainerAllocateResponse()
            try:
                response.ParseFromString(entry.alloc_resp or b"")
            except message_.DecodeError:
                continue
            by_numa = {node: tuple(ids or ()) for node, ids in (entry.device_ids or {}).items()}
            manager.pod_devices.insert(
                entry.pod_uid,
                entry.container_name,
                entry.resource_name,
                ContainerAllocation(devices_by_numa=MappingProxyType(by_numa), response=response),
            )
        manager.allocated_devices = manager.pod_devices.devices()
        for resource in sorted(data.registered_devices or {}):
            manager.healthy[resource] = set()
            manager.unhealthy[resource] = set()
            manager.endpoints[resource] = EndpointInfo(
                endpoint=endpoint_.Endpoint.stopped(resource=resource, journal=journal, now=now),
                options=None,
            )
        return manager
