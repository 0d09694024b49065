"""The claims a driver prepared, kept on disk so that a restarted driver can unprepare them.

The kubelet calls NodeUnprepareResources for a claim once its last pod is gone,
also when the driver restarted in between (a crash, an upgrade, a SIGKILL by
the agent). The driver must then still know what it did for the claim: which
devices (their release hooks run now), which CDI spec. That is this file,
``<kubelet root>/plugins/<driver>/prepared-claims.json``.

It is written whole, atomically and durably (temporary file, fsync, rename,
directory fsync), so a kill at any instant leaves either the old or the new
content; it carries a format version and a SHA-256 of its content, so a file
that was damaged or hand-edited is recognised as such (:class:`CheckpointError`)
instead of being half-trusted. The claims' CDI specs are a second record of
the same facts (:mod:`plugvisor.dra.cdi`): the runtime rebuilds the list from
them when this file is unusable.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from plugvisor.common.atomicfile import write_atomically
from plugvisor.dra.cluster import ClaimRef

FILE_NAME: Final = "prepared-claims.json"
FORMAT: Final = "plugvisor.io/dra-prepared-claims"
VERSION: Final = 1
MAX_BYTES: Final = 64 << 20
"""A checkpoint larger than this is not read (4,000 claims of 32 devices take about 4 MB)."""


class CheckpointError(Exception):
    """The checkpoint file exists but cannot be trusted; the message names the file and why."""


@dataclass(frozen=True, slots=True)
class PreparedDevice:
    """One device of a prepared claim: what the kubelet was told, and which of the kind's devices it is."""

    request_names: tuple[str, ...]
    pool: str
    device: str
    device_id: str
    cdi_device_ids: tuple[str, ...] = ()
    admin_access: bool = False

    def to_json(self) -> dict[str, Any]:
        """The checkpoint's form."""
        return {
            "requestNames": list(self.request_names),
            "pool": self.pool,
            "device": self.device,
            "deviceId": self.device_id,
            "cdiDeviceIds": list(self.cdi_device_ids),
            "adminAccess": self.admin_access,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PreparedDevice:
        """Read the checkpoint's form (``KeyError``, ``TypeError`` or ``ValueError`` when it is not)."""
        return cls(
            request_names=_strings(data["requestNames"]),
            pool=_string(data["pool"]),
            device=_string(data["device"]),
            device_id=_string(data["deviceId"]),
            cdi_device_ids=_strings(data["cdiDeviceIds"]),
            admin_access=_bool(data["adminAccess"]),
        )


@dataclass(frozen=True, slots=True)
class PreparedClaim:
    """A claim the driver prepared: its devices, and the CDI spec written for it (None: no edits)."""

    claim: ClaimRef
    devices: tuple[PreparedDevice, ...]
    cdi_spec: str | None = None
    """The spec's file name in the CDI directory."""
    spec: Mapping[str, Any] | None = None
    """The spec's document, to write it again should the CDI directory lose it (a tmpfs after a reboot)."""

    @property
    def device_ids(self) -> tuple[str, ...]:
        """The kind's device IDs of the claim, in allocation order."""
        return tuple(device.device_id for device in self.devices)

    @property
    def device_names(self) -> tuple[str, ...]:
        """The pool's device names of the claim, in allocation order."""
        return tuple(device.device for device in self.devices)

    def to_json(self) -> dict[str, Any]:
        """The checkpoint's form."""
        return {
            "namespace": self.claim.namespace,
            "name": self.claim.name,
            "uid": self.claim.uid,
            "devices": [device.to_json() for device in self.devices],
            "cdiSpec": self.cdi_spec,
            "spec": None if self.spec is None else dict(self.spec),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PreparedClaim:
        """Read the checkpoint's form (``KeyError``, ``TypeError`` or ``ValueError`` when it is not)."""
        spec = data["spec"]
        if spec is not None and not isinstance(spec, dict):
            raise TypeError("spec must be an object or null")
        cdi_spec = data["cdiSpec"]
        return cls(
            claim=ClaimRef(_string(data["namespace"]), _string(data["name"]), _string(data["uid"])),
            devices=tuple(PreparedDevice.from_json(device) for device in _list(data["devices"])),
            cdi_spec=None if cdi_spec is None else _file_name(cdi_spec),
            spec=spec,
        )


def _string(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__}")
    return value


def _file_name(value: object) -> str:
    """A spec's name in the CDI directory: the driver writes and removes it, so never a path elsewhere."""
    name = _string(value)
    if not name or "/" in name or name.startswith(".") or "\0" in name:
        raise ValueError(f"{name!r} is not a file name in the CDI directory")
    return name


def _bool(value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"expected true or false, got {type(value).__name__}")
    return value


def _list(value: object) -> list[Any]:
    if not isinstance(value, list):
        raise TypeError(f"expected a list, got {type(value).__name__}")
    return value


def _strings(value: object) -> tuple[str, ...]:
    return tuple(_string(item) for item in _list(value))


def _digest(body: Mapping[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


class Checkpoint:
    """The prepared-claims file of one driver."""

    def __init__(self, path: Path, *, driver: str) -> None:
        self.path = path
        self.driver = driver

    def render(self, claims: Iterable[PreparedClaim]) -> bytes:
        """The file's bytes for ``claims`` (sorted by UID, so equal sets give equal bytes)."""
        body = {
            "format": FORMAT,
            "version": VERSION,
            "driver": self.driver,
            "claims": [claim.to_json() for claim in sorted(claims, key=lambda c: c.claim.uid)],
        }
        return (json.dumps({**body, "checksum": _digest(body)}, indent=1, ensure_ascii=False) + "\n").encode()

    def save(self, claims: Iterable[PreparedClaim]) -> None:
        """Replace the file with ``claims``, atomically and durably; raises :class:`OSError`."""
        write_atomically(self.path, self.render(claims), mode=0o600)

    def load(self) -> dict[str, PreparedClaim]:
        """The prepared claims by UID (none without a file); :class:`CheckpointError` when it is unusable."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise CheckpointError(f"{self.path}: cannot open it: {exc.strerror or exc}") from None
        try:
            with os.fdopen(fd, "rb") as handle:
                raw = handle.read(MAX_BYTES + 1)
        except OSError as exc:
            raise CheckpointError(f"{self.path}: cannot read it: {exc.strerror or exc}") from None
        if len(raw) > MAX_BYTES:
            raise CheckpointError(f"{self.path}: larger than {MAX_BYTES >> 20} MiB; not a checkpoint of ours")
        return self.parse(raw)

    def parse(self, raw: bytes) -> dict[str, PreparedClaim]:
        """Read the file's bytes (see :meth:`load`)."""
        try:
            document = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise CheckpointError(f"{self.path}: not valid JSON ({exc}); the file is damaged") from None
        if not isinstance(document, dict) or document.get("format") != FORMAT:
            raise CheckpointError(f"{self.path}: not a plugvisor prepared-claims checkpoint")
        if document.get("version") != VERSION:
            raise CheckpointError(
                f"{self.path}: format version {document.get('version')!r}; "
                f"this plugvisor reads version {VERSION}"
            )
        checksum = document.pop("checksum", None)
        if checksum != _digest(document):
            raise CheckpointError(f"{self.path}: checksum mismatch; the file was damaged or edited by hand")
        if document.get("driver") != self.driver:
            raise CheckpointError(
                f"{self.path}: written by driver {document.get('driver')!r}, not {self.driver!r}"
            )
        try:
            claims = [PreparedClaim.from_json(entry) for entry in _list(document["claims"])]
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(
                f"{self.path}: a claim entry is malformed ({type(exc).__name__}: {exc})"
            ) from None
        return {claim.claim.uid: claim for claim in claims}
