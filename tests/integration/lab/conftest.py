"""Fixtures for the lab's integration tests: real, short temporary directories (inotify needs them)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator

import pytest


@pytest.fixture
def root() -> Iterator[str]:
    """A fresh lab root path under /tmp (the directory itself does not exist yet)."""
    base = tempfile.mkdtemp(prefix="/tmp/pvlab-")
    try:
        yield f"{base}/root"
    finally:
        shutil.rmtree(base, ignore_errors=True)
