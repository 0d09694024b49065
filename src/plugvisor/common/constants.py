"""Constants of the kubelet's device plugin contract that live outside the .proto.

Upstream keeps these in ``constants.go`` beside the generated code; plugins and
the emulated kubelet must agree on them to the byte, so both import them from
here rather than spelling them out.
"""

from __future__ import annotations

from typing import Final

HEALTHY: Final = "Healthy"
UNHEALTHY: Final = "Unhealthy"

VERSION: Final = "v1beta1"
SUPPORTED_VERSIONS: Final[tuple[str, ...]] = (VERSION,)

DEVICE_PLUGIN_PATH: Final = "/var/lib/kubelet/device-plugins/"
KUBELET_SOCKET_NAME: Final = "kubelet.sock"
KUBELET_SOCKET: Final = DEVICE_PLUGIN_PATH + KUBELET_SOCKET_NAME
CHECKPOINT_NAME: Final = "kubelet_internal_checkpoint"

PRE_START_CONTAINER_TIMEOUT_SECONDS: Final = 30
"""The kubelet gives PreStartContainer this long; the only RPC deadline besides the dial."""

KUBELET_DIAL_TIMEOUT_SECONDS: Final = 10
"""The kubelet's blocking dial of a plugin's endpoint during Register."""

KUBELET_MAX_RECEIVE_BYTES: Final = 4 * 1024 * 1024
"""gRPC's default receive limit, which the kubelet's device-plugin client keeps: a larger ListAndWatch
message ends the stream on the kubelet's side and the resource loses every device."""

DEVICE_PLUGINS_DIR_NAME: Final = "device-plugins"
POD_RESOURCES_DIR_NAME: Final = "pod-resources"
PLUGINS_REGISTRY_DIR_NAME: Final = "plugins_registry"
DEVICE_PLUGIN_TYPE: Final = "DevicePlugin"

MAX_UNIX_SOCKET_PATH: Final = 107
"""grpc refuses unix socket paths longer than this many bytes."""

# -- Per-device monitoring: what the agent hands its children (plugvisor.common.monitoring) --------

MONITOR_DIR_ENV: Final = "PLUGVISOR_MONITOR_DIR"
"""Where a supervised plugin writes its report and, when elected, the owners file."""
POD_RESOURCES_SOCKET_ENV: Final = "PLUGVISOR_POD_RESOURCES_SOCKET"
POD_RESOURCES_INTERVAL_ENV: Final = "PLUGVISOR_POD_RESOURCES_INTERVAL"
TELEMETRY_INTERVAL_ENV: Final = "PLUGVISOR_TELEMETRY_INTERVAL"

# -- Dynamic Resource Allocation (DRA) kubelet plugins --------------------------------------

DRA_PLUGIN_TYPE: Final = "DRAPlugin"
"""``PluginInfo.type`` of a DRA driver's kubelet plugin in the plugin-watcher registration."""
DRA_SERVICE_V1: Final = "v1.DRAPlugin"
DRA_SERVICE_V1BETA1: Final = "v1beta1.DRAPlugin"
DRA_SERVICES: Final[tuple[str, ...]] = (DRA_SERVICE_V1, DRA_SERVICE_V1BETA1)
"""The DRAPlugin services a kubelet 1.34+ accepts, newest first: it picks the first the plugin lists."""
DRA_HEALTH_SERVICE_V1: Final = "v1.DRAResourceHealth"
DRA_HEALTH_SERVICE_V1ALPHA1: Final = "v1alpha1.DRAResourceHealth"
DRA_HEALTH_SERVICES: Final[tuple[str, ...]] = (DRA_HEALTH_SERVICE_V1, DRA_HEALTH_SERVICE_V1ALPHA1)
"""The optional device health services, newest first, as the kubelet picks them."""
DRA_PLUGINS_DIR_NAME: Final = "plugins"
"""``<kubelet root>/plugins/<driver>/`` holds a driver's own files: its DRA socket, its checkpoint."""
DRA_SOCKET_NAME: Final = "dra.sock"
DRA_REGISTRATION_SOCKET_SUFFIX: Final = "-reg.sock"
"""A driver's registration socket is ``plugins_registry/<driver>-reg.sock`` (the upstream helper's name)."""
DRA_CALL_TIMEOUT_SECONDS: Final = 45
"""The kubelet gives each NodePrepareResources / NodeUnprepareResources call this long."""
DRA_HEALTH_TIMEOUT_SECONDS: Final = 30
"""Without a fresh health report for this long, the kubelet takes a device's health as Unknown."""
DEFAULT_CDI_DIR: Final = "/var/run/cdi"
"""Where container runtimes look for CDI specs besides ``/etc/cdi``: the one for specs made at run time."""
DRA_DRIVER_NAME_MAX: Final = 63
"""A DRA driver name is a DNS subdomain of at most 63 characters (the API server's limit)."""
