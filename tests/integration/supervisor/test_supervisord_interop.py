"""`plugvisor export supervisord` under a real supervisord (PyPI `supervisor`): same children, same result."""

import asyncio
import contextlib
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest

from plugvisor.supervisor.config import load_config
from plugvisor.supervisor.supervisord import export_supervisord

from .conftest import EXPECTED, SERIAL, registered_all

supervisord = shutil.which("supervisord") or str(Path(sys.executable).with_name("supervisord"))
pytestmark = pytest.mark.skipif(
    not Path(supervisord).exists(),
    reason="supervisord (PyPI `supervisor`, the test extra) is not installed",
)


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
    return found


async def test_supervisord_runs_the_exported_programs(node, kubelet):
    """Every resource registers under supervisord; a killed child is restarted; a stop ends them all."""
    node.write_config()
    exported = node.base / "plugvisor.conf"
    exported.write_text(export_supervisord(load_config(node.config_path), source=str(node.config_path)))
    main = node.base / "supervisord.conf"
    main.write_text(
        "[supervisord]\n"
        f"logfile={node.base}/supervisord.log\npidfile={node.base}/supervisord.pid\n"
        f"childlogdir={node.base}\nnodaemon=true\n"
        f"[include]\nfiles={exported}\n"
    )
    proc = await asyncio.create_subprocess_exec(
        supervisord, "-c", str(main), stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
    )
    try:
        await kubelet.wait_for(registered_all(EXPECTED), timeout=30)
        endpoint = kubelet.resource(SERIAL).endpoint
        programs = children_of(proc.pid)
        assert len(programs) == 3
        victim = next(p for p in programs if SERIAL.encode() in Path(f"/proc/{p}/cmdline").read_bytes())
        os.kill(victim, signal.SIGKILL)
        await kubelet.wait_for(
            lambda k: k.resource(SERIAL).registered and k.resource(SERIAL).endpoint != endpoint, timeout=30
        )
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 30)
    assert children_of(proc.pid) == []
    await kubelet.wait_for(lambda k: all(not k.resource(name).registered for name in EXPECTED), timeout=10)
    # Programs stopped by supervisord remove their sockets; only the SIGKILLed one could not
    # (supervisord, unlike `plugvisor run`, does not clean up after a kill).
    assert node.sockets() in ([], [Path(endpoint).name])
