"""The nic kind on the lab, through the emulated kubelet: pools, selectors, Allocate, link health, numvfs."""

import asyncio
import json
import os
import signal
import sys

import pytest

from plugvisor.emulators import lab
from plugvisor.emulators.kubelet import EmulatedKubelet
from plugvisor.plugins.nic import KIND

RESOURCE = "intel.com/sriov_net"
ENV = "PCIDEVICE_INTEL_COM_SRIOV_NET"


def vfs(node, pf=None):
    return {d.bdf: d for d in node.devices(kind=lab.DeviceKind.NIC_VF) if pf is None or d.parent == pf}


def allocatable(kubelet, resource=RESOURCE):
    v = kubelet.resource(resource)
    return None if v is None else v.allocatable


def listed(kubelet, resource=RESOURCE):
    v = kubelet.resource(resource)
    return None if v is None else sorted(v.devices)


class TestPools:
    async def test_every_vf_is_a_device_and_pfs_are_never_listed(self, make_lab, kubelet, running):
        node = make_lab("dgx-like")
        async with running(kubelet, node, KIND, {}, RESOURCE):
            await kubelet.wait_for(lambda k: allocatable(k) == 16)
            devices = kubelet.resource(RESOURCE).devices
        assert sorted(devices) == sorted(vfs(node))
        assert {i: d.numa_nodes for i, d in devices.items()} == {
            b: (v.numa_node,) for b, v in vfs(node).items()
        }

    @pytest.mark.parametrize(
        ("match", "expected"),
        [
            ({"vendors": ["15b3"]}, lambda n: vfs(n, "nic1")),
            ({"devices": ["0x1889"], "drivers": ["iavf"]}, lambda n: vfs(n, "nic0")),
            (
                {"pfNames": ["enp10s0f0#0-2,5"]},
                lambda n: {b: v for b, v in vfs(n, "nic0").items() if v.name[-1] in "0125"},
            ),
            ({"rootDevices": ["8a:00.0"]}, lambda n: vfs(n, "nic1")),
            ({"pciAddresses": ["0000:0a:01.3"]}, lambda n: {"0000:0a:01.3": None}),
            ({"drivers": ["vfio-pci"]}, lambda n: {}),
        ],
        ids=["vendor", "device+driver", "pf-range", "root-device", "address", "no-match"],
    )
    async def test_selectors_choose_the_pool(self, make_lab, kubelet, running, match, expected):
        node = make_lab("dgx-like")
        want = sorted(expected(node))
        async with running(kubelet, node, KIND, {"match": match}, RESOURCE):
            await kubelet.wait_for(lambda k: listed(k) == want)

    async def test_sriov_numvfs_changes_reach_the_kubelet_without_a_restart(self, make_lab, kubelet, running):
        node = make_lab("dgx-like")
        async with running(kubelet, node, KIND, {"match": {"pfNames": ["enp10s0f0"]}}, RESOURCE):
            await kubelet.wait_for(lambda k: allocatable(k) == 8)
            node.set_num_vfs("nic0", 0)
            await kubelet.wait_for(lambda k: listed(k) == [])
            node.set_num_vfs("nic0", 12)
            await kubelet.wait_for(lambda k: listed(k) == sorted(vfs(node, "nic0")) and allocatable(k) == 12)
            node.fault("nic0", "vfs-reset")
            await kubelet.wait_for(lambda k: listed(k) == [])
            node.heal("nic0")
            await kubelet.wait_for(lambda k: allocatable(k) == 12)


