"""Hostile and careless requests: the right status with a bounded message, and the server keeps serving."""

import grpc
import pytest

from plugvisor.api.deviceplugin.v1beta1 import api_pb2

from .conftest import ids

HUGE = "x" * (1 << 20)
MALFORMED = b"\x0a\xff\xff\xff\xff\x0f"  # field 1, length-delimited, with an impossible length
METHODS = {
    "GetDevicePluginOptions": api_pb2.DevicePluginOptions,
    "ListAndWatch": api_pb2.ListAndWatchResponse,
    "GetPreferredAllocation": api_pb2.PreferredAllocationResponse,
    "Allocate": api_pb2.AllocateResponse,
    "PreStartContainer": api_pb2.PreStartContainerResponse,
}


async def test_a_one_megabyte_device_id_is_not_found_with_a_short_echo(serve):
    served = await serve()
    request = api_pb2.AllocateRequest(
        container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=[HUGE, "w0"])]
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await served.stub.Allocate(request)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    details = caught.value.details()
    assert len(details) < 1000 and f"({len(HUGE)} characters)" in details
    for call in (
        served.stub.PreStartContainer(api_pb2.PreStartContainerRequest(devices_ids=[HUGE])),
        served.stub.GetPreferredAllocation(
            api_pb2.PreferredAllocationRequest(
                container_requests=[
                    api_pb2.ContainerPreferredAllocationRequest(
                        available_deviceIDs=["w0"], must_include_deviceIDs=[HUGE], allocation_size=1
                    )
                ]
            )
        ),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call
        assert caught.value.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT)
        assert len(caught.value.details()) < 1000


@pytest.mark.parametrize("method", sorted(METHODS))
async def test_malformed_protobuf_is_invalid_argument_and_the_server_keeps_serving(serve, method):
    served = await serve()
    raw = served.channel.unary_unary(
        f"/v1beta1.DevicePlugin/{method}",
        request_serializer=None,
        response_deserializer=METHODS[method].FromString,
    )
    if method == "ListAndWatch":
        raw = served.channel.unary_stream(
            f"/v1beta1.DevicePlugin/{method}",
            request_serializer=None,
            response_deserializer=METHODS[method].FromString,
        )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        call = raw(MALFORMED)
        if method == "ListAndWatch":
            async for _ in call:
                pass
        else:
            await call
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"{method}: the request is not a valid" in caught.value.details()
    stream = served.stub.ListAndWatch(api_pb2.Empty())
    assert ids(await stream.read()) == ["w0", "w1", "w2", "w3"]
    stream.cancel()
