"""The checkpoint file and what a restarted kubelet makes of it."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from plugvisor.common import constants
from plugvisor.emulators.kubelet import EmulatedKubelet, EventKind, PluginMethod, checkpoint, devices
from plugvisor.emulators.kubelet.pods import PodPhase

from .conftest import PluginFactory, counts
from .test_pods import manifest

GPU = "example.com/gpu"


class TestCheckpointFile:
    async def test_written_on_every_list_and_verifiable_with_the_kubelets_rule(
        self, kubelet: EmulatedKubelet, plugin: PluginFactory
    ) -> None:
        """RegisteredDevices holds the healthy IDs; the checksum verifies."""
        stub = await plugin(GPU, devices("a", "b"))
        await stub.register(kubelet.socket_path)
        await kubelet.wait_for(counts(GPU, 2, 2))
        data = checkpoint.read(kubelet.checkpoint_path)
        assert data.pod_device_entries is None
        assert data.registered_devices == {GPU: ["a", "b"]}
        await stub.update(devices("a") + devices("b", health=constants.UNHEALTHY))
        await kubelet.wait_for(counts(GPU, 1, 2))
        assert checkpoint.read(kubelet.checkpoint_path).registered_devices == {GPU: ["a"]}

    async def test_an_allocation_is_checkpointed_with_its_response(
        self, kubelet: EmulatedKubelet, plugin: PluginFactory
    ) -> None:
        """One entry per (pod, container, resource), devices under NUMA -1, response serialized."""
        stub = await plugin(GPU, devices("a", "b"))
        await stub.register(kubelet.socket_path)
        await kubelet.wait_for(counts(GPU, 2, 2))
        status = await kubelet.add_pod(manifest("p"))
        document = json.loads(kubelet.checkpoint_path.read_text())
        assert document["Data"]["PodDeviceEntries"] == [
            {
                "PodUID": status.uid,
                "ContainerName": "app",
                "ResourceName": GPU,
                "DeviceIDs": {"-1": ["a"]},
                "AllocResp": "",
            }
        ]
        assert document["Checksum"] == checkpoint.checksum(checkpoint.read(kubelet.checkpoint_path))


class TestRestartFromTheFile:
    async def test_a_corrupt_checkpoint_is_reported_and_ignored(self, socket_dir: Path) -> None:
        """The kubelet logs it and starts empty."""
        (socket_dir / constants.CHECKPOINT_NAME).write_text(
            '{"Data":{"PodDeviceEntries":null,"RegisteredDevices":{"a.io/x":[]}},"Checksum":1}'
        )
        kubelet = EmulatedKubelet(socket_dir, grace_period=0.5)
        await kubelet.start()
        try:
            assert kubelet.resources == {}
            (event,) = [e for e in kubelet.events if e.kind is EventKind.CHECKPOINT_IGNORED]
            assert "checkpoint is corrupted" in event.message
        finally:
            await kubelet.stop()

    async def test_a_checkpoint_from_a_real_node_is_restored(self, socket_dir: Path) -> None:
        """Resources at capacity 0, the pod's devices held - from a file the kubelet wrote."""
        (socket_dir / constants.CHECKPOINT_NAME).write_bytes(
            b'{"Data":{"PodDeviceEntries":[{"PodUID":"bf52b2cd-b611-4e79-86b1-280b283185c3","ContainerName":"check",'
            b'"ResourceName":"nvidia.com/gpu","DeviceIDs":{"-1":["tegra"]},'
            b'"AllocResp":"Ch8KFk5WSURJQV9WSVNJQkxFX0RFVklDRVMSBXRlZ3Jh"}],'
            b'"RegisteredDevices":{"nvidia.com/gpu":["tegra"]}},"Checksum":3660592824}'
        )
        kubelet = EmulatedKubelet(socket_dir, grace_period=0.5)
        await kubelet.start()
        try:
            view = kubelet.resource("nvidia.com/gpu")
            assert view is not None and (view.capacity, view.allocatable, view.registered) == (0, 0, False)
            assert kubelet.allocated(
                "nvidia.com/gpu", pod_uid="bf52b2cd-b611-4e79-86b1-280b283185c3", container="check"
            ) == ("tegra",)
            await kubelet.wait_for(lambda k: (v := k.resource("nvidia.com/gpu")) is not None and v.removed)
            assert checkpoint.read(kubelet.checkpoint_path).registered_devices == {}
        finally:
            await kubelet.stop()

    async def test_a_running_pod_survives_a_kubelet_restart_before_its_plugin_returns(
        self, kubelet: EmulatedKubelet, plugin: PluginFactory
    ) -> None:
        """The runtime still runs the container, so re-admission needs nothing (issue #118559's rule)."""
        stub = await plugin(GPU, devices("a", "b"))
        await stub.register(kubelet.socket_path)
        await kubelet.wait_for(counts(GPU, 2, 2))
        first = await kubelet.add_pod(manifest("p"))
        await kubelet.restart()
        assert kubelet.sources_ready
        status = kubelet.pod("p")
        assert status is not None and status.phase is PodPhase.RUNNING and status.uid == first.uid
        assert status.container("app").devices == first.container("app").devices

    async def test_a_new_pod_before_the_plugin_returns_is_rejected(
        self, kubelet: EmulatedKubelet, plugin: PluginFactory
    ) -> None:
        """Restored at capacity 0: "no healthy devices present", UnexpectedAdmissionError, no retry."""
        stub = await plugin(GPU, devices("a"))
        await stub.register(kubelet.socket_path)
        await kubelet.wait_for(counts(GPU, 1, 1))
        await kubelet.restart()
        status = await kubelet.add_pod(manifest("late"))
        assert (status.phase, status.reason) == (PodPhase.FAILED, "UnexpectedAdmissionError")
        assert "no healthy devices present; cannot allocate unhealthy devices example.com/gpu" in (
            status.message or ""
        )

    async def test_a_pod_with_a_completed_init_container_is_rejected_after_a_restart(
        self, kubelet: EmulatedKubelet, plugin: PluginFactory
    ) -> None:
        """Upstream's init-container gap (kubernetes#138446): the finished init container is not running."""
        stub = await plugin(GPU, devices("a", "b"))
        await stub.register(kubelet.socket_path)
        await kubelet.wait_for(counts(GPU, 2, 2))
        await kubelet.add_pod(manifest("p", init=1))
        await kubelet.restart()
        assert kubelet.pod("p").phase is PodPhase.FAILED  # type: ignore[union-attr]


