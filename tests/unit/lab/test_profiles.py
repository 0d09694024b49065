"""Profiles: built-ins are valid, bad ones are refused with the file and the field named."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from pyfakefs.fake_filesystem import FakeFilesystem

from plugvisor.emulators.lab import Lab, ProfileError, builtin, builtin_names, load_profile, parse_profile


class TestBuiltins:
    def test_all_named_profiles_exist(self) -> None:
        """The product's five profiles ship with the package."""
        assert {"small", "dgx-like", "amd-like", "intel-gpu-like", "big"} <= set(builtin_names())

    @pytest.mark.parametrize(
        "name", ["small", "dgx-like", "amd-like", "intel-gpu-like", "big", "nvidia-h200-vm"]
    )
    def test_builtin_validates(self, name: str) -> None:
        """Every built-in profile passes the same validation as a user's file."""
        assert name == builtin(name).name


BAD = [
    (
        "unknown-key",
        {"name": "x", "gpus": [{"model": "nvidia-h100", "count": 1, "colour": "red"}]},
        "gpus[0].colour",
    ),
    ("bad-model", {"name": "x", "gpus": [{"model": "voodoo-5", "count": 1}]}, "gpus[0].model"),
    ("zero-count", {"name": "x", "nics": [{"model": "intel-e810", "count": 0}]}, "nics[0].count"),
    (
        "too-many-vfs",
        {"name": "x", "nics": [{"model": "intel-e810", "count": 1, "totalVfs": 4, "numVfs": 8}]},
        "nics[0].numVfs",
    ),
    (
        "over-model-limit",
        {"name": "x", "nics": [{"model": "mellanox-cx6", "count": 1, "totalVfs": 500}]},
        "totalVfs",
    ),
    (
        "missing-numa",
        {"name": "x", "numaNodes": 2, "gpus": [{"model": "nvidia-h100", "count": 1, "numaNodes": [3]}]},
        "gpus[0].numaNodes",
    ),
    ("bad-afu", {"name": "x", "fpgas": [{"model": "intel-pac-n3000", "count": 1, "afuId": "xyz"}]}, "afuId"),
    ("empty", {"name": "x"}, "no devices"),
    (
        "ports",
        {"name": "x", "nics": [{"model": "intel-e810", "count": 3, "portsPerCard": 2}]},
        "nics[0].count",
    ),
    (
        "too-many-devices-in-all",
        {"name": "x", "gpus": [{"model": "nvidia-h100", "count": 4096}] * 4},
        "16384 PCI functions",
    ),
    (
        "too-many-vfs-in-all",
        {"name": "x", "nics": [{"model": "intel-e810", "count": 64, "totalVfs": 256, "numVfs": 256}]},
        "16448 PCI functions",
    ),
]


class TestInvalid:
    @pytest.mark.parametrize(("data", "field"), [(d, f) for _, d, f in BAD], ids=[i for i, _, _ in BAD])
    def test_error_names_the_field(self, data: dict[str, object], field: str) -> None:
        """Each kind of mistake is reported with the YAML field it is in and the source."""
        with pytest.raises(ProfileError) as caught:
            parse_profile(data, source="node.yaml")
        assert field in str(caught.value)
        assert str(caught.value).startswith("node.yaml:") or "node.yaml:" in str(caught.value)

    def test_not_a_mapping(self) -> None:
        """A YAML list at the top is refused with what was expected."""
        with pytest.raises(ProfileError, match="expected a mapping"):
            parse_profile([1, 2], source="p.yaml")

    def test_yaml_syntax_error_names_line(self, fs: FakeFilesystem) -> None:
        """A YAML syntax error names the file and the line."""
        fs.create_file("/p.yaml", contents="name: x\ngpus: [\n")
        with pytest.raises(ProfileError, match=r"/p.yaml: line \d+, column \d+: not valid YAML"):
            load_profile("/p.yaml")

    @pytest.mark.parametrize(
        ("contents", "expected"),
        [
            (b"name: x\nname: y\ngpus: [{model: h100}]\n", r"line 2, column 1: .*duplicate key 'name'"),
            (b"name: \xff\n", r"line 1, column 7: byte 0xff is not UTF-8"),
        ],
    )
    def test_a_repeated_key_or_a_stray_byte_is_named(self, fs: FakeFilesystem, contents, expected) -> None:
        """Strict reading: PyYAML alone keeps the last of two keys, and a stray byte was a traceback."""
        fs.create_file("/p.yaml", contents=contents)
        with pytest.raises(ProfileError, match=r"/p.yaml: " + expected):
            load_profile("/p.yaml")

    @pytest.mark.parametrize(
        ("document", "expected"),
        [
            ({"name": "x", "gpu": []}, "gpu: unknown key; did you mean `gpus`?"),
            (
                {"name": "x", "gpus": [{"model": "nvidia-h100", "count": 2, "perSwich": 2}]},
                "gpus[0].perSwich: unknown key; did you mean `perSwitch`?",
            ),
            ({"name": "x", "numaNode": 2}, "numaNode: unknown key; did you mean `numaNodes`?"),
        ],
    )
    def test_an_unknown_key_names_the_nearest_known_one(self, document, expected) -> None:
        """A typo in a profile says which key was probably meant."""
        with pytest.raises(ProfileError, match=re.escape(expected)):
            parse_profile(document, source="p.yaml")

    def test_missing_file(self, fs: FakeFilesystem) -> None:
        """A profile file that does not exist is a profile error naming it."""
        with pytest.raises(ProfileError, match=r"/nope\.yaml: cannot read"):
            load_profile("/nope.yaml")

    def test_invalid_profile_writes_nothing(self, fs: FakeFilesystem) -> None:
        """Creating a lab from an invalid profile leaves the root untouched (not even created)."""
        fs.create_file(
            "/bad.yaml", contents="name: bad\ngpus:\n  - model: nvidia-h100\n    count: 1\n    extra: 1\n"
        )
        with pytest.raises(ProfileError, match=r"/bad.yaml: gpus\[0\].extra: unknown key"):
            Lab.create("/lab/root", "/bad.yaml")
        assert not os.path.exists("/lab")

    def test_file_profile_round_trip(self, fs: FakeFilesystem) -> None:
        """A valid file profile builds a lab with the devices it names."""
        Path("/p.yaml").write_text(
            "name: mine\nnics:\n  - model: mellanox-cx6\n    count: 2\n    portsPerCard: 2\n"
        )
        lab = Lab.create("/lab/root", "/p.yaml")
        assert [d.name for d in lab.devices()] == ["nic0", "nic1"]
