"""The DevicePlugin servicer over a real unix socket: every RPC, every rejection, concurrent streams."""

import asyncio
import os
import socket
import stat
from pathlib import Path

import grpc
import pytest
from structlog.testing import capture_logs

from plugvisor.api.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from plugvisor.deviceplugin.cell import SnapshotCell
from plugvisor.deviceplugin.devices import Device, DeviceSet, Health
from plugvisor.deviceplugin.endpoint import PluginEndpoint
from plugvisor.deviceplugin.errors import SocketInUseError
from plugvisor.deviceplugin.hooks import ContainerAllocation, Hooks
from plugvisor.deviceplugin.server import PluginServer
from plugvisor.deviceplugin.snapshot import Snapshot

from .conftest import RESOURCE, ids, widgets


def allocate_request(*containers):
    return api_pb2.AllocateRequest(
        container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=list(c)) for c in containers]
    )


def preferred_request(available, must=(), size=1):
    return api_pb2.PreferredAllocationRequest(
        container_requests=[
            api_pb2.ContainerPreferredAllocationRequest(
                available_deviceIDs=list(available), must_include_deviceIDs=list(must), allocation_size=size
            )
        ]
    )


class Topology:
    """A preferred allocator that keeps a container on one NUMA node."""

    def preferred_allocation(self, available, must_include, size, snapshot):
        by_node = sorted(available, key=lambda i: (snapshot.devices[i].numa_nodes, i))
        return list(must_include) + [i for i in by_node if i not in must_include][: size - len(must_include)]


class Broken:
    def preferred_allocation(self, available, must_include, size, snapshot):
        return ["not-a-device"]

    def post_allocate(self, allocation, snapshot):
        raise RuntimeError("hook bug")


class Renumber:
    def post_allocate(self, allocation, snapshot):
        return ContainerAllocation(
            specs=allocation.specs, envs={**allocation.envs, "WIDGET_COUNT": str(len(snapshot.devices))}
        )


class Resetter:
    def __init__(self):
        self.calls = []

    def pre_start_container(self, snapshot):
        self.calls.append(list(snapshot.devices))
        if "w3" in snapshot.devices:
            raise OSError("reset failed: port busy")


class TestOptions:
    async def test_options_follow_the_hooks_the_plugin_has(self, serve):
        plain = await serve()
        assert await plain.stub.GetDevicePluginOptions(api_pb2.Empty()) == api_pb2.DevicePluginOptions()
        rich = await serve(plugin=type("Both", (Topology, Resetter), {})())
        options = await rich.stub.GetDevicePluginOptions(api_pb2.Empty())
        assert options.pre_start_required and options.get_preferred_allocation_available


