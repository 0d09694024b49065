"""The gpu kind with NVML on the lab: the lab's stand-in libnvidia-ml.so.1 through the real pynvml and ctypes.

The same path as a real node's: the plugin finds ``libnvidia-ml.so.1`` under
the lab's driver root, pynvml loads it with ctypes, and the lab's faults raise
NVML events (``xid-<n>``, ``ecc-dbe``) that reach the kubelet as Unhealthy
devices (device-plugin mode) or as device taints in the slice (DRA mode).
"""

import asyncio
import json
from pathlib import Path

import pytest
import structlog

from plugvisor.common.hostpaths import HostPaths
from plugvisor.dra.devices import PCI_BUS_ID, SemVer
from plugvisor.emulators import lab
from plugvisor.emulators.kubelet import EmulatedKubelet
from plugvisor.plugins.gpu import KIND
from plugvisor.plugins.gpu.nvml import LIBRARY, library_candidates
from plugvisor.testing import running_dra_driver

RESOURCE = "plugvisor.io/gpu"
DRIVER = "gpu.plugvisor.io"
QUICK = {"nvml": {"recoverAfterSeconds": 1}}
"""NVML's quiet period before a GPU is healthy again: one second in tests, five minutes by default."""


@pytest.fixture
def nvidia_lab(make_lab):
    def make(profile: str = "dgx-like") -> lab.Lab:
        node = make_lab(profile)
        if not any(p.exists() for p in library_candidates(HostPaths(root=Path(node.root)), "/")):
            pytest.skip(f"the lab wrote no {LIBRARY} (it needs a C compiler, cc, to build its NVML stand-in)")
        return node

    return make


def gpus(node):
    return {d.name: d for d in node.devices(kind=lab.DeviceKind.GPU)}


def allocatable(kubelet):
    view = kubelet.resource(RESOURCE)
    return None if view is None else view.allocatable


def last_xid(runtime, bdf: str) -> float | None:
    """The ``plugvisor_gpu_last_xid`` reading the plugin would report now for the GPU at ``bdf``."""
    source = runtime.watcher._source
    for reading in source.nvml.readings(bdf):
        if reading.family == "plugvisor_gpu_last_xid":
            return reading.value
    return None


async def eventually(predicate, timeout: float = 10.0, what: str = "the condition") -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise TimeoutError(f"{what} did not hold within {timeout} s")
        await asyncio.sleep(0.02)


REAL_UUID = "GPU-2b75dc85-67dc-fd5d-9317-96e28aca4f63"


