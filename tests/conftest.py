"""Fixtures shared by every test level."""

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A fresh directory under /tmp with a short path: unix socket paths must stay under 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="/tmp/pv-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
