"""Fixtures for the DRA driver's integration tests: a lab, an emulated kubelet with objects, processes."""

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from plugvisor.emulators import lab
from plugvisor.emulators.kubelet import EmulatedKubelet

NODE = "node-1"


@pytest.fixture
def base():
    """A short directory under /tmp: the kubelet root (unix sockets need short paths)."""
    path = Path(tempfile.mkdtemp(prefix="/tmp/pvd-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def lab_root():
    """A dgx-like lab (8 GPUs on two root complexes, FPGAs, NICs) on /dev/shm when there is one."""
    under = "/dev/shm" if Path("/dev/shm").is_dir() else "/tmp"
    path = Path(tempfile.mkdtemp(prefix=f"{under}/pvd-"))
    lab.Lab.create(str(path / "root"), "dgx-like")
    try:
        yield path / "root"
    finally:
        shutil.rmtree(path, ignore_errors=True)


def make_kubelet(base: Path, **options) -> EmulatedKubelet:
    return EmulatedKubelet(
        base / "device-plugins",
        objects_dir=base / "api",
        node_name=NODE,
        write_view=False,
        pod_resources=False,
        **options,
    )


@pytest.fixture
async def kubelet(base) -> AsyncIterator[EmulatedKubelet]:
    emulated = make_kubelet(base)
    await emulated.start()
    yield emulated
    if emulated.running:
        await emulated.stop()


def driver_args(base: Path, root: Path, kind: str = "gpu", *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "plugvisor",
        "plugin",
        kind,
        "--mode",
        "dra",
        "--host-root",
        str(root),
        "--kubelet-dir",
        str(base / "device-plugins"),
        "--objects-dir",
        str(base / "api"),
        "--node-name",
        NODE,
        "--cdi-dir",
        "/cdi",
        *extra,
    ]


class Driver:
    """A DRA driver process; stopped (SIGTERM, then SIGKILL) when the test ends."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def stop(self) -> int:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), 30)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        assert self.proc.returncode is not None
        return self.proc.returncode

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)


@pytest.fixture
async def start_driver(base, lab_root):
    started: list[Driver] = []

    async def start(*extra: str, kind: str = "gpu", env: dict[str, str] | None = None) -> Driver:
        proc = await asyncio.create_subprocess_exec(
            *driver_args(base, lab_root, kind, *extra),
            stdout=asyncio.subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
        )
        driver = Driver(proc)
        started.append(driver)
        return driver

    yield start
    for driver in started:
        await driver.stop()


def slice_devices(base: Path, driver: str = "gpu.plugvisor.io") -> list[str]:
    """The device names of the driver's published slice (none before it is written)."""
    path = base / "api" / "resourceslices" / f"{driver}-{NODE}.json"
    try:
        return [device["name"] for device in json.loads(path.read_text())["spec"]["devices"]]
    except (OSError, ValueError):
        return []


def registered(driver: str = "gpu.plugvisor.io", times: int = 1):
    """A kubelet predicate: the kubelet registered the driver's kubelet plugin ``times`` times so far."""
    return lambda k: sum(r.resource == driver and r.accepted for r in k.registrations) >= times


async def eventually(predicate, *, what: str, timeout: float = 30.0) -> None:
    """Wait until ``predicate()`` holds, looking every 20 ms (files and other processes send no events)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout} s")
        await asyncio.sleep(0.02)
