"""The emulated kubelet: the kubelet's side of the device plugin protocol, by its rules.

:class:`EmulatedKubelet` serves ``v1beta1.Registration`` on ``<DIR>/kubelet.sock``,
dials each registering plugin, consumes its ListAndWatch stream and keeps
capacity and allocatable exactly as the kubelet's device manager does; it admits
containers with the kubelet's allocation algorithm and restarts the way a
kubelet restarts (every socket in the directory deleted, the checkpoint read
back). It runs pods from manifests (admission, PreStartContainer, the runtime
config a container would get, pod status), serves PodResources v1 and writes
``kubelet_internal_checkpoint`` byte-compatible with the kubelet's. Its state is
readable as Python objects and as JSON files beside the directory. Error texts, rules
and their order follow the kubelet of v1.31-v1.35 (see docs/kubelet-contract.md).

:class:`StubDevicePlugin` is the matching raw test plugin: a plain gRPC
DevicePlugin with settable devices, options and failures.
"""

from plugvisor.emulators.kubelet import checkpoint, versions
from plugvisor.emulators.kubelet.allocation import ContainerKind
from plugvisor.emulators.kubelet.errors import (
    AllocationError,
    KubeletError,
    NotDevicePluginResourceError,
    PreStartError,
)
from plugvisor.emulators.kubelet.gates import FeatureGates
from plugvisor.emulators.kubelet.kubelet import DEFAULT_GRACE_PERIOD, EmulatedKubelet
from plugvisor.emulators.kubelet.manifest import ManifestError, PodSpec, parse_manifest
from plugvisor.emulators.kubelet.model import (
    Allocation,
    DeviceView,
    Event,
    EventKind,
    PluginCall,
    PluginMethod,
    PluginOptions,
    RegistrationRecord,
    ResourceView,
)
from plugvisor.emulators.kubelet.pods import ContainerState, ContainerStatusView, PodPhase, PodStatusView
from plugvisor.emulators.kubelet.registration import Replacement, cleanup_plugin_directory
from plugvisor.emulators.kubelet.runtime_config import RuntimeConfig
from plugvisor.emulators.kubelet.stub import StubDevicePlugin, device, devices
from plugvisor.emulators.kubelet.view import default_view_path

__all__ = [
    "DEFAULT_GRACE_PERIOD",
    "Allocation",
    "AllocationError",
    "ContainerKind",
    "ContainerState",
    "ContainerStatusView",
    "DeviceView",
    "EmulatedKubelet",
    "Event",
    "EventKind",
    "FeatureGates",
    "KubeletError",
    "ManifestError",
    "NotDevicePluginResourceError",
    "PluginCall",
    "PluginMethod",
    "PluginOptions",
    "PodPhase",
    "PodSpec",
    "PodStatusView",
    "PreStartError",
    "RegistrationRecord",
    "Replacement",
    "ResourceView",
    "RuntimeConfig",
    "StubDevicePlugin",
    "checkpoint",
    "cleanup_plugin_directory",
    "default_view_path",
    "device",
    "devices",
    "parse_manifest",
    "versions",
]
