"""A framework plugin against the emulated kubelet: registration, updates, restarts, allocation.

Each test runs the plugin runtime and the emulated kubelet in one event loop, over
real unix sockets, the way a node runs them in two processes.
"""

import asyncio
import contextlib
from pathlib import Path

import grpc
import pytest
from structlog.testing import capture_logs

from plugvisor.api.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from plugvisor.common.hostpaths import HostPaths
from plugvisor.deviceplugin import runtime as runtime_module
from plugvisor.deviceplugin.devices import Device, DeviceSpec, Health
from plugvisor.deviceplugin.runtime import DevicePluginRuntime, PluginConfig
from plugvisor.deviceplugin.snapshot import Snapshot
from plugvisor.emulators.kubelet import EmulatedKubelet, EventKind, PluginMethod

RESOURCE = "example.com/widget"


class FileBackedWidgets:
    """Devices w0..w{n-1}; a file `<dir>/sick-wN` marks wN unhealthy, `<dir>/gone-wN` removes it."""

    def __init__(self, state_dir: Path, count: int = 4) -> None:
        self.state_dir = state_dir
        self.count = count
        self.pre_started: list[list[str]] = []
        self.preferred_calls = 0

    def scan(self) -> Snapshot:
        devices = []
        for i in range(self.count):
            name = f"w{i}"
            if (self.state_dir / f"gone-{name}").exists():
                continue
            health = Health.UNHEALTHY if (self.state_dir / f"sick-{name}").exists() else Health.HEALTHY
            devices.append(
                Device(
                    name,
                    health=health,
                    numa_nodes=[i % 2],
                    specs=[DeviceSpec(f"/dev/{name}", f"/dev/{name}")],
                )
            )
        return Snapshot(devices, watch=[self.state_dir])

    def preferred_allocation(self, available, must_include, size, snapshot):
        self.preferred_calls += 1
        return (
            sorted(available, reverse=True)[:size]
            if not must_include
            else [*must_include, *[i for i in sorted(available, reverse=True) if i not in must_include]][
                :size
            ]
        )

    def pre_start_container(self, snapshot):
        self.pre_started.append(list(snapshot.devices))


@contextlib.asynccontextmanager
async def running(runtime: DevicePluginRuntime):
    stop = asyncio.Event()
    task = asyncio.create_task(runtime.run(stop))
    try:
        yield task
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


def counts(kubelet: EmulatedKubelet, resource: str = RESOURCE):
    view = kubelet.resource(resource)
    return None if view is None else (view.allocatable, view.capacity)


@pytest.fixture
async def kubelet(short_dir):
    k = EmulatedKubelet(short_dir / "dp", grace_period=60.0)
    await k.start()
    yield k
    if k.running:
        await k.stop()


@pytest.fixture
def state_dir(short_dir):
    path = short_dir / "state"
    path.mkdir()
    return path


def runtime_for(kubelet: EmulatedKubelet, source, resource: str = RESOURCE) -> DevicePluginRuntime:
    paths = HostPaths(root=Path("/"), kubelet_dir=kubelet.socket_dir)
    return DevicePluginRuntime(PluginConfig(resource, paths, rescan_interval=30.0), source)


