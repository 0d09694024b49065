"""Fixtures for the lab's unit tests: every file system here is a pyfakefs one."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pyfakefs.fake_filesystem import FakeFilesystem

from plugvisor.emulators.lab import Lab

ROOT = "/lab/root"


class _Pristine:
    """Real trees of the profiles tests asked for, each made once per session (see ``lab_of``)."""

    def __init__(self) -> None:
        shm = Path("/dev/shm")
        self.base = Path(tempfile.mkdtemp(prefix="/dev/shm/pvu-" if shm.is_dir() else "/tmp/pvu-"))
        self.trees: dict[str, Path] = {}

    def tree(self, fs: FakeFilesystem, profile: str) -> Path:
        if profile not in self.trees:
            fs.pause()  # made on the real file system, which is the point
            try:
                Lab.create(str(self.base / profile), profile)
            finally:
                fs.resume()
            self.trees[profile] = self.base / profile
        return self.trees[profile]


@pytest.fixture(scope="session")
def _pristine() -> Iterator[_Pristine]:
    pristine = _Pristine()
    yield pristine
    shutil.rmtree(pristine.base, ignore_errors=True)


@pytest.fixture
def lab_of(fs: FakeFilesystem, _pristine: _Pristine) -> Callable[[str], Lab]:
    """A lab of a named profile at ``ROOT`` in the fake file system, copied lazily from a real one.

    Made in pyfakefs, a lab of a server profile (amd-like: 8,600 files, CPU topology included) took
    15-40 s, where the real file system takes under a second: tests of what a fault or a model writes
    into an existing lab get a copy-on-write view of a tree made once on the real file system, read
    only as far as the test looks. The trees carry no absolute path (links are relative, the state
    names no root), so the view is the lab ``Lab.create(ROOT, profile)`` would have made. Tests of
    creation itself keep calling ``Lab.create`` in the fake file system.
    """

    def make(profile: str) -> Lab:
        fs.add_real_directory(str(_pristine.tree(fs, profile)), read_only=False, target_path=ROOT)
        return Lab.open(ROOT)

    return make


@pytest.fixture
def small(lab_of: Callable[[str], Lab]) -> Lab:
    """A ``small`` lab in a fake file system."""
    return lab_of("small")
