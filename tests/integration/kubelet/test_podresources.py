"""PodResources v1 over its real socket, checked field by field."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from plugvisor.api.podresources.v1 import api_pb2 as pr
from plugvisor.api.podresources.v1 import api_pb2_grpc as pr_grpc
from plugvisor.emulators.kubelet import EmulatedKubelet, device
from plugvisor.emulators.kubelet.gates import FeatureGates

from .conftest import PluginFactory, counts
from .test_pods import manifest

GPU = "example.com/gpu"


@pytest.fixture
async def node(socket_dir: Path, plugin: PluginFactory) -> AsyncIterator[EmulatedKubelet]:
    kubelet = EmulatedKubelet(
        socket_dir,
        grace_period=0.5,
        gates=FeatureGates(kubelet_pod_resources_get=True),
        pod_resources_burst=1000,
    )
    await kubelet.start()
    # g0 on NUMA 0, g1 on both NUMA nodes, g2 without topology.
    stub = await plugin(GPU, [device("g0", numa=[0]), device("g1", numa=[0, 1]), device("g2")])
    await stub.register(kubelet.socket_path)
    await kubelet.wait_for(counts(GPU, 3, 3))
    yield kubelet
    await kubelet.stop()


async def call(kubelet: EmulatedKubelet, method: str, request: object) -> object:
    async with grpc.aio.insecure_channel(f"unix:{kubelet.pod_resources_socket}") as channel:
        return await getattr(pr_grpc.PodResourcesListerStub(channel), method)(request)


def devices_of(container: pr.ContainerResources) -> list[tuple[str, list[str], list[int] | None]]:
    return [
        (
            d.resource_name,
            list(d.device_ids),
            [n.ID for n in d.topology.nodes] if d.HasField("topology") else None,
        )
        for d in container.devices
    ]


class TestList:
    async def test_sidecars_then_app_containers_with_one_entry_per_device_and_numa_node(
        self, node: EmulatedKubelet
    ) -> None:
        """Init containers are left out; the multi-NUMA device appears once per node."""
        await node.add_pod(manifest("p", init=1, sidecar=1, app=2))
        response = await call(node, "List", pr.ListPodResourcesRequest())
        assert isinstance(response, pr.ListPodResourcesResponse)
        (pod,) = response.pod_resources
        assert (pod.name, pod.namespace) == ("p", "default")
        assert [c.name for c in pod.containers] == ["side", "app"]
        assert devices_of(pod.containers[0]) == [(GPU, ["g0"], [0])]
        assert devices_of(pod.containers[1]) == [(GPU, ["g1"], [0]), (GPU, ["g1"], [1]), (GPU, ["g2"], None)]
        assert all(not c.cpu_ids and not c.memory and not c.dynamic_resources for c in pod.containers)

    async def test_terminated_and_deleted_pods_are_not_listed(self, node: EmulatedKubelet) -> None:
        """Only active pods; a rejected pod is Failed and so not active."""
        await node.add_pod(manifest("ok", app=1))
        await node.add_pod(manifest("rejected", app=9))
        await node.add_pod(manifest("gone", app=1))
        node.delete_pod("gone")
        response = await call(node, "List", pr.ListPodResourcesRequest())
        assert [p.name for p in response.pod_resources] == ["ok"]  # type: ignore[attr-defined]

    async def test_list_frees_the_devices_of_deleted_pods(self, node: EmulatedKubelet) -> None:
        """List runs UpdateAllocatedDevices first, as upstream."""
        status = await node.add_pod(manifest("gone", app=1))
        node.delete_pod("gone")
        await call(node, "List", pr.ListPodResourcesRequest())
        assert node.allocated(GPU, pod_uid=status.uid, container="app") is None


class TestAllocatableAndGet:
    async def test_allocatable_lists_every_healthy_device_allocated_or_not(
        self, node: EmulatedKubelet
    ) -> None:
        """Allocation does not change the answer."""
        await node.add_pod(manifest("p", app=1))
        response = await call(node, "GetAllocatableResources", pr.AllocatableResourcesRequest())
        assert devices_of(response) == [  # type: ignore[arg-type]
            (GPU, ["g0"], [0]),
            (GPU, ["g1"], [0]),
            (GPU, ["g1"], [1]),
            (GPU, ["g2"], None),
        ]

    async def test_get_describes_one_pod_and_names_a_missing_one(self, node: EmulatedKubelet) -> None:
        """Get answers like List for one pod; an unknown pod is an Unknown error with upstream's text."""
        await node.add_pod(manifest("p", app=1))
        response = await call(node, "Get", pr.GetPodResourcesRequest(pod_name="p", pod_namespace="default"))
        assert [c.name for c in response.pod_resources.containers] == ["app"]  # type: ignore[attr-defined]
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await call(node, "Get", pr.GetPodResourcesRequest(pod_name="nope", pod_namespace="default"))
        assert raised.value.code() is grpc.StatusCode.UNKNOWN
        assert raised.value.details() == "pod nope in namespace default not found"


class TestGatesAndLimits:
    async def test_get_is_disabled_without_its_gate_before_1_34(self, socket_dir: Path) -> None:
        """KubeletPodResourcesGet was off by default until it went beta in 1.34."""
        kubelet = EmulatedKubelet(socket_dir, kubelet_version="1.29")
        await kubelet.start()
        try:
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await call(kubelet, "Get", pr.GetPodResourcesRequest(pod_name="p", pod_namespace="default"))
            assert raised.value.details() == "PodResources API Get method disabled"
        finally:
            await kubelet.stop()

    async def test_get_answers_by_default_from_1_34(self, kubelet: EmulatedKubelet) -> None:
        """Beta and on in 1.34, GA in 1.36: a real 1.37 kubelet answers Get with no gate set."""
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await call(kubelet, "Get", pr.GetPodResourcesRequest(pod_name="p", pod_namespace="default"))
        assert raised.value.details() == "pod p in namespace default not found"

    async def test_calls_beyond_the_burst_are_rejected_by_the_rate_limit(
        self, kubelet: EmulatedKubelet
    ) -> None:
        """Burst 10: the eleventh immediate call fails with ResourceExhausted."""
        codes = []
        async with grpc.aio.insecure_channel(f"unix:{kubelet.pod_resources_socket}") as channel:
            stub = pr_grpc.PodResourcesListerStub(channel)
            for _ in range(30):
                try:
                    await stub.List(pr.ListPodResourcesRequest())
                    codes.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as error:
                    codes.append(error.code())
                    assert error.details() == "rejected by rate limit"
        assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes
        assert codes[:10] == [grpc.StatusCode.OK] * 10

    async def test_the_socket_sits_beside_a_directory_not_named_device_plugins(
        self, kubelet: EmulatedKubelet
    ) -> None:
        """So that two emulated kubelets under /tmp never share a socket."""
        assert kubelet.pod_resources_socket == Path(f"{kubelet.socket_dir}.pod-resources/kubelet.sock")

    async def test_the_kubelet_layout_when_the_directory_is_device_plugins(self, socket_dir: Path) -> None:
        """<root>/device-plugins gives <root>/pod-resources/kubelet.sock; the directory goes on stop."""
        kubelet = EmulatedKubelet(socket_dir / "device-plugins", write_view=False)
        await kubelet.start()
        assert kubelet.pod_resources_socket == socket_dir / "pod-resources" / "kubelet.sock"
        assert kubelet.pod_resources_socket.is_socket()
        await kubelet.stop()
        assert not (socket_dir / "pod-resources").exists()