class TestRegistration:
    async def test_registers_and_the_kubelet_sees_every_device(self, kubelet, state_dir):
        async with running(runtime_for(kubelet, FileBackedWidgets(state_dir))):
            await kubelet.wait_for(lambda k: counts(k) == (4, 4))
        record = kubelet.registrations[0]
        assert record.accepted and record.version == "v1beta1"
        assert record.endpoint.startswith("plugvisor-widget-") and "/" not in record.endpoint

    async def test_the_kubelet_uses_the_options_the_hooks_imply(self, kubelet, state_dir):
        async with running(runtime_for(kubelet, FileBackedWidgets(state_dir))):
            await kubelet.wait_for(lambda k: counts(k) == (4, 4))
            options = kubelet.resource(RESOURCE).options
        assert options.pre_start_required and options.get_preferred_allocation_available

    async def test_waits_for_a_kubelet_that_is_not_there_yet(self, short_dir, state_dir):
        kubelet = EmulatedKubelet(short_dir / "dp", grace_period=60.0)
        (short_dir / "dp").mkdir()
        runtime = runtime_for(kubelet, FileBackedWidgets(state_dir))
        async with running(runtime):
            async with asyncio.timeout(10):  # serving on its socket, so next it waits for the kubelet
                while runtime.endpoint is None or not runtime.endpoint.path.exists():
                    await asyncio.sleep(0.01)
            assert runtime.registrations.value is None
            await kubelet.start()
            try:
                await kubelet.wait_for(lambda k: counts(k) == (4, 4))
            finally:
                await kubelet.stop()

    async def test_two_resources_side_by_side(self, kubelet, state_dir, short_dir):
        other = short_dir / "other"
        other.mkdir()
        async with (
            running(runtime_for(kubelet, FileBackedWidgets(state_dir, 2))),
            running(runtime_for(kubelet, FileBackedWidgets(other, 3), "example.com/gadget")),
        ):
            await kubelet.wait_for(
                lambda k: counts(k) == (2, 2) and counts(k, "example.com/gadget") == (3, 3)
            )
            endpoints = {kubelet.resource(r).endpoint for r in (RESOURCE, "example.com/gadget")}
        assert len(endpoints) == 2

    async def test_a_second_instance_for_the_same_resource_gets_its_own_socket(self, kubelet, state_dir):
        first, second = (
            runtime_for(kubelet, FileBackedWidgets(state_dir)),
            runtime_for(kubelet, FileBackedWidgets(state_dir)),
        )
        async with running(first), running(second):
            await first.registrations.wait_newer(0)
            await second.registrations.wait_newer(0)
            assert first.endpoint.path != second.endpoint.path
            assert first.endpoint.path.exists() and second.endpoint.path.exists()


class TestUpdates:
    async def test_a_health_change_reaches_the_kubelet_and_recovers(self, kubelet, state_dir):
        async with running(runtime_for(kubelet, FileBackedWidgets(state_dir))):
            await kubelet.wait_for(lambda k: counts(k) == (4, 4))
            (state_dir / "sick-w2").touch()
            await kubelet.wait_for(lambda k: counts(k) == (3, 4))
            assert kubelet.resource(RESOURCE).devices["w2"].health == "Unhealthy"
            (state_dir / "sick-w2").unlink()
            await kubelet.wait_for(lambda k: counts(k) == (4, 4))

    async def test_a_vanished_device_leaves_the_list(self, kubelet, state_dir):
        async with running(runtime_for(kubelet, FileBackedWidgets(state_dir))):
            await kubelet.wait_for(lambda k: counts(k) == (4, 4))
            (state_dir / "gone-w0").touch()
            await kubelet.wait_for(lambda k: counts(k) == (3, 3))
            assert "w0" not in kubelet.resource(RESOURCE).devices

    async def test_stopping_the_plugin_ends_its_stream(self, kubelet, state_dir):
        async with running(runtime_for(kubelet, FileBackedWidgets(state_dir))):
            await kubelet.wait_for(lambda k: counts(k) == (4, 4))
        await kubelet.wait_for(lambda k: counts(k) == (0, 4))


class TestKubeletRestart:
    async def test_registers_again_on_a_fresh_socket_with_the_same_devices(self, kubelet, state_dir):
        runtime = runtime_for(kubelet, FileBackedWidgets(state_dir))
        async with running(runtime):
            await kubelet.wait_for(lambda k: counts(k) == (4, 4))
            first_endpoint = kubelet.resource(RESOURCE).endpoint
            for restart in range(1, 4):
                await kubelet.restart()
                await kubelet.wait_for(
                    lambda k, r=restart: (
                        k.generation == r + 1 and counts(k) == (4, 4) and k.resource(RESOURCE).registered
                    )
                )
            assert kubelet.resource(RESOURCE).endpoint != first_endpoint
        accepted = [r for r in kubelet.registrations if r.accepted]
        assert len(accepted) == 4  # one per kubelet generation: no spurious re-registration
        assert [r.generation for r in accepted] == [1, 2, 3, 4]


