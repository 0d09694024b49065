"""The PodResources poller on real sockets: missing, slow, rate-limited endpoints; one poller per agent."""

import asyncio
import time

import grpc
import structlog

from plugvisor.api.podresources.v1 import api_pb2, api_pb2_grpc
from plugvisor.common import device_metrics, monitoring
from plugvisor.common.hostpaths import HostPaths
from plugvisor.deviceplugin.devices import Device
from plugvisor.deviceplugin.hooks import ReleaseWatch
from plugvisor.deviceplugin.monitorconfig import MonitorConfig
from plugvisor.deviceplugin.owners import OwnerWatch
from plugvisor.deviceplugin.runtime import DevicePluginRuntime, PluginConfig
from plugvisor.deviceplugin.snapshot import Snapshot
from plugvisor.emulators.kubelet import EmulatedKubelet

RESOURCE = "example.com/widget"


class Widgets:
    def scan(self) -> Snapshot:
        return Snapshot(Device(f"w{i}") for i in range(3))

    def describe(self, snapshot: Snapshot):
        return {
            i: monitoring.DeviceDescription(kind="widget", pci_address=f"0000:0{i[1]}:00.0")
            for i in snapshot.devices
        }


def unavailable_lines(logs):
    return [entry for entry in logs if entry["event"] == "pod_resources_unavailable"]


async def test_a_missing_socket_is_said_once_and_never_dialled(short_dir):
    watch = OwnerWatch(socket=short_dir / "nowhere.sock", interval=0.05)
    with structlog.testing.capture_logs() as logs:
        for _ in range(5):
            await watch.poll_once()
    owners = watch.owners.value
    assert not owners.up
    assert owners.error.startswith("missing:")
    assert owners.calls_failed == 0  # nothing was called
    (line,) = unavailable_lines(logs)
    assert line["condition"] == "missing"


class SlowLister(api_pb2_grpc.PodResourcesListerServicer):
    async def List(self, request, context):
        await asyncio.sleep(5)
        return api_pb2.ListPodResourcesResponse()


async def test_a_slow_endpoint_times_out_each_call_and_is_said_once(short_dir):
    socket = short_dir / "slow.sock"
    server = grpc.aio.server()
    api_pb2_grpc.add_PodResourcesListerServicer_to_server(SlowLister(), server)
    server.add_insecure_port(f"unix:{socket}")
    await server.start()
    try:
        watch = OwnerWatch(socket=socket, interval=0.05, timeout=0.2)
        with structlog.testing.capture_logs() as logs:
            for _ in range(3):
                assert await watch.poll_once() == 1
        (line,) = unavailable_lines(logs)
        assert line["condition"] == "slow"
        assert watch.owners.value.calls_failed == 3
    finally:
        await server.stop(0)


class BigNodeLister(api_pb2_grpc.PodResourcesListerServicer):
    """A node whose List answer is ``size`` bytes and more: 8 containers holding many devices each."""

    def __init__(self, size: int) -> None:
        ids = [
            f"0000:{i // 256:02x}:{i % 256 // 8:02x}.{i % 8}-vf-{'x' * 40}"
            for i in range(size // 64 // 8 + 1)
        ]
        containers = [
            api_pb2.ContainerResources(
                name=f"c{n}", devices=[api_pb2.ContainerDevices(resource_name=RESOURCE, device_ids=ids)]
            )
            for n in range(8)
        ]
        self.response = api_pb2.ListPodResourcesResponse(
            pod_resources=[api_pb2.PodResources(name="big", namespace="ns", containers=containers)]
        )

    async def List(self, request, context):
        return self.response


async def serve_lister(socket, lister):
    server = grpc.aio.server(options=[("grpc.max_send_message_length", 256 << 20)])
    api_pb2_grpc.add_PodResourcesListerServicer_to_server(lister, server)
    server.add_insecure_port(f"unix:{socket}")
    await server.start()
    return server


async def test_a_big_nodes_answer_over_4_mib_is_taken(short_dir):
    """gRPC's default limit (4 MiB) made it 'rate-limited' and backed off: owners never appeared."""
    lister = BigNodeLister(6 << 20)
    assert lister.response.ByteSize() > 4 << 20
    server = await serve_lister(short_dir / "big.sock", lister)
    try:
        watch = OwnerWatch(socket=short_dir / "big.sock", interval=0.05)
        assert await watch.poll_once() == 1
        owners = watch.owners.value
        assert owners.up, owners.error
        assert len({device for (_, device) in owners.holders}) == len(
            lister.response.pod_resources[0].containers[0].devices[0].device_ids
        )
    finally:
        await server.stop(0)


async def test_an_answer_larger_than_the_client_takes_is_named_not_taken_for_rate_limiting(short_dir):
    server = await serve_lister(short_dir / "big.sock", BigNodeLister(2 << 20))
    try:
        watch = OwnerWatch(socket=short_dir / "big.sock", interval=0.05, max_answer_bytes=1 << 20)
        with structlog.testing.capture_logs() as logs:
            assert await watch.poll_once() == 1  # no backoff: waiting does not make it smaller
        (line,) = unavailable_lines(logs)
        assert line["condition"] == "too-large"
        assert "larger than this client takes (1 MiB)" in watch.owners.value.error
    finally:
        await server.stop(0)


async def test_rate_limiting_backs_off_keeps_the_owners_and_recovers(short_dir):
    kubelet = EmulatedKubelet(
        short_dir / "dp", write_view=False, pod_resources_qps=0.0001, pod_resources_burst=1
    )
    await kubelet.start()
    try:
        watch = OwnerWatch(socket=kubelet.pod_resources_socket, interval=0.05)
        with structlog.testing.capture_logs() as logs:
            assert await watch.poll_once() == 1  # the burst allows one
            assert watch.owners.value.up
            factors = [await watch.poll_once(1)]
            for _ in range(4):
                factors.append(await watch.poll_once(factors[-1]))
        assert factors == [2, 4, 8, 8, 8]  # doubling, capped
        (line,) = unavailable_lines(logs)
        assert line["condition"] == "rate-limited"
        owners = watch.owners.value
        assert not owners.up and owners.last_success is not None and owners.calls_ok == 1
    finally:
        await kubelet.stop()


async def test_device_metrics_go_on_without_pod_resources(short_dir):
    """Without PodResources a plugin still reports every device and says once why owners are absent."""
    kubelet = EmulatedKubelet(short_dir / "dp", write_view=False, pod_resources=False)
    await kubelet.start()
    config = PluginConfig(
        RESOURCE,
        HostPaths(root=short_dir, kubelet_dir=kubelet.socket_dir),
        monitoring=MonitorConfig(enabled=True, pod_resources_interval=0.05, telemetry_interval=0.05),
    )
    runtime = DevicePluginRuntime(config, Widgets())
    stop = asyncio.Event()
    with structlog.testing.capture_logs() as logs:
        task = asyncio.create_task(runtime.run(stop))
        try:
            assert runtime.monitor is not None
            deadline = time.monotonic() + 20
            while True:
                report = runtime.monitor.report.value
                if report is not None and len(report.devices) == 3:
                    break
                assert time.monotonic() < deadline, "no device report"
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.3)  # several more polls: still one line
            text = b"".join(
                f"{m.name} {s.labels} {s.value}\n".encode()
                for m in device_metrics.collect(runtime.monitor.view())
                for s in m.samples
            ).decode()
        finally:
            stop.set()
            await asyncio.wait_for(task, 10)
            await kubelet.stop()
    assert text.count("plugvisor_device_healthy ") == 3
    assert "'pci_address': '0000:00:00.0'" in text
    assert "plugvisor_pod_resources_up {} 0.0" in text
    assert len(unavailable_lines(logs)) == 1


