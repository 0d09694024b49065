"""resolve_in_root agrees with the kernel: the same paths resolved by a process that really chroots."""

import json
import os
from pathlib import Path

import pytest

from plugvisor.common.hostpaths import resolve_in_root

PATHS = [
    "/var/run/cdi",
    "/var/run/cdi/../x",
    "/var/lock/x",
    "/up/run",
    "/../../run/cdi",
    "/deep/abs/cdi",
    "/deep/rel/cdi",
    "/nothing/../var/run/cdi",
    "/nothing/more",
    "/run/cdi/",
    "/dev/nvidia0",
    "/dev/dri/card0",
    "/sys/bus/pci/devices/0000:03:00.0/class",
]


def _tree(root: Path) -> None:
    (root / "run" / "cdi").mkdir(parents=True)
    (root / "run" / "lock").mkdir()
    (root / "var").mkdir()
    (root / "var" / "run").symlink_to("/run")
    (root / "var" / "lock").symlink_to("../run/lock")
    (root / "up").symlink_to("../../../..")
    (root / "deep" / "x").mkdir(parents=True)
    (root / "deep" / "abs").symlink_to("/var/run")
    (root / "deep" / "rel").symlink_to("x/../../var/run")
    (root / "realdev" / "dri").mkdir(parents=True)
    (root / "dev").symlink_to("realdev")
    (root / "realdev" / "nvidia0").symlink_to("/dev/../realdev/dri")
    (root / "realdev" / "dri" / "card0").write_text("")
    device = root / "sys" / "devices" / "pci0000:00" / "0000:03:00.0"
    device.mkdir(parents=True)
    (device / "class").write_text("0x030000\n")
    (root / "sys" / "bus" / "pci" / "devices").mkdir(parents=True)
    (root / "sys" / "bus" / "pci" / "devices" / "0000:03:00.0").symlink_to(
        "../../../devices/pci0000:00/0000:03:00.0"
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="chroot needs root (CAP_SYS_CHROOT)")
def test_every_path_resolves_where_a_chrooted_process_finds_it(tmp_path):
    root = tmp_path / "host"
    _tree(root)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(read)
            os.chroot(root)
            os.chdir("/")
            answer = json.dumps([os.path.realpath(p) for p in PATHS]).encode()
            os.write(write, answer)
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        kernel = json.loads(pipe.read())
    os.waitpid(pid, 0)
    ours = ["/" + str(resolve_in_root(root, p).relative_to(root)).removeprefix(".") for p in PATHS]
    assert [o.replace("//", "/").rstrip("/") or "/" for o in ours] == kernel