class TestAllocation:
    async def test_the_kubelet_allocates_with_preference_and_pre_start(self, kubelet, state_dir):
        source = FileBackedWidgets(state_dir)
        async with running(runtime_for(kubelet, source)):
            await kubelet.wait_for(lambda k: counts(k) == (4, 4))
            allocation = await kubelet.allocate(RESOURCE, 2, pod_uid="p1", container="c")
        assert sorted(allocation.device_ids) == ["w2", "w3"]
        assert [d.host_path for d in allocation.response.devices] == [
            f"/dev/{i}" for i in allocation.device_ids
        ]
        assert allocation.preferred_called and allocation.pre_start_called
        assert source.preferred_calls == 1
        assert sorted(source.pre_started[0]) == ["w2", "w3"]
        assert kubelet.calls_for(RESOURCE)[:2] == [
            PluginMethod.GET_DEVICE_PLUGIN_OPTIONS,
            PluginMethod.LIST_AND_WATCH,
        ]


class TestSupervision:
    """The hooks a supervisor uses: status datagrams and exiting on a kubelet restart."""

    async def test_reports_registrations_and_devices_on_the_status_socket(
        self, kubelet, state_dir, short_dir
    ):
        import socket

        from plugvisor.common.notify import StatusReporter, decode

        listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        listener.bind(str(short_dir / "status.sock"))
        listener.setblocking(False)
        loop = asyncio.get_running_loop()
        paths = HostPaths(root=Path("/"), kubelet_dir=kubelet.socket_dir)
        runtime = DevicePluginRuntime(
            PluginConfig(RESOURCE, paths),
            FileBackedWidgets(state_dir),
            status=StatusReporter(str(short_dir / "status.sock")),
        )
        messages = []

        async def until(predicate):
            while not any(predicate(m) for m in messages):
                messages.append(decode(await asyncio.wait_for(loop.sock_recv(listener, 4096), 10)))

        try:
            async with running(runtime):
                await until(lambda m: m.get("REGISTERED") == "1")
                (state_dir / "sick-w1").touch()
                await until(lambda m: m.get("DEVICES") == "3/4")
                await kubelet.restart()
                await until(lambda m: "KUBELET_RESTART" in m)
                await until(lambda m: m.get("REGISTERED") == "2")
        finally:
            listener.close()
        registered = [m for m in messages if "REGISTERED" in m]
        assert registered[0]["ENDPOINT"].startswith("plugvisor-widget-")
        assert registered[0]["DEVICES"] == "4/4"
        # The count before the first scan is no count: "0/0" made the agent warn that a resource of
        # four widgets matched no device.
        assert next(m["DEVICES"] for m in messages if "DEVICES" in m) == "4/4"

    async def test_exits_on_a_kubelet_restart_when_told_to(self, kubelet, state_dir):
        from plugvisor.deviceplugin.runtime import KubeletRestartedError

        paths = HostPaths(root=Path("/"), kubelet_dir=kubelet.socket_dir)
        runtime = DevicePluginRuntime(
            PluginConfig(RESOURCE, paths, on_kubelet_restart="exit"), FileBackedWidgets(state_dir)
        )
        task = asyncio.create_task(runtime.run(asyncio.Event()))
        await kubelet.wait_for(lambda k: counts(k) == (4, 4))
        await kubelet.restart()
        with pytest.raises(KubeletRestartedError):
            await asyncio.wait_for(task, 10)


class Releasing(FileBackedWidgets):
    """Widgets that also implement the proposed PostStopContainer and Deallocate hooks."""

    def __init__(self, state_dir: Path) -> None:
        super().__init__(state_dir)
        self.post_stopped: list[list[str]] = []
        self.deallocated: list[list[str]] = []

    def post_stop_container(self, snapshot):
        self.post_stopped.append(sorted(snapshot.devices))

    def deallocate(self, snapshot):
        self.deallocated.append(sorted(snapshot.devices))