async def test_one_process_polls_for_the_whole_agent_and_another_takes_over(short_dir):
    """Two watchers sharing a monitor directory: one calls the kubelet, the other reads its file."""
    kubelet = EmulatedKubelet(short_dir / "dp", write_view=False)
    await kubelet.start()
    monitor_dir = short_dir / "monitor"
    monitor_dir.mkdir()
    first = OwnerWatch(socket=kubelet.pod_resources_socket, interval=0.05, monitor_dir=monitor_dir)
    second = OwnerWatch(socket=kubelet.pod_resources_socket, interval=0.05, monitor_dir=monitor_dir)
    leader = asyncio.create_task(first.run())
    follower = asyncio.create_task(second.run())
    try:
        await wait_for(lambda: first.leader and second.owners.value.calls_ok >= 2)
        assert not second.leader
        leader.cancel()  # the poller goes away: its lock with it
        await asyncio.gather(leader, return_exceptions=True)
        calls = second.owners.value.calls_ok
        await wait_for(lambda: second.leader and second.owners.value.calls_ok > calls + 1)
    finally:
        for task in (leader, follower):
            task.cancel()
        await asyncio.gather(leader, follower, return_exceptions=True)
        await kubelet.stop()


async def wait_for(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


class Scrubbed(Widgets):
    """A source with a release hook: the framework watches PodResources for it."""

    def __init__(self):
        self.scrubbed: list[str] = []

    def release_watch(self):
        return ReleaseWatch(interval=0.05)

    def released(self, snapshot):
        self.scrubbed.extend(snapshot.devices)


async def test_release_watching_follows_the_monitoring_poller_instead_of_calling_the_kubelet_again(short_dir):
    """With monitoring on, a release hook learns of releases from the one shared poller (no second client)."""
    kubelet = EmulatedKubelet(short_dir / "dp", write_view=False)
    await kubelet.start()
    source = Scrubbed()
    config = PluginConfig(
        RESOURCE,
        HostPaths(root=short_dir, kubelet_dir=kubelet.socket_dir),
        monitoring=MonitorConfig(enabled=True, pod_resources_interval=0.05, telemetry_interval=1),
    )
    runtime = DevicePluginRuntime(config, source)
    stop = asyncio.Event()
    task = asyncio.create_task(runtime.run(stop))
    try:
        await kubelet.wait_for(
            lambda k: (v := k.resource(RESOURCE)) is not None and v.allocatable == 3, timeout=20
        )
        pod = await kubelet.add_pod(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "p"},
                "spec": {
                    "containers": [{"name": "c", "image": "x", "resources": {"limits": {RESOURCE: "1"}}}]
                },
            }
        )
        (device,) = pod.container("c").devices[RESOURCE]
        owners = runtime.monitor.owner_watch.owners
        await wait_for(lambda: (RESOURCE, device) in owners.value.holders)
        await wait_for(lambda: runtime.release_watch is not None and device in runtime.release_watch.held)
        assert kubelet.delete_pod("p")
        await wait_for(lambda: source.scrubbed == [device])
        assert runtime.release_watch.failures == 0  # it never called List itself
        assert runtime.release_watch.polls <= owners.value.calls_ok
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await kubelet.stop()
