"""What a container runtime would receive for one container: the kubelet's merge of Allocate responses.

The kubelet caches one ``ContainerAllocateResponse`` per (pod, container,
resource) and, at every container start, merges the container's responses into
run options (``podDevices.deviceRunContainerOptions``, docs/kubelet-contract.md, section 6):

* envs by key, device nodes and mounts by ``container_path``, annotations by
  key - the first one wins and a *different* later value is only logged
  (here: recorded in :attr:`RuntimeConfig.conflicts`);
* mounts are named after their container path, keep ``read_only`` and are
  never SELinux-relabelled;
* CDI device names are de-duplicated across the container's responses.

Go iterates the responses (a map) and each response's envs and annotations
(maps) in random order, so upstream's "first" is not deterministic; the
emulator takes resources in sorted order and map entries in key order, and
documents that choice rather than pretending to a fixed upstream order.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from plugvisor.api.deviceplugin.v1beta1 import api_pb2


@dataclass(frozen=True, slots=True)
class RuntimeMount:
    """A CRI mount as the kubelet builds it from a plugin's ``Mount``."""

    name: str
    container_path: str
    host_path: str
    read_only: bool
    selinux_relabel: bool = False


@dataclass(frozen=True, slots=True)
class RuntimeDevice:
    """A CRI device node as the kubelet builds it from a plugin's ``DeviceSpec``."""

    host_path: str
    container_path: str
    permissions: str


@dataclass(frozen=True, slots=True)
class Conflict:
    """A later response disagreed with an earlier one; the earlier value was kept (and logged upstream)."""

    kind: str
    """``env``, ``device``, ``mount`` or ``annotation``."""
    key: str
    kept: str
    ignored: str
    resource: str


@dataclass(frozen=True, slots=True)
class RuntimeConfig:
    """The device-related part of a container's runtime config, as the CRI would get it."""

    envs: Mapping[str, str]
    mounts: tuple[RuntimeMount, ...]
    devices: tuple[RuntimeDevice, ...]
    annotations: Mapping[str, str]
    cdi_devices: tuple[str, ...]
    conflicts: tuple[Conflict, ...]

    def to_json(self) -> dict[str, object]:
        """Describe the config as plain JSON data (the pod status file carries it)."""
        return {
            "envs": dict(self.envs),
            "mounts": [
                {
                    "name": mount.name,
                    "containerPath": mount.container_path,
                    "hostPath": mount.host_path,
                    "readOnly": mount.read_only,
                    "selinuxRelabel": mount.selinux_relabel,
                }
                for mount in self.mounts
            ],
            "devices": [
                {
                    "hostPath": device.host_path,
                    "containerPath": device.container_path,
                    "permissions": device.permissions,
                }
                for device in self.devices
            ],
            "annotations": dict(self.annotations),
            "cdiDevices": list(self.cdi_devices),
            "conflicts": [
                {
                    "kind": conflict.kind,
                    "key": conflict.key,
                    "kept": conflict.kept,
                    "ignored": conflict.ignored,
                    "resource": conflict.resource,
                }
                for conflict in self.conflicts
            ],
        }


EMPTY = RuntimeConfig(
    envs=MappingProxyType({}),
    mounts=(),
    devices=(),
    annotations=MappingProxyType({}),
    cdi_devices=(),
    conflicts=(),
)


def merge(responses: Iterable[tuple[str, api_pb2.ContainerAllocateResponse]]) -> RuntimeConfig:
    """Merge ``(resource, response)`` pairs, in the order given, with the kubelet's first-wins rules."""
    envs: dict[str, str] = {}
    annotations: dict[str, str] = {}
    device_paths: dict[str, str] = {}
    mount_paths: dict[str, str] = {}
    mounts: list[RuntimeMount] = []
    devices: list[RuntimeDevice] = []
    cdi: list[str] = []
    conflicts: list[Conflict] = []

    def keyed(kind: str, target: dict[str, str], values: Mapping[str, str], resource: str) -> None:
        for key in sorted(values):
            value = values[key]
            if key in target:
                if target[key] != value:
                    conflicts.append(Conflict(kind, key, target[key], value, resource))
                continue
            target[key] = value

    for resource, response in responses:
        keyed("env", envs, response.envs, resource)
        for device in response.devices:
            if device.container_path in device_paths:
                if device_paths[device.container_path] != device.host_path:
                    conflicts.append(
                        Conflict(
                            "device",
                            device.container_path,
                            device_paths[device.container_path],
                            device.host_path,
                            resource,
                        )
                    )
                continue
            device_paths[device.container_path] = device.host_path
            devices.append(RuntimeDevice(device.host_path, device.container_path, device.permissions))
        for mount in response.mounts:
            if mount.container_path in mount_paths:
                if mount_paths[mount.container_path] != mount.host_path:
                    conflicts.append(
                        Conflict(
                            "mount",
                            mount.container_path,
                            mount_paths[mount.container_path],
                            mount.host_path,
                            resource,
                        )
                    )
                continue
            mount_paths[mount.container_path] = mount.host_path
            mounts.append(
                RuntimeMount(
                    name=mount.container_path,
                    container_path=mount.container_path,
                    host_path=mount.host_path,
                    read_only=mount.read_only,
                )
            )
        keyed("annotation", annotations, response.annotations, resource)
        for cdi_device in response.cdi_devices:
            if cdi_device.name not in cdi:
                cdi.append(cdi_device.name)
    return RuntimeConfig(
        envs=MappingProxyType(envs),
        mounts=tuple(mounts),
        devices=tuple(devices),
        annotations=MappingProxyType(annotations),
        cdi_devices=tuple(cdi),
        conflicts=tuple(conflicts),
    )