POD = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {"name": "user", "namespace": "default"},
    "spec": {
        "restartPolicy": "Never",
        "containers": [{"name": "main", "image": "x", "resources": {"limits": {RESOURCE: "2"}}}],
    },
}


def answered(kubelet: EmulatedKubelet, method: PluginMethod) -> list[bool]:
    """Whether the plugin offered each ``method`` call the kubelet has had an answer to."""
    return [
        bool(e.fields["offered"])
        for e in kubelet.events
        if e.kind is EventKind.PLUGIN_CALL_ANSWERED and e.fields["method"] == method
    ]


class TestProposedReleaseCalls:
    """The KEP-20210712 addendum's calls, served only when the plugin has the hooks."""

    async def test_post_stop_and_deallocate_reach_the_hooks(self, short_dir, state_dir):
        from plugvisor.emulators.kubelet import FeatureGates

        gates = FeatureGates.parse("DeviceManagerDeallocate=true")
        async with EmulatedKubelet(short_dir / "dp", gates=gates, write_view=False) as kubelet:
            source = Releasing(state_dir)
            async with running(runtime_for(kubelet, source)):
                await kubelet.wait_for(lambda k: counts(k) == (4, 4))
                pod = await kubelet.add_pod(POD)
                held = sorted(pod.container("main").devices[RESOURCE])
                await kubelet.exit_container("user", "main", exit_code=0)
                await kubelet.wait_for(lambda k: PluginMethod.POST_STOP_CONTAINER in k.calls_for(RESOURCE))
                kubelet.delete_pod("user")
                # As upstream, devices of deleted pods are freed when the next admission updates
                # the allocated set; that is when Deallocate goes out.
                await kubelet.add_pod({**POD, "metadata": {"name": "next", "namespace": "default"}})
                # The kubelet journals a call as it sends it, and its answer when it comes: the plugin
                # must not stop in between (its stop would cut the call off).
                await kubelet.wait_for(
                    lambda k: (
                        answered(k, PluginMethod.POST_STOP_CONTAINER) == [True]
                        and answered(k, PluginMethod.DEALLOCATE) == [True]
                    )
                )
        assert source.post_stopped == [held]
        assert source.deallocated == [held]
        failed = [e for e in kubelet.events if "failed" in str(e.kind)]
        assert not failed, failed

    async def test_without_the_hooks_the_calls_are_not_offered(self, short_dir, state_dir):
        from plugvisor.emulators.kubelet import FeatureGates

        gates = FeatureGates.parse("DeviceManagerDeallocate=true")
        async with EmulatedKubelet(short_dir / "dp", gates=gates, write_view=False) as kubelet:
            async with running(runtime_for(kubelet, FileBackedWidgets(state_dir))):
                await kubelet.wait_for(lambda k: counts(k) == (4, 4))
                await kubelet.add_pod(POD)
                await kubelet.exit_container("user", "main", exit_code=0)
                # Not merely sent: answered, before the plugin stops (its stop would cut the call off).
                await kubelet.wait_for(lambda k: answered(k, PluginMethod.POST_STOP_CONTAINER) == [False])
            failed = [e for e in kubelet.events if "failed" in str(e.kind)]
        assert not failed, failed  # UNIMPLEMENTED means "not offered", not an error


class WithLifecycle(FileBackedWidgets):
    """Widgets with a lifecycle, recording what ran when."""

    def __init__(self, state_dir: Path, events: list[str], *, fail_start: bool = False) -> None:
        super().__init__(state_dir)
        self.events = events
        self.fail_start = fail_start

    def start(self) -> None:
        self.events.append("start")
        if self.fail_start:
            raise RuntimeError("device busy")

    def scan(self) -> Snapshot:
        if not self.events or self.events[-1] != "scan":
            self.events.append("scan")
        return super().scan()

    def close(self) -> None:
        self.events.append("close")