class TestListAndWatch:
    async def test_first_message_is_the_full_list_then_every_change(self, serve):
        served = await serve()
        stream = served.stub.ListAndWatch(api_pb2.Empty())
        assert ids(await stream.read()) == ["w0", "w1", "w2", "w3"]
        served.cell.publish(Snapshot([Device("w0"), Device("w1", health=Health.UNHEALTHY)]))
        message = await stream.read()
        assert [(d.ID, d.health) for d in message.devices] == [("w0", "Healthy"), ("w1", "Unhealthy")]
        stream.cancel()

    async def test_a_list_too_large_for_the_kubelet_is_an_error_naming_its_size(self, serve):
        # The kubelet reads ListAndWatch with gRPC's default 4 MiB limit: a larger list ends its stream
        # with RESOURCE_EXHAUSTED on the kubelet's side only, and every device of the resource is dropped.
        many = DeviceSet(Device(f"{'x' * 50}-{i}") for i in range(80_000))
        served = await serve(many)
        with capture_logs() as logs, pytest.raises(grpc.aio.AioRpcError) as refused:
            await served.stub.ListAndWatch(api_pb2.Empty()).read()
        assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED  # as the kubelet sees it
        errors = [e for e in logs if e["event"] == "device_list_too_large"]
        assert len(errors) == 1
        assert errors[0]["log_level"] == "error"
        assert errors[0]["devices"] == 80_000
        assert errors[0]["bytes"] > errors[0]["limit"] == 4 * 1024 * 1024

    async def test_topology_is_sent_only_for_devices_that_have_one(self, serve):
        served = await serve(DeviceSet([Device("a", numa_nodes=[1]), Device("b")]))
        message = await served.stub.ListAndWatch(api_pb2.Empty()).read()
        assert [n.ID for n in message.devices[0].topology.nodes] == [1]
        assert not message.devices[1].HasField("topology")

    async def test_concurrent_streams_all_see_every_published_list(self, serve):
        served = await serve()
        streams = [served.stub.ListAndWatch(api_pb2.Empty()) for _ in range(3)]
        for s in streams:
            await s.read()
        served.cell.publish(Snapshot(widgets(2)))
        assert [ids(await s.read()) for s in streams] == [["w0", "w1"]] * 3
        for s in streams:
            s.cancel()

    async def test_a_slow_stream_ends_on_the_latest_list(self, serve):
        served = await serve()
        stream = served.stub.ListAndWatch(api_pb2.Empty())
        await stream.read()
        for n in range(1, 8):
            served.cell.publish(Snapshot(widgets(n)))
        last = []
        while last != ["w0", "w1", "w2", "w3", "w4", "w5", "w6"]:
            last = list(ids(await asyncio.wait_for(stream.read(), 5)))
        stream.cancel()

    async def test_a_new_snapshot_with_the_same_devices_sends_nothing(self, serve):
        """Only the watch paths or the hooks' data changed: the kubelet's view did not."""
        served = await serve()
        stream = served.stub.ListAndWatch(api_pb2.Empty())
        await stream.read()
        served.cell.publish(Snapshot(widgets(4), watch=["/elsewhere"], data="rescanned"))
        served.cell.publish(Snapshot(widgets(3)))
        assert ids(await asyncio.wait_for(stream.read(), 5)) == ["w0", "w1", "w2"]
        stream.cancel()

    async def test_an_empty_list_is_sent_as_zero_devices(self, serve):
        served = await serve(DeviceSet())
        assert ids(await served.stub.ListAndWatch(api_pb2.Empty()).read()) == []

    async def test_streams_end_when_the_server_stops(self, serve):
        served = await serve()
        stream = served.stub.ListAndWatch(api_pb2.Empty())
        await stream.read()
        served.cell.close()
        assert await stream.read() is grpc.aio.EOF


