"""Claims and slices as files: the API server's part, for a node that has none (emulation, tests).

Without a scheduler and an API server nobody allocates claims or stores
slices, yet a driver's whole node side (registration, prepare, CDI, health,
restarts) can be exercised honestly: the allocation a scheduler would have made
is written as a ResourceClaim object by whoever plays the scheduler (a test,
the emulated kubelet), and the slices the driver publishes are written as
ResourceSlice objects for anyone to read. Both are the API's own JSON shapes
(``resource.k8s.io/v1``), in one directory::

    <dir>/resourceclaims/<namespace>/<name>.json    read by FileClaimReader
    <dir>/resourceslices/<driver>-<pool>.json       written by FileSlicePublisher

``plugvisor plugin KIND --mode dra --objects-dir DIR`` runs a driver this way.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import structlog

from plugvisor.common.atomicfile import write_atomically
from plugvisor.common.validation import bounded, shorten
from plugvisor.dra.cluster import AllocatedDevice, ClaimError, PublishState
from plugvisor.dra.devices import PublishedDevice, device_json

API_VERSION: Final = "resource.k8s.io/v1"
CLAIMS_DIR: Final = "resourceclaims"
SLICES_DIR: Final = "resourceslices"
_MAX_OBJECT_BYTES: Final = 4 << 20


def claim_path(directory: Path, namespace: str, name: str) -> Path:
    """Where the claim ``namespace/name`` is kept."""
    return directory / CLAIMS_DIR / namespace / f"{name}.json"


def slice_path(directory: Path, driver: str, pool: str) -> Path:
    """Where the driver's slice of ``pool`` is kept."""
    return directory / SLICES_DIR / f"{driver}-{pool}.json"


class ClaimObjectError(ValueError):
    """A claim file that is no ResourceClaim the API server would store; the message names the field."""


class NotAllocatedError(LookupError):
    """A ResourceClaim without ``status.allocation``: the scheduler has not allocated it (yet)."""


def _read_json(path: Path) -> Any:
    """The file's JSON; :class:`ClaimObjectError` for one over the size limit or not JSON."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as handle:
        content = handle.read(_MAX_OBJECT_BYTES + 1)
    if len(content) > _MAX_OBJECT_BYTES:
        raise ClaimObjectError(f"larger than {_MAX_OBJECT_BYTES >> 20} MiB, no claim is")
    try:
        return json.loads(content)
    except ValueError as exc:
        raise ClaimObjectError(f"not JSON: {shorten(str(exc), 200)}") from None


def _kind_of(value: object) -> str:
    """What a JSON value is, for a message: ``null``, ``a list``, ``7``."""
    if value is None:
        return "null"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return bounded(json.dumps(value), 40)


def _object(value: object, where: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise ClaimObjectError(f"{where}: expected an object, got {_kind_of(value)}")
    return value


def _claim_object(document: object) -> Mapping[str, Any]:
    if not isinstance(document, dict):
        raise ClaimObjectError(f"not a ResourceClaim: expected a JSON object, got {_kind_of(document)}")
    return document


def _string(result: Mapping[str, Any], key: str, where: str) -> str:
    value = result.get(key)
    if not isinstance(value, str):
        raise ClaimObjectError(f"{where}.{key}: expected a string, got {_kind_of(value)}")
    return value


def allocation_results(claim: Mapping[str, Any]) -> list[AllocatedDevice]:
    """A ResourceClaim object's ``status.allocation.devices.results``, each field of the type the API has.

    Raises :class:`NotAllocatedError` when the claim has no allocation, and
    :class:`ClaimObjectError`, naming the field, for a value of the wrong type:
    ``adminAccess: "false"`` is refused, not read as true (a non-empty string),
    which would share a device another claim holds.
    """
    status = claim.get("status")
    if status is None or _object(status, "status").get("allocation") is None:
        raise NotAllocatedError
    allocation = _object(status["allocation"], "status.allocation")
    devices = _object(allocation.get("devices"), "status.allocation.devices")
    results = devices.get("results")
    where = "status.allocation.devices.results"
    if not isinstance(results, list):
        raise ClaimObjectError(f"{where}: expected a list, got {_kind_of(results)}")
    allocated = []
    for index, item in enumerate(results):
        entry = f"{where}[{index}]"
        result = _object(item, entry)
        admin = result.get("adminAccess")
        if admin is not None and not isinstance(admin, bool):
            raise ClaimObjectError(f"{entry}.adminAccess: expected true or false, got {_kind_of(admin)}")
        allocated.append(
            AllocatedDevice(
                request=_string(result, "request", entry),
                driver=_string(result, "driver", entry),
                pool=_string(result, "pool", entry),
                device=_string(result, "device", entry),
                admin_access=bool(admin),
            )
        )
    return allocated


class FileClaimReader:
    """Reads allocated claims from ``<dir>/resourceclaims``, with the API server's three refusals."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    async def allocated_devices(self, *, namespace: str, name: str, uid: str) -> Sequence[AllocatedDevice]:
        """The claim's allocated devices; :class:`ClaimError` when it is missing, newer or not allocated."""
        return await asyncio.to_thread(self._read, namespace, name, uid)

    def _read(self, namespace: str, name: str, uid: str) -> list[AllocatedDevice]:
        path = claim_path(self.directory, namespace, name)
        if "/" in namespace or "/" in name or namespace in {"", ".", ".."} or name in {"", ".", ".."}:
            raise ClaimError(f"resourceclaims {name!r} in namespace {namespace!r}: not a valid name")
        try:
            claim = _claim_object(_read_json(path))
            found = _string(_object(claim.get("metadata"), "metadata"), "uid", "metadata")
        except FileNotFoundError:
            raise ClaimError(f'resourceclaims "{name}" not found in namespace "{namespace}"') from None
        except OSError as exc:
            raise ClaimError(f"{path}: cannot read the claim: {exc.strerror or exc}") from None
        except ClaimObjectError as exc:
            raise ClaimError(f"{path}: {exc}") from None
        if found != uid:
            shown = bounded(found, 140)
            raise ClaimError(
                f"{namespace}/{name} now has UID {shown}, not {uid}: the claim was deleted and created again"
            )
        try:
            return allocation_results(claim)
        except NotAllocatedError:
            raise ClaimError(f"{namespace}/{name} is not allocated") from None
        except ClaimObjectError as exc:
            raise ClaimError(f"{path}: {exc}") from None


