"""Pods on the emulated kubelet: admission, container starts, runtime config, status, the pods directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plugvisor.api.deviceplugin.v1beta1 import api_pb2
from plugvisor.common import constants
from plugvisor.emulators.kubelet import EmulatedKubelet, EventKind, PluginMethod, device, devices
from plugvisor.emulators.kubelet.gates import FeatureGates
from plugvisor.emulators.kubelet.manifest import ManifestError
from plugvisor.emulators.kubelet.pods import ContainerState, PodPhase

from .conftest import PluginFactory, counts

GPU = "example.com/gpu"


def manifest(
    name: str, *, app: int = 1, init: int | None = None, sidecar: int | None = None, policy: str = "Always"
) -> str:
    lines = [
        "apiVersion: v1",
        "kind: Pod",
        f"metadata: {{name: {name}}}",
        "spec:",
        f"  restartPolicy: {policy}",
    ]
    inits = []
    if init is not None:
        inits.append(f"  - {{name: init, image: x, resources: {{limits: {{{GPU}: {init}}}}}}}")
    if sidecar is not None:
        inits.append(
            "  - {name: side, image: x, restartPolicy: Always, "
            f"resources: {{limits: {{{GPU}: {sidecar}}}}}}}"
        )
    if inits:
        lines += ["  initContainers:", *inits]
    lines += ["  containers:", f"  - {{name: app, image: x, resources: {{limits: {{{GPU}: {app}}}}}}}"]
    return "\n".join(lines) + "\n"


def env_per_device(request: api_pb2.AllocateRequest) -> api_pb2.AllocateResponse:
    return api_pb2.AllocateResponse(
        container_responses=[
            api_pb2.ContainerAllocateResponse(
                envs={"DEVICES": ",".join(sorted(r.devices_ids))},
                devices=[
                    api_pb2.DeviceSpec(container_path=f"/dev/{i}", host_path=f"/dev/{i}", permissions="rw")
                    for i in r.devices_ids
                ],
                cdi_devices=[api_pb2.CDIDevice(name=f"example.com/gpu={i}") for i in r.devices_ids],
            )
            for r in request.container_requests
        ]
    )


@pytest.fixture
async def gpus(kubelet: EmulatedKubelet, plugin: PluginFactory):
    stub = await plugin(GPU, devices("g0", "g1", "g2"), pre_start_required=True)
    stub.allocate_func = env_per_device
    await stub.register(kubelet.socket_path)
    await kubelet.wait_for(counts(GPU, 3, 3))
    return stub


class TestAdmission:
    async def test_a_pod_is_admitted_started_and_its_runtime_config_recorded(
        self, kubelet: EmulatedKubelet, gpus
    ) -> None:
        """One Allocate per container and resource, PreStart at the start, the merged config recorded."""
        status = await kubelet.add_pod(manifest("p", app=2))
        assert status.phase is PodPhase.RUNNING
        app = status.container("app")
        assert app.state is ContainerState.RUNNING
        assert app.devices == {GPU: ("g0", "g1")}
        assert app.runtime is not None
        assert dict(app.runtime.envs) == {"DEVICES": "g0,g1"}
        assert [d.host_path for d in app.runtime.devices] == ["/dev/g0", "/dev/g1"]
        assert app.runtime.cdi_devices == ("example.com/gpu=g0", "example.com/gpu=g1")
        assert kubelet.calls_for(GPU)[2:] == [PluginMethod.ALLOCATE, PluginMethod.PRE_START_CONTAINER]
        assert [sorted(r.container_requests[0].devices_ids) for r in gpus.calls(PluginMethod.ALLOCATE)] == [
            ["g0", "g1"]
        ]

    async def test_init_and_sidecar_share_a_device_and_the_app_gets_another(
        self, kubelet: EmulatedKubelet, gpus
    ) -> None:
        """The reuse pool: an init container's device is reused by the sidecar, never by an app container."""
        status = await kubelet.add_pod(manifest("p", init=1, sidecar=1, app=1))
        assert status.container("init").devices == status.container("side").devices == {GPU: ("g0",)}
        assert status.container("app").devices == {GPU: ("g1",)}
        assert status.container("init").state is ContainerState.TERMINATED
        assert status.container("side").state is ContainerState.RUNNING

    async def test_a_pod_that_does_not_fit_is_rejected_with_the_kubelets_reason(
        self, kubelet: EmulatedKubelet, gpus
    ) -> None:
        """No retry: the pod is Failed with UnexpectedAdmissionError and the device manager's text."""
        status = await kubelet.add_pod(manifest("big", app=4))
        assert status.phase is PodPhase.FAILED
        assert status.reason == "UnexpectedAdmissionError"
        assert status.message == (
            "Pod was rejected: Allocate failed due to requested number of devices unavailable for "
            f"{GPU}. Requested: 4, Available: 3, which is unexpected"
        )
        assert [e.kind for e in kubelet.events].count(EventKind.POD_REJECTED) == 1

    async def test_a_failed_pre_start_leaves_the_container_waiting(
        self, kubelet: EmulatedKubelet, gpus
    ) -> None:
        """CreateContainerConfigError with the device manager's message; the allocation stands."""
        gpus.errors[PluginMethod.PRE_START_CONTAINER] = "not ready"
        status = await kubelet.add_pod(manifest("p"))
        app = status.container("app")
        assert (status.phase, app.state, app.reason) == (
            PodPhase.PENDING,
            ContainerState.WAITING,
            "CreateContainerConfigError",
        )
        assert (
            app.message == "device plugin PreStartContainer rpc failed with err: "
            "rpc error: code = Unknown desc = not ready"
        )
        assert app.devices == {GPU: ("g0",)}

    async def test_a_container_restart_calls_pre_start_again_with_the_same_devices(
        self, kubelet: EmulatedKubelet, gpus
    ) -> None:
        """Restarting reuses the cached allocation: no second Allocate."""
        await kubelet.add_pod(manifest("p"))
        app = await kubelet.restart_container("p", "app")
        assert (app.restart_count, app.devices) == (1, {GPU: ("g0",)})
        assert kubelet.calls_for(GPU).count(PluginMethod.ALLOCATE) == 1
        assert kubelet.calls_for(GPU).count(PluginMethod.PRE_START_CONTAINER) == 2

    async def test_a_deleted_pod_frees_its_devices_at_the_next_admission(
        self, kubelet: EmulatedKubelet, gpus
    ) -> None:
        """Devices of inactive pods are reclaimed lazily (UpdateAllocatedDevices)."""
        await kubelet.add_pod(manifest("a", app=3))
        assert kubelet.delete_pod("a")
        assert kubelet.allocated(GPU, pod_uid=_uid(kubelet, "a", deleted=True), container="app") is not None
        status = await kubelet.add_pod(manifest("b", app=3))
        assert status.phase is PodPhase.RUNNING


