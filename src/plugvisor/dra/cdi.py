"""One CDI spec per prepared claim: the container edits the runtime applies for the claim's devices.

The kubelet hands the CDI device IDs a driver returns to the container runtime,
which looks them up in the node's CDI directory (``/var/run/cdi``) and applies
their ``containerEdits``. A driver writes those specs; per claim, so that
unpreparing a claim is removing one file (the Container Device Interface
spec, https://github.com/cncf-tags/container-device-interface/blob/main/SPEC.md).

- the spec's ``kind`` is ``k8s.<driver>/claim`` and its file is
  ``k8s.<driver>-claim_<claim UID>.json`` (CDI's name for a transient spec), so
  the file of a claim is known from its UID alone: an unprepare after a crash
  finds it even without the checkpoint;
- one CDI device per request of the claim, ``<claim UID>-<request>``, carries
  the request's edits, merged as Allocate merges a container's (device nodes,
  mounts, and variables such as ``NVIDIA_VISIBLE_DEVICES=a,b`` joined across
  the request's devices);
- the spec's ``plugvisor.io/prepared-claim`` annotation records the claim
  (namespace, name, UID, devices), so the checkpoint can be rebuilt from the
  specs if it is ever lost.

Written atomically: the runtime never reads half a spec.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from plugvisor.common.atomicfile import sync_directory, write_atomically
from plugvisor.deviceplugin.hooks import ContainerAllocation
from plugvisor.dra.checkpoint import PreparedClaim

CDI_VERSION: Final = "0.6.0"
"""The first CDI version with annotations on specs and devices."""
CLASS: Final = "claim"
CLAIM_ANNOTATION: Final = "plugvisor.io/prepared-claim"
_MAX_SPEC_BYTES: Final = 4 << 20


def vendor(driver: str) -> str:
    """The CDI vendor of a driver's claim specs (``k8s.gpu.plugvisor.io``)."""
    return f"k8s.{driver}"


def kind(driver: str) -> str:
    """The CDI kind of a driver's claim specs (``k8s.gpu.plugvisor.io/claim``)."""
    return f"{vendor(driver)}/{CLASS}"


def spec_file_name(driver: str, claim_uid: str) -> str:
    """The spec file of one claim (``k8s.gpu.plugvisor.io-claim_<uid>.json``)."""
    return f"{vendor(driver)}-{CLASS}_{claim_uid}.json"


def device_name(claim_uid: str, request: str) -> str:
    """The CDI device of one request of a claim."""
    return f"{claim_uid}-{request}"


def qualified(driver: str, name: str) -> str:
    """The fully qualified CDI device ID the kubelet passes on (``k8s.gpu.plugvisor.io/claim=<uid>-gpus``)."""
    return f"{kind(driver)}={name}"


def container_edits(allocation: ContainerAllocation) -> dict[str, Any]:
    """A container allocation as CDI ``containerEdits`` (empty parts left out).

    Annotations have no place in a container's CDI edits; they are kept as the
    CDI device's own annotations (information for people, not for the container).
    """
    edits: dict[str, Any] = {}
    if allocation.envs:
        edits["env"] = [f"{key}={value}" for key, value in sorted(allocation.envs.items())]
    if allocation.specs:
        edits["deviceNodes"] = [
            {"path": spec.container_path, "hostPath": spec.host_path, "permissions": spec.permissions}
            for spec in allocation.specs
        ]
    if allocation.mounts:
        edits["mounts"] = [
            {
                "hostPath": mount.host_path,
                "containerPath": mount.container_path,
                "options": ["rbind", "rprivate", "ro" if mount.read_only else "rw"],
            }
            for mount in allocation.mounts
        ]
    return edits


def render(
    driver: str, claim: PreparedClaim, requests: Sequence[tuple[str, ContainerAllocation]]
) -> dict[str, Any] | None:
    """The claim's spec document, one device per request with edits; None when no request has any."""
    devices: list[dict[str, Any]] = []
    for request, allocation in requests:
        edits = container_edits(allocation)
        if not edits:
            continue
        device: dict[str, Any] = {"name": device_name(claim.claim.uid, request), "containerEdits": edits}
        if allocation.annotations:
            device["annotations"] = dict(allocation.annotations)
        devices.append(device)
    if not devices:
        return None
    record = {**claim.to_json(), "spec": None, "cdiSpec": spec_file_name(driver, claim.claim.uid)}
    return {
        "cdiVersion": CDI_VERSION,
        "kind": kind(driver),
        "annotations": {CLAIM_ANNOTATION: json.dumps(record, sort_keys=True, separators=(",", ":"))},
        "devices": devices,
    }


