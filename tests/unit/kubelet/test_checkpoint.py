"""The checkpoint file: the kubelet's JSON shape and checksum, to the byte.

The four vectors come from docs/kubelet-contract.md, section 7 (two of them are real kubelet
files); if these pass, a checkpoint copied from a node verifies here and one
written here verifies on a node.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from plugvisor.emulators.kubelet import checkpoint

REAL_ENTRY = (
    b'{"Data":{"PodDeviceEntries":[{"PodUID":"bf52b2cd-b611-4e79-86b1-280b283185c3","ContainerName":"check",'
    b'"ResourceName":"nvidia.com/gpu","DeviceIDs":{"-1":["tegra"]},'
    b'"AllocResp":"Ch8KFk5WSURJQV9WSVNJQkxFX0RFVklDRVMSBXRlZ3Jh"}],'
    b'"RegisteredDevices":{"nvidia.com/gpu":["tegra"]}},"Checksum":3660592824}'
)
VECTORS = [
    pytest.param(
        b'{"Data":{"PodDeviceEntries":null,"RegisteredDevices":{}},"Checksum":3467439661}', id="empty-null"
    ),
    pytest.param(
        b'{"Data":{"PodDeviceEntries":[],"RegisteredDevices":{}},"Checksum":2932075448}', id="empty-list"
    ),
    pytest.param(
        b'{"Data":{"PodDeviceEntries":null,"RegisteredDevices":{"nvidia.com/gpu":'
        b'["GPU-0650a168-e770-3ea8-8ac3-8a1d419763e0"]}},"Checksum":3952659280}',
        id="real-registered-only",
    ),
    pytest.param(REAL_ENTRY, id="real-with-entry"),
]


class TestChecksum:
    @pytest.mark.parametrize("content", VECTORS)
    def test_the_fact_sheet_vectors_verify(self, content: bytes) -> None:
        """Each vector decodes and its stored checksum matches ours."""
        data = checkpoint.decode(content)
        assert checkpoint.checksum(data) == json.loads(content)["Checksum"]

    @pytest.mark.parametrize("content", VECTORS)
    def test_encoding_a_decoded_file_gives_the_same_bytes(self, content: bytes) -> None:
        """Go's encoding/json shape is reproduced exactly, null versus [] included."""
        assert checkpoint.encode(checkpoint.decode(content)) == content

    def test_null_and_empty_entries_hash_differently(self) -> None:
        """A Go nil slice and an empty one render differently in go-spew, so do their checksums."""
        null = checkpoint.CheckpointData(pod_device_entries=None, registered_devices={})
        empty = checkpoint.CheckpointData(pod_device_entries=[], registered_devices={})
        assert checkpoint.checksum(null) == 3467439661
        assert checkpoint.checksum(empty) == 2932075448

    def test_the_spew_rendering_of_an_entry(self) -> None:
        """Types on struct fields, raw strings, numeric map keys, bytes as decimals."""
        data = checkpoint.CheckpointData(
            pod_device_entries=[
                checkpoint.PodDevicesEntry("u", "c", "r/x", {1: ["b"], -1: ["a"], 0: []}, b"\x01\xff")
            ],
            registered_devices={"r/x": None},
        )
        assert checkpoint.spew(data) == (
            "(checkpoint.checkpointData){PodDeviceEntries:([]checkpoint.PodDevicesEntry)[{PodUID:(string)u "
            "ContainerName:(string)c ResourceName:(string)r/x DeviceIDs:(checkpoint.DevicesPerNUMA)"
            "map[-1:[a] 0:[] 1:[b]] AllocResp:([]uint8)[1 255]}] RegisteredDevices:(map[string][]string)"
            "map[r/x:<nil>]}"
        )

    def test_fnv1a_32_known_values(self) -> None:
        """The hash is FNV-1a 32 (offset basis for empty input, a published value for "a")."""
        assert checkpoint.fnv1a_32(b"") == 0x811C9DC5
        assert checkpoint.fnv1a_32(b"a") == 0xE40C292C


