"""The node's pool of one driver: the published form of one scan, and the way back from names to devices.

Claims name devices by their pool name (``gpu-6d3c...``), the kind's hooks
want device IDs and the snapshot they came from. A :class:`Pool` holds the
three together for one snapshot, so that a claim is always checked and
prepared against the very device set that was published, never against a
newer scan that raced it (the device-plugin side holds the same rule).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import structlog

from plugvisor.deviceplugin.snapshot import Snapshot
from plugvisor.dra.devices import PublishedDevice
from plugvisor.dra.hooks import DraDescriber, default_dra_devices


@dataclass(frozen=True, slots=True)
class Pool:
    """One snapshot as the driver offers it."""

    snapshot: Snapshot[Any] = field(default_factory=Snapshot)
    devices: Mapping[str, PublishedDevice] = field(default_factory=lambda: MappingProxyType({}))
    """Published devices by their name in the pool, in scan order."""
    ids: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """Device ID (the kind's) of each published name."""

    def healthy(self) -> list[PublishedDevice]:
        """What the slice lists: the published devices whose device is healthy now."""
        healthy = self.snapshot.devices.healthy_ids
        return [device for name, device in self.devices.items() if self.ids[name] in healthy]

    def is_healthy(self, name: str) -> bool:
        """Whether the named device's device is healthy."""
        return self.ids[name] in self.snapshot.devices.healthy_ids


def build_pool(snapshot: Snapshot[Any], describer: DraDescriber | None, *, driver: str) -> Pool:
    """The pool of ``snapshot``: the describer's answer (or the default), checked.

    Raises what the describer raises. An entry for a device the snapshot does
    not have, or a second device with a name already taken, is left out and
    logged: the rest is still offered.
    """
    if not snapshot.devices:  # before a first successful scan the kind's data may be missing too
        return Pool(snapshot)
    answer = describer.dra_devices(snapshot) if describer is not None else default_dra_devices(snapshot)
    log = structlog.get_logger("plugvisor.dra").bind(driver=driver)
    devices: dict[str, PublishedDevice] = {}
    ids: dict[str, str] = {}
    for device_id in snapshot.devices:
        published: object = answer.get(device_id)
        if published is None:
            continue
        if not isinstance(published, PublishedDevice):  # a kind written without a type checker
            log.error("dra_device_invalid", device=device_id, error=f"not a PublishedDevice: {published!r}")
            continue
        taken = ids.get(published.name)
        if taken is not None:
            log.error(
                "dra_device_name_taken",
                device=device_id,
                name=published.name,
                taken_by=taken,
                meaning="the device is not offered; names in a pool must be unique",
            )
            continue
        devices[published.name] = published
        ids[published.name] = device_id
    unknown = sorted(set(answer) - set(snapshot.devices))
    if unknown:
        log.error("dra_devices_unknown", devices=unknown[:10], meaning="not devices of this scan; left out")
    return Pool(snapshot, MappingProxyType(devices), MappingProxyType(ids))