class TestHealth:
    async def test_pf_link_down_makes_its_vfs_unhealthy_and_up_again_healthy(
        self, make_lab, kubelet, running, health_of
    ):
        node = make_lab("dgx-like")
        nic0 = set(vfs(node, "nic0"))
        async with running(kubelet, node, KIND, {}, RESOURCE):
            await kubelet.wait_for(lambda k: allocatable(k) == 16)
            node.fault("nic0", "link-down")
            await kubelet.wait_for(lambda k: allocatable(k) == 8)
            health = health_of(kubelet, RESOURCE)
            assert {b for b, h in health.items() if h == "Unhealthy"} == nic0
            node.heal("nic0")
            await kubelet.wait_for(lambda k: allocatable(k) == 16)

    @pytest.mark.parametrize("target", ["pf", "vf"])
    async def test_aer_fatal_on_the_pf_or_a_vf(self, make_lab, kubelet, running, health_of, target):
        node = make_lab("dgx-like")
        victim = "nic1" if target == "pf" else "nic1vf2"
        expected = 8 if target == "pf" else 1
        async with running(kubelet, node, KIND, {}, RESOURCE):
            await kubelet.wait_for(lambda k: allocatable(k) == 16)
            node.fault(victim, "aer-fatal")
            await kubelet.wait_for(lambda k: allocatable(k) == 16 - expected)
            node.heal(victim)
            await kubelet.wait_for(lambda k: allocatable(k) == 16)

    async def test_vf_link_health_is_opt_in(self, make_lab, kubelet, running):
        node = make_lab("dgx-like")
        async with running(kubelet, node, KIND, {"vfLinkHealth": True}, RESOURCE):
            await kubelet.wait_for(lambda k: allocatable(k) == 16)
            node.fault("nic0vf1", "link-down")
            await kubelet.wait_for(lambda k: allocatable(k) == 15)

    async def test_unplugging_a_vf_removes_it_and_plugging_brings_it_back(self, make_lab, kubelet, running):
        node = make_lab("dgx-like")
        gone = next(b for b, v in vfs(node).items() if v.name == "nic1vf4")
        async with running(kubelet, node, KIND, {}, RESOURCE):
            await kubelet.wait_for(lambda k: allocatable(k) == 16)
            node.unplug("nic1vf4")
            await kubelet.wait_for(lambda k: listed(k) is not None and gone not in listed(k))
            node.plug("nic1vf4")
            await kubelet.wait_for(lambda k: allocatable(k) == 16)


class TestAllocate:
    async def test_kernel_bound_vfs_get_the_pci_address_variable_and_no_nodes(
        self, make_lab, kubelet, running
    ):
        node = make_lab("dgx-like")
        async with running(kubelet, node, KIND, {"match": {"vendors": ["0x8086"]}}, RESOURCE):
            await kubelet.wait_for(lambda k: allocatable(k) == 8)
            allocation = await kubelet.allocate(RESOURCE, 2)
        envs = dict(allocation.response.envs)
        assert sorted(envs[ENV].split(",")) == sorted(allocation.device_ids)
        info = json.loads(envs[f"{ENV}_INFO"])
        assert sorted(info) == sorted(allocation.device_ids)
        assert all(v == {"generic": {"deviceID": b}} for b, v in info.items())
        assert not allocation.response.devices


async def test_vfio_vfs_get_their_group_node_and_the_container_node(lab_base, kubelet, running):
    profile = lab_base / "vfio.yaml"
    profile.write_text(
        "name: vfio\nnics:\n  - model: intel-e810\n    count: 1\n    numVfs: 2\n    vfDriver: vfio-pci\n"
    )
    node = lab.Lab.create(str(lab_base / "root"), str(profile))
    async with running(kubelet, node, KIND, {"match": {"drivers": ["vfio-pci"]}}, RESOURCE):
        await kubelet.wait_for(lambda k: allocatable(k) == 2)
        allocation = await kubelet.allocate(RESOURCE, 1)
    (bdf,) = allocation.device_ids
    record = vfs(node)[bdf]
    paths = sorted(d.container_path for d in allocation.response.devices)
    assert paths == sorted(
        ["/dev/vfio/vfio", *(n.path for n in record.device_nodes if n.path != "/dev/vfio/vfio")]
    )
    info = json.loads(allocation.response.envs[f"{ENV}_INFO"])
    assert info[bdf]["vfio"]["mount"] == "/dev/vfio/vfio"


async def test_plugin_nic_runs_as_a_real_process(make_lab, base):
    node = make_lab("dgx-like")
    async with EmulatedKubelet(base / "dp2", write_view=False) as kubelet:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "plugvisor",
            "plugin",
            "nic",
            "--resource",
            RESOURCE,
            "--host-root",
            str(node.root),
            "--kubelet-dir",
            str(base / "dp2"),
            "--options-json",
            json.dumps({"match": {"pfNames": ["enp138s0f0"]}}),
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            await kubelet.wait_for(lambda k: allocatable(k) == 8, timeout=20)
            node.fault("nic1", "link-down")
            await kubelet.wait_for(lambda k: allocatable(k) == 0)
            node.heal("nic1")
            await kubelet.wait_for(lambda k: allocatable(k) == 8)
        finally:
            proc.send_signal(signal.SIGTERM)
            _, stderr = await asyncio.wait_for(proc.communicate(), 10)
        assert proc.returncode == 0, stderr.decode()