def encode(document: Mapping[str, Any]) -> bytes:
    """A spec's bytes: deterministic, so that writing the same spec again changes nothing."""
    return (json.dumps(document, indent=2) + "\n").encode()


def write(directory: Path, file_name: str, document: Mapping[str, Any]) -> Path:
    """Write one spec atomically and durably (raises :class:`OSError`); returns its path."""
    path = directory / file_name
    write_atomically(path, encode(document), mode=0o644)
    return path


def remove(directory: Path, file_name: str) -> bool:
    """Remove one spec if it is there; True if it was (:class:`OSError` for anything but its absence)."""
    try:
        (directory / file_name).unlink()
    except FileNotFoundError:
        return False
    sync_directory(directory)
    return True


def exists(directory: Path, file_name: str) -> bool:
    """Whether the spec file is there (a link in its place is not our spec)."""
    with contextlib.suppress(OSError):
        return (directory / file_name).lstat().st_mode & 0o170000 == 0o100000
    return False


RELEASED_SUFFIX: Final = ".released"
"""A claim's release marker ends so: no CDI runtime reads it (they read ``*.json`` and ``*.yaml``)."""


def release_marker(driver: str, claim_uid: str) -> str:
    """The file saying a claim was released though the checkpoint lists it (``...-claim_<uid>.released``)."""
    return spec_file_name(driver, claim_uid).removesuffix(".json") + RELEASED_SUFFIX


def mark_released(directory: Path, driver: str, claim_uid: str) -> None:
    """Leave the claim's release marker (an empty file: it needs an inode, no data block); :class:`OSError`.

    For an unprepare whose release hooks ran but whose checkpoint could not be
    written (a full disk): a driver restarted before the next write must not
    take the claim for prepared and release it again. The CDI directory is
    usually a tmpfs, not the full disk of the checkpoint.
    """
    directory.mkdir(parents=True, exist_ok=True)  # a claim without edits wrote no spec there yet
    path = directory / release_marker(driver, claim_uid)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    os.close(fd)
    sync_directory(directory)


def unmark_released(directory: Path, driver: str, claim_uid: str) -> None:
    """Remove the claim's release marker if it is there (:class:`OSError` for anything but its absence)."""
    try:
        (directory / release_marker(driver, claim_uid)).unlink()
    except FileNotFoundError:
        return
    sync_directory(directory)


def released(directory: Path, driver: str) -> set[str]:
    """The UIDs of the claims whose release marker is in ``directory`` (none when it cannot be read)."""
    prefix = f"{vendor(driver)}-{CLASS}_"
    try:
        names = [path.name for path in directory.iterdir()]
    except OSError:
        return set()
    return {
        name[len(prefix) : -len(RELEASED_SUFFIX)]
        for name in names
        if name.startswith(prefix) and name.endswith(RELEASED_SUFFIX)
    }


def recover(directory: Path, driver: str) -> tuple[dict[str, PreparedClaim], list[str]]:
    """The prepared claims the driver's specs in ``directory`` record, and what could not be read.

    What rebuilds the checkpoint when it is lost or damaged: every
    ``k8s.<driver>-claim_*.json`` whose annotation names a claim. A claim whose
    devices had no edits has no spec and is not found; unpreparing it needs
    nothing but its release hooks, which then do not run.
    """
    prefix = f"{vendor(driver)}-{CLASS}_"
    found: dict[str, PreparedClaim] = {}
    problems: list[str] = []
    try:
        names = sorted(entry.name for entry in directory.iterdir() if entry.name.startswith(prefix))
    except OSError as exc:
        return {}, [f"{directory}: cannot list it: {exc.strerror or exc}"]
    for name in names:
        path = directory / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as handle:
                document = json.loads(handle.read(_MAX_SPEC_BYTES))
            record = json.loads(document["annotations"][CLAIM_ANNOTATION])
            claim = PreparedClaim.from_json(record)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            problems.append(f"{path}: {type(exc).__name__}: {exc}")
            continue
        found[claim.claim.uid] = PreparedClaim(claim.claim, claim.devices, name, document)
    return found, problems
