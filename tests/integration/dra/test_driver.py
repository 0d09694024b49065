"""A kind as a DRA driver against the emulated kubelet: registration, slices, claims, health, sockets.

In process, through the public helpers a kind's author uses (``plugvisor.testing``):
the kubelet's plugin watcher registers the driver over its real unix sockets,
claims are prepared by the kubelet's calls, CDI specs are read back as a
container runtime would.
"""

import asyncio
import contextlib
import json
import os

import pytest

from plugvisor.common import device_metrics, monitoring
from plugvisor.common.hostpaths import HostPaths
from plugvisor.deviceplugin.monitorconfig import MonitorConfig
from plugvisor.dra.devices import PCIE_ROOT
from plugvisor.dra.hooks import kind_resource
from plugvisor.dra.local import FileClaimReader, FileSlicePublisher
from plugvisor.dra.runtime import DraDriverRuntime, DriverConfig
from plugvisor.emulators import lab
from plugvisor.emulators.kubelet.dra import DraCallError
from plugvisor.plugins.generic import KIND as GENERIC
from plugvisor.plugins.gpu import KIND as GPU
from plugvisor.testing import dra_devices, running_dra_driver

from .conftest import NODE, eventually, make_kubelet, slice_devices

DRIVER = "gpu.plugvisor.io"


def running(kubelet, lab_root, kind=GPU, options=None, driver=DRIVER, **kwargs):
    return running_dra_driver(
        kubelet, kind, options or {}, driver=driver, root=lab_root, cdi_dir="/cdi", **kwargs
    )


