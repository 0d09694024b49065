"""The slice publisher and the claim reader against a real kube-apiserver, as the deployment's RBAC allows.

The driver authenticates as a plain user bound to the ClusterRole of deploy/kubernetes/components/dra,
so these tests also show that role is enough (and what happens without it).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from lightkube import AsyncClient
from lightkube.resources.core_v1 import Namespace, Node
from lightkube.resources.rbac_authorization_v1 import ClusterRole, ClusterRoleBinding
from lightkube.resources.resource_v1 import ResourceClaim, ResourceClaimStatus, ResourceSlice
from structlog.testing import capture_logs

from plugvisor.dra.kube import connect
from plugvisor.dra.kube import slices as slices_module
from plugvisor.dra.kube.claims import AllocatedDevice, ClaimError, ClaimReader
from plugvisor.dra.kube.config import api_client
from plugvisor.dra.kube.slices import DeviceTaint, PublishedDevice, SemVer, SlicePublisher

from .conftest import ADMIN_TOKEN, DRIVER_TOKEN, DRIVER_USER, NOBODY_TOKEN, ApiServer, running_api_server

REPO = Path(__file__).resolve().parents[3]
DRIVER = "gpu.plugvisor.io"
WAIT = 60.0


def gpu(index: int, **extra: Any) -> PublishedDevice:
    attributes: dict[str, Any] = {
        "model": "H100",
        "index": index,
        "driverVersion": SemVer("550.54.15"),
        "healthy": True,
        "resource.kubernetes.io/pcieRoot": f"pci0000:{index // 4:02x}",
    }
    attributes.update(extra)
    return PublishedDevice(f"gpu-{index}", attributes=attributes, capacity={"memory": "1024Mi"})


async def pool(admin: AsyncClient, node: str) -> list[dict[str, Any]]:
    items = [s.to_dict() async for s in admin.list(ResourceSlice, fields={"spec.nodeName": node})]
    return sorted(items, key=lambda s: s["metadata"]["name"])


async def until(condition, timeout: float = WAIT) -> None:
    async with asyncio.timeout(timeout):
        while not await condition():
            await asyncio.sleep(0.05)


@pytest.fixture(scope="module")
def driver_role(apiserver: ApiServer) -> None:
    """The deployment's ClusterRole, bound to the driver's user (set up once, with the admin token)."""
    documents = list(yaml.safe_load_all((REPO / "deploy/kubernetes/components/dra/rbac.yaml").read_text()))
    role = next(doc for doc in documents if doc["kind"] == "ClusterRole")
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": "plugvisor-dra-test-user"},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": role["metadata"]["name"],
        },
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": DRIVER_USER}],
    }

    async def setup() -> None:
        admin = api_client(apiserver.config(ADMIN_TOKEN))
        await admin.create(ClusterRole.from_dict(role))
        await admin.create(ClusterRoleBinding.from_dict(binding))
        await admin.close()

    asyncio.run(setup())


@pytest.fixture
async def node(admin: AsyncClient) -> AsyncIterator[str]:
    """A Node object of its own per test (the slices' owner), deleted afterwards."""
    name = f"node-{uuid.uuid4().hex[:8]}"
    await admin.create(Node.from_dict({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}))
    yield name
    await admin.delete(Node, name)
    for item in await pool(admin, name):
        await admin.delete(ResourceSlice, item["metadata"]["name"])


@pytest.fixture
async def publisher(apiserver: ApiServer, driver_role: None, node: str) -> AsyncIterator[SlicePublisher]:
    client = api_client(apiserver.config(DRIVER_TOKEN))
    publisher = SlicePublisher(
        client,
        driver=DRIVER,
        node=node,
        resync_delay=0.2,
        backoff_initial=0.05,
        backoff_max=1.0,
        close_client=True,
    )
    yield publisher
    await publisher.close()


async def test_a_pool_split_in_two_is_accepted_and_owned_by_the_node(
    admin: AsyncClient, publisher: SlicePublisher, node: str
) -> None:
    await publisher.publish([gpu(i) for i in range(130)])
    assert await publisher.wait_synced(WAIT), publisher.state

    slices = await pool(admin, node)
    assert [len(s["spec"]["devices"]) for s in slices] == [128, 2]
    assert {(s["spec"]["pool"]["generation"], s["spec"]["pool"]["resourceSliceCount"]) for s in slices} == {
        (1, 2)
    }
    node_uid = (await admin.get(Node, node)).metadata.uid  # type: ignore[union-attr]
    assert {s["metadata"]["ownerReferences"][0]["uid"] for s in slices} == {node_uid}
    first = slices[0]["spec"]["devices"][0]
    assert first["attributes"]["driverVersion"] == {"version": "550.54.15"}
    assert first["capacity"]["memory"] == {"value": "1Gi"}  # the API server's canonical form of 1024Mi


async def test_a_restarted_driver_with_the_same_devices_writes_nothing(
    apiserver: ApiServer, admin: AsyncClient, publisher: SlicePublisher, node: str
) -> None:
    """The API server stores 1024Mi as 1Gi and adds fields of its own: none of that is a change, so a
    driver process that starts again with the same devices leaves its slices as they are."""
    await publisher.publish([gpu(i) for i in range(3)])
    assert await publisher.wait_synced(WAIT)
    before = [s["metadata"]["resourceVersion"] for s in await pool(admin, node)]
    await publisher.close()

    again = SlicePublisher(
        api_client(apiserver.config(DRIVER_TOKEN)), driver=DRIVER, node=node, close_client=True
    )
    try:
        await again.publish([gpu(i) for i in range(3)])
        assert await again.wait_synced(WAIT)
    finally:
        await again.close()

    assert [s["metadata"]["resourceVersion"] for s in await pool(admin, node)] == before


async def test_a_tainted_device_keeps_its_taint_and_its_time(
    admin: AsyncClient, publisher: SlicePublisher, node: str
) -> None:
    taint = DeviceTaint("plugvisor.io/unhealthy", "aer-fatal", "NoSchedule")
    sick = PublishedDevice("gpu-1", attributes={"index": 1}, capacity={}, taints=(taint,))
    await publisher.publish([gpu(0), sick])
    assert await publisher.wait_synced(WAIT)
    (stored,) = await pool(admin, node)

    await publisher.publish([gpu(0, model="H200"), sick])
    assert await publisher.wait_synced(WAIT)
    (updated,) = await pool(admin, node)

    assert publisher.taints_supported is True
    (kept,) = updated["spec"]["devices"][1]["taints"]
    assert (kept["key"], kept["value"], kept["effect"]) == (
        "plugvisor.io/unhealthy",
        "aer-fatal",
        "NoSchedule",
    )
    assert kept["timeAdded"] == stored["spec"]["devices"][1]["taints"][0]["timeAdded"]


async def test_slices_deleted_as_the_kubelet_does_at_start_come_back(
    admin: AsyncClient, publisher: SlicePublisher, node: str
) -> None:
    await publisher.publish([gpu(0), gpu(1)])
    assert await publisher.wait_synced(WAIT)

    for item in await pool(admin, node):
        await admin.delete(ResourceSlice, item["metadata"]["name"])

    async def back() -> bool:
        return [d["name"] for s in await pool(admin, node) for d in s["spec"]["devices"]] == [
            "gpu-0",
            "gpu-1",
        ]

    await until(back)


async def test_a_device_the_api_server_refuses_is_named_and_left_out(
    admin: AsyncClient, publisher: SlicePublisher, node: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With our own checks out of the way, the API server's refusal is read back to the device and field."""
    monkeypatch.setattr(slices_module, "checked_device", lambda device, driver: (device, []))
    bad = PublishedDevice("gpu-1", attributes={"not valid": 1}, capacity={})
    with capture_logs() as logs:
        await publisher.publish([gpu(0), bad, gpu(2)])
        assert await publisher.wait_synced(WAIT)

    assert [d["name"] for s in await pool(admin, node) for d in s["spec"]["devices"]] == ["gpu-0", "gpu-2"]
    (refusal,) = [e for e in logs if e["event"] == "resourceslice_refused"]
    assert refusal["devices"] == ["gpu-1"]
    assert "spec.devices[1].attributes" in refusal["error"]


async def test_connect_finds_the_api_server_through_kubeconfig(
    apiserver: ApiServer, admin: AsyncClient, driver_role: None, node: str, tmp_path: Path
) -> None:
    """What the driver entry calls: configuration from KUBECONFIG (a CA file, a token), then both halves."""
    env = {"KUBECONFIG": str(apiserver.kubeconfig(DRIVER_TOKEN, tmp_path / "kubeconfig"))}

    claims, publisher = await connect(driver=DRIVER, node_name=node, env=env)
    try:
        await publisher.publish([gpu(0)])
        assert await publisher.wait_synced(WAIT), publisher.state
    finally:
        await publisher.close()

    assert [d["name"] for s in await pool(admin, node) for d in s["spec"]["devices"]] == ["gpu-0"]
    assert isinstance(claims, ClaimReader)


async def test_withdraw_deletes_the_pool(admin: AsyncClient, publisher: SlicePublisher, node: str) -> None:
    await publisher.publish([gpu(i) for i in range(200)])
    assert await publisher.wait_synced(WAIT)

    await publisher.withdraw()

    assert await pool(admin, node) == []


async def test_without_the_role_the_failure_says_what_is_missing(apiserver: ApiServer, node: str) -> None:
    """A user the API server knows but the role is not bound to gets 403, said with a hint."""
    client = api_client(apiserver.config(NOBODY_TOKEN))
    publisher = SlicePublisher(client, driver=DRIVER, node=node, backoff_initial=0.05, close_client=True)
    try:
        await publisher.publish([gpu(0)])
        async with asyncio.timeout(WAIT):
            while publisher.state.error is None:
                await asyncio.sleep(0.05)
    finally:
        await publisher.close()
    assert "HTTP 403" in publisher.state.error  # type: ignore[operator]
    assert "RBAC" in publisher.state.error  # type: ignore[operator]


async def test_claims_are_read_with_their_allocation_and_refused_when_they_cannot_be_prepared(
    apiserver: ApiServer, admin: AsyncClient, driver_role: None
) -> None:
    namespace = f"team-{uuid.uuid4().hex[:6]}"
    await admin.create(
        Namespace.from_dict({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    )
    request = {
        "name": "gpus",
        "exactly": {"deviceClassName": DRIVER, "allocationMode": "ExactCount", "count": 2},
    }
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "pair", "namespace": namespace},
        "spec": {"devices": {"requests": [request]}},
    }
    created = await admin.create(ResourceClaim.from_dict(body))
    uid = str(created.metadata.uid)  # type: ignore[union-attr]
    client = api_client(apiserver.config(DRIVER_TOKEN))
    reader = ClaimReader(client, timeout=5.0)
    try:
        with pytest.raises(ClaimError, match="not allocated"):
            await reader.allocated_devices(namespace=namespace, name="pair", uid=uid)

        results = [
            {"request": "gpus", "driver": DRIVER, "pool": "node-a", "device": f"gpu-{i}"} for i in (2, 3)
        ]
        allocated = created.to_dict()
        allocated["status"] = {"allocation": {"devices": {"results": results}}}
        await admin.replace(ResourceClaimStatus.from_dict(allocated), "pair", namespace=namespace)
        devices = await reader.allocated_devices(namespace=namespace, name="pair", uid=uid)
        assert devices == [
            AllocatedDevice("gpus", DRIVER, "node-a", "gpu-2"),
            AllocatedDevice("gpus", DRIVER, "node-a", "gpu-3"),
        ]

        with pytest.raises(ClaimError, match="the claim was replaced"):
            await reader.allocated_devices(namespace=namespace, name="pair", uid=str(uuid.uuid4()))
        with pytest.raises(ClaimError, match="not found"):
            await reader.allocated_devices(namespace=namespace, name="other", uid=uid)
    finally:
        await client.close()
        await admin.delete(Namespace, namespace)


def test_where_the_cluster_drops_device_taints_a_tainted_device_is_withdrawn(tmp_path: Path) -> None:
    """An API server with DRADeviceTaints off (the default before 1.36) drops the field; the dry-run probe
    tells, and the tainted device leaves the pool instead (its own API server, so it comes last)."""

    async def scenario(server: ApiServer) -> tuple[bool | None, list[str], list[dict[str, Any]]]:
        admin = api_client(server.config(ADMIN_TOKEN))
        await admin.create(Node.from_dict({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}}))
        client = api_client(server.config(ADMIN_TOKEN))
        publisher = SlicePublisher(client, driver=DRIVER, node="n1", backoff_initial=0.05, close_client=True)
        sick = PublishedDevice(
            "gpu-1", attributes={}, capacity={}, taints=(DeviceTaint("k", "", "NoExecute"),)
        )
        with capture_logs() as logs:
            await publisher.publish([gpu(0), sick])
            assert await publisher.wait_synced(WAIT)
        stored = await pool(admin, "n1")
        await publisher.close()
        await admin.close()
        return publisher.taints_supported, [e["event"] for e in logs], stored

    with running_api_server(feature_gates="DRADeviceTaints=false,DRADeviceTaintRules=false") as server:
        supported, events, stored = asyncio.run(scenario(server))

    assert supported is False
    assert "device_taints_unsupported" in events
    assert [d["name"] for s in stored for d in s["spec"]["devices"]] == ["gpu-0"]