class TestTheRealH200Node:
    """plugvisor's view of ``nvidia-h200-vm`` (a real H200 VM reproduced) against what the real node showed:
    one GPU at 0000:00:06.0 with its UUID, a 32 GT/s x16 link, no NUMA node, the open module's 580.159.04,
    the driver's files under /usr/local/nvidia, NVML's H200 (Hopper, 9.0, 150754820096 bytes, CUDA 13.0)."""

    @pytest.fixture
    def node(self, make_lab):
        node = make_lab("nvidia-h200-vm")
        if not any(
            p.exists() for p in library_candidates(HostPaths(root=Path(node.root)), "/usr/local/nvidia")
        ):
            pytest.skip(f"the lab wrote no {LIBRARY} (it needs a C compiler, cc, to build its NVML stand-in)")
        return node

    async def test_the_device_plugin_sees_one_gpu_by_its_uuid_without_numa_with_its_link_and_nvml(
        self, node, kubelet, running
    ):
        options = {"driverRoot": "/usr/local/nvidia"}
        async with running(kubelet, node, KIND, options, RESOURCE) as runtime:
            await kubelet.wait_for(lambda k: allocatable(k) == 1)
            (device,) = kubelet.resource(RESOURCE).devices.values()
            snapshot = runtime.snapshot.value
            described = runtime.watcher._source.describe(snapshot)[REAL_UUID]
            allocation = await kubelet.allocate(RESOURCE, 1)
        assert list(kubelet.resource(RESOURCE).devices) == [REAL_UUID]
        assert device.numa_nodes == ()
        assert described.pci_address == "0000:00:06.0"
        link = {
            (r.family, r.labels.get("link")): r.value for r in described.readings if "pcie_link" in r.family
        }
        assert link[("plugvisor_device_pcie_link_speed_gts", "current")] == 32.0
        assert link[("plugvisor_device_pcie_link_width_lanes", "current")] == 16.0
        assert not any(r.family == "plugvisor_device_aer_errors" for r in described.readings)
        identity = snapshot.data.nvml["0000:00:06.0"].identity
        assert (identity.product_name, identity.architecture, identity.compute_capability) == (
            "NVIDIA H200",
            "Hopper",
            "9.0",
        )
        assert identity.memory_bytes == 150754820096
        assert snapshot.data.system.driver_version == "580.159.04"
        nodes = sorted(d.container_path for d in allocation.response.devices)
        assert nodes == ["/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia0", "/dev/nvidiactl"]

    async def test_the_slice_has_the_drivers_version_nvmls_identity_and_no_numa_node(
        self, node, dra_kubelet, base
    ):
        options = {"driverRoot": "/usr/local/nvidia"}
        async with running_dra_driver(
            dra_kubelet, KIND, options, driver=DRIVER, root=Path(node.root)
        ) as driver:
            await eventually(lambda: len(published_slice(base)) == 1, what="the GPU in the slice")
            (device,) = driver.devices.values()
        attributes = dict(device.attributes)
        assert attributes["driverVersion"] == SemVer("580.159.4")
        assert (attributes["productName"], attributes["uuid"]) == ("NVIDIA H200", REAL_UUID)
        assert attributes["cudaDriverVersion"] == SemVer("13.0.0")
        assert (attributes[PCI_BUS_ID], attributes["resource.kubernetes.io/pcieRoot"]) == (
            "0000:00:06.0",
            "pci0000:00",
        )
        assert dict(device.capacity) == {"memory": "143771Mi"}  # 150754820096 bytes
        assert "resource.kubernetes.io/numaNode" not in attributes

    async def test_without_nvml_the_open_modules_banner_still_gives_the_version(
        self, node, dra_kubelet, base
    ):
        options = {"nvml": {"enabled": False}}
        async with running_dra_driver(
            dra_kubelet, KIND, options, driver=DRIVER, root=Path(node.root)
        ) as driver:
            await eventually(lambda: len(published_slice(base)) == 1, what="the GPU in the slice")
            (device,) = driver.devices.values()
        assert device.attributes["driverVersion"] == SemVer("580.159.4")
        assert "productName" not in device.attributes and not device.capacity

    async def test_a_wrong_driver_root_runs_on_sysfs_saying_where_it_looked(self, node, dra_kubelet, base):
        with structlog.testing.capture_logs() as logs:
            async with running_dra_driver(
                dra_kubelet, KIND, {}, driver=DRIVER, root=Path(node.root)
            ) as driver:
                await eventually(lambda: len(published_slice(base)) == 1, what="the GPU in the slice")
                (device,) = driver.devices.values()
        (said,) = [e for e in logs if e["event"] == "nvml_unavailable"]
        assert "libnvidia-ml.so.1 not found under driverRoot /" in said["reason"]
        assert said["log_level"] == "info"  # no driver there: not a broken one
        assert "productName" not in device.attributes


