"""The device model: immutable values, so that "did anything change?" is plain equality.

A scan produces a fresh :class:`DeviceSet`; the framework publishes it only when
it differs from the last one (Intel's notifier does the same with a deep
compare). Health is part of every snapshot, so a device that recovers simply
shows up Healthy in the next scan: there is no one-way "unhealthy" channel to
get stuck in (NVIDIA's plugin carries a FIXME for exactly that).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final, overload

from plugvisor.common import constants

MAX_DEVICE_ID_LENGTH: Final = 63
"""The API's documented limit. The kubelet does not enforce it, but IDs end up in pod
annotations, checkpoint files and metrics labels, so the framework does."""

_VALID_PERMISSIONS: Final = frozenset("rwm")


class Health(enum.Enum):
    """A device's health as the kubelet spells it on the wire."""

    HEALTHY = constants.HEALTHY
    UNHEALTHY = constants.UNHEALTHY


class InvalidDeviceError(ValueError):
    """A device description a plugin built is not something the kubelet can use."""


def _is_str(value: object) -> bool:
    """Runtime check for plugins written without a type checker (the annotations promise str)."""
    return isinstance(value, str)


def _is_int(value: object) -> bool:
    """Runtime check for NUMA IDs (bool is an int in Python, but never a NUMA node)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _frozen_map(value: Mapping[str, str], what: str, device_id: str) -> Mapping[str, str]:
    for key, val in value.items():
        if not _is_str(key) or not _is_str(val):
            raise InvalidDeviceError(f"device {device_id!r}: {what} must map strings to strings, got {key!r}")
    return MappingProxyType(dict(sorted(value.items())))


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """A device node the container runtime creates in the container (cgroup-allowed)."""

    container_path: str
    host_path: str
    permissions: str = "rw"

    def __post_init__(self) -> None:
        if not self.permissions or not set(self.permissions) <= _VALID_PERMISSIONS:
            raise InvalidDeviceError(
                f"device node {self.host_path!r}: permissions {self.permissions!r} must be made of r, w and m"
            )
        for name, value in (("container_path", self.container_path), ("host_path", self.host_path)):
            if not value.startswith("/"):
                raise InvalidDeviceError(f"device node {name} {value!r} must be an absolute path")


@dataclass(frozen=True, slots=True)
class Mount:
    """A bind mount the container runtime adds to the container."""

    container_path: str
    host_path: str
    read_only: bool = False

    def __post_init__(self) -> None:
        for name, value in (("container_path", self.container_path), ("host_path", self.host_path)):
            if not value.startswith("/"):
                raise InvalidDeviceError(f"mount {name} {value!r} must be an absolute path")


@dataclass(frozen=True, slots=True)
class Device:
    """One schedulable unit of a resource, with everything Allocate needs to hand it out.

    ``numa_nodes`` becomes the device's TopologyInfo; leave it empty when the
    device has no NUMA affinity (the kubelet then treats it as NUMA-agnostic).
    ``cdi_devices`` are fully qualified CDI names (``vendor.example/gpu=gpu0``).
    """

    id: str
    health: Health = Health.HEALTHY
    numa_nodes: Sequence[int] = ()
    specs: Sequence[DeviceSpec] = ()
    mounts: Sequence[Mount] = ()
    envs: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    cdi_devices: Sequence[str] = ()

    def __post_init__(self) -> None:
        if not _is_str(self.id) or not self.id:
            raise InvalidDeviceError(f"device ID must be a non-empty string, got {self.id!r}")
        if len(self.id) > MAX_DEVICE_ID_LENGTH:
            raise InvalidDeviceError(
                f"device ID {self.id!r} is {len(self.id)} characters; the API allows {MAX_DEVICE_ID_LENGTH}"
            )
        if not self.id.isprintable() or any(ch.isspace() for ch in self.id):
            raise InvalidDeviceError(f"device ID {self.id!r} must be printable and contain no white space")
        if not isinstance(self.health, Health):  # see _is_str
            raise InvalidDeviceError(f"device {self.id!r}: health must be a Health, got {self.health!r}")
        # Normalise containers to tuples / read-only maps so instances stay immutable and comparable.
        if any(not _is_int(n) or n < 0 for n in self.numa_nodes):
            raise InvalidDeviceError(f"device {self.id!r}: NUMA nodes must be non-negative integers")
        object.__setattr__(self, "numa_nodes", tuple(sorted(set(self.numa_nodes))))
        object.__setattr__(self, "specs", tuple(self.specs))
        object.__setattr__(self, "mounts", tuple(self.mounts))
        object.__setattr__(self, "cdi_devices", tuple(self.cdi_devices))
        object.__setattr__(self, "envs", _frozen_map(self.envs, "envs", self.id))
        object.__setattr__(self, "annotations", _frozen_map(self.annotations, "annotations", self.id))

    @property
    def healthy(self) -> bool:
        """Whether the kubelet may allocate this device."""
        return self.health is Health.HEALTHY

    def with_health(self, health: Health) -> Device:
        """Return a copy with another health (the rest unchanged)."""
        if health is self.health:
            return self
        return Device(
            id=self.id,
            health=health,
            numa_nodes=self.numa_nodes,
            specs=self.specs,
            mounts=self.mounts,
            envs=self.envs,
            annotations=self.annotations,
            cdi_devices=self.cdi_devices,
        )

    def __hash__(self) -> int:
        return hash((self.id, self.health))


class DeviceSet(Mapping[str, Device]):
    """An immutable, ordered collection of devices keyed by ID (order = scan order).

    Duplicate IDs are refused at construction: the kubelet would silently collapse
    them (and double-count conflicting health), which is never what a plugin meant.
    """

    __slots__ = ("_by_id", "_healthy_ids")

    _by_id: Mapping[str, Device]
    _healthy_ids: frozenset[str]

    def __init__(self, devices: Iterable[Device] = ()) -> None:
        by_id: dict[str, Device] = {}
        for device in devices:
            if device.id in by_id:
                raise InvalidDeviceError(f"device ID {device.id!r} appears twice in one device set")
            by_id[device.id] = device
        self._by_id = by_id
        self._healthy_ids = frozenset(i for i, d in by_id.items() if d.healthy)

    def __getitem__(self, device_id: str) -> Device:
        return self._by_id[device_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_id)

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, device_id: object) -> bool:
        return device_id in self._by_id

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DeviceSet):
            return NotImplemented
        return list(self._by_id.items()) == list(other._by_id.items())

    def __hash__(self) -> int:
        return hash(tuple(self._by_id))

    def __repr__(self) -> str:
        shown = list(self._by_id)[:8]
        more = "..." if len(self) > 8 else ""
        return f"DeviceSet({len(self)} devices, {len(self._healthy_ids)} healthy: {shown}{more})"

    @property
    def healthy_ids(self) -> frozenset[str]:
        """IDs of the devices the kubelet may allocate."""
        return self._healthy_ids

    def healthy(self) -> DeviceSet:
        """The healthy devices only."""
        return DeviceSet(d for d in self._by_id.values() if d.healthy)

    @overload
    def subset(self, ids: Iterable[str]) -> DeviceSet: ...
    @overload
    def subset(self, ids: Iterable[str], *, strict: bool) -> DeviceSet: ...
    def subset(self, ids: Iterable[str], *, strict: bool = True) -> DeviceSet:
        """The devices with the given IDs, in the given order; unknown IDs raise KeyError when strict."""
        if strict:
            return DeviceSet(self._by_id[i] for i in ids)
        return DeviceSet(self._by_id[i] for i in ids if i in self._by_id)
