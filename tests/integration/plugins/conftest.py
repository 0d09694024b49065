"""Fixtures for the kinds' integration tests: a lab root, an emulated kubelet, a running plugin runtime."""

import shutil
import tempfile
from pathlib import Path

import pytest

from plugvisor.emulators import lab
from plugvisor.emulators.kubelet import EmulatedKubelet
from plugvisor.testing import running_plugin


def _tmp(prefix: str, under: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f"{under}/{prefix}"))


@pytest.fixture
def base():
    """A short directory under /tmp (unix sockets need short paths)."""
    path = _tmp("pvl-", "/tmp")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def lab_base():
    """Where lab trees go: /dev/shm when there is one (creating dgx-like there takes ms, on /tmp seconds)."""
    path = _tmp("pvl-", "/dev/shm" if Path("/dev/shm").is_dir() else "/tmp")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def make_lab(lab_base):
    def make(profile: str) -> lab.Lab:
        return lab.Lab.create(str(lab_base / "root"), profile)

    return make


@pytest.fixture
async def kubelet(base):
    k = EmulatedKubelet(base / "dp", grace_period=60.0, write_view=False)
    await k.start()
    yield k
    if k.running:
        await k.stop()


def _running(kubelet: EmulatedKubelet, node: lab.Lab, kind, options: dict, resource: str):
    """Run ``kind`` in process against the lab and the kubelet until the block ends (the public helper)."""
    return running_plugin(kubelet, kind, options, resource=resource, root=Path(node.root))


@pytest.fixture
def running():
    """``async with running(kubelet, lab, KIND, options, resource) as runtime:`` runs the kind in process."""
    return _running


def _health_of(kubelet: EmulatedKubelet, resource: str) -> dict[str, str]:
    v = kubelet.resource(resource)
    return {} if v is None else {i: d.health for i, d in v.devices.items()}


@pytest.fixture
def health_of():
    """``health_of(kubelet, resource)``: device ID -> health as the kubelet sees it."""
    return _health_of
