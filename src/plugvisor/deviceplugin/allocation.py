"""Request checking and the default allocation, as pure functions over domain values.

Kept apart from the servicer so the rules can be unit-tested and fuzzed without
sockets, and so the servicer stays a thin translation layer. Every rejection
names the offending IDs; IDs are only ever used as keys into the current
:class:`DeviceSet`, never as paths, so an ID such as ``../../etc`` is simply an
unknown ID.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

import grpc

from plugvisor.common.validation import shorten
from plugvisor.deviceplugin.devices import DeviceSet, DeviceSpec, Mount
from plugvisor.deviceplugin.errors import RequestError
from plugvisor.deviceplugin.hooks import ContainerAllocation

_SHOWN_IDS = 10
_SHOWN_ID_LENGTH = 80  # a 1 MB ID echoed whole would exceed gRPC's 16 KiB status limit: RESOURCE_EXHAUSTED


def format_ids(ids: Iterable[str]) -> str:
    """Render IDs for an error message: JSON-quoted (control characters escaped), each and all capped."""
    items = sorted(set(ids))
    shown = json.dumps([shorten(item, _SHOWN_ID_LENGTH) for item in items[:_SHOWN_IDS]])
    if len(items) > _SHOWN_IDS:
        shown = shown[:-1] + f", ... and {len(items) - _SHOWN_IDS} more]"
    return shown


def _duplicates(ids: Sequence[str]) -> set[str]:
    seen: set[str] = set()
    dups: set[str] = set()
    for i in ids:
        if i in seen:
            dups.add(i)
        seen.add(i)
    return dups


def _check_listed(ids: Sequence[str], *, where: str, resource: str, what: str = "device IDs") -> None:
    """Refuse an empty list, or one that names a device twice."""
    if not ids:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"{where}: no {what} for resource {resource}")
    if len(set(ids)) != len(ids):  # the set is built in C; which IDs repeat is worked out only then
        dups = _duplicates(ids)
        raise RequestError(
            grpc.StatusCode.INVALID_ARGUMENT, f"{where}: {what} {format_ids(dups)} are listed more than once"
        )


def _check_known(ids: Sequence[str], devices: DeviceSet, *, where: str, resource: str) -> None:
    unknown = [i for i in ids if i not in devices]
    if unknown:
        raise RequestError(
            grpc.StatusCode.NOT_FOUND,
            f"{where}: unknown device IDs {format_ids(unknown)} for resource {resource}",
        )


def _check_known_and_healthy(ids: Sequence[str], devices: DeviceSet, *, where: str, resource: str) -> None:
    healthy = devices.healthy_ids
    if healthy.issuperset(ids):  # the usual case, in one pass in C: every ID is known and healthy
        return
    _check_known(ids, devices, where=where, resource=resource)
    unhealthy = [i for i in ids if i not in healthy]
    if unhealthy:
        raise RequestError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"{where}: device IDs {format_ids(unhealthy)} of resource {resource} are unhealthy",
        )


def check_allocate(containers: Sequence[Sequence[str]], devices: DeviceSet, *, resource: str) -> None:
    """Refuse an Allocate request that cannot be honoured exactly as asked.

    The kubelet sends one container request per call, but the API allows several;
    a device may appear only once across the whole request, because two containers
    handed the same exclusive device is a double allocation.
    """
    if not containers:
        raise RequestError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"Allocate for {resource}: the request has no container requests",
        )
    seen: dict[str, int] = {}
    for index, ids in enumerate(containers):
        where = f"Allocate container request {index}"
        _check_listed(ids, where=where, resource=resource)
        _check_known_and_healthy(ids, devices, where=where, resource=resource)
        shared = [i for i in ids if i in seen]
        if shared:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{where}: device IDs {format_ids(shared)} are also requested "
                f"by container request {seen[shared[0]]}",
            )
        for i in ids:
            seen[i] = index


def check_pre_start(ids: Sequence[str], devices: DeviceSet, *, resource: str) -> None:
    """Refuse a PreStartContainer call for devices we do not have.

    Health is not checked: a container restarting on a device that has since gone
    unhealthy is the kubelet's call to make, and the pre-start hook may be what
    brings the device back.
    """
    _check_listed(ids, where="PreStartContainer", resource=resource)
    _check_known(ids, devices, where="PreStartContainer", resource=resource)


def check_preferred(
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    devices: DeviceSet,
    *,
    index: int,
    resource: str,
) -> None:
    """Refuse a GetPreferredAllocation container request that has no valid answer."""
    where = f"GetPreferredAllocation container request {index}"
    _check_listed(available, where=where, resource=resource, what="available device IDs")
    if must_include:
        _check_listed(must_include, where=where, resource=resource, what="must-include device IDs")
    _check_known_and_healthy(available, devices, where=where, resource=resource)
    offered = set(available)
    outside = [i for i in must_include if i not in offered]
    if outside:
        raise RequestError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{where}: must-include device IDs {format_ids(outside)} are not among the available IDs",
        )
    if size <= 0:
        raise RequestError(
            grpc.StatusCode.INVALID_ARGUMENT, f"{where}: allocation size {size} must be positive"
        )
    if size > len(available):
        raise RequestError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{where}: allocation size {size} cannot be met from {len(available)} available devices",
        )
    if size < len(must_include):
        raise RequestError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{where}: allocation size {size} is smaller than the {len(must_include)} must-include devices",
        )


def default_preferred(available: Sequence[str], must_include: Sequence[str], size: int) -> list[str]:
    """The framework's choice without a hook: the must-include IDs, then the others in the kubelet's order."""
    chosen = list(must_include)
    taken = set(chosen)
    for device_id in available:
        if len(chosen) >= size:
            break
        if device_id not in taken:
            chosen.append(device_id)
            taken.add(device_id)
    return chosen


def is_valid_preferred(
    answer: Sequence[str], available: Sequence[str], must_include: Sequence[str], size: int
) -> bool:
    """Whether a hook's answer honours the request (right size, from available, includes must-include)."""
    chosen = set(answer)
    return (
        len(answer) == size
        and len(chosen) == size
        and chosen <= set(available)
        and set(must_include) <= chosen
    )


