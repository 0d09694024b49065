"""--mknod: real character nodes whose numbers agree with sys/dev/char and dev/char."""

from __future__ import annotations

import os
import stat
import tempfile

import pytest

from plugvisor.emulators.lab import Lab, MknodNotPermittedError, fidelity


def _can_mknod() -> bool:
    path = tempfile.mktemp(prefix="/tmp/pvlab-probe-")
    try:
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3))
    except PermissionError:
        return False
    os.unlink(path)
    return True


needs_mknod = pytest.mark.skipif(not _can_mknod(), reason="this process lacks CAP_MKNOD")


@needs_mknod
def test_nodes_are_char_devices(root: str) -> None:
    """Every device node is a char device with the numbers its sys/dev/char link names."""
    lab = Lab.create(root, "dgx-like", mknod=True)
    for rec in lab.devices():
        for node in rec.device_nodes:
            info = os.stat(root + node.path)
            assert stat.S_ISCHR(info.st_mode)
            assert (node.major, node.minor) == (os.major(info.st_rdev), os.minor(info.st_rdev))
            assert os.path.islink(f"{root}/sys/dev/char/{node.major}:{node.minor}")
    assert stat.S_ISCHR(os.stat(f"{root}/dev/nvidiactl").st_mode)
    assert fidelity.problems(root) == []


@needs_mknod
def test_faults_keep_real_nodes(root: str) -> None:
    """A node that vanishes on a fault comes back as a char device, atomically renamed into place."""
    lab = Lab.create(root, "small", mknod=True)
    lab.fault("gpu0", "fallen-off-bus")
    assert not os.path.exists(f"{root}/dev/nvidia0")
    lab.heal("gpu0")
    assert os.major(os.stat(f"{root}/dev/nvidia0").st_rdev) == 195


def test_missing_capability_is_clear(root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without CAP_MKNOD, --mknod fails naming the capability and writes no tree."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "mknod", refuse)
    with pytest.raises(MknodNotPermittedError, match="CAP_MKNOD"):
        Lab.create(root, "small", mknod=True)
    assert not os.path.exists(f"{root}/sys")
