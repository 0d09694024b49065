"""Both registration modes against the emulated kubelet: kubelet.sock Register and the plugin watcher.

Each mode must survive the same things: a kubelet restart (kubelet-sock: the plugin notices
and registers again on a fresh socket; plugin-watcher: the kubelet dials the same socket
back) and a SIGKILLed plugin process (a new process registers again), with health changes
streamed in between.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from plugvisor.common.hostpaths import HostPaths
from plugvisor.common.sockets import socket_files, socket_name, socket_prefix
from plugvisor.deviceplugin import metrics
from plugvisor.deviceplugin.runtime import DevicePluginRuntime, PluginConfig
from plugvisor.emulators.kubelet import EmulatedKubelet, EventKind
from plugvisor.plugins.kinds import get_kind

RESOURCE = "example.com/serial"
MODES = ["kubelet-sock", "plugin-watcher"]


def counts(allocatable: int, capacity: int):
    def check(kubelet: EmulatedKubelet) -> bool:
        view = kubelet.resource(RESOURCE)
        return view is not None and (view.allocatable, view.capacity) == (allocatable, capacity)

    return check


@pytest.fixture
def node(short_dir: Path) -> Path:
    (short_dir / "root" / "dev").mkdir(parents=True)
    for name in ("ttyUSB0", "ttyUSB1"):
        (short_dir / "root" / "dev" / name).touch()
    return short_dir


def registry_paths(node: Path) -> tuple[Path, Path]:
    """The kubelet's layout: <root>/device-plugins and <root>/plugins_registry."""
    return node / "kubelet" / "device-plugins", node / "kubelet" / "plugins_registry"


async def registration_number(runtime: DevicePluginRuntime, number: int):
    """Wait until the runtime has published its ``number``-th registration; return it."""
    async with asyncio.timeout(20):
        while (latest := runtime.registrations.value) is None or latest.number < number:
            await runtime.registrations.wait_newer(runtime.registrations.version)
    return latest


@pytest.mark.parametrize("mode", MODES)
async def test_a_plugin_registers_streams_health_and_survives_a_kubelet_restart(node: Path, mode) -> None:
    kubelet_dir, registry = registry_paths(node)
    async with EmulatedKubelet(kubelet_dir, grace_period=30) as kubelet:
        assert kubelet.plugins_registry == registry
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "plugvisor", "plugin", "generic",
            "--host-root", str(node / "root"), "--kubelet-dir", str(kubelet_dir),
            "--resource", RESOURCE, "--path", "/dev/ttyUSB*", "--registration", mode,
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            await kubelet.wait_for(counts(2, 2), timeout=20)
            (record,) = kubelet.registrations
            assert record.via == ("plugins_registry" if mode == "plugin-watcher" else "kubelet.sock")
            (node / "root/dev/ttyUSB1").unlink()
            await kubelet.wait_for(counts(1, 1), what="the removed device streamed")
            await kubelet.restart()
            await kubelet.wait_for(
                lambda k: counts(1, 1)(k) and k.resource(RESOURCE).registered and len(k.registrations) == 2,
                timeout=20,
                what="registered again after the kubelet restart",
            )
            assert [r.generation for r in kubelet.registrations] == [1, 2]
            if mode == "plugin-watcher":
                # The kubelet dialled the same socket back: the plugin did nothing.
                assert kubelet.registrations[0].endpoint == kubelet.registrations[1].endpoint
        finally:
            proc.send_signal(signal.SIGTERM)
            _, stderr = await asyncio.wait_for(proc.communicate(), 15)
        assert proc.returncode == 0, stderr.decode()


@pytest.mark.parametrize("mode", MODES)
async def test_a_killed_plugin_process_comes_back_registered(node: Path, mode) -> None:
    kubelet_dir, _ = registry_paths(node)
    argv = [
        sys.executable, "-m", "plugvisor", "plugin", "generic",
        "--host-root", str(node / "root"), "--kubelet-dir", str(kubelet_dir),
        "--resource", RESOURCE, "--path", "/dev/ttyUSB*", "--registration", mode,
    ]  # fmt: skip
    async with EmulatedKubelet(kubelet_dir, grace_period=30) as kubelet:
        first = await asyncio.create_subprocess_exec(*argv, stderr=asyncio.subprocess.DEVNULL)
        await kubelet.wait_for(counts(2, 2), timeout=20)
        first.send_signal(signal.SIGKILL)
        await first.wait()
        await kubelet.wait_for(counts(0, 2), what="the killed plugin's stream ended: allocatable 0")
        second = await asyncio.create_subprocess_exec(*argv, stderr=asyncio.subprocess.PIPE)
        try:
            await kubelet.wait_for(counts(2, 2), timeout=20, what="the new process registered")
            assert [r.accepted for r in kubelet.registrations][-1]
        finally:
            second.send_signal(signal.SIGTERM)
            _, stderr = await asyncio.wait_for(second.communicate(), 15)
        assert second.returncode == 0, stderr.decode()


