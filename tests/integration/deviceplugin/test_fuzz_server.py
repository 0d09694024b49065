"""Arbitrary requests against a live server: a correct answer or the right error, and it keeps serving."""

import asyncio

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plugvisor.api.deviceplugin.v1beta1 import api_pb2
from plugvisor.deviceplugin.devices import Device, DeviceSet, Health

DEVICES = DeviceSet(
    [Device(f"d{i}", numa_nodes=[i % 2]) for i in range(4)] + [Device("sick", health=Health.UNHEALTHY)]
)
ID = st.one_of(st.sampled_from([*DEVICES, "ghost", "../../etc", ""]), st.text(max_size=8))
ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION}
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


class SameNode:
    def preferred_allocation(self, available, must_include, size, snapshot):
        ordered = list(must_include) + sorted(
            set(available) - set(must_include), key=lambda i: snapshot.devices[i].numa_nodes
        )
        return ordered[:size]


def run(coro):
    return asyncio.get_event_loop().run_until_complete(coro)


@FUZZ
@given(containers=st.lists(st.lists(ID, max_size=4), max_size=3))
def test_allocate(fuzz_server, containers):
    stub = fuzz_server
    request = api_pb2.AllocateRequest(
        container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=c) for c in containers]
    )
    try:
        response = run(stub.Allocate(request))
    except grpc.aio.AioRpcError as err:
        assert err.code() in ERRORS, err
        assert err.details()
    else:
        flat = [i for c in containers for i in c]
        assert len(flat) == len(set(flat)) and set(flat) <= DEVICES.healthy_ids
        assert len(response.container_responses) == len(containers)
    assert run(stub.GetDevicePluginOptions(api_pb2.Empty())).get_preferred_allocation_available


@FUZZ
@given(available=st.lists(ID, max_size=6), must=st.lists(ID, max_size=3), size=st.integers(-3, 8))
def test_preferred_allocation(fuzz_server, available, must, size):
    stub = fuzz_server
    request = api_pb2.PreferredAllocationRequest(
        container_requests=[
            api_pb2.ContainerPreferredAllocationRequest(
                available_deviceIDs=available, must_include_deviceIDs=must, allocation_size=size
            )
        ]
    )
    try:
        response = run(stub.GetPreferredAllocation(request))
    except grpc.aio.AioRpcError as err:
        assert err.code() in ERRORS, err
        return
    chosen = list(response.container_responses[0].deviceIDs)
    assert len(chosen) == size == len(set(chosen))
    assert set(must) <= set(chosen) <= set(available)
