"""A driver process whose checkpoint's file system fills up: every claim's error says so, the driver lives on.

The driver's directory (``<kubelet root>/plugins/<driver>``: its checkpoint)
is put on a small tmpfs of its own, filled to the last byte while the driver
serves. Needs root for the mount; skipped, saying so, without it.
"""

import json

import pytest

from plugvisor.emulators.kubelet.dra import DraCallError, resource_claim

from ..full_disk import fill, small_tmpfs
from .conftest import NODE, eventually, registered, slice_devices

DRIVER = "fpga.plugvisor.io"
NO_SPACE = "No space left on device"


@pytest.fixture
def plugins_disk(base):
    """``<kubelet root>/plugins`` on a 1 MiB tmpfs of its own."""
    with small_tmpfs(base / "plugins", "1m") as directory:
        yield directory


def claim(device, uid, name):
    return resource_claim("default", name, uid, [("ports", DRIVER, NODE, device)])


async def test_a_full_disk_fails_each_claim_by_name_releases_once_and_the_retries_finish_with_room(
    kubelet, base, lab_root, plugins_disk, start_driver
):
    released = base / "released"  # the fpga kind's release command writes here, off the full disk
    command = ["sh", "-c", f"echo {{device}} >> {released}"]
    driver = await start_driver(
        "--options-json", json.dumps({"releaseCleanup": {"command": command}}), kind="fpga"
    )
    await kubelet.wait_for(registered(DRIVER), what="the driver registered", timeout=60)
    await eventually(lambda: len(slice_devices(base, DRIVER)) == 1, what="the slice")
    (port,) = slice_devices(base, DRIVER)
    checkpoint = base / "plugins" / DRIVER / "prepared-claims.json"
    spec = lab_root / "cdi" / f"k8s.{DRIVER}-claim_uid-1.json"
    await kubelet.dra.prepare(claim(port, "uid-1", "one"))
    assert spec.exists()

    fill(plugins_disk)
    for _ in range(2):  # the kubelet retries while the disk is full
        with pytest.raises(DraCallError) as failure:
            await kubelet.dra.unprepare("default", "one")
        assert f"cannot record its removal in {checkpoint}: {NO_SPACE}" in failure.value.message
        assert released.read_text().split() == ["dfl-port.0"] and not spec.exists()
    with pytest.raises(DraCallError) as failure:  # the port is free, but no claim can be recorded
        await kubelet.dra.prepare(claim(port, "uid-2", "two"))
    assert f"cannot record it in {checkpoint}: {NO_SPACE}" in failure.value.message
    assert not (lab_root / "cdi" / f"k8s.{DRIVER}-claim_uid-2.json").exists()
    assert driver.proc.returncode is None

    (plugins_disk / "filler").unlink()
    await kubelet.dra.unprepare("default", "one")
    assert released.read_text().split() == ["dfl-port.0"]
    await kubelet.dra.prepare(claim(port, "uid-2", "two"))
    assert [c["uid"] for c in json.loads(checkpoint.read_text())["claims"]] == ["uid-2"]
    await kubelet.dra.unprepare("default", "two")
    assert released.read_text().split() == ["dfl-port.0", "dfl-port.0"]