def dead_socket(path: Path) -> Path:
    """A socket file whose process is gone, as a SIGKILL leaves it."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.close()
    return path


@pytest.mark.parametrize("mode", MODES)
async def test_a_plugin_removes_the_dead_socket_a_killed_plugin_of_its_resource_left(node: Path, mode):
    """No agent sweeps a standalone plugin's socket: the next plugin of the resource removes it, and only it.

    plugin-watcher: the kubelet, restarted, finds the dead socket and tries to register
    it again and again; the new plugin's start ends that.
    """
    kubelet_dir, registry = registry_paths(node)
    directory = registry if mode == "plugin-watcher" else kubelet_dir
    argv = [
        sys.executable, "-m", "plugvisor", "plugin", "generic",
        "--host-root", str(node / "root"), "--kubelet-dir", str(kubelet_dir),
        "--resource", RESOURCE, "--path", "/dev/ttyUSB*", "--registration", mode,
    ]  # fmt: skip
    async with EmulatedKubelet(kubelet_dir, grace_period=30, dial_timeout=2) as kubelet:
        first = await asyncio.create_subprocess_exec(*argv, stderr=asyncio.subprocess.DEVNULL)
        await kubelet.wait_for(counts(2, 2), timeout=20)
        first.send_signal(signal.SIGKILL)
        await first.wait()
        (left,) = socket_files(directory, socket_prefix(RESOURCE) + "-")
        kept = [
            dead_socket(directory / socket_name("example.com/fuse")),  # another resource's
            directory / socket_name(RESOURCE),  # not a socket
        ]
        kept[1].write_text("")
        if mode == "plugin-watcher":
            await kubelet.restart()
            await kubelet.wait_for(
                lambda k: any(
                    e.kind == EventKind.REGISTRATION_FAILED and e.fields.get("path") == str(left)
                    for e in k.events
                ),
                timeout=60,
                what="the kubelet trying to register the dead socket",
            )
        second = await asyncio.create_subprocess_exec(*argv, stderr=asyncio.subprocess.PIPE)
        try:
            await kubelet.wait_for(
                lambda k: counts(2, 2)(k) and k.resource(RESOURCE).registered,
                timeout=30,
                what="the new process registered",
            )
            async with asyncio.timeout(30):  # beside kubelet.sock it may go after the registration
                while os.path.lexists(left):
                    await asyncio.sleep(0.02)
            assert all(path.exists() for path in kept)
            (serving,) = socket_files(directory, socket_prefix(RESOURCE) + "-")
            assert serving != left
        finally:
            second.send_signal(signal.SIGTERM)
            _, stderr = await asyncio.wait_for(second.communicate(), 15)
        assert second.returncode == 0, stderr.decode()
        said = [line for line in stderr.decode().splitlines() if "dead_sockets_removed" in line]
        assert len(said) == 1 and left.name in said[0] and "killed" in said[0], stderr.decode()


async def test_in_process_the_registrations_cell_and_metric_count_the_kubelets_dial_backs(node: Path) -> None:
    """plugin-watcher: each kubelet registration of the plugin is published and counted."""
    kubelet_dir, registry = registry_paths(node)
    paths = HostPaths(root=node / "root", kubelet_dir=kubelet_dir)
    config = PluginConfig(RESOURCE, paths, registration="plugin-watcher")
    assert config.registry_dir == registry
    kind = get_kind("generic")
    source = kind.build(
        kind.options_model.model_validate({"paths": ["/dev/ttyUSB*"]}), paths, resource=RESOURCE
    )
    runtime = DevicePluginRuntime(config, source)
    before = metrics.PLUGIN_REGISTRATIONS.labels(RESOURCE)._value.get()
    stop = asyncio.Event()
    async with EmulatedKubelet(kubelet_dir, grace_period=30) as kubelet:
        task = asyncio.create_task(runtime.run(stop))
        try:
            first = await registration_number(runtime, 1)
            assert (first.number, first.reason) == (1, "start")
            await kubelet.restart()
            second = await registration_number(runtime, 2)
            assert second.reason == "kubelet dialled back"
            assert second.endpoint == first.endpoint
            assert metrics.PLUGIN_REGISTRATIONS.labels(RESOURCE)._value.get() == before + 2
        finally:
            stop.set()
            await asyncio.wait_for(task, 15)
    assert not list(registry.glob("plugvisor-*.sock")), "the plugin left its registry socket behind"


async def test_a_plugin_watcher_plugin_finds_the_emulated_kubelet_from_the_same_directory(node: Path) -> None:
    """`plugvisor kubelet --dir D` and `plugvisor plugin --kubelet-dir D --registration plugin-watcher` meet.

    A directory not named ``device-plugins`` has its plugins_registry beside it as ``D.plugins_registry``
    (as its pod-resources is ``D.pod-resources``), not in D's parent, shared by every such directory there.
    """
    kubelet_dir = node / "dp"
    paths = HostPaths(root=node / "root", kubelet_dir=kubelet_dir)
    config = PluginConfig(RESOURCE, paths, registration="plugin-watcher")
    kind = get_kind("generic")
    source = kind.build(
        kind.options_model.model_validate({"paths": ["/dev/ttyUSB*"]}), paths, resource=RESOURCE
    )
    stop = asyncio.Event()
    async with EmulatedKubelet(kubelet_dir, grace_period=30) as kubelet:
        assert config.registry_dir == kubelet.plugins_registry
        task = asyncio.create_task(DevicePluginRuntime(config, source).run(stop))
        try:
            await kubelet.wait_for(counts(2, 2), timeout=20, what="registered through the plugin watcher")
        finally:
            stop.set()
            await asyncio.wait_for(task, 15)


class TestTheRegistrySocketLost:
    """The kubelet deregisters a plugin whose plugins_registry socket goes, and registers only a new one."""

    @pytest.mark.parametrize("how", ["deleted", "replaced by a regular file"])
    async def test_the_plugin_serves_a_fresh_socket_and_is_registered_again(self, node: Path, how) -> None:
        kubelet_dir, registry = registry_paths(node)
        async with EmulatedKubelet(kubelet_dir, grace_period=30) as kubelet:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "plugvisor", "plugin", "generic",
                "--host-root", str(node / "root"), "--kubelet-dir", str(kubelet_dir),
                "--resource", RESOURCE, "--path", "/dev/ttyUSB*", "--registration", "plugin-watcher",
                stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            try:
                await kubelet.wait_for(counts(2, 2), timeout=20)
                (socket,) = registry.glob("plugvisor-*.sock")
                if how == "deleted":
                    socket.unlink()
                else:
                    (registry / ".stray").write_text("not a socket\n")
                    (registry / ".stray").replace(socket)
                await kubelet.wait_for(
                    lambda k: counts(2, 2)(k) and len([r for r in k.registrations if r.accepted]) == 2,
                    timeout=20,
                    what="registered again on a fresh socket",
                )
                endpoints = [r.endpoint for r in kubelet.registrations if r.accepted]
                assert endpoints[0] != endpoints[1]
                if how != "deleted":
                    assert socket.read_text() == "not a socket\n"  # the operator's file is left alone
            finally:
                proc.send_signal(signal.SIGTERM)
                _, stderr = await asyncio.wait_for(proc.communicate(), 15)
            assert proc.returncode == 0, stderr.decode()
            log = stderr.decode()
            assert log.count("event='registration_lost'") == 1, log
            assert "Traceback" not in log


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a read-only tmpfs needs root")
async def test_a_read_only_plugins_registry_is_one_clear_error_and_exit_2(node: Path) -> None:
    """It was a crash loop of `RuntimeError: Failed to bind` tracebacks."""
    kubelet_dir, registry = registry_paths(node)
    registry.mkdir(parents=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro", "tmpfs", str(registry)], check=False).returncode:
        pytest.skip("this environment cannot mount tmpfs")
    try:
        result = await asyncio.to_thread(
            subprocess.run,
            [
                sys.executable, "-m", "plugvisor", "plugin", "generic",
                "--host-root", str(node / "root"), "--kubelet-dir", str(kubelet_dir),
                "--resource", RESOURCE, "--path", "/dev/ttyUSB*", "--registration", "plugin-watcher",
            ],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
    finally:
        subprocess.run(["umount", str(registry)], check=True)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert f"cannot create the plugin socket {registry}/plugvisor-" in result.stderr
    assert f"{registry} is on a read-only filesystem" in result.stderr
