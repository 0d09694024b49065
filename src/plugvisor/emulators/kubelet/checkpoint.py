"""``kubelet_internal_checkpoint``: the device manager's checkpoint, byte-compatible with the kubelet's.

Why exact: tools (and people) read this file on real nodes, and a plugin author
who copies a checkpoint from a node into the emulator, or the other way round,
must get the same answer from both. So this module reproduces, from
docs/kubelet-contract.md, section 7:

* the JSON shape Go's ``encoding/json`` writes for ``DeviceManagerCheckpoint``
  (field order, sorted map keys, ``null`` for nil slices and maps, ``[]byte`` as
  base64, HTML-safe string escaping);
* the checksum: FNV-1a 32 over the go-spew ``%#v`` rendering of the in-memory
  ``checkpoint.checkpointData`` (the test vectors in the fact sheet are unit tests);
* the read path: a missing file is only logged, a checksum mismatch is
  ``CorruptCheckpointError`` and anything that does not decode (including the
  pre-1.20 format whose ``DeviceIDs`` is a plain list) is an error too - the
  kubelet logs both and starts without the data.

Nil versus empty matters for the checksum (``PodDeviceEntries: null`` and ``[]``
hash differently), so the model keeps ``None`` apart from empty containers all
the way from JSON to rendering, exactly as Go's decoder does.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from plugvisor.common.validation import huge_integer_problem, json_integer

FNV32_OFFSET: Final = 0x811C9DC5
FNV32_PRIME: Final = 0x01000193


class CheckpointError(Exception):
    """The checkpoint could not be used; ``str()`` is what the kubelet would log."""


class CheckpointNotFoundError(CheckpointError):
    """No checkpoint file: harmless at a first start ("checkpoint is not found")."""


class CorruptCheckpointError(CheckpointError):
    """The stored checksum does not match the data (``errors.ErrCorruptCheckpoint``)."""


@dataclass(frozen=True, slots=True)
class PodDevicesEntry:
    """One (pod, container, resource) allocation as ``checkpoint.PodDevicesEntry``.

    ``device_ids`` maps NUMA node (``-1`` = no topology) to IDs; ``None`` is a
    JSON ``null``. ``alloc_resp`` is the serialized ``ContainerAllocateResponse``.
    """

    pod_uid: str
    container_name: str
    resource_name: str
    device_ids: Mapping[int, Sequence[str] | None] | None
    alloc_resp: bytes | None


@dataclass(frozen=True, slots=True)
class CheckpointData:
    """``checkpoint.checkpointData``: the part of the file the checksum covers."""

    pod_device_entries: Sequence[PodDevicesEntry] | None
    registered_devices: Mapping[str, Sequence[str] | None] | None


# -- go-spew %#v ---------------------------------------------------------------------------


def _spew_strings(values: Sequence[str] | None) -> str:
    """Render a ``[]string`` nested in a map: ``[a b]``, ``[]`` or ``<nil>`` (no type, no quotes)."""
    return "<nil>" if values is None else "[" + " ".join(values) + "]"


def _key(values: Sequence[str] | None) -> tuple[str, ...] | None:
    return None if values is None else tuple(values)


@functools.lru_cache(maxsize=4096)
def _spew_pair(name: str, values: tuple[str, ...] | None) -> str:
    """One ``RegisteredDevices`` entry as spew renders it; remembered, like :func:`_json_pair`."""
    return f"{name}:{_spew_strings(values)}"


@functools.lru_cache(maxsize=4096)
def _json_pair(name: str, values: tuple[str, ...] | None) -> str:
    """One ``RegisteredDevices`` entry as encoding/json writes it.

    Remembered: the checkpoint is written whole after every device list the
    kubelet receives, and between two writes one resource's entry changes.
    """
    return f"{_go_string(name)}:{_go_strings(values)}"


def _spew_entry(entry: PodDevicesEntry) -> str:
    if entry.device_ids is None:
        devices = "(checkpoint.DevicesPerNUMA)<nil>"
    else:
        # spew's SortKeys sorts integer keys numerically.
        pairs = " ".join(
            f"{node}:{_spew_strings(entry.device_ids[node])}" for node in sorted(entry.device_ids)
        )
        devices = f"(checkpoint.DevicesPerNUMA)map[{pairs}]"
    if entry.alloc_resp is None:
        response = "([]uint8)<nil>"
    else:
        response = "([]uint8)[" + " ".join(str(byte) for byte in entry.alloc_resp) + "]"
    return (
        f"{{PodUID:(string){entry.pod_uid} ContainerName:(string){entry.container_name} "
        f"ResourceName:(string){entry.resource_name} DeviceIDs:{devices} AllocResp:{response}}}"
    )


def spew(data: CheckpointData) -> str:
    """Render ``data`` exactly as go-spew's ``Sprintf("%#v")`` with the kubelet's hash config."""
    if data.pod_device_entries is None:
        entries = "([]checkpoint.PodDevicesEntry)<nil>"
    else:
        entries = (
            "([]checkpoint.PodDevicesEntry)[" + " ".join(map(_spew_entry, data.pod_device_entries)) + "]"
        )
    if data.registered_devices is None:
        registered = "(map[string][]string)<nil>"
    else:
        # Go sorts string keys bytewise; UTF-8 bytes order equals code point order.
        devices = data.registered_devices
        pairs = " ".join(_spew_pair(name, _key(devices[name])) for name in sorted(devices))
        registered = f"(map[string][]string)map[{pairs}]"
    return f"(checkpoint.checkpointData){{PodDeviceEntries:{entries} RegisteredDevices:{registered}}}"


_FNV_STRIDE: Final = 512
"""Bytes between two running states kept of the last payload hashed (:func:`fnv1a_32`)."""

_LAST_HASHED: Final[list[tuple[bytes, list[int]]]] = [(b"", [FNV32_OFFSET])]
"""The last payload hashed, and the hash's running state after each whole stride of it (the first: none)."""


