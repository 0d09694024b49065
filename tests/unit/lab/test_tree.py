"""The tree writer: the guard, atomic replacement and diff application (pyfakefs)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pyfakefs.fake_filesystem import FakeFilesystem

from plugvisor.emulators.lab import Lab, UnsafeRootError, check_root
from plugvisor.emulators.lab.spec import Dir, File, Link, Spec
from plugvisor.emulators.lab.tree import LAB_DIR, FakeTree


class TestGuard:
    @pytest.mark.parametrize("root", ["/", "/sys", "/sys/bus/pci", "/dev", "/dev/fake", "/proc/1"])
    def test_refuses_real_trees(self, fs: FakeFilesystem, root: str) -> None:
        """The file system root and anything inside /sys, /dev or /proc are refused."""
        with pytest.raises(UnsafeRootError, match="refusing"):
            check_root(root)

    def test_refuses_a_sysfs_lookalike(self, fs: FakeFilesystem) -> None:
        """A directory with sysfs's fingerprint (kernel/, devices/, firmware/) is refused."""
        for name in ("kernel", "devices", "firmware", "bus"):
            fs.create_dir(f"/chroot/sys/{name}")
        with pytest.raises(UnsafeRootError, match="looks like a real /sys"):
            check_root("/chroot")
        with pytest.raises(UnsafeRootError, match="looks like a real /sys"):
            check_root("/chroot/sys")

    def test_refuses_a_devfs_lookalike(self, fs: FakeFilesystem) -> None:
        """A dev/ with pts/ or shm/ is a real devfs, not a lab's."""
        fs.create_dir("/chroot/dev/pts")
        with pytest.raises(UnsafeRootError, match="looks like a real /dev"):
            check_root("/chroot")

    def test_refuses_symlinked_sys(self, fs: FakeFilesystem) -> None:
        """A root whose sys/ is a symlink (say, to the real /sys) is refused."""
        fs.create_dir("/elsewhere")
        fs.create_symlink("/chroot/sys", "/elsewhere")
        with pytest.raises(UnsafeRootError, match="is a symlink"):
            check_root("/chroot")

    def test_create_refused_writes_nothing(self, fs: FakeFilesystem) -> None:
        """Lab.create on a refused root touches nothing."""
        fs.create_dir("/chroot/dev/shm")
        with pytest.raises(UnsafeRootError):
            Lab.create("/chroot", "small")
        assert os.listdir("/chroot") == ["dev"]

    def test_existing_foreign_tree_is_kept(self, fs: FakeFilesystem) -> None:
        """A root holding a sys/ the lab did not write is not overwritten."""
        fs.create_file("/r/sys/mine")
        with pytest.raises(Exception, match="not a lab's"):
            Lab.create("/r", "small")
        assert os.path.exists("/r/sys/mine")

    def test_write_through_symlink_refused(self, fs: FakeFilesystem) -> None:
        """A write whose parent passes through a symlink out of the root is refused."""
        fs.create_dir("/outside")
        fs.create_dir("/r")
        fs.create_symlink("/r/sys/escape", "/outside")
        tree = FakeTree("/r")
        with pytest.raises(UnsafeRootError, match="symlink"):
            tree.put("sys/escape/x", File(b"1\n"))
        assert os.listdir("/outside") == []


class TestAtomicWrites:
    def test_put_replaces_and_leaves_no_temporaries(self, fs: FakeFilesystem) -> None:
        """A replaced attribute has the new content and staging is empty afterwards."""
        tree = FakeTree("/r")
        tree.put("sys/a/operstate", File(b"up\n"))
        tree.put("sys/a/operstate", File(b"down\n"))
        assert tree.read("sys/a/operstate") == b"down\n"
        assert os.listdir(f"/r/{LAB_DIR}/tmp") == []

    def test_apply_adds_subtree_and_removes_it(self, fs: FakeFilesystem) -> None:
        """A new owned directory appears with its content; removing it removes links into it first."""
        tree = FakeTree("/r")
        spec: Spec = {
            "sys/devices/x": Dir(),
            "sys/devices/x/vendor": File(b"0x10de\n"),
            "sys/bus/pci/devices/x": Link("../../../devices/x"),
        }
        tree.apply({}, spec)
        assert Path("/r/sys/bus/pci/devices/x/vendor").read_text().strip() == "0x10de"
        tree.apply(spec, {})
        assert not os.path.lexists("/r/sys/devices/x")
        assert not os.path.lexists("/r/sys/bus/pci/devices/x")

    def test_apply_writes_only_changes(self, fs: FakeFilesystem) -> None:
        """Unchanged entries keep their inode; changed ones are replaced."""
        tree = FakeTree("/r")
        old: Spec = {"sys/d": Dir(), "sys/d/a": File(b"1\n"), "sys/d/b": File(b"1\n")}
        tree.apply({}, old)
        inode = os.stat("/r/sys/d/a").st_ino
        tree.apply(old, {**old, "sys/d/b": File(b"2\n")})
        assert inode == os.stat("/r/sys/d/a").st_ino
        assert tree.read("sys/d/b") == b"2\n"
