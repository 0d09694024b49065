"""The node's pool of one driver: the published form of one scan, and the way back from names to devices.

Claims name devices by their pool name (``gpu-6d3c...``), the kind's hooks
want device IDs and the snapshot they came from. A :class:`Pool` holds the
three together for one snapshot, so that a claim is always checked and
prepared against the very device set that was published, never against a
newer scan that raced it (the device-plugin side holds the same rule).

It is also where every device gets a name of its own (:func:`distinct_names`):
kinds name devices one at a time, and two IDs that differ only in case or
punctuation make one DNS label.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Final

import structlog

from plugvisor.common.names import dns_label_problem
from plugvisor.common.validation import shorten
from plugvisor.deviceplugin.snapshot import Snapshot
from plugvisor.dra.devices import PublishedDevice
from plugvisor.dra.hooks import DraDescriber, default_dra_devices, with_hash

_HASH_LENGTHS: Final = (6, 12, 24, 40)
"""Hex digits of a device ID's SHA-256 in its name, by round; 40 leave 22 characters of the name."""


@dataclass(frozen=True, slots=True)
class Pool:
    """One snapshot as the driver offers it."""

    snapshot: Snapshot[Any] = field(default_factory=Snapshot)
    devices: Mapping[str, PublishedDevice] = field(default_factory=lambda: MappingProxyType({}))
    """Published devices by their name in the pool, in scan order."""
    ids: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """Device ID (the kind's) of each published name."""

    @property
    def names(self) -> Mapping[str, str]:
        """The name in the pool of each published device ID (the way from the kind's IDs to names)."""
        return {device_id: name for name, device_id in self.ids.items()}

    def healthy(self) -> list[PublishedDevice]:
        """What the slice lists: the published devices whose device is healthy now."""
        healthy = self.snapshot.devices.healthy_ids
        return [device for name, device in self.devices.items() if self.ids[name] in healthy]

    def listed(self) -> list[PublishedDevice]:
        """What the slice lists: the healthy devices, and the unhealthy ones that carry a taint.

        A kind that says why a device is unhealthy with a taint (the gpu kind's
        ``gpu.plugvisor.io/xid``) gets the device published with it, so that
        ``kubectl get resourceslice`` shows the reason and the scheduler keeps
        new claims off it; the slice publisher withdraws it instead where the
        cluster drops taints. An unhealthy device without taints is withdrawn.
        """
        healthy = self.snapshot.devices.healthy_ids
        return [
            device
            for name, device in self.devices.items()
            if self.ids[name] in healthy
            or any(t.effect in ("NoSchedule", "NoExecute") for t in device.taints)
        ]

    def is_healthy(self, name: str) -> bool:
        """Whether the named device's device is healthy."""
        return self.ids[name] in self.snapshot.devices.healthy_ids


def build_pool(
    snapshot: Snapshot[Any],
    describer: DraDescriber | None,
    *,
    driver: str,
    pinned: Mapping[str, str] = MappingProxyType({}),
) -> Pool:
    """The pool of ``snapshot``: the describer's answer (or the default), checked, every name distinct.

    ``pinned``: the name of each device ID that a prepared claim holds (see
    :func:`distinct_names`). Raises what the describer raises. An entry for a
    device the snapshot does not have is left out and logged.
    """
    if not snapshot.devices:  # before a first successful scan the kind's data may be missing too
        return Pool(snapshot)
    answer = describer.dra_devices(snapshot) if describer is not None else default_dra_devices(snapshot)
    log = structlog.get_logger("plugvisor.dra").bind(driver=driver)
    wanted: dict[str, PublishedDevice] = {}
    for device_id in snapshot.devices:
        published: object = answer.get(device_id)
        if published is None:
            continue
        if not isinstance(published, PublishedDevice):  # a kind written without a type checker
            log.error("dra_device_invalid", device=device_id, error=f"not a PublishedDevice: {published!r}")
            continue
        wanted[device_id] = published
    unknown = sorted(set(answer) - set(snapshot.devices))
    if unknown:
        log.error("dra_devices_unknown", devices=unknown[:10], meaning="not devices of this scan; left out")
    pins = {device_id: name for device_id, name in pinned.items() if dns_label_problem(name) is None}
    names = distinct_names({device_id: device.name for device_id, device in wanted.items()}, pins)
    renamed = {i: name for i, name in names.items() if name is not None and name != wanted[i].name}
    if renamed:
        log.info(
            "dra_device_names_disambiguated",
            devices={
                shorten(i, 80): f"{wanted[i].name} -> {name}" for i, name in sorted(renamed.items())[:10]
            },
            meaning="devices named alike get a hash of their ID; a prepared claim's device keeps its name",
        )
    devices: dict[str, PublishedDevice] = {}
    ids: dict[str, str] = {}
    for device_id, name in names.items():
        if name is None:
            log.error(
                "dra_device_name_taken",
                device=shorten(device_id, 80),
                meaning="the device is not offered: other devices are named like each of its hashed names",
            )
            continue
        device = wanted[device_id]
        devices[name] = device if name == device.name else replace(device, name=name)
        ids[name] = device_id
    return Pool(snapshot, MappingProxyType(devices), MappingProxyType(ids))


def distinct_names(wanted: Mapping[str, str], pinned: Mapping[str, str]) -> dict[str, str | None]:
    """A distinct DNS label for every device ID of ``wanted`` (ID -> the name its kind gives it), same order.

    A function of the two mappings' contents, never of their order (the scan's
    order may change from one start to the next), so that a restarted driver
    gives every device the name the claims allocated from its slices know:

    - a name only one device wants is that device's;
    - devices that want one name (IDs that differ only in case or punctuation,
      ``AB-1`` and ``ab_1``) each get it with a hash of their own ID added
      (``ab-1-22bb3d``); a device of a prepared claim (``pinned``: its name
      then) keeps that name, and only the newcomer gets a hash;
    - a readable name beats a hashed one that happens to be the same (a device
      named to look like another's hashed name), and names that still meet get
      a longer hash, until none does; a device that meets a readable name
      with its longest hash (other devices named after its every hashed name:
      made so on purpose) gets none (None).
    """
    level = dict.fromkeys(wanted, 0)
    """0: the name as wanted or pinned; n: with _HASH_LENGTHS[n - 1] digits of the ID's hash."""

    def name(device_id: str) -> str:
        if level[device_id] == 0:
            return pinned.get(device_id) or wanted[device_id]
        return with_hash(wanted[device_id], device_id, _HASH_LENGTHS[level[device_id] - 1])

    def rank(device_id: str) -> int:
        """Who keeps a name several devices want: the one of the lowest rank, when it is the only one."""
        return 0 if level[device_id] == 0 and device_id in pinned else level[device_id] + 1

    while True:
        claimants: dict[str, list[str]] = {}
        for device_id in wanted:
            claimants.setdefault(name(device_id), []).append(device_id)
        losers: set[str] = set()
        for group in claimants.values():
            ranks = [rank(device_id) for device_id in group]
            best = min(ranks)
            unique = ranks.count(best) == 1
            losers.update(i for i, r in zip(group, ranks, strict=True) if r > best or not unique)
        moving = [device_id for device_id in losers if level[device_id] < len(_HASH_LENGTHS)]
        if not moving:
            return {device_id: None if device_id in losers else name(device_id) for device_id in wanted}
        for device_id in moving:
            level[device_id] += 1
