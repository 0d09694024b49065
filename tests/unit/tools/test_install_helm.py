"""tools/install_helm.py takes one absolute directory; anything else is refused in one line, nothing made."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[3]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("install_helm_tool", REPO / "tools" / "install_helm.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


install_helm = _load()


@pytest.fixture
def cwd(tmp_path, monkeypatch):
    """An empty working directory, where a relative path would have been created."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def nothing_installed(monkeypatch):
    calls = []
    monkeypatch.setattr(install_helm, "install", lambda target: calls.append(target) or "installed")
    return calls


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--bin", "relative/dir"], "'relative/dir': expected an absolute directory"),
        (["--bin", "--target"], "'--target': expected an absolute directory"),
        (["--bin", "/a", "/b"], "expected one directory, got 2"),
        (["--bin", "/etc/hostname"], "/etc/hostname: exists and is not a directory"),
    ],
    ids=["relative", "option", "two", "a-file"],
)
def test_bad_input_is_one_line_exit_2_and_creates_nothing(argv, message, capsys, nothing_installed, cwd):
    assert install_helm.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and err.startswith("install_helm.py: ")
    assert nothing_installed == [] and os.listdir(cwd) == []


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_says_how_to_call_it_and_creates_nothing(flag, capsys, nothing_installed, cwd):
    assert install_helm.main(["--bin", flag]) == 0
    assert "usage: python tools/install_helm.py [DIR]" in capsys.readouterr().out
    assert nothing_installed == [] and os.listdir(cwd) == []


def test_an_absolute_directory_or_none_is_installed_into(nothing_installed, tmp_path):
    assert install_helm.main(["--bin", str(tmp_path / "bin")]) == 0
    assert install_helm.main(["--bin"]) == 0
    assert nothing_installed == [tmp_path / "bin", Path(sys.executable).parent]