def fnv1a_32(payload: bytes) -> int:
    """Return the 32-bit FNV-1a hash of ``payload`` (Go's ``hash/fnv.New32a``).

    FNV is a running state over the bytes, so the hash of a payload that begins
    like the last one hashed continues from the state kept at the last whole
    stride they share, exactly. The kubelet hashes its whole checkpoint at every
    write, and writes it after every device list it receives: at a restart of N
    resources, N hashes of N entries, one byte at a time in Python (1.6 ms each
    at 256, 0.4 s of the emulated kubelet's CPU), of which each write changes one
    entry and keeps the ones sorted before it.
    """
    last, states = _LAST_HASHED[0]
    low, high = 0, min(len(payload), len(last)) // _FNV_STRIDE
    while low < high:  # the most whole strides both begin with (equal prefixes: a monotone test)
        middle = (low + high + 1) // 2
        if payload[: middle * _FNV_STRIDE] == last[: middle * _FNV_STRIDE]:
            low = middle
        else:
            high = middle - 1
    kept = states[: low + 1]
    value = kept[low]
    for start in range(low * _FNV_STRIDE, len(payload), _FNV_STRIDE):
        for byte in payload[start : start + _FNV_STRIDE]:
            value = ((value ^ byte) * FNV32_PRIME) & 0xFFFFFFFF
        if start + _FNV_STRIDE <= len(payload):
            kept.append(value)
    _LAST_HASHED[0] = (payload, kept)
    return value


def checksum(data: CheckpointData) -> int:
    """Return the checksum the kubelet stores for ``data``."""
    return fnv1a_32(spew(data).encode("utf-8"))


# -- Go encoding/json ----------------------------------------------------------------------

_GO_JSON_ESCAPES: Final = {
    "<": "\\u003c",
    ">": "\\u003e",
    "&": "\\u0026",
    "\u2028": "\\u2028",
    "\u2029": "\\u2029",
}


