"""Profiles declare plain device nodes (for the generic kind); the guard tells a lab from a kernel's tree."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from pyfakefs.fake_filesystem import FakeFilesystem

from plugvisor.emulators.lab import Lab, ProfileError, UnsafeRootError, check_root, parse_profile

FUSE = {"path": "fuse", "major": 10, "minor": 229}


class TestDeclaredNodes:
    def test_a_profile_of_device_nodes_only_is_a_lab(self, fs: FakeFilesystem) -> None:
        """/dev/fuse and a serial port, written as the kernel shows such nodes in dev/ and sys/."""
        profile = parse_profile(
            {
                "name": "plain",
                "deviceNodes": [FUSE, {"path": "ttyUSB0", "major": 188, "minor": 0, "subsystem": "tty"}],
            },
            source="p.yaml",
        )
        Lab.create("/lab", profile)
        assert os.path.isfile("/lab/dev/fuse")
        assert os.readlink("/lab/sys/dev/char/10:229") == "../../devices/virtual/misc/fuse"
        assert Path("/lab/sys/devices/virtual/misc/fuse/dev").read_text() == "10:229\n"
        uevent = Path("/lab/sys/devices/virtual/tty/ttyUSB0/uevent").read_text()
        assert uevent == "MAJOR=188\nMINOR=0\nDEVNAME=ttyUSB0\n"
        assert os.path.realpath("/lab/sys/class/tty/ttyUSB0") == "/lab/sys/devices/virtual/tty/ttyUSB0"
        assert os.readlink("/lab/dev/char/188:0") == "../ttyUSB0"
        devices = Path("/lab/proc/devices").read_text().splitlines()
        assert " 10 misc" in devices
        assert "188 tty" in devices

    @pytest.mark.parametrize(
        ("nodes", "field", "why"),
        [
            ([FUSE, FUSE], "deviceNodes[1].path", "already declared by deviceNodes[0]"),
            ([FUSE, {**FUSE, "path": "fuse2"}], "deviceNodes[1]", "10:229 is already used"),
            ([{"path": "nvidia9", "major": 250, "minor": 0}], "deviceNodes[0].path", "the lab writes"),
            ([{"path": "x", "major": 195, "minor": 9}], "deviceNodes[0].major", "lab's nvidia devices"),
            ([{"path": "vfio-like", "major": 10, "minor": 196}], "deviceNodes[0]", "/dev/vfio/vfio"),
            ([{"path": "../etc/passwd", "major": 1, "minor": 1}], "deviceNodes[0].path", "pattern"),
            ([{"path": "/dev/fuse", "major": 10, "minor": 229}], "deviceNodes[0].path", "pattern"),
            (
                [{"path": "a/tun", "major": 10, "minor": 1}, {"path": "tun", "major": 10, "minor": 2}],
                "deviceNodes[1].path",
                "sys/class/misc/tun",
            ),
        ],
    )
    def test_clashes_are_refused_naming_the_field(
        self, nodes: list[dict[str, object]], field: str, why: str
    ) -> None:
        """A node that would overwrite another, or the lab's own devices, is a profile error."""
        with pytest.raises(ProfileError) as caught:
            parse_profile({"name": "x", "deviceNodes": nodes}, source="p.yaml")
        assert field in str(caught.value)
        assert why in str(caught.value)


class TestPreciseGuard:
    def test_a_lab_with_real_character_nodes_is_still_a_lab(self, fs: FakeFilesystem) -> None:
        """dev/null and dev/fuse as real char devices (a --mknod lab) do not make dev/ "a real /dev"."""
        fs.create_file("/lab/dev/null", st_mode=stat.S_IFCHR | 0o666)
        fs.create_file("/lab/dev/fuse", st_mode=stat.S_IFCHR | 0o666)
        fs.create_file("/lab/dev/tty", st_mode=stat.S_IFCHR | 0o666)
        assert check_root("/lab") == "/lab"

    @pytest.mark.parametrize(
        ("fstype", "where", "tree"),
        [
            ("devtmpfs", "dev", "/dev"),
            ("sysfs", "sys", "/sys"),
            ("proc", "proc", "/proc"),
            ("devpts", "dev", "/dev"),
        ],
    )
    def test_a_kernel_file_system_is_refused_wherever_it_is_mounted(
        self, fs: FakeFilesystem, fstype: str, where: str, tree: str
    ) -> None:
        """An empty directory is refused when the mount table says a kernel file system is there."""
        fs.create_dir(f"/chroot/{where}")
        fs.create_file(
            "/proc/self/mountinfo",
            contents=(
                "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
                f"90 22 0:5 / /chroot/{where} rw,nosuid shared:2 - {fstype} {fstype} rw\n"
            ),
        )
        with pytest.raises(UnsafeRootError, match=f"looks like a real {tree}"):
            check_root("/chroot")

    def test_mount_points_with_spaces_are_read_as_the_kernel_escapes_them(self, fs: FakeFilesystem) -> None:
        r"""mountinfo writes a space as \040; a devtmpfs at "/my lab/dev" is found."""
        fs.create_dir("/my lab/dev")
        fs.create_file("/proc/self/mountinfo", contents="90 1 0:5 / /my\\040lab/dev rw - devtmpfs udev rw\n")
        with pytest.raises(UnsafeRootError, match="looks like a real /dev"):
            check_root("/my lab")

    def test_the_hosts_own_dev_reached_through_a_link_is_refused(self, fs: FakeFilesystem) -> None:
        """A root whose dev/ is the host's /dev itself (here: a symlink to it) is refused."""
        fs.create_dir("/dev")
        fs.create_symlink("/chroot/dev", "/dev")
        with pytest.raises(UnsafeRootError):
            check_root("/chroot")

    def test_a_symlinked_stdin_marks_a_devfs(self, fs: FakeFilesystem) -> None:
        """dev/stdin -> /proc/self/fd/0 is a devfs's layout, never a lab's."""
        fs.create_symlink("/chroot/dev/stdin", "/proc/self/fd/0")
        with pytest.raises(UnsafeRootError, match="looks like a real /dev"):
            check_root("/chroot")
