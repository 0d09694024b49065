"""Fixtures for the lab's unit tests: every file system here is a pyfakefs one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pyfakefs.fake_filesystem import FakeFilesystem

from plugvisor.emulators.lab import Lab

ROOT = "/lab/root"


@pytest.fixture
def small(fs: FakeFilesystem) -> Iterator[Lab]:
    """A ``small`` lab in a fake file system."""
    yield Lab.create(ROOT, "small")
