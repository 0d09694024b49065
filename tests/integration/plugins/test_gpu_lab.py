"""The gpu kind on the lab's profiles, through the emulated kubelet: IDs, topology, Allocate, faults, CDI."""

import asyncio
import json
import signal
import sys
from pathlib import Path

import pytest

from plugvisor.emulators import lab
from plugvisor.emulators.kubelet import EmulatedKubelet
from plugvisor.plugins.gpu import KIND

RESOURCE = "plugvisor.io/gpu"


def gpus(node):
    return {d.name: d for d in node.devices(kind=lab.DeviceKind.GPU)}


def allocatable(kubelet, resource=RESOURCE):
    v = kubelet.resource(resource)
    return None if v is None else v.allocatable


class TestDiscovery:
    async def test_dgx_like_lists_every_gpu_by_uuid_with_its_numa_node(self, make_lab, kubelet, running):
        node = make_lab("dgx-like")
        async with running(kubelet, node, KIND, {}, RESOURCE):
            await kubelet.wait_for(lambda k: allocatable(k) == 8)
            seen = kubelet.resource(RESOURCE).devices
        expected = {g.uuid: g.numa_node for g in gpus(node).values()}
        assert {i: d.numa_nodes for i, d in seen.items()} == {u: (n,) for u, n in expected.items()}

    @pytest.mark.parametrize(
        ("profile", "control"), [("amd-like", "/dev/kfd"), ("intel-gpu-like", None)], ids=["amd", "intel"]
    )
    async def test_drm_gpus_are_listed_by_pci_address_with_their_drm_nodes(
        self, make_lab, kubelet, running, profile, control
    ):
        node = make_lab(profile)
        records = sorted(gpus(node).values(), key=lambda g: g.bdf)
        async with running(kubelet, node, KIND, {}, RESOURCE):
            await kubelet.wait_for(lambda k: allocatable(k) == len(records))
            assert sorted(kubelet.resource(RESOURCE).devices) == [g.bdf for g in records]
            allocation = await kubelet.allocate(RESOURCE, 1)
        paths = {d.container_path for d in allocation.response.devices}
        first = next(g for g in records if g.bdf == allocation.device_ids[0])
        drm = {n.path for n in first.device_nodes if n.path.startswith(("/dev/dri/card", "/dev/dri/renderD"))}
        assert drm and paths - {control} == drm
        assert (control in paths) == (control is not None)
        assert dict(allocation.response.envs) == {"NVIDIA_VISIBLE_DEVICES": first.bdf}

    async def test_pci_and_index_strategies(self, make_lab, kubelet, running):
        node = make_lab("small")
        (gpu,) = gpus(node).values()
        async with (
            running(kubelet, node, KIND, {"deviceIdStrategy": "index"}, "a.io/gpu"),
            running(kubelet, node, KIND, {"deviceIdStrategy": "pci"}, "b.io/gpu"),
        ):
            await kubelet.wait_for(
                lambda k: allocatable(k, "a.io/gpu") == 1 and allocatable(k, "b.io/gpu") == 1
            )
            assert list(kubelet.resource("a.io/gpu").devices) == ["0"]
            assert list(kubelet.resource("b.io/gpu").devices) == [gpu.bdf]