class TestPublishing:
    async def test_the_registered_driver_publishes_every_gpu_in_its_nodes_pool(self, kubelet, lab_root, base):
        async with running(kubelet, lab_root) as gpu:
            await eventually(lambda: len(slice_devices(base)) == 8, what="8 devices in the slice")
            assert sorted(slice_devices(base)) == sorted(gpu.devices)
            document = json.loads((base / "api/resourceslices" / f"{DRIVER}-{NODE}.json").read_text())
            assert document["spec"]["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 1}
            (plugin,) = kubelet.dra.plugins[DRIVER]
            assert (plugin.service, plugin.health_service) == ("v1.DRAPlugin", "v1.DRAResourceHealth")
            assert plugin.endpoint == str(base / "plugins" / DRIVER / "dra.sock")

    async def test_a_faulty_gpu_leaves_the_slice_and_comes_back_healed(self, kubelet, lab_root, base):
        node = lab.Lab.open(str(lab_root))
        async with running(kubelet, lab_root, rescan_interval=0.2):
            await eventually(lambda: len(slice_devices(base)) == 8, what="8 devices")
            # A fault only sysfs sees: one NVML sees too (fallen off the bus is also NVML's XID 79 and a
            # lost GPU) keeps the device in the slice with a taint instead (test_gpu_nvml_lab.py).
            node.fault("gpu3", "aer-fatal")
            await eventually(lambda: len(slice_devices(base)) == 7, what="gpu3 withdrawn")
            node.heal("gpu3")
            await eventually(lambda: len(slice_devices(base)) == 8, what="gpu3 back")

    def test_what_a_kind_publishes_can_be_checked_without_any_process(self, lab_root):
        published = dra_devices(GPU, {}, lab_root, driver=DRIVER)
        assert len(published) == 8 and all(PCIE_ROOT in d.attributes for d in published.values())


class TestClaims:
    async def test_two_gpus_on_one_pcie_root_are_prepared_as_one_cdi_device(self, kubelet, lab_root):
        async with running(kubelet, lab_root) as gpu:
            by_root: dict[object, list[str]] = {}
            for name, device in gpu.devices.items():
                by_root.setdefault(device.attributes[PCIE_ROOT], []).append(name)
            pair = by_root["pci0000:80"][:2]
            claim, edits = await gpu.prepare(*pair, request="gpus")
            assert claim.cdi_devices() == [f"k8s.{DRIVER}/claim={claim.uid}-gpus"]
            uuids = [gpu.devices[name].attributes["uuid"] for name in pair]
            assert edits.env["NVIDIA_VISIBLE_DEVICES"] == ",".join(str(u) for u in uuids)
            own = [path for path, _ in edits.device_nodes if path[len("/dev/nvidia") :].isdigit()]
            assert own == [f"/dev/nvidia{gpu.devices[name].attributes['index']}" for name in pair]
            assert all(host.startswith(str(lab_root)) for _, host in edits.device_nodes)
            spec = gpu.cdi_dir / f"k8s.{DRIVER}-claim_{claim.uid}.json"
            assert spec.exists()
            await gpu.unprepare(claim)
            assert not spec.exists()
            assert gpu.runtime.preparer.prepared == {}

    async def test_a_gpu_kind_with_its_own_cdi_specs_hands_them_out_beside_the_claims(
        self, kubelet, lab_root
    ):
        """``cdi: true`` keeps working in DRA mode: the kind's CDI devices come with the claim's."""
        async with running(kubelet, lab_root, options={"cdi": True, "cdiDir": "/cdi"}) as gpu:
            name = next(iter(gpu.devices))
            claim, edits = await gpu.prepare(name)
            uuid = gpu.devices[name].attributes["uuid"]
            assert claim.cdi_devices() == [
                f"k8s.{DRIVER}/claim={claim.uid}-devices",
                f"{DRIVER}/gpu={uuid}",
            ]
            assert f"/dev/nvidia{gpu.devices[name].attributes['index']}" in [p for p, _ in edits.device_nodes]
            assert edits.env["NVIDIA_VISIBLE_DEVICES"] == uuid

    async def test_a_claim_for_a_device_this_node_does_not_have_is_the_kubelets_error(
        self, kubelet, lab_root
    ):
        async with running(kubelet, lab_root) as gpu:
            with pytest.raises(DraCallError) as refusal:
                await gpu.prepare("gpu-nowhere", name="ghost")
            assert refusal.value.message.startswith(
                "prepare dynamic resources: NodePrepareResources failed for ResourceClaim ghost: "
                "claim default/ghost (uid "
            )
            assert (
                '["gpu-nowhere"] are not devices of driver gpu.plugvisor.io on this node'
                in refusal.value.message
            )

    async def test_the_same_gpu_in_a_second_claim_is_refused_while_the_first_holds_it(
        self, kubelet, lab_root
    ):
        async with running(kubelet, lab_root) as gpu:
            name = next(iter(gpu.devices))
            first, _ = await gpu.prepare(name)
            with pytest.raises(
                DraCallError, match=f"device '{name}' is already prepared for claim default/claim-1"
            ):
                await gpu.prepare(name)
            await gpu.unprepare(first)
            await gpu.prepare(name)

    async def test_a_generic_kind_needs_no_hook_to_be_a_driver(self, kubelet, lab_root):
        async with running(
            kubelet, lab_root, GENERIC, {"paths": ["/dev/nvidia[0-9]"]}, driver="dev.example.com"
        ) as dev:
            assert sorted(dev.devices)[:2] == ["nvidia0", "nvidia1"]
            _, edits = await dev.prepare("nvidia1")
            assert [path for path, _ in edits.device_nodes] == ["/dev/nvidia1"]


class TestHealth:
    async def test_with_the_gate_the_kubelet_hears_each_gpus_health_and_its_cause(self, base, lab_root):
        from plugvisor.emulators.kubelet import FeatureGates

        kubelet = make_kubelet(base, gates=FeatureGates(resource_health_status=True))
        node = lab.Lab.open(str(lab_root))
        async with kubelet, running(kubelet, lab_root, rescan_interval=0.2) as gpu:
            await kubelet.wait_for(lambda k: len(k.dra.health) == 8, what="8 devices' health")
            assert {view.health for view in kubelet.dra.health.values()} == {"Healthy"}
            node.fault("gpu3", "fallen-off-bus")
            name = next(n for n, i in gpu.runtime.pools.value.ids.items() if node.device("gpu3").uuid == i)
            await kubelet.wait_for(
                lambda k: k.dra.health[(DRIVER, NODE, name)].health == "Unhealthy",
                what="gpu3 unhealthy",
                timeout=30,
            )
            assert kubelet.dra.health[(DRIVER, NODE, name)].message

    async def test_without_the_gate_there_is_no_health_stream(self, base, lab_root):
        from plugvisor.emulators.kubelet import FeatureGates

        # Off by hand: 1.36 and later (the emulator's default kubelet is 1.37) have it on by default.
        kubelet = make_kubelet(base, gates=FeatureGates(resource_health_status=False))
        async with kubelet, running(kubelet, lab_root) as gpu:
            (plugin,) = kubelet.dra.plugins[DRIVER]
            assert plugin.health_service == "v1.DRAResourceHealth" and plugin.health_task is None
            assert kubelet.dra.health == {} and gpu.runtime.server.open_health_streams == 0


class TestSockets:
    async def test_a_deleted_registration_socket_is_served_again_and_registered_again(
        self, kubelet, lab_root, base
    ):
        async with running(kubelet, lab_root) as gpu:
            socket = base / "plugins_registry" / f"{DRIVER}-reg.sock"
            assert socket.exists()
            socket.unlink()
            await eventually(lambda: gpu.runtime.registrations.value.number == 2, what="registered again")
            assert socket.exists()
            await gpu.prepare(next(iter(gpu.devices)))

    async def test_a_deleted_dra_socket_is_served_again(self, kubelet, lab_root, base):
        async with running(kubelet, lab_root) as gpu:
            socket = base / "plugins" / DRIVER / "dra.sock"
            socket.unlink()
            await eventually(gpu.runtime.dra_socket.is_ours, what="dra.sock served again")
            await gpu.prepare(next(iter(gpu.devices)))

    async def test_a_link_to_a_live_socket_elsewhere_in_its_place_is_no_takeover(
        self, kubelet, lab_root, base
    ):
        async with running(kubelet, lab_root) as gpu:
            socket = base / "plugins" / DRIVER / "dra.sock"
            socket.unlink()
            socket.symlink_to(base / "device-plugins" / "kubelet.sock")  # the kubelet's, live
            await eventually(gpu.runtime.dra_socket.is_ours, what="dra.sock served again")
            assert not gpu.runtime.dra_socket.standing_by
            await gpu.prepare(next(iter(gpu.devices)))

    async def test_a_restarted_kubelet_registers_the_driver_again_with_no_help(self, kubelet, lab_root):
        async with running(kubelet, lab_root) as gpu:
            claim, _ = await gpu.prepare(next(iter(gpu.devices)))
            await kubelet.restart()
            await eventually(lambda: gpu.runtime.registrations.value.number == 2, what="registered again")
            await gpu.unprepare(claim)
            assert gpu.runtime.preparer.prepared == {}


class TestMonitoring:
    async def test_devices_are_reported_under_the_driver_and_their_pool_names_as_podresources_says(
        self, base, lab_root
    ):
        """PodResources names a DRA-prepared device by driver and pool name: so does the driver's report."""
        from plugvisor.emulators.kubelet import FeatureGates

        kubelet = make_kubelet(base, gates=FeatureGates(resource_health_status=True))
        monitor_dir = base / "monitor"
        monitor_dir.mkdir()
        node = lab.Lab.open(str(lab_root))
        async with kubelet, monitored_driver(kubelet, lab_root, monitor_dir) as runtime:
            await eventually(
                lambda: (
                    (report := monitoring.read_report(monitor_dir, DRIVER)) is not None
                    and len(report.devices) == 8
                ),
                what="the report of 8 GPUs",
            )
            names = runtime.pools.value.names
            report = monitoring.read_report(monitor_dir, DRIVER)
            assert report is not None and sorted(d.id for d in report.devices) == sorted(names.values())
            held = names[node.device("gpu0").uuid]
            owners = {(DRIVER, held): (monitoring.Holder("team", "trainer", "main"),)}
            monitoring.write_owners(monitor_dir, monitoring.Owners(owners, up=True))
            text = device_metrics.render(monitoring.directory_view(monitor_dir, {DRIVER: os.getpid()}))
            info = [line for line in text.decode().splitlines() if line.startswith("plugvisor_device_info{")]
            (line,) = [line for line in info if f'device="{held}"' in line]
            assert f'resource="{DRIVER}"' in line and 'pod="trainer"' in line and 'namespace="team"' in line

            node.fault("gpu3", "fallen-off-bus")
            sick = (DRIVER, NODE, names[node.device("gpu3").uuid])
            await kubelet.wait_for(
                lambda k: sick in k.dra.health and k.dra.health[sick].health == "Unhealthy",
                what="gpu3 unhealthy",
                timeout=30,
            )
            # The cause the monitor described, found by the device's pool name.
            await kubelet.wait_for(
                lambda k: "fallen off the bus" in k.dra.health[sick].message,
                what="gpu3's cause on the health stream",
                timeout=30,
            )


@contextlib.asynccontextmanager
async def monitored_driver(kubelet, lab_root, monitor_dir):
    """The gpu kind as a driver with monitoring on (no PodResources polling), in this process."""
    paths = HostPaths(root=lab_root, kubelet_dir=kubelet.socket_dir)
    config = DriverConfig(
        DRIVER,
        NODE,
        paths,
        cdi_dir="/cdi",
        rescan_interval=0.2,
        plugins_registry=kubelet.plugins_registry,
        monitoring=MonitorConfig(enabled=True, monitor_dir=monitor_dir, owners=False, telemetry_interval=0.2),
    )
    objects = kubelet.dra.objects_dir
    runtime = DraDriverRuntime(
        config,
        GPU.build({}, paths, resource=kind_resource(DRIVER, "gpu")),
        claims=FileClaimReader(objects),
        slices=FileSlicePublisher(objects, driver=DRIVER, node_name=NODE),
    )
    stop = asyncio.Event()
    task = asyncio.create_task(runtime.run(stop))
    try:
        yield runtime
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