def _merge_values(pairs: Iterable[tuple[str, str]]) -> dict[str, str]:
    """Merge key/value pairs from several devices: distinct values of one key join with commas.

    That is what visible-devices style variables want (``X_VISIBLE_DEVICES=a,b``);
    a plugin that needs another rule edits the result in a PostAllocator.
    """
    merged: dict[str, list[str]] = {}
    for key, value in pairs:
        values = merged.setdefault(key, [])
        if value not in values:
            values.append(value)
    return {key: ",".join(values) for key, values in merged.items()}


def build_allocation(devices: DeviceSet) -> ContainerAllocation:
    """The default allocation for one container: the union of what its devices carry.

    Device nodes and mounts are de-duplicated by container path (replicas of one
    device share its nodes); the first device in request order wins a conflict,
    as the kubelet's own merge does.
    """
    specs: dict[str, DeviceSpec] = {}
    mounts: dict[str, Mount] = {}
    cdi: dict[str, None] = {}
    envs: list[tuple[str, str]] = []
    annotations: list[tuple[str, str]] = []
    for device in devices.values():
        for spec in device.specs:
            specs.setdefault(spec.container_path, spec)
        for mount in device.mounts:
            mounts.setdefault(mount.container_path, mount)
        for name in device.cdi_devices:
            cdi.setdefault(name, None)
        envs.extend(device.envs.items())
        annotations.extend(device.annotations.items())
    return ContainerAllocation(
        specs=tuple(specs.values()),
        mounts=tuple(mounts.values()),
        envs=_merge_values(envs),
        annotations=_merge_values(annotations),
        cdi_devices=tuple(cdi),
    )
