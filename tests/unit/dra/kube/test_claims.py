"""Reading a claim's allocation: this driver's results only, and a clear refusal for every bad claim."""

from __future__ import annotations

import pytest

from plugvisor.dra.kube.claims import AllocatedDevice, ClaimError, ClaimReader

from .conftest import DRIVER
from .fakeapi import FakeApi

UID = "0b6b9c1e-1111-4222-8333-444455556666"


def claim(*results: dict[str, object], uid: str = UID) -> dict[str, object]:
    body: dict[str, object] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "two-gpus", "namespace": "team", "uid": uid},
        "spec": {
            "devices": {"requests": [{"name": "gpus", "exactly": {"deviceClassName": "gpu.plugvisor.io"}}]}
        },
    }
    if results:
        body["status"] = {"allocation": {"devices": {"results": list(results)}}}
    return body


def result(device: str, driver: str = DRIVER, **extra: object) -> dict[str, object]:
    return {"request": "gpus", "driver": driver, "pool": "node-a", "device": device, **extra}


async def test_every_allocation_result_is_returned_in_order(api: FakeApi, claims: ClaimReader) -> None:
    api.claims["team", "two-gpus"] = claim(
        result("gpu-3"), result("vf-1", driver="nic.plugvisor.io"), result("gpu-2", adminAccess=True)
    )

    devices = await claims.allocated_devices(namespace="team", name="two-gpus", uid=UID)

    assert devices == [
        AllocatedDevice("gpus", DRIVER, "node-a", "gpu-3"),
        AllocatedDevice("gpus", "nic.plugvisor.io", "node-a", "vf-1"),
        AllocatedDevice("gpus", DRIVER, "node-a", "gpu-2", admin_access=True),
    ]


@pytest.mark.parametrize(
    ("stored", "message"),
    [
        (None, "resourceclaim team/two-gpus: not found (deleted?)"),
        (claim(), "resourceclaim team/two-gpus: not allocated"),
        (
            claim(result("gpu-0"), uid="ffffffff-1111-4222-8333-444455556666"),
            f"resourceclaim team/two-gpus: UID ffffffff-1111-4222-8333-444455556666 is not the {UID} "
            "the kubelet asked for: the claim was replaced",
        ),
    ],
    ids=["deleted", "not-allocated", "replaced"],
)
async def test_a_claim_that_cannot_be_prepared_is_refused_saying_why(
    api: FakeApi, claims: ClaimReader, stored: dict[str, object] | None, message: str
) -> None:
    if stored is not None:
        api.claims["team", "two-gpus"] = stored

    with pytest.raises(ClaimError) as raised:
        await claims.allocated_devices(namespace="team", name="two-gpus", uid=UID)

    assert str(raised.value) == message
    assert raised.value.retriable is False


async def test_an_unreachable_api_server_is_a_retriable_refusal(api: FakeApi, claims: ClaimReader) -> None:
    api.down = True

    with pytest.raises(ClaimError) as raised:
        await claims.allocated_devices(namespace="team", name="two-gpus", uid=UID)

    assert str(raised.value).startswith(
        "resourceclaim team/two-gpus: the API server did not answer: ConnectError"
    )
    assert raised.value.retriable is True
    assert len(api.requests) > 1  # tried more than once before giving up
