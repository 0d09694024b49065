"""The device-plugin framework: write a device source, get a kubelet-compliant plugin.

A plugin is a :class:`DeviceSource` (a one-shot ``scan()`` returning a
:class:`Snapshot`: the devices, the directories to watch, and the data its hooks
need) plus, optionally, any of the hook Protocols (:class:`PreferredAllocator`,
:class:`ContainerPreStarter`, :class:`PostAllocator`, :class:`ReleaseHandler`,
:class:`PluginLifecycle`, ...). :func:`run_plugin` does the rest: event-driven
rediscovery, the five DevicePlugin RPCs with strict request checking,
registration that survives kubelet restarts, and structured logs.

This package knows no hardware and no supervisor; the layers are enforced by
import-linter contracts in pyproject.toml. Names are exported lazily so that
importing the device model (for example to validate a configuration in the
supervisor, which must never load gRPC) does not import the gRPC server.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from plugvisor.common.hostpaths import HostPaths
    from plugvisor.common.logs import configure_logging
    from plugvisor.deviceplugin.devices import (
        Device,
        DeviceSet,
        DeviceSpec,
        Health,
        InvalidDeviceError,
        Mount,
    )
    from plugvisor.deviceplugin.errors import (
        ConfigurationError,
        PlugvisorError,
        RegistrationRejectedError,
        RequestError,
        SocketInUseError,
    )
    from plugvisor.deviceplugin.hooks import (
        ContainerAllocation,
        ContainerPostStopper,
        ContainerPreStarter,
        Deallocator,
        DeviceSource,
        Hooks,
        PluginLifecycle,
        PostAllocator,
        PreferredAllocator,
        ReleaseHandler,
        ReleaseWatch,
        RescanRequester,
        UeventSubscriber,
        resolve_hooks,
    )
    from plugvisor.deviceplugin.runtime import DevicePluginRuntime, PluginConfig, Registration, run_plugin
    from plugvisor.deviceplugin.snapshot import Snapshot

_HOME = {
    "Device": "devices",
    "DeviceSet": "devices",
    "DeviceSpec": "devices",
    "Health": "devices",
    "InvalidDeviceError": "devices",
    "Mount": "devices",
    "ConfigurationError": "errors",
    "PlugvisorError": "errors",
    "RegistrationRejectedError": "errors",
    "RequestError": "errors",
    "SocketInUseError": "errors",
    "ContainerAllocation": "hooks",
    "ContainerPostStopper": "hooks",
    "ContainerPreStarter": "hooks",
    "Deallocator": "hooks",
    "DeviceSource": "hooks",
    "Hooks": "hooks",
    "PluginLifecycle": "hooks",
    "PostAllocator": "hooks",
    "PreferredAllocator": "hooks",
    "ReleaseHandler": "hooks",
    "ReleaseWatch": "hooks",
    "RescanRequester": "hooks",
    "UeventSubscriber": "hooks",
    "resolve_hooks": "hooks",
    "HostPaths": "plugvisor.common.hostpaths",
    "configure_logging": "plugvisor.common.logs",
    "DevicePluginRuntime": "runtime",
    "PluginConfig": "runtime",
    "Registration": "runtime",
    "run_plugin": "runtime",
    "Snapshot": "snapshot",
}

__all__ = [
    "ConfigurationError",
    "ContainerAllocation",
    "ContainerPostStopper",
    "ContainerPreStarter",
    "Deallocator",
    "Device",
    "DevicePluginRuntime",
    "DeviceSet",
    "DeviceSource",
    "DeviceSpec",
    "Health",
    "Hooks",
    "HostPaths",
    "InvalidDeviceError",
    "Mount",
    "PluginConfig",
    "PluginLifecycle",
    "PlugvisorError",
    "PostAllocator",
    "PreferredAllocator",
    "Registration",
    "RegistrationRejectedError",
    "ReleaseHandler",
    "ReleaseWatch",
    "RequestError",
    "RescanRequester",
    "Snapshot",
    "SocketInUseError",
    "UeventSubscriber",
    "configure_logging",
    "resolve_hooks",
    "run_plugin",
]


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'plugvisor.deviceplugin' has no attribute {name!r}")
    home = module if "." in module else f"plugvisor.deviceplugin.{module}"
    return getattr(importlib.import_module(home), name)
