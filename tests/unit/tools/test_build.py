"""tools/kubernetes/build.py refuses a versions.toml it cannot use in one line, before doing anything."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[3]
GOOD = (REPO / "tools" / "kubernetes" / "versions.toml").read_text()


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("build_tool", REPO / "tools" / "kubernetes" / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


build = _load()


@pytest.fixture
def versions_file(tmp_path, monkeypatch):
    path = tmp_path / "versions.toml"
    monkeypatch.setattr(build, "VERSIONS", path)
    monkeypatch.setenv("PLUGVISOR_K8S_CACHE", str(tmp_path / "cache"))
    return path


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "cannot read it: No such file or directory"),
        (GOOD.replace('version = "v1.37.2"', 'version = "v1.37.2'), "not valid TOML"),
        (GOOD.replace("[etcd]", "[etc]"), "[etcd]: missing table"),
        (
            GOOD.replace('packages = ["runc", ', 'packages = "runc"\nold = ['),
            "debian.packages: expected a list",
        ),
        (GOOD.replace('"v1.37.2"', '"../../../tmp/evil"'), "kubernetes.version: expected a release tag"),
        (GOOD.replace('"v3.7.3"', "37"), "etcd.version: expected a release tag"),
        (GOOD.replace('"runc"', '"runc; rm -rf /"'), "is not a Debian package name"),
    ],
    ids=["missing", "toml-typo", "missing-table", "packages-str", "escaping-version", "number", "bad-name"],
)
@pytest.mark.parametrize("args", [["--status"], ["--print-bin-dir"], []], ids=["status", "bin-dir", "build"])
def test_a_versions_file_it_cannot_use_is_one_line_and_exit_2(versions_file, capsys, content, expected, args):
    if content is not None:
        versions_file.write_text(content)
    assert build.main(args) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and expected in err and str(versions_file) in err
    assert "Traceback" not in err
    assert not (versions_file.parent / "cache").exists()
    assert not Path("/tmp/evil").exists()


def test_the_repositorys_versions_file_is_accepted():
    assert build.versions()["kubernetes"]["version"].startswith("v")