class TestDevicePlugin:
    async def test_the_plugin_reads_each_gpus_identity_and_telemetry_through_nvml(
        self, nvidia_lab, kubelet, running
    ):
        node = nvidia_lab()
        first = gpus(node)["gpu0"]
        async with running(kubelet, node, KIND, {}, RESOURCE) as runtime:
            await kubelet.wait_for(lambda k: allocatable(k) == 8)
            scan = runtime.snapshot.value.data
            view = scan.nvml[first.bdf]
            readings = runtime.watcher._source.describe(runtime.snapshot.value)[first.uuid].readings
        assert len(scan.nvml) == 8
        assert (view.identity.architecture, view.identity.brand) == ("Hopper", "Nvidia")
        assert view.identity.compute_capability == "9.0"
        assert view.identity.memory_bytes == 85520809984
        assert scan.system.cuda_driver_version == "12.4"  # the lab's default driver, 550
        families = {r.family for r in readings}
        assert {
            "plugvisor_device_temperature_celsius",
            "plugvisor_device_power_watts",
            "plugvisor_gpu_memory_used_bytes",
            "plugvisor_gpu_memory_total_bytes",
            "plugvisor_gpu_last_xid",
            "plugvisor_gpu_sm_clock_hertz",
        } <= families

    async def test_nvmls_lines_name_the_resource_the_plugin_serves(self, nvidia_lab, kubelet, running):
        with structlog.testing.capture_logs() as logs:
            async with running(kubelet, nvidia_lab(), KIND, {}, RESOURCE):
                await kubelet.wait_for(lambda k: allocatable(k) == 8)
        (opened,) = [e for e in logs if e["event"] == "nvml_opened"]
        assert opened["resource"] == RESOURCE

    async def test_an_xid_makes_its_gpu_unhealthy_with_the_xid_as_cause_and_heal_brings_it_back(
        self, nvidia_lab, kubelet, running, health_of
    ):
        node = nvidia_lab()
        target, other = gpus(node)["gpu3"], gpus(node)["gpu4"]
        async with running(kubelet, node, KIND, QUICK, RESOURCE) as runtime:
            await kubelet.wait_for(lambda k: allocatable(k) == 8)
            node.fault("gpu3", "xid-79")
            await kubelet.wait_for(lambda k: health_of(k, RESOURCE).get(target.uuid) == "Unhealthy")
            assert health_of(kubelet, RESOURCE)[other.uuid] == "Healthy"
            causes = runtime.watcher._source.describe(runtime.snapshot.value)
            assert causes[target.uuid].cause_code == "xid-79"
            node.heal("gpu3")
            await kubelet.wait_for(lambda k: allocatable(k) == 8)
            assert health_of(kubelet, RESOURCE)[target.uuid] == "Healthy"

    async def test_an_active_xid_keeps_the_gpu_unhealthy_past_the_quiet_period(
        self, nvidia_lab, kubelet, running, health_of
    ):
        node = nvidia_lab()
        target = gpus(node)["gpu2"]
        async with running(kubelet, node, KIND, QUICK, RESOURCE) as runtime:
            await kubelet.wait_for(lambda k: allocatable(k) == 8)
            node.fault("gpu2", "xid-48")
            await kubelet.wait_for(lambda k: health_of(k, RESOURCE).get(target.uuid) == "Unhealthy")
            events = runtime.watcher._source.nvml._gpus[target.bdf].health
            seen = events.events
            # The lab raises the XID again about once a second: three more events span three quiet periods.
            await eventually(lambda: events.events >= seen + 3, what="three more XID events")
            assert health_of(kubelet, RESOURCE)[target.uuid] == "Unhealthy"

    async def test_nvidias_ignored_xids_change_nothing(self, nvidia_lab, kubelet, running, health_of):
        node = nvidia_lab()
        quiet, loud = gpus(node)["gpu0"], gpus(node)["gpu1"]
        async with running(kubelet, node, KIND, {}, RESOURCE) as runtime:
            await kubelet.wait_for(lambda k: allocatable(k) == 8)
            node.fault("gpu0", "xid-13")
            node.fault("gpu1", "xid-43")
            await eventually(
                lambda: last_xid(runtime, quiet.bdf) == 13 and last_xid(runtime, loud.bdf) == 43,
                what="both XIDs seen by the plugin",
            )
            assert allocatable(kubelet) == 8
            assert set(health_of(kubelet, RESOURCE).values()) == {"Healthy"}

    async def test_a_double_bit_ecc_error_is_unhealthy(self, nvidia_lab, kubelet, running, health_of):
        node = nvidia_lab()
        target = gpus(node)["gpu6"]
        async with running(kubelet, node, KIND, QUICK, RESOURCE) as runtime:
            await kubelet.wait_for(lambda k: allocatable(k) == 8)
            node.fault("gpu6", "ecc-dbe")
            await kubelet.wait_for(lambda k: health_of(k, RESOURCE).get(target.uuid) == "Unhealthy")
            described = runtime.watcher._source.describe(runtime.snapshot.value)[target.uuid]
        assert described.cause_code == "ecc-dbe"

    async def test_with_nvml_turned_off_the_plugin_runs_on_sysfs_alone(self, nvidia_lab, kubelet, running):
        node = nvidia_lab()
        async with running(kubelet, node, KIND, {"nvml": {"enabled": False}}, RESOURCE) as runtime:
            await kubelet.wait_for(lambda k: allocatable(k) == 8)
            assert runtime.snapshot.value.data.nvml == {}
            assert runtime.watcher._source.nvml is None


@pytest.fixture
async def dra_kubelet(base):
    emulated = EmulatedKubelet(
        base / "device-plugins",
        objects_dir=base / "api",
        node_name="node-1",
        write_view=False,
        pod_resources=False,
    )
    await emulated.start()
    yield emulated
    if emulated.running:
        await emulated.stop()