class TestJsonShape:
    def test_numa_keys_sort_as_strings_like_encoding_json(self) -> None:
        """Go sorts map keys by their text: "-1" < "0" < "10" < "2"."""
        data = checkpoint.CheckpointData(
            pod_device_entries=[
                checkpoint.PodDevicesEntry("u", "c", "r/x", {2: ["a"], 10: ["b"], -1: ["c"]}, b"")
            ],
            registered_devices={},
        )
        text = checkpoint.encode(data).decode()
        assert '"DeviceIDs":{"-1":["c"],"10":["b"],"2":["a"]}' in text
        assert '"AllocResp":""' in text

    def test_html_sensitive_characters_are_escaped_as_go_does(self) -> None:
        """encoding/json escapes <, > and & even inside plain strings."""
        data = checkpoint.CheckpointData(pod_device_entries=None, registered_devices={"a.io/x": ["<&>"]})
        assert '["\\u003c\\u0026\\u003e"]' in checkpoint.encode(data).decode()
        assert checkpoint.decode(checkpoint.encode(data)) == data


class TestReading:
    def test_a_missing_file_is_reported_as_not_found(self, tmp_path: Path) -> None:
        """The kubelet only logs "checkpoint is not found" at a first start."""
        with pytest.raises(checkpoint.CheckpointNotFoundError, match="checkpoint is not found"):
            checkpoint.read(tmp_path / "kubelet_internal_checkpoint")

    def test_a_wrong_checksum_is_corrupt(self) -> None:
        """A flipped checksum is ErrCorruptCheckpoint."""
        tampered = REAL_ENTRY.replace(b"3660592824", b"3660592825")
        with pytest.raises(checkpoint.CorruptCheckpointError, match="checkpoint is corrupted"):
            checkpoint.decode(tampered)

    def test_edited_data_is_corrupt(self) -> None:
        """Changing a device ID without recomputing the checksum is detected."""
        with pytest.raises(checkpoint.CorruptCheckpointError):
            checkpoint.decode(REAL_ENTRY.replace(b'"tegra"]}}', b'"other"]}}'))

    def test_the_pre_1_20_format_is_not_read(self) -> None:
        """DeviceIDs as a plain list fails to decode (no fallback in the kubelet read)."""
        old = (
            b'{"Data":{"PodDeviceEntries":[{"PodUID":"u","ContainerName":"c","ResourceName":"r/x",'
            b'"DeviceIDs":["a"],"AllocResp":""}],"RegisteredDevices":{"r/x":["a"]}},"Checksum":1}'
        )
        with pytest.raises(checkpoint.CheckpointError, match="cannot unmarshal array"):
            checkpoint.decode(old)

    @pytest.mark.parametrize("content", [b"", b"{", b"[]", b"{}", b'{"Data":[]}'], ids=str)
    def test_garbage_is_an_error_never_a_crash(self, content: bytes) -> None:
        """Anything that is not a valid checkpoint raises CheckpointError."""
        with pytest.raises(checkpoint.CheckpointError):
            checkpoint.decode(content)

    def test_write_then_read_round_trips(self, tmp_path: Path) -> None:
        """The file written verifies with the same rule when read back."""
        data = checkpoint.decode(REAL_ENTRY)
        path = tmp_path / "kubelet_internal_checkpoint"
        checkpoint.write(path, data)
        assert path.read_bytes() == REAL_ENTRY
        assert checkpoint.read(path) == data
        assert sorted(p.name for p in tmp_path.iterdir()) == ["kubelet_internal_checkpoint"]


def plain_fnv1a_32(payload: bytes) -> int:
    value = 0x811C9DC5
    for byte in payload:
        value = ((value ^ byte) * 0x01000193) & 0xFFFFFFFF
    return value


def test_a_payload_that_begins_like_the_last_one_hashes_as_if_hashed_alone():
    """The hash resumes from the last payload's running state where both begin alike: never another value."""
    rng = random.Random(7)
    base = bytes(rng.randrange(256) for _ in range(5000))
    payloads = [
        base,
        base[:1500] + b"x" + base[1501:],  # one byte changed inside a stride
        base[:1024] + b"y" + base[1024:],  # inserted at a stride's edge
        base[:1024],  # a shorter one that ends on the edge
        base[:1023],
        base + base,
        b"",
        base,
    ]
    for payload in payloads:
        assert checkpoint.fnv1a_32(payload) == plain_fnv1a_32(payload)
