"""tools/kind/capfit.py: the runc wrapper takes from a spec exactly the capabilities root lacks here."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[3]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("capfit_tool", REPO / "tools" / "kind" / "capfit.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


capfit = _load()

# These VMs' root: every capability up to CAP_CHECKPOINT_RESTORE (40) but CAP_SYS_RESOURCE (24).
STATUS_WITHOUT_SYS_RESOURCE = "Name:\tcapfit\nCapInh:\t0000000000000000\nCapBnd:\t000001fffeffffff\n"
PRIVILEGED = ["CAP_CHOWN", "CAP_SYS_ADMIN", "CAP_SYS_RESOURCE", "CAP_SYS_TIME"]


def _spec() -> dict[str, Any]:
    """The shape of the config.json Docker 20.10 writes for ``docker run --privileged``."""
    return {
        "ociVersion": "1.0.2-dev",
        "process": {
            "args": ["sh"],
            "capabilities": {name: list(PRIVILEGED) for name in ("bounding", "effective", "permitted")}
            | {"inheritable": list(PRIVILEGED)},
        },
        "root": {"path": "rootfs"},
        "linux": {"maskedPaths": []},
    }


def test_the_missing_capability_is_read_from_the_bounding_set() -> None:
    assert capfit.missing_capabilities(STATUS_WITHOUT_SYS_RESOURCE) == {"CAP_SYS_RESOURCE"}
    assert capfit.missing_capabilities("CapBnd:\t000001ffffffffff\n") == frozenset()


def test_a_status_without_a_bounding_set_is_refused() -> None:
    with pytest.raises(ValueError, match="CapBnd"):
        capfit.missing_capabilities("Name:\tx\n")


def test_create_drops_the_missing_capability_from_every_set_and_nothing_else(tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "config.json").write_text(json.dumps(_spec()))
    argv = [
        "--root",
        "/run/x",
        "--log",
        "log.json",
        "create",
        "--bundle",
        str(bundle),
        "--pid-file",
        "p",
        "id",
    ]
    capfit.fit(argv, capfit.missing_capabilities(STATUS_WITHOUT_SYS_RESOURCE))
    fitted = json.loads((bundle / "config.json").read_text())
    expected = _spec()
    for granted in expected["process"]["capabilities"].values():
        granted.remove("CAP_SYS_RESOURCE")
    assert fitted == expected


def test_the_bundle_defaults_to_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(_spec()))
    monkeypatch.chdir(tmp_path)
    capfit.fit(["run", "id"], frozenset({"CAP_SYS_RESOURCE"}))
    fitted = json.loads((tmp_path / "config.json").read_text())
    assert "CAP_SYS_RESOURCE" not in fitted["process"]["capabilities"]["bounding"]


def test_exec_fits_the_process_file(tmp_path: Path) -> None:
    """``docker exec --privileged`` (kind runs its node commands so) hands runc a process spec alone."""
    process = tmp_path / "process.json"
    process.write_text(json.dumps(_spec()["process"]))
    capfit.fit(["exec", "--process", str(process), "--detach", "id"], frozenset({"CAP_SYS_RESOURCE"}))
    assert json.loads(process.read_text())["capabilities"]["effective"] == [
        "CAP_CHOWN",
        "CAP_SYS_ADMIN",
        "CAP_SYS_TIME",
    ]


def test_with_a_full_bounding_set_the_spec_is_left_byte_for_byte(tmp_path: Path) -> None:
    text = json.dumps(_spec(), indent=3)
    (tmp_path / "config.json").write_text(text)
    capfit.fit(["create", "-b", str(tmp_path), "id"], capfit.missing_capabilities("CapBnd:\t1ffffffffff\n"))
    assert (tmp_path / "config.json").read_text() == text


def test_commands_without_a_spec_are_passed_through() -> None:
    assert capfit.spec_file(["--root", "/r", "start", "id"]) is None
    assert capfit.spec_file(["delete", "--force", "id"]) is None
    assert capfit.spec_file(["exec", "id"]) is None