class TestAllocate:
    async def test_allocate_returns_the_gpu_node_the_control_nodes_and_the_visible_devices_variable(
        self, make_lab, kubelet, running
    ):
        node = make_lab("dgx-like")
        async with running(kubelet, node, KIND, {"visibleDevicesEnv": "MY_GPUS"}, RESOURCE):
            await kubelet.wait_for(lambda k: allocatable(k) == 8)
            allocation = await kubelet.allocate(RESOURCE, 1)
        (uuid,) = allocation.device_ids
        record = next(g for g in gpus(node).values() if g.uuid == uuid)
        container = sorted(d.container_path for d in allocation.response.devices)
        own = f"/dev/nvidia{record.device_nodes[0].minor}"
        assert container == sorted(
            [own, "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset"]
        )
        host = {d.container_path: d.host_path for d in allocation.response.devices}
        assert host[own] == f"{node.root}{own}"
        assert dict(allocation.response.envs) == {"MY_GPUS": uuid}

    async def test_preferred_allocation_picks_switch_local_pairs_and_numa_local_quads(
        self, make_lab, kubelet, running
    ):
        node = make_lab("dgx-like")
        by_uuid = {g.uuid: g for g in gpus(node).values()}
        async with running(kubelet, node, KIND, {}, RESOURCE):
            await kubelet.wait_for(lambda k: allocatable(k) == 8)
            pair = await kubelet.allocate(RESOURCE, 2, pod_uid="pair")
            quad = await kubelet.allocate(RESOURCE, 4, pod_uid="quad")
        assert pair.preferred_called and quad.preferred_called
        assert len({by_uuid[i].pcie_switch for i in pair.device_ids}) == 1
        assert len({by_uuid[i].numa_node for i in quad.device_ids}) == 1
        assert {by_uuid[i].pcie_switch for i in quad.device_ids}.isdisjoint(
            {by_uuid[i].pcie_switch for i in pair.device_ids}
        ), "the quad fills the NUMA node the pair did not start"

    @pytest.mark.parametrize(("policy", "distinct"), [("spread", 2), ("pack", 1)], ids=["spread", "pack"])
    async def test_replicas_spread_over_or_pack_onto_physical_gpus(
        self, make_lab, kubelet, running, policy, distinct
    ):
        node = make_lab("dgx-like")
        options = {"replicas": 4, "allocationPolicy": policy}
        async with running(kubelet, node, KIND, options, RESOURCE):
            await kubelet.wait_for(lambda k: allocatable(k) == 32)
            allocation = await kubelet.allocate(RESOURCE, 2)
        assert all("::" in i for i in allocation.device_ids)
        assert len({i.split("::")[0] for i in allocation.device_ids}) == distinct
        assert len(allocation.response.envs["NVIDIA_VISIBLE_DEVICES"].split(",")) == distinct


class TestHealth:
    @pytest.mark.parametrize("fault", ["aer-fatal", "fallen-off-bus"])
    async def test_a_fault_makes_the_gpu_unhealthy_and_healing_makes_it_healthy_again(
        self, make_lab, kubelet, running, health_of, fault
    ):
        node = make_lab("dgx-like")
        uuid = gpus(node)["gpu3"].uuid
        # Falling off the bus is also NVML's XID 79, which holds the GPU unhealthy for NVML's quiet
        # period after the heal (test_gpu_nvml_lab.py): one second here instead of five minutes.
        async with running(kubelet, node, KIND, {"nvml": {"recoverAfterSeconds": 1}}, RESOURCE):
            await kubelet.wait_for(lambda k: allocatable(k) == 8)
            node.fault("gpu3", fault)
            await kubelet.wait_for(lambda k: health_of(k, RESOURCE).get(uuid) == "Unhealthy")
            assert kubelet.resource(RESOURCE).allocatable == 7
            node.heal("gpu3")
            await kubelet.wait_for(lambda k: allocatable(k) == 8)
            assert health_of(kubelet, RESOURCE)[uuid] == "Healthy"

    async def test_correctable_and_nonfatal_errors_are_not_faults_by_default(
        self, make_lab, kubelet, running, health_of
    ):
        node = make_lab("dgx-like")
        records = gpus(node)
        async with running(kubelet, node, KIND, {}, RESOURCE):
            await kubelet.wait_for(lambda k: allocatable(k) == 8)
            node.fault("gpu0", "aer-correctable")
            node.fault("gpu1", "aer-nonfatal")
            node.fault("gpu2", "aer-fatal")
            await kubelet.wait_for(lambda k: health_of(k, RESOURCE).get(records["gpu2"].uuid) == "Unhealthy")
            health = health_of(kubelet, RESOURCE)
        assert health[records["gpu0"].uuid] == health[records["gpu1"].uuid] == "Healthy"

    async def test_aer_policy_is_configurable(self, make_lab, kubelet, running, health_of):
        node = make_lab("small")
        (gpu,) = gpus(node).values()
        async with running(kubelet, node, KIND, {"aerUnhealthy": ["fatal", "nonfatal"]}, RESOURCE):
            await kubelet.wait_for(lambda k: allocatable(k) == 1)
            node.fault(gpu.name, "aer-nonfatal")
            await kubelet.wait_for(lambda k: allocatable(k) == 0)

    async def test_hot_unplug_removes_the_gpu_and_replug_brings_it_back_under_the_same_id(
        self, make_lab, kubelet, running
    ):
        node = make_lab("dgx-like")
        uuid = gpus(node)["gpu5"].uuid
        async with running(kubelet, node, KIND, {}, RESOURCE):
            await kubelet.wait_for(lambda k: allocatable(k) == 8)
            node.unplug("gpu5")
            await kubelet.wait_for(lambda k: uuid not in k.resource(RESOURCE).devices)
            node.plug("gpu5")
            await kubelet.wait_for(lambda k: uuid in k.resource(RESOURCE).devices and allocatable(k) == 8)


