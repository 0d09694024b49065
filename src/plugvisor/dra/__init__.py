"""Every kind also a Dynamic Resource Allocation (DRA) driver: the kubelet plugin side.

A DRA driver's kubelet plugin registers through the kubelet's plugin watcher,
prepares the claims the scheduler allocated from the node's pool (as CDI
specs), and publishes the node's devices as ResourceSlices. Everything a kind
already has serves it: the scan (devices, health, NUMA, PCI placement), the
container edits and the hooks. What a kind may add is how its devices look in
a slice (:class:`DraDescriber`). docs/dra.md says how it all fits.

This package may use the device model (devices, hooks, snapshots, discovery)
but not the device-plugin server, endpoint or registration, and the
device-plugin framework never imports it (import-linter contracts). Names are
exported lazily, as in :mod:`plugvisor.deviceplugin`: a kind's module imports
the gRPC-free device model at load time, and the agent loads kinds.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from plugvisor.dra.cluster import AllocatedDevice, ClaimError, ClaimReader, ClaimRef, SlicePublisher
    from plugvisor.dra.devices import (
        AttributeValue,
        DeviceTaint,
        InvalidDraDeviceError,
        PublishedDevice,
        SemVer,
        bytes_quantity,
    )
    from plugvisor.dra.hooks import DraDescriber, default_dra_devices, dra_device_name
    from plugvisor.dra.runtime import DraDriverRuntime, DriverConfig, run_driver

_HOME = {
    "AllocatedDevice": "cluster",
    "ClaimError": "cluster",
    "ClaimReader": "cluster",
    "ClaimRef": "cluster",
    "SlicePublisher": "cluster",
    "AttributeValue": "devices",
    "DeviceTaint": "devices",
    "InvalidDraDeviceError": "devices",
    "PublishedDevice": "devices",
    "SemVer": "devices",
    "bytes_quantity": "devices",
    "DraDescriber": "hooks",
    "default_dra_devices": "hooks",
    "dra_device_name": "hooks",
    "DraDriverRuntime": "runtime",
    "DriverConfig": "runtime",
    "run_driver": "runtime",
}

__all__ = [
    "AllocatedDevice",
    "AttributeValue",
    "ClaimError",
    "ClaimReader",
    "ClaimRef",
    "DeviceTaint",
    "DraDescriber",
    "DraDriverRuntime",
    "DriverConfig",
    "InvalidDraDeviceError",
    "PublishedDevice",
    "SemVer",
    "SlicePublisher",
    "bytes_quantity",
    "default_dra_devices",
    "dra_device_name",
    "run_driver",
]


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'plugvisor.dra' has no attribute {name!r}")
    return getattr(importlib.import_module(f"plugvisor.dra.{module}"), name)