_GO_PLAIN: Final = re.compile(r"[ !#-%'-;=?-\[\]-~]*")
"""Printable ASCII that encoding/json writes as it is (no quote, backslash or HTML character)."""


def _go_string(value: str) -> str:
    """Encode a string like Go's encoding/json: raw UTF-8, HTML-safe escapes.

    Resource names and device IDs are plain ASCII: written as they are without a
    round through :mod:`json`. The checkpoint is written after every device list
    the kubelet receives, all of it each time: at 256 resources the encoding took
    4 ms a write, a second of the emulated kubelet's CPU for one restart.
    """
    if _GO_PLAIN.fullmatch(value):
        return f'"{value}"'
    encoded = json.dumps(value, ensure_ascii=False)
    for raw, escaped in _GO_JSON_ESCAPES.items():
        encoded = encoded.replace(raw, escaped)
    return encoded


def _go_strings(values: Sequence[str] | None) -> str:
    return "null" if values is None else "[" + ",".join(map(_go_string, values)) + "]"


def _go_entry(entry: PodDevicesEntry) -> str:
    if entry.device_ids is None:
        devices = "null"
    else:
        # encoding/json sorts map keys by their *string* form, so "-1" < "0" < "10" < "2".
        keys = sorted(entry.device_ids, key=str)
        devices = "{" + ",".join(f'"{key}":{_go_strings(entry.device_ids[key])}' for key in keys) + "}"
    response = "null" if entry.alloc_resp is None else _go_string(base64.b64encode(entry.alloc_resp).decode())
    return (
        f'{{"PodUID":{_go_string(entry.pod_uid)},"ContainerName":{_go_string(entry.container_name)},'
        f'"ResourceName":{_go_string(entry.resource_name)},"DeviceIDs":{devices},"AllocResp":{response}}}'
    )


def encode(data: CheckpointData) -> bytes:
    """Return the file content the kubelet writes for ``data``, checksum included."""
    if data.pod_device_entries is None:
        entries = "null"
    else:
        entries = "[" + ",".join(map(_go_entry, data.pod_device_entries)) + "]"
    if data.registered_devices is None:
        registered = "null"
    else:
        devices = data.registered_devices
        registered = "{" + ",".join(_json_pair(name, _key(devices[name])) for name in sorted(devices)) + "}"
    document = (
        f'{{"Data":{{"PodDeviceEntries":{entries},"RegisteredDevices":{registered}}},'
        f'"Checksum":{checksum(data)}}}'
    )
    return document.encode("utf-8")


def _type_error(what: str, value: object, go_type: str) -> CheckpointError:
    kinds = {list: "array", dict: "object", str: "string", bool: "bool", int: "number", float: "number"}
    kind = kinds.get(type(value), type(value).__name__)
    return CheckpointError(f"json: cannot unmarshal {kind} into Go struct field {what} of type {go_type}")


def _strings(value: object, what: str) -> list[str] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise _type_error(what, value, "[]string")
    return list(value)