class TestAllocate:
    async def test_answers_each_container_in_order(self, serve):
        served = await serve()
        response = await served.stub.Allocate(allocate_request(["w2"], ["w0", "w1"]))
        first, second = response.container_responses
        assert [d.host_path for d in first.devices] == ["/dev/w2"]
        assert dict(second.envs) == {"WIDGETS": "w0,w1"}
        assert [d.permissions for d in second.devices] == ["rw", "rw"]

    @pytest.mark.parametrize(
        ("request_ids", "code", "fragment"),
        [
            ([], grpc.StatusCode.INVALID_ARGUMENT, "no container requests"),
            ([[]], grpc.StatusCode.INVALID_ARGUMENT, "no device IDs"),
            ([["w0", "ghost"]], grpc.StatusCode.NOT_FOUND, '["ghost"]'),
            ([["../../etc/passwd"]], grpc.StatusCode.NOT_FOUND, '["../../etc/passwd"]'),
            ([["w1", "w1"]], grpc.StatusCode.INVALID_ARGUMENT, '["w1"] are listed more than once'),
            ([["w0"], ["w0"]], grpc.StatusCode.INVALID_ARGUMENT, "also requested"),
        ],
        ids=["empty", "no-ids", "unknown", "path-like", "repeated", "two-containers-one-device"],
    )
    async def test_bad_requests_get_a_status_that_names_the_ids(self, serve, request_ids, code, fragment):
        served = await serve()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await served.stub.Allocate(allocate_request(*request_ids))
        assert info.value.code() == code
        assert fragment in info.value.details()
        # ... and the server keeps serving.
        assert (await served.stub.Allocate(allocate_request(["w0"]))).container_responses

    async def test_a_changed_device_set_changes_the_answer_for_the_same_ids(self, serve):
        served = await serve()
        first = await served.stub.Allocate(allocate_request(["w1"]))
        assert dict(first.container_responses[0].envs) == {"WIDGETS": "w1"}
        served.cell.publish(Snapshot([Device("w1", envs={"WIDGETS": "renamed"})]))
        again = await served.stub.Allocate(allocate_request(["w1"]))
        assert dict(again.container_responses[0].envs) == {"WIDGETS": "renamed"}
        assert list(again.container_responses[0].devices) == []

    async def test_a_request_answered_before_is_refused_once_its_device_turns_unhealthy(self, serve):
        served = await serve()
        for _ in range(2):  # the second answer comes from the answers kept for this device set
            assert (await served.stub.Allocate(allocate_request(["w2"]))).container_responses
        sick = [d.with_health(Health.UNHEALTHY) if d.id == "w2" else d for d in widgets(4).values()]
        served.cell.publish(Snapshot(sick))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await served.stub.Allocate(allocate_request(["w2"]))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert '["w2"]' in info.value.details()

    async def test_unhealthy_devices_are_refused(self, serve):
        served = await serve(DeviceSet([Device("ok"), Device("sick", health=Health.UNHEALTHY)]))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await served.stub.Allocate(allocate_request(["ok", "sick"]))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert '["sick"]' in info.value.details()

    async def test_post_allocate_edits_the_response(self, serve):
        served = await serve(plugin=Renumber())
        response = await served.stub.Allocate(allocate_request(["w0", "w3"]))
        assert response.container_responses[0].envs["WIDGET_COUNT"] == "2"

    async def test_a_failing_post_allocate_hook_fails_the_call_not_the_server(self, serve):
        served = await serve(plugin=Broken())
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await served.stub.Allocate(allocate_request(["w0"]))
        assert info.value.code() == grpc.StatusCode.INTERNAL
        assert "hook bug" in info.value.details()


class TestPreferredAllocation:
    async def test_the_hook_chooses(self, serve):
        devices = DeviceSet(
            [Device("a", numa_nodes=[1]), Device("b", numa_nodes=[0]), Device("c", numa_nodes=[0])]
        )
        served = await serve(devices, plugin=Topology())
        response = await served.stub.GetPreferredAllocation(preferred_request(["a", "b", "c"], size=2))
        assert list(response.container_responses[0].deviceIDs) == ["b", "c"]

    async def test_an_invalid_hook_answer_is_replaced_by_the_default(self, serve):
        served = await serve(plugin=Broken())
        response = await served.stub.GetPreferredAllocation(preferred_request(["w0", "w1", "w2"], ["w2"], 2))
        assert list(response.container_responses[0].deviceIDs) == ["w2", "w0"]

    @pytest.mark.parametrize(
        ("available", "must", "size", "code"),
        [
            (["w0", "nope"], [], 1, grpc.StatusCode.NOT_FOUND),
            (["w0"], ["w1"], 1, grpc.StatusCode.INVALID_ARGUMENT),
            (["w0", "w1"], [], 5, grpc.StatusCode.INVALID_ARGUMENT),
            (["w0", "w0"], [], 1, grpc.StatusCode.INVALID_ARGUMENT),
        ],
        ids=["unknown", "must-include-outside", "size-cannot-be-met", "repeated"],
    )
    async def test_unsatisfiable_requests_are_rejected(self, serve, available, must, size, code):
        served = await serve(plugin=Topology())
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await served.stub.GetPreferredAllocation(preferred_request(available, must, size))
        assert info.value.code() == code

    async def test_an_empty_request_is_rejected(self, serve):
        served = await serve()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await served.stub.GetPreferredAllocation(api_pb2.PreferredAllocationRequest())
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