def published_slice(base: Path) -> dict[str, dict]:
    """The devices of the driver's ResourceSlice as written (by name), none before it is."""
    path = base / "api" / "resourceslices" / f"{DRIVER}-node-1.json"
    try:
        return {device["name"]: device for device in json.loads(path.read_text())["spec"]["devices"]}
    except (OSError, ValueError):
        return {}


class TestDra:
    async def test_nvidia_gpus_carry_gpu_nvidia_coms_attributes_and_memory_capacity(
        self, nvidia_lab, dra_kubelet, base
    ):
        node = nvidia_lab()
        first = gpus(node)["gpu0"]
        async with running_dra_driver(dra_kubelet, KIND, {}, driver=DRIVER, root=Path(node.root)) as driver:
            await eventually(lambda: len(published_slice(base)) == 8, what="8 devices in the slice")
            device = next(d for d in driver.devices.values() if d.attributes[PCI_BUS_ID] == first.bdf)
            written = published_slice(base)[device.name]
        attributes = dict(device.attributes)
        assert attributes["type"] == "gpu"
        assert attributes["productName"] == "NVIDIA H100 80GB HBM3"
        assert (attributes["brand"], attributes["architecture"]) == ("Nvidia", "Hopper")
        assert attributes["cudaComputeCapability"] == SemVer("9.0.0")
        assert attributes["cudaDriverVersion"] == SemVer("12.4.0")  # the lab's default driver, 550
        assert attributes["uuid"] == first.uuid
        assert written["capacity"]["memory"] == {"value": "81559Mi"}
        assert written["attributes"]["cudaComputeCapability"] == {"version": "9.0.0"}

    async def test_nvmls_lines_name_the_driver_not_the_kinds_resource(self, nvidia_lab, dra_kubelet, base):
        """The kind is built as ``<driver>/gpu`` (its CDI kind); the process is known by the driver's name."""
        node = nvidia_lab()
        with structlog.testing.capture_logs() as logs:
            async with running_dra_driver(dra_kubelet, KIND, {}, driver=DRIVER, root=Path(node.root)):
                await eventually(lambda: len(published_slice(base)) == 8, what="8 devices in the slice")
        (opened,) = [e for e in logs if e["event"] == "nvml_opened"]
        assert opened["resource"] == DRIVER
        assert {e["resource"] for e in logs if "resource" in e} == {DRIVER}

    async def test_an_xid_taints_the_device_in_the_slice_and_heal_removes_the_taint(
        self, nvidia_lab, dra_kubelet, base
    ):
        node = nvidia_lab()
        target = gpus(node)["gpu3"]
        async with running_dra_driver(
            dra_kubelet, KIND, QUICK, driver=DRIVER, root=Path(node.root)
        ) as driver:
            await eventually(lambda: len(published_slice(base)) == 8, what="8 devices in the slice")
            name = next(n for n, d in driver.devices.items() if d.attributes[PCI_BUS_ID] == target.bdf)
            node.fault("gpu3", "xid-79")
            await eventually(lambda: published_slice(base)[name].get("taints"), what="a taint on the device")
            assert published_slice(base)[name]["taints"] == [
                {"key": "gpu.plugvisor.io/xid", "value": "79", "effect": "NoSchedule"}
            ]
            assert sum("taints" in d for d in published_slice(base).values()) == 1
            node.heal("gpu3")
            await eventually(lambda: "taints" not in published_slice(base)[name], what="the taint gone")
            assert len(published_slice(base)) == 8

    async def test_a_gpu_fallen_off_the_bus_stays_in_the_slice_tainted_lost(
        self, nvidia_lab, dra_kubelet, base
    ):
        node = nvidia_lab()
        target = gpus(node)["gpu5"]
        async with running_dra_driver(
            dra_kubelet, KIND, QUICK, driver=DRIVER, root=Path(node.root)
        ) as driver:
            await eventually(lambda: len(published_slice(base)) == 8, what="8 devices in the slice")
            name = next(n for n, d in driver.devices.items() if d.attributes[PCI_BUS_ID] == target.bdf)
            node.fault("gpu5", "fallen-off-bus")
            await eventually(
                lambda: (
                    "gpu.plugvisor.io/gpu-lost"
                    in {t["key"] for t in published_slice(base)[name].get("taints", ())}
                ),
                what="the lost GPU's taint",
            )
            assert len(published_slice(base)) == 8
            node.heal("gpu5")
            await eventually(lambda: "taints" not in published_slice(base)[name], what="the taints gone")
