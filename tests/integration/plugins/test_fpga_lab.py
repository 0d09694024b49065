"""The fpga kind on the lab through the emulated kubelet: IDs, Allocate, health, PreStart, cleanup."""

import asyncio
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from plugvisor.emulators import lab
from plugvisor.plugins.fpga import KIND, intel_af_resource, intel_region_resource, xilinx_resource

AF = intel_af_resource("69528db6eb31577a8c3668f9faa081f6", "d8424dc4a4a3c413f89e433683f9040b")
REGION = intel_region_resource("69528db6eb31577a8c3668f9faa081f6")
XILINX = xilinx_resource("xilinx_u250_gen3x16_xdma_shell_4_1", "0x5f0e2a62")


def fpgas(node):
    return {d.name: d for d in node.devices(kind=lab.DeviceKind.FPGA)}


def allocatable(kubelet, resource):
    v = kubelet.resource(resource)
    return None if v is None else v.allocatable


def port_dir(node):
    return Path(node.root) / fpgas(node)["fpga0"].sysfs_path / "fpga_region/region0/dfl-port.0"


async def eventually(predicate, timeout=10.0):
    """Poll a condition that is not the kubelet's (kubelet.wait_for wakes only on kubelet changes)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not predicate():
        assert loop.time() < end, "condition not reached"
        await asyncio.sleep(0.01)


def pod(name, resource, count=1):
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"containers": [{"name": "app", "image": "x", "resources": {"limits": {resource: count}}}]},
    }


class TestDiscoveryAndAllocate:
    async def test_af_mode_lists_the_dfl_port_and_allocate_hands_out_its_node(
        self, make_lab, kubelet, running
    ):
        node = make_lab("dgx-like")
        async with running(kubelet, node, KIND, {"family": "af"}, AF):
            await kubelet.wait_for(lambda k: allocatable(k, AF) == 1)
            assert kubelet.resource(AF).devices["dfl-port.0"].numa_nodes == (fpgas(node)["fpga0"].numa_node,)
            allocation = await kubelet.allocate(AF, 1)
        assert list(allocation.device_ids) == ["dfl-port.0"]
        (spec,) = allocation.response.devices
        assert (spec.container_path, spec.host_path, spec.permissions) == (
            "/dev/dfl-port.0",
            f"{node.root}/dev/dfl-port.0",
            "rw",
        )
        assert dict(allocation.response.envs) == {"FPGA_VISIBLE_DEVICES": "dfl-port.0"}

    async def test_match_by_ids_selects_or_leaves_out_the_port(self, make_lab, kubelet, running):
        node = make_lab("dgx-like")
        wanted = {"family": "region", "match": {"interfaceIds": ["69528DB6EB31577A8C3668F9FAA081F6"]}}
        other = {"family": "af", "match": {"afuIds": ["0" * 31 + "1"]}}
        async with (
            running(kubelet, node, KIND, wanted, REGION),
            running(kubelet, node, KIND, other, "x.io/other"),
        ):
            await kubelet.wait_for(
                lambda k: allocatable(k, REGION) == 1 and k.resource("x.io/other") is not None
            )
            assert kubelet.resource("x.io/other").capacity == 0

    async def test_xilinx_mode_lists_the_user_pf_with_render_and_mgmt_nodes(self, make_lab, kubelet, running):
        node = make_lab("dgx-like")
        card = fpgas(node)["fpga1"]
        async with running(kubelet, node, KIND, {"family": "xilinx"}, XILINX):
            await kubelet.wait_for(lambda k: allocatable(k, XILINX) == 1)
            allocation = await kubelet.allocate(XILINX, 1)
        assert list(allocation.device_ids) == [card.bdf]
        paths = sorted(d.container_path for d in allocation.response.devices)
        expected = sorted(n.path for n in card.device_nodes if not n.path.startswith("/dev/dri/card"))
        assert paths == expected
        assert dict(allocation.response.envs) == {"FPGA_VISIBLE_DEVICES": card.bdf}


class TestHealth:
    @pytest.mark.parametrize("fault", ["afu-id-invalid", "aer-fatal", "fallen-off-bus"])
    async def test_a_dfl_fault_makes_the_port_unhealthy_and_healing_makes_it_healthy_again(
        self, make_lab, kubelet, running, health_of, fault
    ):
        node = make_lab("dgx-like")
        async with running(kubelet, node, KIND, {"family": "af"}, AF):
            await kubelet.wait_for(lambda k: allocatable(k, AF) == 1)
            node.fault("fpga0", fault)
            await kubelet.wait_for(lambda k: health_of(k, AF) == {"dfl-port.0": "Unhealthy"})
            node.heal("fpga0")
            await kubelet.wait_for(lambda k: health_of(k, AF) == {"dfl-port.0": "Healthy"})

    async def test_an_invalid_afu_is_no_fault_in_region_mode(self, make_lab, kubelet, running, health_of):
        node = make_lab("dgx-like")
        async with running(kubelet, node, KIND, {"family": "region"}, REGION):
            await kubelet.wait_for(lambda k: allocatable(k, REGION) == 1)
            node.fault("fpga0", "afu-id-invalid")
            node.fault("fpga0", "aer-fatal")
            await kubelet.wait_for(lambda k: allocatable(k, REGION) == 0)
            node.heal("fpga0", "aer-fatal")
            await kubelet.wait_for(lambda k: allocatable(k, REGION) == 1)

    @pytest.mark.parametrize("fault", ["rom-missing", "fallen-off-bus"])
    async def test_a_xilinx_fault_keeps_the_card_listed_unhealthy_until_healed(
        self, make_lab, kubelet, running, health_of, fault
    ):
        node = make_lab("dgx-like")
        bdf = fpgas(node)["fpga1"].bdf
        options = {"family": "xilinx", "match": {"shells": ["xilinx_u250_gen3x16_xdma_shell_4_1"]}}
        async with running(kubelet, node, KIND, options, XILINX):
            await kubelet.wait_for(lambda k: allocatable(k, XILINX) == 1)
            node.fault("fpga1", fault)
            await kubelet.wait_for(lambda k: health_of(k, XILINX) == {bdf: "Unhealthy"})
            node.heal("fpga1")
            await kubelet.wait_for(lambda k: health_of(k, XILINX) == {bdf: "Healthy"})

    async def test_unplug_removes_the_port_and_plug_brings_it_back(self, make_lab, kubelet, running):
        node = make_lab("dgx-like")
        async with running(kubelet, node, KIND, {}, AF):
            await kubelet.wait_for(lambda k: allocatable(k, AF) == 1)
            node.unplug("fpga0")
            await kubelet.wait_for(lambda k: k.resource(AF).capacity == 0)
            node.plug("fpga0")
            await kubelet.wait_for(lambda k: allocatable(k, AF) == 1)


class TestPreStart:
    async def test_a_pod_start_clears_the_port_events_and_runs_the_command(
        self, make_lab, kubelet, running, base
    ):
        node = make_lab("dgx-like")
        marker = base / "prestart.log"
        script = f"import sys; open({str(marker)!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')"
        options = {"preStartCommand": [sys.executable, "-c", script, "{device}", "{dev}", "{sysfs}"]}
        port = port_dir(node)
        async with running(kubelet, node, KIND, options, AF):
            await kubelet.wait_for(lambda k: allocatable(k, AF) == 1)
            status = await kubelet.add_pod(pod("p", AF))
        assert status.phase == "Running"
        assert kubelet.calls_for(AF).count("PreStartContainer") == 1
        assert (port / "ap1_event").read_text() == (port / "ap2_event").read_text() == "1\n"
        assert marker.read_text() == f"dfl-port.0 {node.root}/dev/dfl-port.0 {port}\n"

    async def test_a_failing_command_fails_the_container_start_with_its_message(
        self, make_lab, kubelet, running
    ):
        node = make_lab("small")
        script = "import sys; sys.exit('port is wedged')"
        options = {"preStartCommand": [sys.executable, "-c", script], "preStartAction": "none"}
        async with running(kubelet, node, KIND, options, AF):
            await kubelet.wait_for(lambda k: allocatable(k, AF) == 1)
            status = await kubelet.add_pod(pod("p", AF))
        (app,) = status.containers
        assert status.phase == "Pending"
        assert "port is wedged" in app.message and "dfl-port.0" in app.message
        assert (port_dir(node) / "ap1_event").read_text() == "0\n", "preStartAction none writes nothing"


class TestReleaseCleanup:
    async def test_deleting_the_pod_runs_the_cleanup_exactly_once(self, make_lab, kubelet, running, base):
        node = make_lab("dgx-like")
        marker = base / "cleanup.log"
        script = f"import sys; open({str(marker)!r}, 'a').write(sys.argv[1] + '\\n')"
        options = {
            "releaseCleanup": {"command": [sys.executable, "-c", script, "{device}"], "interval": 0.05}
        }
        async with running(kubelet, node, KIND, options, AF) as runtime:
            await kubelet.wait_for(lambda k: allocatable(k, AF) == 1)
            watcher = runtime.release_watch
            assert watcher is not None, "releaseCleanup makes the framework watch PodResources"
            await kubelet.add_pod(pod("p", AF))
            await eventually(lambda: watcher.held == {"dfl-port.0"})
            assert not marker.exists(), "nothing is cleaned while the pod holds the port"
            kubelet.delete_pod("p")
            await eventually(lambda: marker.exists() and watcher.held == frozenset())
            polls = watcher.polls
            await eventually(lambda: watcher.polls >= polls + 3)
            assert marker.read_text() == "dfl-port.0\n"

    async def test_an_unreachable_pod_resources_socket_cleans_nothing(self, make_lab, kubelet, running, base):
        node = make_lab("small")
        marker = base / "cleanup.log"
        options = {
            "releaseCleanup": {
                "command": ["touch", str(marker)],
                "podResourcesSocket": str(base / "nowhere.sock"),
                "interval": 0.05,
            }
        }
        async with running(kubelet, node, KIND, options, AF) as runtime:
            await kubelet.wait_for(lambda k: allocatable(k, AF) == 1)
            watcher = runtime.release_watch
            assert watcher is not None
            await kubelet.add_pod(pod("p", AF))
            kubelet.delete_pod("p")
            await eventually(lambda: watcher.failures >= 3)
            assert watcher.polls == 0
        assert not marker.exists()


async def test_plugin_fpga_runs_as_a_real_process_with_release_cleanup(make_lab, base):
    import json
    import signal

    from plugvisor.emulators.kubelet import EmulatedKubelet

    node = make_lab("dgx-like")
    marker = base / "cleanup.log"
    options = {
        "family": "xilinx",
        "releaseCleanup": {"command": ["sh", "-c", f"echo {{device}} >> {marker}"], "interval": 0.05},
    }
    bdf = fpgas(node)["fpga1"].bdf
    async with EmulatedKubelet(base / "dp2", write_view=False) as kubelet:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "plugvisor",
            "plugin",
            "fpga",
            "--resource",
            XILINX,
            "--host-root",
            str(node.root),
            "--kubelet-dir",
            str(base / "dp2"),
            "--options-json",
            json.dumps(options),
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            await kubelet.wait_for(lambda k: allocatable(k, XILINX) == 1, timeout=20)
            await kubelet.add_pod(pod("p", XILINX))
            # The watcher logs what it sees held; the card must be seen held before the pod goes.
            line = ""
            while "devices_held" not in line or bdf not in line:
                line = (await asyncio.wait_for(proc.stderr.readline(), 10)).decode()
                assert line, "plugin exited"
            kubelet.delete_pod("p")
            await eventually(marker.exists)
        finally:
            proc.send_signal(signal.SIGTERM)
            _, stderr = await asyncio.wait_for(proc.communicate(), 10)
        assert proc.returncode == 0, stderr.decode()
        assert marker.read_text() == f"{bdf}\n"


async def test_the_proposed_deallocate_call_cleans_once_even_when_the_watch_also_sees_the_release(short_dir):
    """Deallocate (emulated kubelet gate) and the PodResources watch may both notice one release."""
    from plugvisor.common.hostpaths import HostPaths
    from plugvisor.deviceplugin.cell import SnapshotCell
    from plugvisor.deviceplugin.release import Releases

    lab_root = Path(tempfile.mkdtemp(prefix="pvf-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    try:
        lab.Lab.create(lab_root / "node", "dgx-like")
        log = short_dir / "cleaned.log"
        options = {"releaseCleanup": {"command": ["sh", "-c", f"echo {{device}} >> {log}"], "interval": 3600}}
        source = KIND.build(
            options, HostPaths(root=lab_root / "node", kubelet_dir=short_dir / "dp"), resource="x.io/f"
        )
        releases = Releases(source, SnapshotCell(source.scan()), resource="x.io/f")
        one = [next(iter(source.scan().devices))]
        await releases.release(one)  # the Deallocate call
        await releases.release(one)  # the watch noticing the same release
        assert log.read_text().split() == list(one)
        releases.used(one)  # a new container starts: the next release cleans again
        await releases.release(one)
        assert log.read_text().split() == [*one, *one]
    finally:
        shutil.rmtree(lab_root, ignore_errors=True)
