"""Restart as a kubelet restarts, and the JSON view that scripts read."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from plugvisor.common import constants
from plugvisor.emulators.kubelet import EmulatedKubelet, EventKind, devices

from .conftest import PluginFactory, counts

GPU = "example.com/gpu"


def make_socket(path: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(os.fspath(path))


class TestStart:
    async def test_start_removes_stale_sockets_and_keeps_everything_else(self, socket_dir: Path) -> None:
        """Only sockets go; the checkpoint, other files and directories stay; kubelet.sock is served."""
        make_socket(socket_dir / "stale.sock")
        (socket_dir / constants.CHECKPOINT_NAME).write_text("{}")
        (socket_dir / "README").write_text("x")
        (socket_dir / "dir").mkdir()
        emulated = EmulatedKubelet(socket_dir)
        await emulated.start()
        try:
            names = sorted(p.name for p in socket_dir.iterdir())
            assert names == sorted(
                [constants.CHECKPOINT_NAME, "README", "dir", constants.KUBELET_SOCKET_NAME]
            )
            assert [e.fields["path"] for e in emulated.events if e.kind is EventKind.SOCKET_REMOVED] == [
                str(socket_dir / "stale.sock")
            ]
            assert not (socket_dir / "DEPRECATION").exists()
        finally:
            await emulated.stop()

    async def test_start_creates_the_directory(self, socket_dir: Path) -> None:
        """A missing directory is created (mode 0750 before the umask)."""
        target = socket_dir / "device-plugins"
        emulated = EmulatedKubelet(target, write_view=False)
        await emulated.start()
        try:
            assert (target / constants.KUBELET_SOCKET_NAME).exists()
            assert target.stat().st_mode & 0o777 == 0o750 & ~_umask()
        finally:
            await emulated.stop()


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


class TestRestart:
    async def test_restart_wipes_plugin_sockets_and_serves_again(
        self, kubelet: EmulatedKubelet, plugin: PluginFactory, socket_dir: Path
    ) -> None:
        """Plugin sockets are deleted (their cue to re-register) and kubelet.sock is back."""
        stub = await plugin(GPU, devices("a", "b"))
        (socket_dir / "keep.txt").write_text("x")
        await stub.register(kubelet.socket_path)
        await kubelet.wait_for(counts(GPU, 2, 2))
        await kubelet.restart()
        assert not stub.socket_path.exists()
        assert (socket_dir / "keep.txt").exists()
        assert kubelet.socket_path.exists()
        assert kubelet.generation == 2

    async def test_known_resources_stay_at_zero_until_their_plugin_returns(
        self, kubelet: EmulatedKubelet, plugin: PluginFactory
    ) -> None:
        """As a checkpointed kubelet: capacity 0, no endpoint; re-registration restores the counts."""
        stub = await plugin(GPU, devices("a", "b"))
        await stub.register(kubelet.socket_path)
        await kubelet.wait_for(counts(GPU, 2, 2))
        await kubelet.restart()
        view = kubelet.resource(GPU)
        assert view is not None
        assert (view.allocatable, view.capacity, view.endpoint, view.registered) == (0, 0, None, False)
        await stub.stop()
        await stub.start()
        await stub.register(kubelet.socket_path)
        await kubelet.wait_for(counts(GPU, 2, 2))

    async def test_a_resource_whose_plugin_never_returns_is_removed(
        self, kubelet: EmulatedKubelet, plugin: PluginFactory
    ) -> None:
        """The grace period runs from the restart."""
        stub = await plugin(GPU, devices("a"))
        await stub.register(kubelet.socket_path)
        await kubelet.wait_for(counts(GPU, 1, 1))
        await kubelet.restart()
        await kubelet.wait_for(lambda k: (v := k.resource(GPU)) is not None and v.removed)

    async def test_allocations_survive_a_restart(
        self, kubelet: EmulatedKubelet, plugin: PluginFactory
    ) -> None:
        """Pod allocations are checkpointed: the same container gets the same devices back."""
        stub = await plugin(GPU, devices("a", "b"))
        await stub.register(kubelet.socket_path)
        await kubelet.wait_for(counts(GPU, 2, 2))
        first = await kubelet.allocate(GPU, 1)
        await kubelet.restart()
        await stub.stop()
        await stub.start()
        await stub.register(kubelet.socket_path)
        await kubelet.wait_for(counts(GPU, 2, 2))
        again = await kubelet.allocate(GPU, 1)
        assert again.device_ids == first.device_ids
        assert again.reused


class TestViewFile:
    async def test_the_view_describes_resources_devices_and_events(
        self, kubelet: EmulatedKubelet, plugin: PluginFactory
    ) -> None:
        """The JSON beside the directory carries what scripts need."""
        stub = await plugin(GPU, devices("a", "b"))
        await stub.register(kubelet.socket_path)
        await kubelet.wait_for(counts(GPU, 2, 2))
        await stub.update(devices("a") + devices("b", health=constants.UNHEALTHY))
        await kubelet.wait_for(counts(GPU, 1, 2))
        await kubelet.flush_view()
        assert kubelet.view_path == Path(f"{kubelet.socket_dir}.kubelet.json")
        document = json.loads(kubelet.view_path.read_text())
        assert document["kubelet"]["generation"] == 1
        assert document["kubelet"]["running"] is True
        resource = document["resources"][GPU]
        assert (resource["capacity"], resource["allocatable"], resource["registered"]) == (2, 1, True)
        assert resource["endpoint"] == str(stub.socket_path)
        assert resource["devices"] == [
            {"id": "a", "health": "Healthy", "reported_health": "Healthy", "numa": []},
            {"id": "b", "health": "Unhealthy", "reported_health": "Unhealthy", "numa": []},
        ]
        assert "devices_updated" in [event["kind"] for event in document["events"]]

    async def test_the_view_follows_changes_without_a_flush(
        self, kubelet: EmulatedKubelet, plugin: PluginFactory
    ) -> None:
        """The background writer catches up by itself."""
        stub = await plugin(GPU, devices("a", "b", "c"))
        await stub.register(kubelet.socket_path)
        await kubelet.wait_for(counts(GPU, 3, 3))
        await kubelet.view_settled()
        document = json.loads(kubelet.view_path.read_text())
        assert document["resources"][GPU]["capacity"] == 3
