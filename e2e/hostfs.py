"""What the cluster owners (e2e/local, e2e/kind) both do on the host: read a sysctl, remove what they made,
load one of the repository's build tools to ask it where its cache is."""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
import sys
from pathlib import Path
from typing import Any

from .deployment import REPO


def remove(path: Path) -> None:
    """Remove a file, link or directory tree; a path already gone is no error."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def read_sysctl(name: str) -> str | None:
    """A sysctl's value (``net/ipv4/ip_forward``), or None where the kernel has no such file."""
    try:
        return (Path("/proc/sys") / name).read_text().strip()
    except OSError:
        return None


def load_tool(relpath: str, name: str) -> Any:
    """A tool script of the repository (``tools/kind/build.py``) as a module, registered under ``name``."""
    spec = importlib.util.spec_from_file_location(name, REPO / relpath)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
