"""A DRA driver with no inotify instance left serves all the same: it polls its sockets' directories.

It used to exit 1 with an ``InotifyLimitError`` traceback, counted as a crash by its agent. The
driver runs in a user namespace whose inotify limit is 0 (``tests/integration/inotify_budget.py``).
"""

import asyncio
import os
import socket

import pytest

from plugvisor.common import notify
from plugvisor.emulators.kubelet.dra import resource_claim

from ..inotify_budget import NO_USER_NAMESPACE, inotify_instances, with_inotify_limit
from .conftest import NODE, Driver, driver_args, eventually, registered, slice_devices

DRIVER = "gpu.plugvisor.io"

pytestmark = pytest.mark.skipif(NO_USER_NAMESPACE is not None, reason=str(NO_USER_NAMESPACE))


def drain(receiver: socket.socket, fields: dict[str, str]) -> bool:
    while True:
        try:
            fields.update(notify.decode(receiver.recv(4096)))
        except BlockingIOError:
            return True


async def test_a_driver_without_inotify_registers_keeps_its_sockets_and_says_it_polls(
    kubelet, base, lab_root
):
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(str(base / "status.sock"))
    receiver.setblocking(False)
    log_path = base / "driver.log"
    with log_path.open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            *with_inotify_limit(0, *driver_args(base, lab_root)),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=log,
            env={**os.environ, notify.STATUS_SOCKET_ENV: str(base / "status.sock")},
        )
    driver = Driver(proc)
    fields: dict[str, str] = {}
    try:
        await kubelet.wait_for(registered(), what="the driver registered", timeout=60)
        await eventually(lambda: len(slice_devices(base)) == 8, what="the slice")
        assert inotify_instances(proc.pid) == 0
        claim = resource_claim("default", "gpus", "uid-1", [("gpus", DRIVER, NODE, slice_devices(base)[0])])
        assert (await kubelet.dra.prepare(claim)).cdi_devices() == [f"k8s.{DRIVER}/claim=uid-1-gpus"]
        # Its registration socket deleted: seen by polling, served again, registered again.
        (base / "plugins_registry" / f"{DRIVER}-reg.sock").unlink()
        await kubelet.wait_for(registered(times=2), what="registered again", timeout=60)
        await kubelet.restart()
        await kubelet.wait_for(registered(times=3), what="registered by the new kubelet", timeout=60)
        await eventually(lambda: drain(receiver, fields) and "WATCH" in fields, what="WATCH=")
    finally:
        receiver.close()
        code = await driver.stop()
    assert code == 0, log_path.read_text()
    assert fields["WATCH"].startswith("polling: ")
    assert "fs.inotify.max_user_instances" in fields["WATCH"]
    text = log_path.read_text()
    assert "Traceback" not in text
    said = [line for line in text.splitlines() if "watching_by_polling" in line]
    assert len(said) == 1, text
    assert f"resource='{DRIVER}'" in said[0]  # which of many drivers polls, as the agent names it