class TestCdi:
    async def test_cdi_spec_is_valid_json_names_every_gpu_and_is_stable_across_restarts(
        self, make_lab, kubelet, running
    ):
        node = make_lab("dgx-like")
        options = {"cdi": True, "cdiDir": "/etc/cdi"}
        spec_path = f"{node.root}/etc/cdi/plugvisor.io-gpu.json"
        async with running(kubelet, node, KIND, options, RESOURCE):
            await kubelet.wait_for(lambda k: allocatable(k) == 8)
            allocation = await kubelet.allocate(RESOURCE, 1, pod_uid="one")
        first = Path(spec_path).read_bytes()
        spec = json.loads(first)
        assert spec["cdiVersion"] and spec["kind"] == RESOURCE
        names = {d["name"] for d in spec["devices"]}
        assert names == {g.uuid for g in gpus(node).values()}
        for device in spec["devices"]:
            (dn,) = device["containerEdits"]["deviceNodes"]
            assert dn["path"].startswith("/dev/nvidia") and dn["hostPath"] == f"{node.root}{dn['path']}"
        assert {n["path"] for n in spec["containerEdits"]["deviceNodes"]} >= {"/dev/nvidiactl"}
        (uuid,) = allocation.device_ids
        cdi_names = [d.name for d in allocation.response.cdi_devices]
        assert cdi_names == [f"{RESOURCE}={uuid}"]
        assert not allocation.response.devices, "with CDI the runtime injects the nodes"
        async with running(kubelet, node, KIND, options, RESOURCE):
            await kubelet.wait_for(lambda k: allocatable(k) == 8 and k.resource(RESOURCE).registered)
            await kubelet.allocate(RESOURCE, 1, pod_uid="two")
        assert Path(spec_path).read_bytes() == first


async def test_plugin_gpu_runs_as_a_real_process(make_lab, base):
    node = make_lab("dgx-like")
    async with EmulatedKubelet(base / "dp2", write_view=False) as kubelet:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "plugvisor",
            "plugin",
            "gpu",
            "--host-root",
            str(node.root),
            "--kubelet-dir",
            str(base / "dp2"),
            "--options-json",
            json.dumps({"match": {"vendors": ["0x10de"]}, "replicas": 2}),
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            await kubelet.wait_for(lambda k: allocatable(k) == 16, timeout=20)
            node.fault("gpu0", "fallen-off-bus")
            await kubelet.wait_for(lambda k: allocatable(k) == 14)
            allocation = await kubelet.allocate(RESOURCE, 2)
            assert len({i.split("::")[0] for i in allocation.device_ids}) == 2
        finally:
            proc.send_signal(signal.SIGTERM)
            _, stderr = await asyncio.wait_for(proc.communicate(), 10)
        assert proc.returncode == 0, stderr.decode()
        assert "device_unhealthy" in stderr.decode()