async def test_bad_options_exit_2_naming_the_field(make_lab, base):
    node = make_lab("small")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "plugvisor",
        "plugin",
        "nic",
        "--host-root",
        str(node.root),
        "--kubelet-dir",
        str(base / "dp3"),
        "--options-json",
        json.dumps({"match": {"pfNames": ["a b"]}}),
        stderr=asyncio.subprocess.PIPE,
    )
    _, stderr = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 2
    assert "match.pfNames[0]" in stderr.decode()


RDMA = "nvidia.com/rdma_vf"
RDMA_ENV = "PCIDEVICE_NVIDIA_COM_RDMA_VF"


class TestRdma:
    @pytest.mark.parametrize(("is_rdma", "pf"), [(True, "nic1"), (False, "nic0")])
    async def test_is_rdma_selects_the_vfs_with_an_rdma_device(self, make_lab, kubelet, running, is_rdma, pf):
        """isRdma: true keeps the ConnectX-like VFs (each has an mlx5 device), false the E810-like ones."""
        node = make_lab("dgx-like")
        async with running(kubelet, node, KIND, {"match": {"isRdma": is_rdma}}, RDMA):
            await kubelet.wait_for(lambda k: listed(k, RDMA) == sorted(vfs(node, pf)))

    async def test_a_pod_gets_the_vf_its_uverbs_node_and_rdma_cm(self, make_lab, kubelet, running):
        """The container gets the VF's verbs node and rdma_cm, the SR-IOV plugin's RDMA info, NCCL/UCX env."""
        node = make_lab("dgx-like")
        async with running(kubelet, node, KIND, {"match": {"isRdma": True}}, RDMA):
            await kubelet.wait_for(lambda k: allocatable(k, RDMA) == 8)
            status = await kubelet.add_pod(
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": "trainer"},
                    "spec": {
                        "containers": [{"name": "app", "image": "x", "resources": {"limits": {RDMA: 1}}}]
                    },
                }
            )
        assert status.phase == "Running"
        (app,) = status.containers
        (bdf,) = app.devices[RDMA]
        record = vfs(node)[bdf]
        uverbs = [n for n in record.device_nodes if "/uverbs" in n.path]
        assert len(uverbs) == 1
        runtime = app.runtime
        assert runtime is not None
        assert sorted(d.container_path for d in runtime.devices) == sorted(
            [uverbs[0].path, "/dev/infiniband/rdma_cm"]
        )
        assert all(d.host_path.startswith(str(node.root)) for d in runtime.devices)
        envs = dict(runtime.envs)
        assert envs[RDMA_ENV] == bdf
        ibdev = os.listdir(f"{node.root}/sys/bus/pci/devices/{bdf}/infiniband")[0]
        rdma = json.loads(envs[f"{RDMA_ENV}_INFO"])[bdf]["rdma"]
        assert rdma == {"rdma_dev": ibdev, "uverbs": uverbs[0].path, "rdma_cm": "/dev/infiniband/rdma_cm"}
        assert envs["NCCL_IB_HCA"] == f"={ibdev}"
        assert envs["UCX_NET_DEVICES"] == f"{ibdev}:1"

    async def test_rdma_port_down_makes_the_vf_unhealthy_and_heal_restores_it(
        self, make_lab, kubelet, running, health_of
    ):
        """An RDMA port fault on one VF takes that VF (only) out of allocatable; heal brings it back."""
        node = make_lab("dgx-like")
        victim = node.device("nic1vf3").bdf
        async with running(kubelet, node, KIND, {"match": {"isRdma": True}}, RDMA):
            await kubelet.wait_for(lambda k: allocatable(k, RDMA) == 8)
            node.fault("nic1vf3", "rdma-port-down")
            await kubelet.wait_for(lambda k: allocatable(k, RDMA) == 7)
            assert {b for b, h in health_of(kubelet, RDMA).items() if h == "Unhealthy"} == {victim}
            node.heal("nic1vf3")
            await kubelet.wait_for(lambda k: allocatable(k, RDMA) == 8)
