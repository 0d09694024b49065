"""Fixtures: a short socket directory, a running emulated kubelet, and stub plugins that clean up."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from plugvisor.api.deviceplugin.v1beta1 import api_pb2
from plugvisor.emulators.kubelet import EmulatedKubelet, StubDevicePlugin

PluginFactory = Callable[..., Awaitable[StubDevicePlugin]]


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    """A device-plugins directory short enough for unix sockets; removed with its view file."""
    path = Path(tempfile.mkdtemp(prefix="/tmp/pvk-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
    for sibling in (".kubelet.json", ".pods.json", ".kubelet.sock"):
        Path(f"{path}{sibling}").unlink(missing_ok=True)
    shutil.rmtree(f"{path}.pod-resources", ignore_errors=True)
    shutil.rmtree(f"{path}.plugins_registry", ignore_errors=True)


@pytest.fixture
async def kubelet(socket_dir: Path) -> AsyncIterator[EmulatedKubelet]:
    """A started emulated kubelet with test-sized timeouts (grace period: 0.5 s, dial: 1 s)."""
    emulated = EmulatedKubelet(socket_dir, grace_period=0.5, dial_timeout=1.0)
    await emulated.start()
    yield emulated
    await emulated.stop()


@pytest.fixture
async def kubelet_1_35(socket_dir: Path) -> AsyncIterator[EmulatedKubelet]:
    """The same, playing 1.35: plugin instances per resource name, ResourceHealthStatus off by default."""
    emulated = EmulatedKubelet(socket_dir, grace_period=0.5, dial_timeout=1.0, kubelet_version="1.35")
    await emulated.start()
    yield emulated
    await emulated.stop()


@pytest.fixture
async def plugin(socket_dir: Path) -> AsyncIterator[PluginFactory]:
    """Start stub plugins in the socket directory (not registered); all are stopped at the end."""
    started: list[StubDevicePlugin] = []

    async def start(
        resource: str, devices: Sequence[api_pb2.Device] = (), *, name: str | None = None, **options: Any
    ) -> StubDevicePlugin:
        sock = socket_dir / (name or f"plugin-{len(started)}.sock")
        stub = StubDevicePlugin(sock, resource, devices=devices, **options)
        await stub.start()
        started.append(stub)
        return stub

    yield start
    for stub in started:
        await stub.stop()


def counts(resource: str, allocatable: int, capacity: int) -> Callable[[EmulatedKubelet], bool]:
    """Predicate: the node reports (allocatable, capacity) for ``resource``."""

    def reported(kubelet: EmulatedKubelet) -> bool:
        view = kubelet.resource(resource)
        return view is not None and (view.allocatable, view.capacity) == (allocatable, capacity)

    reported.__qualname__ = f"{resource} at (allocatable {allocatable}, capacity {capacity})"
    return reported
