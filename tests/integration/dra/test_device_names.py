"""Device names in the pool: every device offered under its own name, the same one after a restart.

IDs that differ only in case or punctuation (``AB-1``, ``ab_1``) make the same
DNS label; both devices must still be offered, and a claim allocated by name
must find its device again in the driver's next process.
"""

import shutil
import tempfile
from pathlib import Path

import pytest

from plugvisor.plugins.generic import KIND as GENERIC
from plugvisor.testing import running_dra_driver

from .conftest import eventually, slice_devices

DRIVER = "dev.example.com"
OPTIONS = {"paths": ["/dev/*"]}


@pytest.fixture
def root():
    path = Path(tempfile.mkdtemp(prefix="/tmp/pvd-"))
    (path / "dev").mkdir()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def running(kubelet, root):
    return running_dra_driver(
        kubelet, GENERIC, OPTIONS, driver=DRIVER, root=root, cdi_dir="/cdi", rescan_interval=0.2
    )


async def test_look_alike_devices_are_both_offered_and_keep_their_names_across_a_restart(kubelet, root, base):
    (root / "dev/AB-1").touch()
    async with running(kubelet, root) as dev:
        assert list(dev.devices) == ["ab-1"]
        first, _ = await dev.prepare("ab-1", name="first")
        (root / "dev/ab_1").touch()  # a look-alike appears while the first one is prepared
        await eventually(lambda: len(dev.devices) == 2, what="both devices offered")
        names = {device_id: name for name, device_id in dev.runtime.pools.value.ids.items()}
        assert names["AB-1"] == "ab-1" and names["ab_1"].startswith("ab-1-")
        await eventually(lambda: sorted(slice_devices(base, DRIVER)) == sorted(names.values()), what="slice")
        second, edits = await dev.prepare(names["ab_1"], name="second")
        assert [path for path, _ in edits.device_nodes] == ["/dev/ab_1"]
    async with running(kubelet, root) as dev:  # the next process: the claims name the same devices
        assert {i: n for n, i in dev.runtime.pools.value.ids.items()} == names
        await dev.unprepare(first)
        await dev.unprepare(second)
        assert dev.runtime.preparer.prepared == {}