class FileSlicePublisher:
    """Writes the driver's pool on this node as one ResourceSlice file; a new generation at every change."""

    def __init__(
        self,
        directory: Path,
        *,
        driver: str,
        node_name: str,
        on_state: Callable[[PublishState], None] | None = None,
    ) -> None:
        self.path = slice_path(directory, driver, node_name)
        self.driver = driver
        self.node_name = node_name
        self.generation = 0
        self._devices: list[dict[str, Any]] | None = None
        self._on_state = on_state
        self._log = structlog.get_logger("plugvisor.dra").bind(driver=driver)

    def _report(self, state: PublishState) -> None:
        if self._on_state is not None:
            self._on_state(state)

    async def publish(self, devices: Sequence[PublishedDevice]) -> None:
        """Write the slice if the devices changed or the file is gone (a failed write is logged)."""
        rendered = [device_json(device) for device in devices]
        if rendered == self._devices and await asyncio.to_thread(self.path.exists):
            return
        generation = self.generation + 1
        document = {
            "apiVersion": API_VERSION,
            "kind": "ResourceSlice",
            "metadata": {"name": f"{self.node_name}-{self.driver}"},
            "spec": {
                "driver": self.driver,
                "nodeName": self.node_name,
                "pool": {"name": self.node_name, "generation": generation, "resourceSliceCount": 1},
                "devices": rendered,
            },
        }
        content = (json.dumps(document, indent=1) + "\n").encode()
        try:
            await asyncio.to_thread(write_atomically, self.path, content, durable=False)
        except OSError as exc:
            error = f"{self.path}: {exc.strerror or exc}"
            self._log.error("slice_not_written", path=str(self.path), error=exc.strerror or str(exc))
            self._report(PublishState(error=error))
            return
        self.generation, self._devices = generation, rendered
        self._report(PublishState(True, len(rendered), generation=generation, slices=1))

    def hold(self) -> None:
        """Nothing to stop: the file is written only by :meth:`publish`, and nobody repairs it."""

    async def withdraw(self) -> None:
        """Remove the slice file."""
        await asyncio.to_thread(self.path.unlink, missing_ok=True)
        self._devices = None

    async def close(self) -> None:
        """Nothing to release: the file stays, as slices stay for a restarting driver."""