class TestLifecycle:
    async def test_start_runs_before_the_first_scan_and_close_after_the_stop(self, kubelet, state_dir):
        events: list[str] = []
        async with running(runtime_for(kubelet, WithLifecycle(state_dir, events))):
            await kubelet.wait_for(lambda k: counts(k) == (4, 4))
            assert events == ["start", "scan"]
        assert events == ["start", "scan", "close"]

    async def test_a_failing_start_ends_the_plugin_and_still_closes(self, kubelet, state_dir):
        events: list[str] = []
        runtime = runtime_for(kubelet, WithLifecycle(state_dir, events, fail_start=True))
        with pytest.raises(RuntimeError, match="device busy"):
            await asyncio.wait_for(runtime.run(asyncio.Event()), 10)
        assert events == ["start"], "nothing was started, so nothing is closed"


class OverTheKubeletsMessageLimit:
    """More devices than one ListAndWatch message of the kubelet's 4 MiB limit holds."""

    def scan(self) -> Snapshot:
        return Snapshot([Device(f"{'x' * 50}-{i:06d}") for i in range(80_000)])


async def test_a_kubelet_that_cuts_every_stream_at_once_is_not_registered_with_in_a_hot_loop(kubelet):
    """The kubelet ends the stream it cannot read and drops the plugin; registering again at once, for
    ever, would spin. The second cut in a row waits 0.5 s, the next 1 s, and so on."""
    with capture_logs() as logs:
        async with running(runtime_for(kubelet, OverTheKubeletsMessageLimit())):
            await kubelet.wait_for(
                lambda k: len([r for r in k.registrations if r.accepted]) >= 3,
                timeout=60,
                what="three registrations, each stream cut at once",
            )
    waits = [e["waited"] for e in logs if e["event"] == "stream_cut_again"]
    assert waits[:1] == [0.5], logs
    assert "Received message larger than max" in str(kubelet.events), "not the 4 MiB limit"


class KubeletThatNeverDialsBack(api_pb2_grpc.RegistrationServicer):
    """Accepts every Register and never opens ListAndWatch: what a plugin sees when the kubelet dropped its
    connection before the stream opened (up to 1.36, another plugin's end just after our registration)."""

    def __init__(self) -> None:
        self.endpoints: list[str] = []

    async def Register(self, request, context):
        self.endpoints.append(request.endpoint)
        return api_pb2.Empty()


async def test_a_registration_the_kubelet_never_opens_a_stream_on_is_made_again_from_a_fresh_socket(
    short_dir, state_dir, monkeypatch
):
    """Nothing ends that was never opened, so only the missing stream says the kubelet does not follow us."""
    monkeypatch.setattr(runtime_module, "STREAM_OPEN_TIMEOUT", 0.2)
    kubelet_dir = short_dir / "dp"
    kubelet_dir.mkdir()
    fake = KubeletThatNeverDialsBack()
    server = grpc.aio.server()
    api_pb2_grpc.add_RegistrationServicer_to_server(fake, server)
    server.add_insecure_port(f"unix:{kubelet_dir / 'kubelet.sock'}")
    await server.start()
    paths = HostPaths(root=Path("/"), kubelet_dir=kubelet_dir)
    runtime = DevicePluginRuntime(PluginConfig(RESOURCE, paths), FileBackedWidgets(state_dir))
    try:
        with capture_logs() as logs:
            async with running(runtime):
                async with asyncio.timeout(20):
                    while len(fake.endpoints) < 3:
                        await asyncio.sleep(0.05)
    finally:
        await server.stop(0)
    assert len(set(fake.endpoints)) == len(fake.endpoints), "a socket was registered twice"
    unopened = [e for e in logs if e["event"] == "no_stream_after_registration"]
    assert unopened and unopened[0]["endpoint"] == fake.endpoints[0], logs
    assert [e["waited"] for e in logs if e["event"] == "stream_cut_again"][:1] == [0.5], "not paced"
