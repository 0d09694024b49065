"""What the emulated kubelet shows the outside world: immutable records and views.

Tests, benchmarks and the demo read these; none of them can change kubelet
state by accident because every record is a frozen dataclass, and views are
snapshots taken at the moment of the call. Times are ``time.monotonic()``
seconds (comparable with each other, never with wall time), except
:attr:`Event.wall`, which exists for humans and logs.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TypeAlias

from plugvisor.api.deviceplugin.v1beta1 import api_pb2

FieldValue: TypeAlias = str | int | float | bool | None
"""A value an :class:`Event` may carry: JSON- and log-friendly scalars only."""


def _empty_fields() -> Mapping[str, FieldValue]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class PluginOptions:
    """The two flags of ``DevicePluginOptions``, as a plain value."""

    pre_start_required: bool = False
    get_preferred_allocation_available: bool = False

    @classmethod
    def from_proto(cls, message: api_pb2.DevicePluginOptions) -> PluginOptions:
        """Copy the flags out of the wire message."""
        return cls(
            pre_start_required=message.pre_start_required,
            get_preferred_allocation_available=message.get_preferred_allocation_available,
        )


@dataclass(frozen=True, slots=True)
class DeviceView:
    """One device of a resource as the kubelet holds it.

    ``health`` is what the kubelet *counts* (``"Healthy"`` only when the ID is in
    its healthy set, so a device of a dead plugin shows ``"Unhealthy"``);
    ``reported_health`` is the string the plugin last sent, or ``None`` when the
    kubelet has no report (after a restart, before the plugin is back).
    """

    id: str
    health: str
    reported_health: str | None
    numa_nodes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ResourceView:
    """One extended resource as the node reports it, plus the device manager's detail.

    ``capacity``/``allocatable`` are what the node status would carry.
    ``registered`` is true while a plugin endpoint is live (connected, not
    stopped); ``endpoint`` is that endpoint's socket path, or ``None`` when the
    kubelet holds no dialled endpoint (restored after a restart, or removed).
    ``removed`` marks a resource dropped after the grace period: the node keeps
    reporting it at capacity 0 so it stays recognisably device-plugin managed.
    """

    name: str
    capacity: int
    allocatable: int
    devices: Mapping[str, DeviceView]
    healthy_ids: frozenset[str]
    unhealthy_ids: frozenset[str]
    endpoint: str | None
    registered: bool
    options: PluginOptions | None
    stopped_at: float | None
    removed: bool
    topology_aware: bool


@dataclass(frozen=True, slots=True)
class RegistrationRecord:
    """One ``Register`` call as the kubelet handled it, in arrival order."""

    resource: str
    endpoint: str
    version: str
    requested_options: PluginOptions | None
    accepted: bool
    error: str | None
    received_at: float
    finished_at: float
    generation: int
    via: str = "kubelet.sock"
    """``kubelet.sock`` (a Register call) or ``plugins_registry`` (found by the plugin watcher).

    For the plugin watcher, ``endpoint`` is the full socket path and ``version``
    the plugin's supported versions, comma-separated.
    """


class PluginMethod(enum.StrEnum):
    """The DevicePlugin RPCs the kubelet may call, by their wire names."""

    GET_DEVICE_PLUGIN_OPTIONS = "GetDevicePluginOptions"
    LIST_AND_WATCH = "ListAndWatch"
    GET_PREFERRED_ALLOCATION = "GetPreferredAllocation"
    ALLOCATE = "Allocate"
    PRE_START_CONTAINER = "PreStartContainer"
    POST_STOP_CONTAINER = "PostStopContainer"
    """Proposed (KEP-20210712 addendum), never upstream: only with the DeviceManagerDeallocate gate."""
    DEALLOCATE = "Deallocate"
    """Proposed (KEP-20210712 addendum), never upstream: only with the DeviceManagerDeallocate gate."""


@dataclass(frozen=True, slots=True)
class PluginCall:
    """One RPC the kubelet started towards a plugin (recorded when it is issued)."""

    resource: str
    endpoint: str
    method: PluginMethod
    at: float
    generation: int


class EventKind(enum.StrEnum):
    """What happened; one event per state change a human or script cares about."""

    STARTED = "started"
    STOPPED = "stopped"
    SOCKET_REMOVED = "socket_removed"
    REGISTERED = "registered"
    REGISTRATION_FAILED = "registration_failed"
    DEVICES_UPDATED = "devices_updated"
    STREAM_ENDED = "stream_ended"
    ENDPOINT_STOPPED = "endpoint_stopped"
    RESOURCE_REMOVED = "resource_removed"
    ALLOCATED = "allocated"
    ALLOCATION_FAILED = "allocation_failed"
    PRE_START_FAILED = "pre_start_failed"
    POD_REMOVED = "pod_removed"
    POD_ADDED = "pod_added"
    POD_REJECTED = "pod_rejected"
    POD_DELETED = "pod_deleted"
    POD_INVALID = "pod_invalid"
    CONTAINER_STARTED = "container_started"
    CONTAINER_START_FAILED = "container_start_failed"
    CONTAINER_EXITED = "container_exited"
    CHECKPOINT_RESTORED = "checkpoint_restored"
    CHECKPOINT_IGNORED = "checkpoint_ignored"
    CHECKPOINT_WRITE_FAILED = "checkpoint_write_failed"
    VIEW_WRITE_FAILED = "view_write_failed"
    PLUGIN_INSTANCE_ENDED = "plugin_instance_ended"
    PLUGIN_CALL_FAILED = "plugin_call_failed"
    PLUGIN_CALL_ANSWERED = "plugin_call_answered"
    PLUGIN_SOCKET_FOUND = "plugin_socket_found"
    PLUGIN_SOCKET_REMOVED = "plugin_socket_removed"
    PLUGIN_DEREGISTERED = "plugin_deregistered"
    CLAIM_PREPARED = "claim_prepared"
    CLAIM_UNPREPARED = "claim_unprepared"


@dataclass(frozen=True, slots=True)
class Event:
    """A state change, with a one-line message and flat key/value fields for logs."""

    kind: EventKind
    message: str
    resource: str | None
    at: float
    wall: float
    generation: int
    fields: Mapping[str, FieldValue] = field(default_factory=_empty_fields)


@dataclass(frozen=True, slots=True)
class Allocation:
    """The outcome of one container's allocation of one resource.

    ``device_ids`` is sorted for stable comparisons; ``devices_by_numa`` is how
    the kubelet stores them (a multi-NUMA device under each of its nodes,
    ``-1`` for no topology). ``response`` is the cached
    ``ContainerAllocateResponse`` (``container_responses[0]``). The three flags
    say which RPCs this call made; ``reused`` means the container already held
    its devices, so no Allocate was sent.
    """

    pod_uid: str
    container: str
    resource: str
    device_ids: tuple[str, ...]
    devices_by_numa: Mapping[int, tuple[str, ...]]
    response: api_pb2.ContainerAllocateResponse | None
    preferred_called: bool
    allocate_called: bool
    pre_start_called: bool
    reused: bool
