"""The ``tty`` kind: USB serial adapters (``ttyUSB*``, ``ttyACM*``) as devices, one per port.

Written against plugvisor's public contract only (``plugvisor.plugins.PluginKind``,
``plugvisor.deviceplugin``): read sysfs under the host root, return one snapshot
per scan, and answer hooks from the snapshot they are given.

Each port is ``/dev/<name>``; its driver is the name of ``sys/class/tty/<name>/device/driver``.
A port whose device node is missing is Unhealthy. Allocate hands the node to the
container and sets ``SERIAL_PORTS`` to the ports' stable ``/dev/serial/by-id``
names, read in the same scan.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import pydantic

from plugvisor.deviceplugin import ContainerAllocation, Device, DeviceSpec, Health, HostPaths, Snapshot
from plugvisor.plugins import PluginKind

__all__ = ["KIND", "TtyOptions", "TtySource"]


class TtyOptions(pydantic.BaseModel):
    """The ``tty`` keys of a ``resources`` entry."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    names: list[str] = pydantic.Field(default_factory=lambda: ["ttyUSB*", "ttyACM*"], min_length=1)
    """Port names to serve (shell patterns)."""
    drivers: list[str] | None = None
    """Only ports bound to one of these drivers (``ftdi_sio``, ``cdc_acm``...); all when absent."""


@dataclass(frozen=True)
class TtyScan:
    """What the hooks need from one scan: each port's stable ``/dev/serial/by-id`` name, when it has one."""

    by_id: Mapping[str, str] = field(default_factory=dict)


class TtySource:
    """The device source; it keeps nothing between scans (everything a hook needs is in the snapshot)."""

    def __init__(self, options: TtyOptions, paths: HostPaths, *, resource: str) -> None:
        self.options = options
        self.paths = paths
        self.resource = resource

    def scan(self) -> Snapshot[TtyScan]:
        """One device per matching port, Unhealthy when its device node is missing."""
        classes = self.paths.sysfs / "class" / "tty"
        names = sorted(p.name for p in classes.iterdir()) if classes.is_dir() else []
        devices: list[Device] = []
        for name in names:
            if not any(fnmatch.fnmatchcase(name, pattern) for pattern in self.options.names):
                continue
            if self.options.drivers is not None and _driver(classes / name) not in self.options.drivers:
                continue
            node = self.paths.devfs / name
            devices.append(
                Device(
                    name,
                    health=Health.HEALTHY if node.exists() else Health.UNHEALTHY,
                    specs=[DeviceSpec(f"/dev/{name}", self.paths.for_kubelet(node))],
                )
            )
        by_id_dir = self.paths.devfs / "serial" / "by-id"
        watch = [self.paths.devfs, classes, by_id_dir]
        return Snapshot(devices, watch=watch, data=TtyScan(_by_id(by_id_dir)))

    def post_allocate(
        self, allocation: ContainerAllocation, snapshot: Snapshot[TtyScan]
    ) -> ContainerAllocation:
        """Tell the container its ports' stable names (``SERIAL_PORTS``, comma-separated, in order)."""
        stable = [snapshot.data.by_id.get(port, port) for port in snapshot.devices]
        return ContainerAllocation(
            specs=allocation.specs,
            mounts=allocation.mounts,
            envs={**allocation.envs, "SERIAL_PORTS": ",".join(stable)},
            annotations=allocation.annotations,
            cdi_devices=allocation.cdi_devices,
        )


def _driver(port: Path) -> str | None:
    try:
        return (port / "device" / "driver").readlink().name
    except OSError:
        return None


def _by_id(directory: Path) -> dict[str, str]:
    """``ttyUSB0`` -> ``usb-FTDI_FT232R_A1B2-if00-port0``, from the links udev keeps."""
    try:
        entries = sorted(p.name for p in directory.iterdir())
    except OSError:
        return {}
    found: dict[str, str] = {}
    for entry in entries:
        try:
            target = (directory / entry).readlink().name
        except OSError:
            continue
        found.setdefault(target, entry)
    return found


KIND: Final = PluginKind("tty", TtyOptions, TtySource)