class TestPreStartContainer:
    async def test_runs_the_hook_with_the_containers_devices(self, serve):
        resetter = Resetter()
        served = await serve(plugin=resetter)
        await served.stub.PreStartContainer(api_pb2.PreStartContainerRequest(devices_ids=["w1", "w0"]))
        assert resetter.calls == [["w1", "w0"]]

    async def test_a_failing_hook_fails_the_container_start_with_its_message(self, serve):
        served = await serve(plugin=Resetter())
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await served.stub.PreStartContainer(api_pb2.PreStartContainerRequest(devices_ids=["w3"]))
        assert info.value.code() == grpc.StatusCode.INTERNAL
        assert "port busy" in info.value.details()

    async def test_unknown_devices_are_refused(self, serve):
        served = await serve(plugin=Resetter())
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await served.stub.PreStartContainer(api_pb2.PreStartContainerRequest(devices_ids=["w9"]))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


class TestEndpoint:
    async def test_the_socket_is_not_accessible_to_others(self, serve):
        served = await serve()
        mode = stat.S_IMODE(os.stat(served.endpoint.path).st_mode)
        assert mode & 0o077 == 0

    async def test_each_instance_gets_its_own_socket_file(self, serve):
        first, second = await serve(), await serve()
        assert first.endpoint.path != second.endpoint.path
        assert first.endpoint.path.parent == second.endpoint.path.parent

    async def test_a_live_socket_is_never_taken_over(self, serve, short_dir):
        served = await serve()
        intruder = PluginEndpoint(served.server, short_dir, RESOURCE)
        intruder.path = served.endpoint.path
        with pytest.raises(SocketInUseError, match="another live process"):
            await intruder.start()
        assert (await served.stub.GetDevicePluginOptions(api_pb2.Empty())) is not None

    async def test_a_socket_wiped_while_the_endpoint_starts_is_no_error(self, short_dir, monkeypatch):
        """A kubelet restart can delete every socket between our bind and our chmod (a restart storm did)."""
        server = PluginServer(RESOURCE, SnapshotCell(Snapshot(widgets(1))), Hooks())
        endpoint = PluginEndpoint(server, short_dir, RESOURCE)
        chmod = Path.chmod

        def wiped_first(path, mode, **kwargs):
            if path == endpoint.path:
                path.unlink()  # what the restarting kubelet does to every socket in its directory
            return chmod(path, mode, **kwargs)

        monkeypatch.setattr(Path, "chmod", wiped_first)
        await endpoint.start()  # no FileNotFoundError: the registrar finds it gone, a fresh one follows
        assert not endpoint.path.exists()
        await endpoint.stop(grace=0)

    async def test_a_stale_socket_file_is_replaced(self, short_dir):
        server = PluginServer(RESOURCE, SnapshotCell(Snapshot(widgets(1))), Hooks())
        endpoint = PluginEndpoint(server, short_dir, RESOURCE)
        stale = socket.socket(socket.AF_UNIX)
        stale.bind(str(endpoint.path))
        stale.close()  # the file stays, nobody listens
        await endpoint.start()
        try:
            async with grpc.aio.insecure_channel(f"unix:{endpoint.path}") as channel:
                await api_pb2_grpc.DevicePluginStub(channel).GetDevicePluginOptions(api_pb2.Empty())
        finally:
            await endpoint.stop(grace=0)


class TestMetrics:
    async def test_allocations_errors_and_latency_are_counted(self, serve):
        from prometheus_client import REGISTRY

        def sample(name, **labels):
            return REGISTRY.get_sample_value(name, {"resource": RESOURCE, **labels}) or 0.0

        served = await serve()
        allocated = sample("plugvisor_plugin_allocated_devices_total")
        errors = sample("plugvisor_plugin_rpc_errors_total", method="Allocate", code="NOT_FOUND")
        observed = sample("plugvisor_plugin_rpc_duration_seconds_count", method="Allocate")
        for _ in range(2):  # the second is answered from the answers kept for this device set: it counts too
            await served.stub.Allocate(allocate_request(["w0", "w1"]))
        with pytest.raises(grpc.aio.AioRpcError):
            await served.stub.Allocate(allocate_request(["ghost"]))
        assert sample("plugvisor_plugin_allocated_devices_total") == allocated + 4
        assert sample("plugvisor_plugin_rpc_errors_total", method="Allocate", code="NOT_FOUND") == errors + 1
        assert sample("plugvisor_plugin_rpc_duration_seconds_count", method="Allocate") == observed + 2
