"""A node for the e2e_node scenarios: an emulated kubelet with a pods directory, and the sample plugin.

The sample plugin is a plugvisor framework plugin built like upstream's
sample-device-plugin: devices ``Dev-1``..``Dev-N`` (no topology), a mount
``/tmp/<ID>`` and a CDI device ``example.com/resource=CDI-<ID>`` per device.
A file ``<state>/sick-<ID>`` makes a device unhealthy - the framework notices it
through inotify, as a real plugin notices its hardware.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from plugvisor.common.hostpaths import HostPaths
from plugvisor.deviceplugin.devices import Device, Health, Mount
from plugvisor.deviceplugin.runtime import DevicePluginRuntime, PluginConfig
from plugvisor.deviceplugin.snapshot import Snapshot
from plugvisor.emulators.kubelet import EmulatedKubelet, versions
from plugvisor.emulators.kubelet.gates import FeatureGates

RESOURCE = "example.com/resource"
GRACE = 0.3
NODE_NAME = "e2e-node"


def static(name: str) -> str:
    """A static pod's name on this node, as the kubelet names pods from its manifest directory."""
    return f"{name}-{NODE_NAME}"


class SampleDevices:
    """Devices Dev-1..Dev-N, each unhealthy while ``<state>/sick-Dev-N`` exists."""

    def __init__(self, state_dir: Path, count: int = 2) -> None:
        self.state_dir = state_dir
        self.count = count

    def scan(self) -> Snapshot:
        devices = []
        for index in range(1, self.count + 1):
            name = f"Dev-{index}"
            sick = (self.state_dir / f"sick-{name}").exists()
            devices.append(
                Device(
                    name,
                    health=Health.UNHEALTHY if sick else Health.HEALTHY,
                    mounts=[Mount(f"/tmp/{name}", f"/tmp/{name}")],
                    cdi_devices=[f"{RESOURCE}=CDI-{name}"],
                )
            )
        return Snapshot(devices, watch=[self.state_dir])


@dataclass
class Node:
    """A kubelet, its pods directory, and sample plugins that can be started and stopped."""

    root: Path
    kubelet: EmulatedKubelet
    state_dir: Path
    running: dict[str, tuple[asyncio.Task[None], asyncio.Event]] = field(default_factory=dict)

    @property
    def pods_dir(self) -> Path:
        assert self.kubelet.pods_dir is not None
        return self.kubelet.pods_dir

    def start_plugin(self, name: str = "dp1", count: int = 2) -> DevicePluginRuntime:
        """Start a sample plugin (its own socket), as a DaemonSet pod would."""
        paths = HostPaths(root=Path("/"), kubelet_dir=self.kubelet.socket_dir)
        runtime = DevicePluginRuntime(PluginConfig(RESOURCE, paths), SampleDevices(self.state_dir, count))
        stop = asyncio.Event()
        self.running[name] = (asyncio.create_task(runtime.run(stop)), stop)
        return runtime

    async def stop_plugin(self, name: str = "dp1") -> None:
        """Delete the plugin pod: it stops serving and its socket goes."""
        task, stop = self.running.pop(name)
        stop.set()
        await asyncio.wait_for(task, 10)

    def set_health(self, device: str, healthy: bool) -> None:
        marker = self.state_dir / f"sick-{device}"
        if healthy:
            marker.unlink(missing_ok=True)
        else:
            marker.touch()

    async def wait_counts(self, allocatable: int, capacity: int) -> None:
        await self.kubelet.wait_for(
            counts(allocatable, capacity), what=f"(allocatable, capacity) = ({allocatable}, {capacity})"
        )


def counts(allocatable: int, capacity: int) -> Callable[[EmulatedKubelet], bool]:
    def check(kubelet: EmulatedKubelet) -> bool:
        view = kubelet.resource(RESOURCE)
        return view is not None and (view.allocatable, view.capacity) == (allocatable, capacity)

    return check


def busybox_pod(name: str, *, count: int = 1, restart_policy: str = "Always") -> str:
    """The e2e tests' ``makeBusyboxPod``: one container asking for ``count`` sample devices."""
    return (
        f"apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}}}\nspec:\n  restartPolicy: {restart_policy}\n"
        f"  containers:\n  - name: {name}\n    image: busybox\n    command: [sh, -c, 'sleep 60']\n"
        f"    resources:\n      limits: {{{RESOURCE}: {count}}}\n      requests: {{{RESOURCE}: {count}}}\n"
    )


@pytest.fixture
def node_root() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="/tmp/pvk-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def make_node(
    node_root: Path,
) -> AsyncIterator[Callable[..., contextlib.AbstractAsyncContextManager[Node]]]:
    nodes: list[Node] = []

    @contextlib.asynccontextmanager
    async def make(**options: object) -> AsyncIterator[Node]:
        state = node_root / "state"
        state.mkdir(exist_ok=True)
        version = str(options.get("kubelet_version", versions.DEFAULT_VERSION))
        # PodResources Get where the release has it (1.27 on).
        has_get = "KubeletPodResourcesGet" in versions.rules_for(version).feature_gates
        options.setdefault("gates", FeatureGates(kubelet_pod_resources_get=has_get))
        options.setdefault("grace_period", GRACE)
        kubelet = EmulatedKubelet(
            node_root / "device-plugins",
            dial_timeout=2.0,
            pods_dir=node_root / "pods",
            pod_resources_burst=1000,
            node_name=NODE_NAME,
            **options,  # type: ignore[arg-type]
        )
        await kubelet.start()
        node = Node(node_root, kubelet, state)
        nodes.append(node)
        try:
            yield node
        finally:
            for name in list(node.running):
                await node.stop_plugin(name)
            await kubelet.stop()

    yield make