class TestReplacement:
    async def _two_instances(self, kubelet: EmulatedKubelet, plugin: PluginFactory):
        old = await plugin(GPU, devices("a", "b"), name="dp1.sock")
        await old.register(kubelet.socket_path)
        await kubelet.wait_for(counts(GPU, 2, 2))
        new = await plugin(GPU, devices("a", "b"), name="dp2.sock")
        await new.register(kubelet.socket_path)
        await kubelet.wait_for(
            lambda k: (v := k.resource(GPU)) is not None and v.endpoint == str(new.socket_path)
        )
        return old, new

    async def test_per_name_the_old_plugins_exit_zeroes_the_new_plugins_resource(
        self, kubelet_1_35: EmulatedKubelet, plugin: PluginFactory
    ) -> None:
        """kubernetes#121994, reproduced (1.35): the current client is disconnected when any stream ends."""
        old, _new = await self._two_instances(kubelet_1_35, plugin)
        await old.stop()
        await kubelet_1_35.wait_for(counts(GPU, 0, 2))

    async def test_from_1_37_a_second_register_from_a_connected_socket_is_refused(
        self, kubelet: EmulatedKubelet, plugin: PluginFactory
    ) -> None:
        """As the real v1.37.2 kubelet: refused, and the instance forgotten, so its end keeps the devices."""
        dp = await plugin(GPU, devices("a", "b"), name="dp1.sock")
        await dp.register(kubelet.socket_path)
        await kubelet.wait_for(counts(GPU, 2, 2))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await dp.register(kubelet.socket_path)
        assert refused.value.code() is grpc.StatusCode.UNKNOWN
        assert refused.value.details() == f"device plugin already connected: {dp.socket_path}"
        await dp.stop()
        await kubelet.wait_for(
            lambda k: any(
                e.kind is EventKind.PLUGIN_INSTANCE_ENDED and "forgotten" in e.message for e in k.events
            )
        )
        assert counts(GPU, 2, 2)(kubelet)

    async def test_from_1_37_the_refusal_comes_after_the_dial_and_the_options_call(
        self, kubelet: EmulatedKubelet, plugin: PluginFactory
    ) -> None:
        """v1.37.2's PluginConnected asks for the options first, then finds the socket path taken."""
        dp = await plugin(GPU, devices("a"), name="dp1.sock")
        await dp.register(kubelet.socket_path)
        await kubelet.wait_for(counts(GPU, 1, 1))
        with pytest.raises(grpc.aio.AioRpcError):
            await dp.register(kubelet.socket_path)
        asked = [c for c in kubelet.calls if c.method is PluginMethod.GET_DEVICE_PLUGIN_OPTIONS]
        assert len(asked) == 2

    async def test_from_1_37_a_forgotten_instance_keeps_the_resource_up_after_every_plugin_stopped(
        self, kubelet: EmulatedKubelet, plugin: PluginFactory
    ) -> None:
        """The refused Register leaves dp1 in the device manager's store, with no client to end it: when
        dp2 (registered later) stops, dp1's stale entry becomes the endpoint, and nothing ever ends it."""
        dp1 = await plugin(GPU, devices("a", "b"), name="dp1.sock")
        await dp1.register(kubelet.socket_path)
        await kubelet.wait_for(counts(GPU, 2, 2))
        with pytest.raises(grpc.aio.AioRpcError):
            await dp1.register(kubelet.socket_path)
        dp2 = await plugin(GPU, devices("a", "b"), name="dp2.sock")
        await dp2.register(kubelet.socket_path)
        await dp1.stop()
        await dp2.stop()
        await kubelet.wait_for(
            lambda k: (v := k.resource(GPU)) is not None and v.endpoint == str(dp1.socket_path)
        )
        assert counts(GPU, 2, 2)(kubelet)

    async def test_from_1_37_every_instances_list_still_counts(
        self, kubelet: EmulatedKubelet, plugin: PluginFactory
    ) -> None:
        """v1.37.2 applies every stream's message to the resource, the replaced instance's too."""
        old, _new = await self._two_instances(kubelet, plugin)
        await old.update(devices("a"))
        await kubelet.wait_for(counts(GPU, 1, 1))

    async def test_from_1_37_the_old_plugins_exit_leaves_the_new_plugins_resource(
        self, kubelet: EmulatedKubelet, plugin: PluginFactory
    ) -> None:
        """1.37 tracks instances per socket (kubernetes#135437), as the real 1.37.2 kubelet does."""
        assert kubelet.replacement == "per-socket"
        old, _new = await self._two_instances(kubelet, plugin)
        await old.stop()
        await kubelet.wait_for(lambda k: any(e.kind is EventKind.PLUGIN_INSTANCE_ENDED for e in k.events))
        await kubelet.wait_for(counts(GPU, 2, 2))

    async def test_per_socket_the_hand_over_has_no_dip(self, socket_dir: Path, plugin: PluginFactory) -> None:
        """PR #135437: the old instance's exit does not touch the new one."""
        kubelet = EmulatedKubelet(socket_dir, grace_period=0.5, replacement="per-socket")
        await kubelet.start()
        try:
            old, new = await self._two_instances(kubelet, plugin)
            await old.stop()
            await kubelet.wait_for(lambda k: EventKind.PLUGIN_INSTANCE_ENDED in [e.kind for e in k.events])
            assert counts(GPU, 2, 2)(kubelet)
            await new.update(devices("a"))
            await kubelet.wait_for(counts(GPU, 1, 1))
        finally:
            await kubelet.stop()

    async def test_per_socket_the_older_instance_takes_over_when_the_newer_leaves(
        self, socket_dir: Path, plugin: PluginFactory
    ) -> None:
        """DP2 "changed its mind": DP1 is the endpoint again, and the devices stay."""
        kubelet = EmulatedKubelet(socket_dir, grace_period=0.5, replacement="per-socket")
        await kubelet.start()
        try:
            old, new = await self._two_instances(kubelet, plugin)
            await new.stop()
            await kubelet.wait_for(
                lambda k: (v := k.resource(GPU)) is not None and v.endpoint == str(old.socket_path)
            )
            assert counts(GPU, 2, 2)(kubelet)
            status = await kubelet.add_pod(manifest("p"))
            assert status.phase is PodPhase.RUNNING
        finally:
            await kubelet.stop()
