"""A --mknod lab with declared device nodes is still a lab to every command (the guard is precise)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile

import pytest

from plugvisor.emulators.lab import Lab, fidelity, parse_profile


def _can_mknod() -> bool:
    path = tempfile.mktemp(prefix="/tmp/pvlab-probe-")
    try:
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3))
    except PermissionError:
        return False
    os.unlink(path)
    return True


@pytest.mark.skipif(not _can_mknod(), reason="this process lacks CAP_MKNOD")
def test_real_null_and_fuse_nodes_do_not_make_the_lab_a_real_dev(root: str) -> None:
    """Real dev/null and dev/fuse char devices: `lab show` and faults still work; the tree is faithful."""
    profile = parse_profile(
        {
            "name": "generic-node",
            "gpus": [{"model": "nvidia-h100", "count": 1}],
            "deviceNodes": [
                {"path": "null", "major": 1, "minor": 3, "subsystem": "mem"},
                {"path": "fuse", "major": 10, "minor": 229},
            ],
        },
        source="test",
    )
    Lab.create(root, profile, mknod=True)
    info = os.stat(f"{root}/dev/fuse")
    assert stat.S_ISCHR(info.st_mode)
    assert (os.major(info.st_rdev), os.minor(info.st_rdev)) == (10, 229)
    shown = subprocess.run(
        [sys.executable, "-m", "plugvisor", "lab", "show", root], capture_output=True, text=True, check=False
    )
    assert shown.returncode == 0, shown.stderr
    Lab.open(root).fault("gpu0", "aer-fatal")
    assert fidelity.problems(root) == []