def _uid(kubelet: EmulatedKubelet, name: str, *, deleted: bool = False) -> str:
    for event in kubelet.events:
        if event.kind is EventKind.POD_ADDED and event.fields.get("pod") == f"default/{name}":
            return str(event.fields["pod_uid"])
    raise AssertionError(name)


class TestHealthInStatus:
    async def test_allocated_resources_status_follows_device_health(
        self, socket_dir: Path, plugin: PluginFactory
    ) -> None:
        """With ResourceHealthStatus, an allocated device turning unhealthy shows in the container status."""
        kubelet = EmulatedKubelet(
            socket_dir, grace_period=0.5, gates=FeatureGates(resource_health_status=True)
        )
        await kubelet.start()
        try:
            stub = await plugin(GPU, devices("g0"))
            await stub.register(kubelet.socket_path)
            await kubelet.wait_for(counts(GPU, 1, 1))
            status = await kubelet.add_pod(manifest("p"))
            health = status.container("app").allocated_resources_status
            assert health is not None and [(h.resource_id, h.health) for h in health[0].resources] == [
                ("g0", "Healthy")
            ]
            await stub.update([device("g0", constants.UNHEALTHY)])
            await kubelet.wait_for(counts(GPU, 0, 1))
            health = kubelet.pod("p").container("app").allocated_resources_status  # type: ignore[union-attr]
            assert health is not None and health[0].resources[0].health == "Unhealthy"
            assert kubelet.pod("p").phase is PodPhase.RUNNING  # type: ignore[union-attr]
            await kubelet.flush_view()
            document = json.loads(kubelet.pods_view_path.read_text())
            statuses = document["pods"][0]["status"]["containerStatuses"][0]
            assert statuses["allocatedResourcesStatus"] == [
                {"name": GPU, "resources": [{"resourceID": "g0", "health": "Unhealthy"}]}
            ]
        finally:
            await kubelet.stop()

    async def test_without_the_gate_there_is_no_health_status(
        self, kubelet_1_35: EmulatedKubelet, plugin: PluginFactory
    ) -> None:
        """Off by default until 1.36 (beta and on since), as upstream."""
        stub = await plugin(GPU, devices("g0"))
        await stub.register(kubelet_1_35.socket_path)
        await kubelet_1_35.wait_for(counts(GPU, 1, 1))
        status = await kubelet_1_35.add_pod(manifest("p"))
        assert status.container("app").allocated_resources_status is None

    async def test_from_1_36_containers_report_device_health_by_default(
        self, kubelet: EmulatedKubelet, gpus
    ) -> None:
        """ResourceHealthStatus is beta and on from 1.36: the real 1.37 kubelet reports it unasked."""
        status = await kubelet.add_pod(manifest("p"))
        health = status.container("app").allocated_resources_status
        assert health is not None
        assert health[0].resources[0].health == "Healthy"