def _entry(raw: object) -> PodDevicesEntry:
    if not isinstance(raw, dict):
        raise _type_error("Data.PodDeviceEntries", raw, "checkpoint.PodDevicesEntry")
    texts = {}
    for key in ("PodUID", "ContainerName", "ResourceName"):
        value = raw.get(key, "")
        if not isinstance(value, str):
            raise _type_error(f"PodDevicesEntry.Data.PodDeviceEntries.{key}", value, "string")
        texts[key] = value
    raw_devices = raw.get("DeviceIDs")
    devices: dict[int, Sequence[str] | None] | None = None
    if raw_devices is not None:
        if not isinstance(raw_devices, dict):
            # The pre-1.20 format: DeviceIDs was a plain list of IDs.
            raise _type_error(
                "PodDevicesEntry.Data.PodDeviceEntries.DeviceIDs", raw_devices, "checkpoint.DevicesPerNUMA"
            )
        devices = {}
        for key, ids in raw_devices.items():
            try:
                node = int(key)
            except ValueError:
                raise CheckpointError(
                    f"json: cannot unmarshal number {key} into Go value of type int64"
                ) from None
            devices[node] = _strings(ids, "PodDevicesEntry.Data.PodDeviceEntries.DeviceIDs")
    raw_response = raw.get("AllocResp")
    response: bytes | None = None
    if raw_response is not None:
        if not isinstance(raw_response, str):
            raise _type_error("PodDevicesEntry.Data.PodDeviceEntries.AllocResp", raw_response, "[]uint8")
        try:
            response = base64.b64decode(raw_response, validate=True)
        except binascii.Error as error:
            raise CheckpointError(f"illegal base64 data in AllocResp: {error}") from None
    return PodDevicesEntry(
        pod_uid=texts["PodUID"],
        container_name=texts["ContainerName"],
        resource_name=texts["ResourceName"],
        device_ids=devices,
        alloc_resp=response,
    )


def _data(raw_data: object) -> CheckpointData:
    """Decode ``Data`` into a checkpoint pre-filled with empty (non-nil) containers, as the kubelet does."""
    entries: list[PodDevicesEntry] | None = []
    registered: dict[str, Sequence[str] | None] | None = {}
    if raw_data is None:
        return CheckpointData(pod_device_entries=entries, registered_devices=registered)
    if not isinstance(raw_data, dict):
        raise _type_error("Data", raw_data, "checkpoint.checkpointData")
    if "PodDeviceEntries" in raw_data:
        raw_entries = raw_data["PodDeviceEntries"]
        if raw_entries is None:
            entries = None
        elif isinstance(raw_entries, list):
            entries = [_entry(item) for item in raw_entries]
        else:
            raise _type_error("Data.PodDeviceEntries", raw_entries, "[]checkpoint.PodDevicesEntry")
    if "RegisteredDevices" in raw_data:
        raw_registered = raw_data["RegisteredDevices"]
        if raw_registered is None:
            registered = None
        elif isinstance(raw_registered, dict):
            registered = {
                name: _strings(ids, "Data.RegisteredDevices") for name, ids in raw_registered.items()
            }
        else:
            raise _type_error("Data.RegisteredDevices", raw_registered, "map[string][]string")
    return CheckpointData(pod_device_entries=entries, registered_devices=registered)


def decode(content: bytes) -> CheckpointData:
    """Parse and verify file content as the kubelet does; raise :class:`CheckpointError` if unusable."""
    try:
        document = json.loads(content, parse_int=json_integer)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"invalid character in checkpoint: {error}") from None
    problem = huge_integer_problem(document)
    if problem is not None:  # Go's decoder: a number that does not fit its field
        raise CheckpointError(f"cannot unmarshal number in checkpoint: {problem}")
    if not isinstance(document, dict):
        raise _type_error("DeviceManagerCheckpoint", document, "checkpoint.Data")
    data = _data(document.get("Data"))
    stored = document.get("Checksum", 0)
    if not isinstance(stored, int) or isinstance(stored, bool) or stored != checksum(data):
        raise CorruptCheckpointError("checkpoint is corrupted")
    return data


def read(path: Path) -> CheckpointData:
    """Read and verify the checkpoint at ``path``."""
    try:
        content = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointNotFoundError("checkpoint is not found") from None
    except OSError as error:
        raise CheckpointError(f"failed to read checkpoint {path}: {error.strerror}") from None
    return decode(content)


def write(path: Path, data: CheckpointData) -> None:
    """Write the checkpoint atomically (temporary file, fsync, rename), as the kubelet's file store."""
    handle, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    temporary = Path(name)
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(encode(data))
            stream.flush()
            os.fsync(stream.fileno())
        temporary.replace(path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
