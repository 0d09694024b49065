"""The device-plugin framework: write a device source, get a kubelet-compliant plugin.

A plugin is a :class:`DeviceSource` (a one-shot ``scan()`` returning a
:class:`DeviceSet`, and the directories to watch) plus, optionally, any of the
hook Protocols (:class:`PreferredAllocator`, :class:`ContainerPreStarter`,
:class:`PostAllocator`). :func:`run_plugin` does the rest: event-driven
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
        ContainerPreStarter,
        DeviceSource,
        Hooks,
        PostAllocator,
        PreferredAllocator,
        resolve_hooks,
    )
    from plugvisor.deviceplugin.runtime import DevicePluginRuntime, PluginConfig, Registration, run_plugin

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
    "ContainerPreStarter": "hooks",
    "DeviceSource": "hooks",
    "Hooks": "hooks",
    "PostAllocator": "hooks",
    "PreferredAllocator": "hooks",
    "resolve_hooks": "hooks",
    "HostPaths": "plugvisor.common.hostpaths",
    "configure_logging": "plugvisor.common.logs",
    "DevicePluginRuntime": "runtime",
    "PluginConfig": "runtime",
    "Registration": "runtime",
    "run_plugin": "runtime",
}

__all__ = [
    "ConfigurationError",
    "ContainerAllocation",
    "ContainerPreStarter",
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
    "PlugvisorError",
    "PostAllocator",
    "PreferredAllocator",
    "Registration",
    "RegistrationRejectedError",
    "RequestError",
    "SocketInUseError",
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
