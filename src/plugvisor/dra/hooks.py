"""What a kind adds to serve as a DRA driver: how its devices look in a ResourceSlice.

A kind is already everything a DRA driver is made of: its scan gives the
devices with their health, NUMA node and container edits, and its hooks prepare
and clean them. The one thing DRA needs on top is how users select a device:
its name in the pool and its attributes. That is the optional
:class:`DraDescriber` hook; a kind without it is published by
:func:`default_dra_devices`, from the fields every
:class:`~plugvisor.deviceplugin.devices.Device` has.

Every device of the snapshot that the answer names is published (the healthy
ones; see docs/dra.md); a device left out is not offered under DRA at all (the
gpu kind leaves out the time-slicing replicas: in DRA several pods share a
device by sharing one claim).

gRPC-free, so a kind's module can import it at load time.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any, Final, Protocol, runtime_checkable

from plugvisor.deviceplugin.devices import Device
from plugvisor.deviceplugin.snapshot import Snapshot
from plugvisor.dra.devices import NUMA_NODE, AttributeValue, PublishedDevice
from plugvisor.dra.validation import clip_value

_NAME_UNSAFE: Final = re.compile(r"[^a-z0-9]+")
_NAME_MAX: Final = 63
_HASH_LENGTH: Final = 6


@runtime_checkable
class DraDescriber(Protocol):
    """**Protocol:** the kind's devices as a DRA driver publishes them.

    Return, by device ID, the :class:`~plugvisor.dra.devices.PublishedDevice`
    of every device of ``snapshot`` that DRA should offer: its name in the pool
    (a DNS label, unique and stable across scans: claims name it), its
    attributes and its capacities. Called in a worker thread after every change
    of the snapshot, so reading a few sysfs files is fine; raising keeps the
    previous answer (the failure is logged). Health is not part of the answer:
    the driver withdraws unhealthy devices from the slice by itself.
    """

    def dra_devices(self, snapshot: Snapshot[Any]) -> Mapping[str, PublishedDevice]:
        """The published form of the snapshot's devices, by device ID (devices left out are not offered)."""
        ...


def kind_resource(driver: str, kind: str) -> str:
    """The resource name a kind is built with when it serves the DRA driver ``driver``: ``<driver>/<kind>``.

    Kinds name things after their resource (the gpu kind's CDI kind, the nic
    kind's ``PCIDEVICE_<RESOURCE>`` variable) and expect the device plugin's
    ``<domain>/<name>`` form; the driver's name is the domain, the kind's the name.
    """
    return f"{driver}/{kind}"


def dra_device_name(device_id: str) -> str:
    """A DNS label for a device ID: lower case, runs of other characters as ``-``.

    ``GPU-6d3c...`` becomes ``gpu-6d3c...``, ``0000:3b:00.0`` becomes
    ``0000-3b-00-0`` and ``fuse-3`` stays. A name that had to be shortened gets
    a hash of the whole ID, so two long IDs never share a name. IDs that differ
    only in case or punctuation (``AB-1``, ``ab_1``) share one; the pool tells
    them apart (:func:`plugvisor.dra.pool.build_pool`).
    """
    name = _NAME_UNSAFE.sub("-", device_id.lower()).strip("-") or "device"
    if len(name) <= _NAME_MAX:
        return name
    return with_hash(name, device_id, _HASH_LENGTH)


def with_hash(name: str, device_id: str, length: int) -> str:
    """``name`` (a DNS label) shortened to end in ``-`` and ``length`` hex digits of the ID's SHA-256.

    The ID is hashed as given, undecodable bytes of a sysfs name (surrogates) included.
    """
    digest = hashlib.sha256(device_id.encode("utf-8", "surrogatepass")).hexdigest()[:length]
    return f"{name[: _NAME_MAX - length - 1].rstrip('-')}-{digest}"


def default_attributes(device: Device) -> dict[str, AttributeValue]:
    """What every device says about itself: its NUMA node (one only) and the path of its first node.

    ``path`` is where the container sees the device's first device node (or,
    without one, its first mount): what a user would select a generic device
    by, ``device.attributes["<driver>"].path == "/dev/ttyUSB0"``.
    """
    attributes: dict[str, AttributeValue] = {}
    if len(device.numa_nodes) == 1:
        attributes[NUMA_NODE] = device.numa_nodes[0]
    paths = [spec.container_path for spec in device.specs] or [
        mount.container_path for mount in device.mounts
    ]
    if paths:
        attributes["path"] = clip_value(paths[0])
    return attributes


def default_dra_devices(snapshot: Snapshot[Any]) -> dict[str, PublishedDevice]:
    """Every device of the snapshot, named by :func:`dra_device_name`, with :func:`default_attributes`."""
    return {
        device_id: PublishedDevice(dra_device_name(device_id), default_attributes(device))
        for device_id, device in snapshot.devices.items()
    }
