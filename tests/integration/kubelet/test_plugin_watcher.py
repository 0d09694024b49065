"""Plugin-watcher registration: a socket in plugins_registry, and the kubelet dials back.

All supported kubelet versions follow the same plugin-watcher rules (only what a deregistration
disconnects changed in 1.37); the texts are upstream's operation generator and DevicePlugin handler.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from plugvisor.emulators.kubelet import EmulatedKubelet, EventKind, PluginMethod, StubDevicePlugin, devices

from .conftest import counts

GPU = "vendor.example/gpu"


@pytest.fixture
async def node(socket_dir: Path) -> AsyncIterator[EmulatedKubelet]:
    kubelet = EmulatedKubelet(socket_dir / "device-plugins", grace_period=5, dial_timeout=1.0)
    await kubelet.start()
    yield kubelet
    await kubelet.stop()


def registry(kubelet: EmulatedKubelet) -> Path:
    assert kubelet.plugins_registry is not None
    return kubelet.plugins_registry


async def statuses(stub: StubDevicePlugin, count: int) -> list[tuple[bool, str]]:
    """Wait until the plugin has been told ``count`` registration outcomes."""
    async with asyncio.timeout(10):
        while len(stub.registration_statuses) < count:
            stub.status_changed.clear()
            await stub.status_changed.wait()
    return stub.registration_statuses


class TestRegistration:
    async def test_a_socket_in_the_registry_is_dialled_back_and_registered(self, node) -> None:
        assert registry(node) == node.socket_dir.parent / "plugins_registry"
        async with StubDevicePlugin(registry(node) / "gpu.sock", GPU, devices=devices("a", "b")) as stub:
            assert await statuses(stub, 1) == [(True, "")]
            await node.wait_for(counts(GPU, 2, 2))
            (record,) = node.registrations
            assert (record.via, record.endpoint, record.version, record.accepted) == (
                "plugins_registry",
                os.fspath(stub.socket_path),
                "v1beta1",
                True,
            )
            assert node.calls_for(GPU)[:2] == [
                PluginMethod.GET_DEVICE_PLUGIN_OPTIONS,
                PluginMethod.LIST_AND_WATCH,
            ]

    async def test_a_socket_already_there_at_start_is_found_in_a_subdirectory(self, socket_dir) -> None:
        kubelet = EmulatedKubelet(socket_dir / "device-plugins", grace_period=5)
        assert kubelet.plugins_registry is not None
        (kubelet.plugins_registry / "vendor").mkdir(parents=True)
        stub = StubDevicePlugin(kubelet.plugins_registry / "vendor" / "gpu.sock", GPU, devices=devices("a"))
        async with stub, kubelet:
            await kubelet.wait_for(counts(GPU, 1, 1))

    async def test_an_explicit_endpoint_is_dialled_as_a_full_path(self, node, socket_dir) -> None:
        """PluginInfo.endpoint is a full socket path, not a name joined to the device-plugins dir."""
        service = StubDevicePlugin(socket_dir / "service.sock", GPU, devices=devices("a"))
        registrar = StubDevicePlugin(registry(node) / "reg.sock", GPU)
        registrar.info_endpoint = os.fspath(service.socket_path)
        async with service, registrar:
            assert await statuses(registrar, 1) == [(True, "")]
            await node.wait_for(counts(GPU, 1, 1))
            assert node.resource(GPU).endpoint == os.fspath(service.socket_path)  # type: ignore[union-attr]

    async def test_hidden_and_non_socket_entries_are_ignored(self, node) -> None:
        (registry(node) / "notes.txt").write_text("not a plugin")
        hidden = StubDevicePlugin(registry(node) / ".hidden.sock", GPU, devices=devices("a"))
        visible = StubDevicePlugin(registry(node) / "gpu.sock", "vendor.example/other")
        async with hidden, visible:
            await statuses(visible, 1)
            assert hidden.registration_statuses == []
            assert node.resource(GPU) is None


class TestValidation:
    @pytest.mark.parametrize(
        ("name", "versions", "error"),
        [
            (
                GPU,
                ("v1alpha1", "v2"),
                "manager version, v1beta1, is not among plugin supported versions [v1alpha1 v2]",
            ),
            ("gpu", ("v1beta1",), 'invalid name of device plugin socket: the ResourceName "gpu" is invalid'),
        ],
        ids=["unsupported-versions", "invalid-name"],
    )
    async def test_the_plugin_is_told_why_it_was_refused(self, node, name, versions, error) -> None:
        stub = StubDevicePlugin(registry(node) / "p.sock", GPU, devices=devices("a"))
        stub.info_name, stub.info_versions = name, versions
        async with stub:
            (status,) = await statuses(stub, 1)
            assert status == (False, f"RegisterPlugin error -- plugin validation failed with err: {error}")
            # What the real kubelet logs for it (its notifyPlugin returns the refusal as an error).
            await node.wait_for(
                lambda k: any(
                    e.message
                    == f"RegisterPlugin error -- failed to send error at socket {stub.socket_path}, err: "
                    f"RegisterPlugin error -- plugin validation failed with err: {error}"
                    for e in k.events
                ),
                what="the operation's own failure event",
            )
            assert node.calls_for(name) == []

    async def test_a_type_without_a_handler_is_refused(self, node) -> None:
        stub = StubDevicePlugin(registry(node) / "csi.sock", GPU)
        stub.info_type = "CSIPlugin"
        async with stub:
            (status,) = await statuses(stub, 1)
            assert status == (
                False,
                "RegisterPlugin error -- no handler registered for plugin type: CSIPlugin "
                f"at socket {stub.socket_path}",
            )

    async def test_a_failing_options_call_is_a_failed_registration(self, node) -> None:
        stub = StubDevicePlugin(registry(node) / "p.sock", GPU, devices=devices("a"))
        stub.errors[PluginMethod.GET_DEVICE_PLUGIN_OPTIONS] = "injected"
        async with stub:
            (status,) = await statuses(stub, 1)
            assert status == (
                False,
                "RegisterPlugin error -- plugin registration failed with err: failed to get device plugin "
                "options: rpc error: code = Unknown desc = injected",
            )
            assert node.resource(GPU) is None


class TestLifecycle:
    async def test_removing_the_socket_deregisters_the_plugin(self, node) -> None:
        stub = StubDevicePlugin(registry(node) / "gpu.sock", GPU, devices=devices("a", "b"))
        await stub.start()
        await node.wait_for(counts(GPU, 2, 2))
        await stub.stop()  # removes its socket
        await node.wait_for(counts(GPU, 0, 2), what="deregistered: allocatable 0, capacity kept")
        assert EventKind.PLUGIN_DEREGISTERED in [e.kind for e in node.events]

    @pytest.mark.parametrize(("version", "allocatable"), [("1.35", 0), ("1.37", 1)])
    async def test_removing_an_older_instances_socket(self, socket_dir, version, allocatable) -> None:
        """Up to 1.36 DeRegisterPlugin disconnects the resource's current client, whichever socket went;
        from 1.37 only the instance of that socket, and the newer one goes on serving."""
        kubelet = EmulatedKubelet(socket_dir / "device-plugins", grace_period=5, kubelet_version=version)
        await kubelet.start()
        try:
            assert kubelet.plugins_registry is not None
            old = StubDevicePlugin(kubelet.plugins_registry / "old.sock", GPU, devices=devices("a"))
            await old.start()
            await statuses(old, 1)
            async with StubDevicePlugin(
                kubelet.plugins_registry / "new.sock", GPU, devices=devices("a")
            ) as new:
                await statuses(new, 1)
                await old.stop()
                await kubelet.wait_for(lambda k: EventKind.PLUGIN_DEREGISTERED in [e.kind for e in k.events])
                await kubelet.wait_for(counts(GPU, allocatable, 1))
        finally:
            await kubelet.stop()

    async def test_a_re_created_socket_is_registered_again(self, node) -> None:
        """A plugin restart (new socket, same path): deregistered, then registered anew."""
        stub = StubDevicePlugin(registry(node) / "gpu.sock", GPU, devices=devices("a"))
        await stub.start()
        await statuses(stub, 1)
        await stub.stop()
        await stub.start()
        try:
            await statuses(stub, 2)
            await node.wait_for(counts(GPU, 1, 1))
            assert [r.accepted for r in node.registrations] == [True, True]
        finally:
            await stub.stop()

    async def test_a_killed_plugin_leaves_its_socket_and_its_resource_at_allocatable_0(self, node) -> None:
        """The stream ends (no re-dial); the stale socket stays desired until it is re-created."""
        stub = StubDevicePlugin(registry(node) / "gpu.sock", GPU, devices=devices("a"))
        await stub.start()
        await node.wait_for(counts(GPU, 1, 1))
        await stub.end_streams()
        await node.wait_for(counts(GPU, 0, 1))
        await stub.stop()
        # A fresh instance replaces the stale socket: the watcher sees it and the kubelet dials back.
        await stub.start()
        try:
            await node.wait_for(counts(GPU, 1, 1))
        finally:
            await stub.stop()

    async def test_a_dead_socket_being_dialled_holds_up_no_other_plugin(self, node) -> None:
        """A killed plugin's socket takes the whole dial timeout to fail; the kubelet registers each socket
        on its own (one operation per socket), so a live plugin beside it is registered meanwhile."""
        dead = socket.socket(socket.AF_UNIX)
        dead.bind(os.fspath(registry(node) / "dead.sock"))  # bound, never listening: what a SIGKILL leaves
        dead.close()
        await node.wait_for(lambda k: "dead.sock found" in str(k.events))
        async with StubDevicePlugin(registry(node) / "gpu.sock", GPU, devices=devices("a")) as stub:
            assert await statuses(stub, 1) == [(True, "")]
            failed = [e for e in node.events if e.kind is EventKind.REGISTRATION_FAILED]
            assert not failed, "the live plugin waited for the dead socket's dial to fail"

    @pytest.mark.parametrize("version", ["1.26", "1.29", "1.35"])
    async def test_a_restarted_kubelet_dials_back_with_no_help_from_the_plugin(
        self, socket_dir, version
    ) -> None:
        """The device-plugins cleanup does not touch plugins_registry; the new watcher finds the socket."""
        kubelet = EmulatedKubelet(socket_dir / "device-plugins", grace_period=5, kubelet_version=version)
        await kubelet.start()
        try:
            assert kubelet.plugins_registry is not None
            async with StubDevicePlugin(
                kubelet.plugins_registry / "gpu.sock", GPU, devices=devices("a")
            ) as stub:
                await kubelet.wait_for(counts(GPU, 1, 1))
                await kubelet.restart()
                await kubelet.wait_for(counts(GPU, 1, 1))
                assert await statuses(stub, 2) == [(True, ""), (True, "")]
                assert [r.generation for r in kubelet.registrations] == [1, 2]
        finally:
            await kubelet.stop()

    async def test_the_watcher_can_be_turned_off(self, socket_dir) -> None:
        kubelet = EmulatedKubelet(socket_dir / "device-plugins", plugin_watcher=False)
        async with kubelet:
            assert kubelet.plugins_registry is None
            assert not (socket_dir / "plugins_registry").exists()
