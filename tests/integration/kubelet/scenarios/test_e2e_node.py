"""The kubelet's e2e_node device-plugin scenarios (kubelet-contract.md §10), against the emulated kubelet.

Each test is one upstream scenario that needs no container runtime, with the
same (allocatable, capacity) steps, driven by a plugvisor framework plugin
(the sample plugin of ``conftest.py``); scenarios that need a plugin to fail in
a specific RPC use the raw ``StubDevicePlugin``, as upstream uses its error-
injecting test plugin. Upstream's minutes (node status sync, 5 min grace) are
event-driven waits and a 0.3 s grace here.

Not here: 20 (ImagePullBackOff) and 25 (CRI proxy) need a container runtime.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from plugvisor.api.deviceplugin.v1beta1 import api_pb2
from plugvisor.api.podresources.v1 import api_pb2 as pr
from plugvisor.api.podresources.v1 import api_pb2_grpc as pr_grpc
from plugvisor.emulators.kubelet import EmulatedKubelet, PluginMethod, StubDevicePlugin, checkpoint, devices
from plugvisor.emulators.kubelet.gates import FeatureGates
from plugvisor.emulators.kubelet.pods import PodPhase

from .conftest import RESOURCE, Node, busybox_pod, static


async def pod_devices(kubelet: EmulatedKubelet) -> dict[tuple[str, str], list[str]]:
    """PodResources v1 List as {(pod, container): device IDs} for the sample resource."""
    async with grpc.aio.insecure_channel(f"unix:{kubelet.pod_resources_socket}") as channel:
        response = await pr_grpc.PodResourcesListerStub(channel).List(pr.ListPodResourcesRequest())
    return {
        (pod.name, container.name): [
            i for d in container.devices if d.resource_name == RESOURCE for i in d.device_ids
        ]
        for pod in response.pod_resources
        for container in pod.containers
    }


async def add(node: Node, name: str, **options: object) -> None:
    (node.pods_dir / f"{name}.yaml").write_text(busybox_pod(name, **options))  # type: ignore[arg-type]
    await node.kubelet.wait_for(
        lambda k: (p := k.pod(static(name))) is not None and p.phase is not PodPhase.PENDING
    )


def device_of(node: Node, name: str) -> tuple[str, ...]:
    status = node.kubelet.pod(static(name))
    assert status is not None
    return status.container(name).devices.get(RESOURCE, ())


class TestDevicePlugin:
    """device_plugin_test.go."""

    async def test_01_can_schedule_a_pod_that_requires_a_device(self, make_node) -> None:
        async with make_node() as node:
            node.start_plugin()
            await node.wait_counts(2, 2)
            await add(node, "pod1")
            (dev,) = device_of(node, "pod1")
            assert dev.startswith("Dev-")
            assert await pod_devices(node.kubelet) == {(static("pod1"), "pod1"): [dev]}

    async def test_02_can_make_a_cdi_device_accessible_in_a_container(self, make_node) -> None:
        async with make_node() as node:
            node.start_plugin()
            await node.wait_counts(2, 2)
            await add(node, "pod1")
            (dev,) = device_of(node, "pod1")
            runtime = node.kubelet.pod(static("pod1")).container("pod1").runtime  # type: ignore[union-attr]
            assert runtime is not None and runtime.cdi_devices == (f"{RESOURCE}=CDI-{dev}",)
            assert [m.host_path for m in runtime.mounts] == [f"/tmp/{dev}"]

    async def test_03_keeps_assignments_across_pod_restarts(self, make_node) -> None:
        async with make_node() as node:
            node.start_plugin()
            await node.wait_counts(2, 2)
            await add(node, "pod1")
            first = device_of(node, "pod1")
            await node.kubelet.restart_container(static("pod1"), "pod1")
            assert device_of(node, "pod1") == first
            await add(node, "pod2")
            assert device_of(node, "pod2") != first
            assert await pod_devices(node.kubelet) == {
                (static("pod1"), "pod1"): list(first),
                (static("pod2"), "pod2"): list(device_of(node, "pod2")),
            }

    @pytest.mark.parametrize(
        "container_restart", [False, True], ids=["kubelet-restart", "pod-and-kubelet-restart"]
    )
    async def test_04_05_keeps_assignments_across_kubelet_restarts(
        self, make_node, container_restart: bool
    ) -> None:
        async with make_node() as node:
            node.start_plugin()
            await node.wait_counts(2, 2)
            await add(node, "pod1")
            before = node.kubelet.pod(static("pod1"))
            if container_restart:
                await node.kubelet.restart_container(static("pod1"), "pod1")
            await node.kubelet.restart()
            await node.kubelet.wait_for(lambda k: k.resource(RESOURCE).registered)  # type: ignore[union-attr]
            await node.wait_counts(2, 2)
            after = node.kubelet.pod(static("pod1"))
            assert after is not None and before is not None
            assert (after.uid, after.phase) == (before.uid, PodPhase.RUNNING)
            assert await pod_devices(node.kubelet) == {
                (static("pod1"), "pod1"): list(device_of(node, "pod1"))
            }
            assert device_of(node, "pod1") == before.container("pod1").devices[RESOURCE]

    async def test_06_does_not_admit_a_succeeded_pod_again_after_kubelet_restart(self, make_node) -> None:
        async with make_node() as node:
            node.start_plugin()
            await node.wait_counts(2, 2)
            await add(node, "pod1", restart_policy="Never")
            await node.kubelet.exit_container(static("pod1"), "pod1", exit_code=0)
            assert node.kubelet.pod(static("pod1")).phase is PodPhase.SUCCEEDED  # type: ignore[union-attr]
            await node.stop_plugin()
            await node.wait_counts(0, 2)
            allocations = node.kubelet.calls_for(RESOURCE).count(PluginMethod.ALLOCATE)
            await node.kubelet.restart()
            assert node.kubelet.pod(static("pod1")).phase is PodPhase.SUCCEEDED  # type: ignore[union-attr]
            assert node.kubelet.calls_for(RESOURCE).count(PluginMethod.ALLOCATE) == allocations

    async def test_07_keeps_assignments_after_the_device_plugin_restarted(self, make_node) -> None:
        async with make_node() as node:
            node.start_plugin()
            await node.wait_counts(2, 2)
            await add(node, "pod1")
            first = device_of(node, "pod1")
            await node.stop_plugin()
            await node.wait_counts(0, 2)
            node.start_plugin()
            await node.wait_counts(2, 2)
            assert device_of(node, "pod1") == first
            await add(node, "pod2")
            assert device_of(node, "pod2") != first

    async def test_08_keeps_assignments_after_kubelet_and_plugin_restart(self, make_node) -> None:
        async with make_node() as node:
            node.start_plugin()
            await node.wait_counts(2, 2)
            await add(node, "pod1")
            first = device_of(node, "pod1")
            await node.stop_plugin()
            await node.kubelet.restart()
            node.start_plugin()
            await node.wait_counts(2, 2)
            assert node.kubelet.pod(static("pod1")).phase is PodPhase.RUNNING  # type: ignore[union-attr]
            assert await pod_devices(node.kubelet) == {(static("pod1"), "pod1"): list(first)}

    async def test_09_orphaned_pods_deleted_while_the_kubelet_is_down(self, make_node) -> None:
        async with make_node() as node:
            node.start_plugin()
            await node.wait_counts(2, 2)
            await add(node, "pod1")
            await node.kubelet.stop()
            (node.pods_dir / "pod1.yaml").unlink()
            await node.kubelet.start()
            assert await pod_devices(node.kubelet) == {}
            await node.wait_counts(2, 2)
            await add(node, "pod2", count=2)
            assert len(device_of(node, "pod2")) == 2

    async def test_10_can_schedule_a_pod_with_a_restartable_init_container(self, make_node) -> None:
        async with make_node() as node:
            node.start_plugin()
            await node.wait_counts(2, 2)
            limits = f"resources: {{limits: {{{RESOURCE}: 1}}}}"
            (node.pods_dir / "p.yaml").write_text(
                "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec:\n  initContainers:\n"
                f"  - {{name: init-1, image: busybox, {limits}}}\n"
                f"  - {{name: restartable-init-2, image: busybox, restartPolicy: Always, {limits}}}\n"
                f"  containers:\n  - {{name: regular-1, image: busybox, {limits}}}\n"
            )
            await node.kubelet.wait_for(
                lambda k: (p := k.pod(static("p"))) is not None and p.phase is PodPhase.RUNNING
            )
            status = node.kubelet.pod(static("p"))
            assert status is not None
            init, sidecar, app = (
                status.container(n).devices[RESOURCE] for n in ("init-1", "restartable-init-2", "regular-1")
            )
            assert init == sidecar and app != init
            assert await pod_devices(node.kubelet) == {
                (static("p"), "restartable-init-2"): list(sidecar),
                (static("p"), "regular-1"): list(app),
            }

    @pytest.mark.parametrize("version", ["1.29", "1.35"])
    async def test_11_node_reboot_before_the_plugin_registers_fails_admission(
        self, make_node, version
    ) -> None:
        """Kubelet 1.29 and 1.35 (kubernetes#116376): the pod fails admission, its devices unhealthy."""
        # The resource must still be checkpointed when the kubelet restarts: a grace period that could run
        # out between the plugin's stop and the restart (0.3 s, on a loaded machine) dropped it first.
        async with make_node(kubelet_version=version, grace_period=60) as node:
            node.start_plugin()
            await node.wait_counts(2, 2)
            await add(node, "pod1")
            (dev,) = device_of(node, "pod1")
            await node.stop_plugin()
            await node.kubelet.restart(reboot=True)
            status = node.kubelet.pod(static("pod1"))
            assert status is not None and (status.phase, status.reason) == (
                PodPhase.FAILED,
                "UnexpectedAdmissionError",
            )
            assert "no healthy devices present; cannot allocate unhealthy devices" in (status.message or "")
            # The assignment stays in the checkpoint until the rejected pod is collected.
            entries = checkpoint.read(node.kubelet.checkpoint_path).pod_device_entries or []
            assert [(e.pod_uid, list((e.device_ids or {})[-1])) for e in entries] == [(status.uid, [dev])]

    async def test_11_before_the_fix_the_pod_starts_without_its_plugin(self, make_node) -> None:
        """Kubelet 1.26 (issue #109595, the bug #116376 fixed): the checkpointed device is reused as is."""
        async with make_node(kubelet_version="1.26", grace_period=60) as node:  # as test_11 above
            node.start_plugin()
            await node.wait_counts(2, 2)
            await add(node, "pod1")
            (dev,) = device_of(node, "pod1")
            await node.stop_plugin()
            await node.kubelet.restart(reboot=True)
            status = node.kubelet.pod(static("pod1"))
            assert status is not None and status.phase is PodPhase.RUNNING
            assert status.container("pod1").devices[RESOURCE] == (dev,)
            assert node.kubelet.resource(RESOURCE).allocatable == 0  # type: ignore[union-attr]


class TestDevicePluginFailures:
    """device_plugin_failures_test.go."""

    async def test_12_get_device_plugin_options_fails(self, make_node) -> None:
        async with make_node() as node:
            stub = StubDevicePlugin(node.kubelet.socket_dir / "test.sock", RESOURCE, devices=devices("a"))
            stub.errors[PluginMethod.GET_DEVICE_PLUGIN_OPTIONS] = "injected"
            async with stub:
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await stub.register(node.kubelet.socket_path)
            assert "failed to get device plugin options" in (raised.value.details() or "")
            assert node.kubelet.calls_for(RESOURCE) == [PluginMethod.GET_DEVICE_PLUGIN_OPTIONS]
            assert node.kubelet.resource(RESOURCE) is None

    async def test_13_a_single_device_unhealthy_then_healthy(self, make_node) -> None:
        async with make_node() as node:
            node.start_plugin(count=1)
            await node.wait_counts(1, 1)
            node.set_health("Dev-1", healthy=False)
            await node.wait_counts(0, 1)
            node.set_health("Dev-1", healthy=True)
            await node.wait_counts(1, 1)

    async def test_14_a_device_turning_unhealthy_while_used_keeps_the_pod_running(self, make_node) -> None:
        async with make_node() as node:
            node.start_plugin(count=1)
            await node.wait_counts(1, 1)
            await add(node, "pod1")
            node.set_health("Dev-1", healthy=False)
            await node.wait_counts(0, 1)
            assert node.kubelet.pod(static("pod1")).phase is PodPhase.RUNNING  # type: ignore[union-attr]
            (node.pods_dir / "pod1.yaml").unlink()
            await node.kubelet.wait_for(lambda k: k.pod(static("pod1")) is None)
            await node.wait_counts(0, 1)

    async def test_15_four_devices_toggling_health(self, make_node) -> None:
        async with make_node() as node:
            node.start_plugin(count=4)
            await node.wait_counts(4, 4)
            steps = [("Dev-1", False, 3), ("Dev-1", True, 4), ("Dev-2", False, 3), ("Dev-3", False, 2)]
            for device, healthy, allocatable in steps[:2]:
                node.set_health(device, healthy=healthy)
                await node.wait_counts(allocatable, 4)
            node.set_health("Dev-2", healthy=False)
            node.set_health("Dev-3", healthy=False)
            await node.wait_counts(2, 4)
            node.set_health("Dev-2", healthy=True)
            await node.wait_counts(3, 4)
            node.set_health("Dev-3", healthy=True)
            await node.wait_counts(4, 4)

    async def test_16_list_and_watch_fails_immediately(self, make_node) -> None:
        async with make_node() as node:
            stub = StubDevicePlugin(
                node.kubelet.socket_dir / "test.sock", RESOURCE, devices=devices("a", "b")
            )
            stub.errors[PluginMethod.LIST_AND_WATCH] = "injected"
            async with stub:
                await stub.register(node.kubelet.socket_path)
                await node.wait_counts(0, 0)
                assert node.kubelet.calls_for(RESOURCE) == [
                    PluginMethod.GET_DEVICE_PLUGIN_OPTIONS,
                    PluginMethod.LIST_AND_WATCH,
                ]

    async def test_17_list_and_watch_fails_after_provisioning(self, make_node) -> None:
        async with make_node() as node:
            stub = StubDevicePlugin(
                node.kubelet.socket_dir / "test.sock", RESOURCE, devices=devices("a", "b")
            )
            async with stub:
                await stub.register(node.kubelet.socket_path)
                await node.wait_counts(2, 2)
                await stub.end_streams("injected")
                await node.wait_counts(0, 2)
                await node.kubelet.wait_for(lambda k: k.resource(RESOURCE).removed)  # type: ignore[union-attr]
                await node.wait_counts(0, 0)
                assert node.kubelet.calls_for(RESOURCE).count(PluginMethod.LIST_AND_WATCH) == 1

    async def test_18_plugin_stopped_after_provisioning(self, make_node) -> None:
        async with make_node() as node:
            node.start_plugin()
            await node.wait_counts(2, 2)
            await node.stop_plugin()
            await node.wait_counts(0, 2)
            await node.kubelet.wait_for(lambda k: k.resource(RESOURCE).removed)  # type: ignore[union-attr]
            await node.wait_counts(0, 0)

    async def test_19_allocated_resources_status_follows_health(self, make_node) -> None:
        async with make_node(gates=FeatureGates(resource_health_status=True)) as node:
            node.start_plugin(count=1)
            await node.wait_counts(1, 1)
            await add(node, "pod1")

            def health(k: EmulatedKubelet) -> str:
                status = k.pod(static("pod1")).container("pod1").allocated_resources_status  # type: ignore[union-attr]
                assert status is not None
                return status[0].resources[0].health

            assert health(node.kubelet) == "Healthy"
            node.set_health("Dev-1", healthy=False)
            await node.kubelet.wait_for(lambda k: health(k) == "Unhealthy")


class TestDevicePluginMultiple:
    """device_plugin_multiple_test.go: rollout of a second instance, with the fixed kubelet."""

    async def test_21_zero_downtime_rollout(self, make_node) -> None:
        async with make_node(replacement="per-socket") as node:
            node.start_plugin("dp1")
            await node.wait_counts(2, 2)
            dp2 = node.start_plugin("dp2")
            await dp2.registrations.wait_newer(0)
            await node.wait_counts(2, 2)
            await node.stop_plugin("dp1")
            await node.wait_counts(2, 2)
            assert node.kubelet.resource(RESOURCE).registered  # type: ignore[union-attr]
            await add(node, "pod1")
            assert node.kubelet.pod(static("pod1")).phase is PodPhase.RUNNING  # type: ignore[union-attr]

    async def test_21_the_same_rollout_on_an_old_kubelet_drops_to_zero(self, make_node) -> None:
        async with make_node(replacement="per-name") as node:
            node.start_plugin("dp1")
            await node.wait_counts(2, 2)
            dp2 = node.start_plugin("dp2")
            await dp2.registrations.wait_newer(0)
            await node.stop_plugin("dp1")
            await node.wait_counts(0, 2)

    async def test_22_a_slow_second_instance_then_a_third(self, make_node) -> None:
        async with make_node(replacement="per-socket") as node:
            node.start_plugin("dp1")
            await node.wait_counts(2, 2)
            slow = StubDevicePlugin(node.kubelet.socket_dir / "dp2.sock", RESOURCE, devices=devices("x"))
            slow.errors[PluginMethod.GET_DEVICE_PLUGIN_OPTIONS] = "not ready"
            async with slow:
                with pytest.raises(grpc.aio.AioRpcError):
                    await slow.register(node.kubelet.socket_path)
            await node.wait_counts(2, 2)
            dp3 = node.start_plugin("dp3")
            await dp3.registrations.wait_newer(0)
            await node.stop_plugin("dp1")
            await node.wait_counts(2, 2)
            await add(node, "pod1")
            assert node.kubelet.pod(static("pod1")).phase is PodPhase.RUNNING  # type: ignore[union-attr]

    async def test_23_the_second_instance_changes_its_mind(self, make_node) -> None:
        async with make_node(replacement="per-socket") as node:
            node.start_plugin("dp1")
            await node.wait_counts(2, 2)
            dp2 = node.start_plugin("dp2")
            await dp2.registrations.wait_newer(0)
            await node.stop_plugin("dp2")
            await node.wait_counts(2, 2)
            assert node.kubelet.resource(RESOURCE).registered  # type: ignore[union-attr]
            await add(node, "pod1")
            assert node.kubelet.pod(static("pod1")).phase is PodPhase.RUNNING  # type: ignore[union-attr]


class BlockingStub(StubDevicePlugin):
    """Allocate waits until released: the in-flight window of scenario 24."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.release = asyncio.Event()
        self.entered = asyncio.Event()

    async def Allocate(self, request: api_pb2.AllocateRequest, context: object) -> api_pb2.AllocateResponse:  # type: ignore[override]
        self.entered.set()
        await self.release.wait()
        return await super().Allocate(request, context)  # type: ignore[arg-type]


class TestDevicePluginAllocation:
    """device_plugin_allocation_test.go."""

    async def test_24_a_pod_whose_allocation_is_in_flight_is_listed_without_devices(self, make_node) -> None:
        async with make_node() as node:
            stub = BlockingStub(node.kubelet.socket_dir / "test.sock", RESOURCE, devices=devices("a", "b"))
            async with stub:
                await stub.register(node.kubelet.socket_path)
                await node.wait_counts(2, 2)
                admission = asyncio.create_task(node.kubelet.add_pod(busybox_pod("pod1")))
                await stub.entered.wait()
                assert await pod_devices(node.kubelet) == {("pod1", "pod1"): []}
                stub.release.set()
                status = await admission
                assert await pod_devices(node.kubelet) == {
                    ("pod1", "pod1"): list(status.container("pod1").devices[RESOURCE])
                }