class TestPodsDirectory:
    @pytest.fixture
    async def node(self, socket_dir: Path, plugin: PluginFactory):
        pods_dir = socket_dir / "pods"
        kubelet = EmulatedKubelet(socket_dir / "dp", grace_period=0.5, pods_dir=pods_dir, node_name="node1")
        await kubelet.start()
        stub = await plugin(GPU, devices("g0", "g1"))
        await stub.stop()
        stub.socket_path = kubelet.socket_dir / "gpu.sock"
        await stub.start()
        await stub.register(kubelet.socket_path)
        await kubelet.wait_for(counts(GPU, 2, 2))
        yield kubelet, pods_dir
        await kubelet.stop()
        await stub.stop()

    async def test_a_file_dropped_in_is_a_pod_and_removing_it_terminates_the_pod(self, node) -> None:
        """Static-pod style: the directory is the set of pods, each named <name>-<node name>."""
        kubelet, pods_dir = node
        (pods_dir / "p.yaml").write_text(manifest("p"))
        await kubelet.wait_for(lambda k: (p := k.pod("p-node1")) is not None and p.phase is PodPhase.RUNNING)
        (pods_dir / "p.yaml").unlink()
        await kubelet.wait_for(lambda k: k.pod("p-node1") is None, what="pod p-node1 gone")
        assert EventKind.POD_DELETED in [e.kind for e in kubelet.events]

    async def test_bad_manifests_give_an_event_and_the_kubelet_goes_on(self, node) -> None:
        """Not a Pod, requests != limits, unknown fields: each reported once, none admitted."""
        kubelet, pods_dir = node
        (pods_dir / "deploy.yaml").write_text("apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: d}\n")
        (pods_dir / "req.yaml").write_text(
            manifest("r").replace(f"limits: {{{GPU}: 1}}", f"limits: {{{GPU}: 1}}, requests: {{{GPU}: 2}}")
        )
        (pods_dir / "typo.yaml").write_text(manifest("t").replace("limits:", "limts:"))
        (pods_dir / "good.yaml").write_text(manifest("good"))
        await kubelet.wait_for(
            lambda k: (p := k.pod("good-node1")) is not None and p.phase is PodPhase.RUNNING
        )
        await kubelet.sync_pods_dir()
        invalid = sorted(e.message for e in kubelet.events if e.kind is EventKind.POD_INVALID)
        assert len(invalid) == 3
        assert "not a Pod: kind is 'Deployment'" in invalid[0]
        assert f"must be equal to {GPU} limit of 1" in invalid[1]
        assert "('limts' was unexpected)" in invalid[2]
        assert [p.name for p in kubelet.pods] == ["good-node1"]


class TestAddPodApi:
    async def test_a_bad_manifest_raises_a_clear_error(self, kubelet: EmulatedKubelet) -> None:
        """The Python API raises ManifestError; nothing is added."""
        with pytest.raises(ManifestError, match="not a Pod"):
            await kubelet.add_pod("kind: Service\n")
        assert kubelet.pods == []


class TestProposedDeallocate:
    async def test_off_by_default(self, kubelet: EmulatedKubelet, gpus) -> None:
        """Without DeviceManagerDeallocate nothing beyond upstream's RPCs is ever sent."""
        await kubelet.add_pod(manifest("p"))
        kubelet.delete_pod("p")
        await kubelet.add_pod(manifest("q"))
        assert PluginMethod.POST_STOP_CONTAINER not in kubelet.calls_for(GPU)
        assert PluginMethod.DEALLOCATE not in kubelet.calls_for(GPU)

    async def test_with_the_gate_stopped_containers_and_freed_devices_are_reported(
        self, socket_dir: Path, plugin: PluginFactory
    ) -> None:
        """PostStopContainer at the stop, Deallocate when the devices are freed; UNIMPLEMENTED is no error."""
        kubelet = EmulatedKubelet(
            socket_dir, grace_period=0.5, gates=FeatureGates(device_manager_deallocate=True)
        )
        await kubelet.start()
        try:
            stub = await plugin(GPU, devices("g0"))
            await stub.register(kubelet.socket_path)
            await kubelet.wait_for(counts(GPU, 1, 1))
            await kubelet.add_pod(manifest("p"))
            kubelet.delete_pod("p")
            await kubelet.add_pod(manifest("q"))
            await kubelet.wait_for(
                lambda k: [e.kind for e in k.events].count(EventKind.PLUGIN_CALL_ANSWERED) == 2,
                what="both calls answered",
            )
            calls = kubelet.calls_for(GPU)
            assert calls.index(PluginMethod.POST_STOP_CONTAINER) < calls.index(PluginMethod.DEALLOCATE)
            assert kubelet.pod("q").phase is PodPhase.RUNNING  # type: ignore[union-attr]
            answers = [e.fields for e in kubelet.events if e.kind is EventKind.PLUGIN_CALL_ANSWERED]
            assert [a["offered"] for a in answers] == [False, False]
            assert EventKind.PLUGIN_CALL_FAILED not in [e.kind for e in kubelet.events]
        finally:
            await kubelet.stop()
