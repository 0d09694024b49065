"""The slice publisher: one pool per node, split by the per-slice limit, new generations, repair, refusals."""

from __future__ import annotations

import asyncio

import pytest
from structlog.testing import capture_logs

from plugvisor.dra.devices import DeviceTaint, PublishedDevice, SemVer
from plugvisor.dra.kube.config import api_client
from plugvisor.dra.kube.slices import SlicePublisher, comparable, layout

from .conftest import DRIVER, NODE, fake_config
from .fakeapi import FakeApi

WAIT = 30.0  # generous: the machine may be loaded; nothing here depends on it being fast


def gpu(index: int, **attributes: object) -> PublishedDevice:
    attrs = {
        "model": "H100",
        "index": index,
        "healthy": True,
        "driverVersion": SemVer("550.54.15"),
        **attributes,
    }
    return PublishedDevice(f"gpu-{index}", attributes=attrs, capacity={"memory": "80Gi"})  # type: ignore[arg-type]


def writes(api: FakeApi) -> list[tuple[str, str]]:
    return [r for r in api.requests if r[0] in ("POST", "PUT", "DELETE")]


async def until(condition, timeout: float = WAIT) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.005)


async def test_a_pool_is_one_slice_per_node_owned_by_the_node(
    api: FakeApi, publisher: SlicePublisher
) -> None:
    await publisher.publish([gpu(0), gpu(1)])
    assert await publisher.wait_synced(WAIT)

    (item,) = api.pool(DRIVER, NODE)
    assert item["metadata"]["name"].startswith(f"00000-{DRIVER}-{NODE}-")
    assert item["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": api.nodes[NODE], "controller": True}
    ]
    spec = item["spec"]
    assert spec["driver"] == DRIVER and spec["nodeName"] == NODE
    assert spec["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 1}
    assert spec["devices"][0] == {
        "name": "gpu-0",
        "attributes": {
            "model": {"string": "H100"},
            "index": {"int": 0},
            "healthy": {"bool": True},
            "driverVersion": {"version": "550.54.15"},
        },
        "capacity": {"memory": {"value": "80Gi"}},
    }
    assert publisher.state.synced and publisher.state.devices == 2 and publisher.state.error is None


async def test_a_large_pool_is_split_in_order_with_the_slice_count_on_every_slice(
    api: FakeApi, publisher: SlicePublisher
) -> None:
    await publisher.publish([gpu(i) for i in range(300)])
    assert await publisher.wait_synced(WAIT)

    slices = api.pool(DRIVER, NODE)
    assert [len(s["spec"]["devices"]) for s in slices] == [128, 128, 44]
    assert [s["metadata"]["name"][:6] for s in slices] == ["00000-", "00001-", "00002-"]
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in slices} == {3}
    assert api.published(DRIVER, NODE) == [f"gpu-{i}" for i in range(300)]


def test_slices_with_tainted_devices_hold_at_most_64() -> None:
    plain = [{"name": f"d{i}"} for i in range(100)]
    tainted = [{"name": f"t{i}", "taints": [{"key": "k", "effect": "NoSchedule"}]} for i in range(70)]

    assert [len(chunk) for chunk in layout(plain)] == [100]
    assert [len(chunk) for chunk in layout(plain + tainted)] == [100, 64, 6]
    assert [len(chunk) for chunk in layout(tainted + plain)] == [64, 6 + 58, 42]
    assert layout([]) == [[]]


async def test_publishing_the_same_devices_again_writes_nothing(
    api: FakeApi, publisher: SlicePublisher
) -> None:
    await publisher.publish([gpu(0), gpu(1)])
    assert await publisher.wait_synced(WAIT)
    before = len(writes(api))

    await publisher.publish([gpu(0), gpu(1)])
    assert await publisher.wait_synced(WAIT)

    assert len(writes(api)) == before


async def test_a_change_within_one_slice_is_one_update_at_the_same_generation(
    api: FakeApi, publisher: SlicePublisher
) -> None:
    await publisher.publish([gpu(i) for i in range(200)])
    assert await publisher.wait_synced(WAIT)
    before = len(writes(api))

    await publisher.publish([gpu(i, model="H200" if i == 150 else "H100") for i in range(200)])
    assert await publisher.wait_synced(WAIT)

    assert [method for method, _ in writes(api)[before:]] == ["PUT"]
    assert {s["spec"]["pool"]["generation"] for s in api.pool(DRIVER, NODE)} == {1}


async def test_a_change_across_slices_bumps_the_generation_of_every_slice(
    api: FakeApi, publisher: SlicePublisher
) -> None:
    await publisher.publish([gpu(i) for i in range(200)])
    assert await publisher.wait_synced(WAIT)

    await publisher.publish([gpu(i, model="H200" if i in (0, 150) else "H100") for i in range(200)])
    assert await publisher.wait_synced(WAIT)

    assert {s["spec"]["pool"]["generation"] for s in api.pool(DRIVER, NODE)} == {2}
    assert publisher.state.generation == 2


async def test_growing_and_shrinking_the_pool_keeps_one_generation_and_the_right_count(
    api: FakeApi, publisher: SlicePublisher
) -> None:
    await publisher.publish([gpu(i) for i in range(100)])
    assert await publisher.wait_synced(WAIT)

    await publisher.publish([gpu(i) for i in range(130)])
    assert await publisher.wait_synced(WAIT)
    assert [
        (s["spec"]["pool"]["generation"], s["spec"]["pool"]["resourceSliceCount"])
        for s in api.pool(DRIVER, NODE)
    ] == [
        (2, 2),
        (2, 2),
    ]

    await publisher.publish([gpu(i) for i in range(3)])
    assert await publisher.wait_synced(WAIT)
    (item,) = api.pool(DRIVER, NODE)
    assert item["spec"]["pool"]["resourceSliceCount"] == 1
    assert api.published(DRIVER, NODE) == ["gpu-0", "gpu-1", "gpu-2"]


async def test_an_empty_pool_is_still_published(api: FakeApi, publisher: SlicePublisher) -> None:
    await publisher.publish([])
    assert await publisher.wait_synced(WAIT)

    (item,) = api.pool(DRIVER, NODE)
    assert item["spec"]["devices"] == [] and item["spec"]["pool"]["resourceSliceCount"] == 1


async def test_a_name_used_twice_is_published_once_and_named_once(
    api: FakeApi, publisher: SlicePublisher
) -> None:
    with capture_logs() as logs:
        await publisher.publish([gpu(1), gpu(1, model="A100")])
        await publisher.publish([gpu(1), gpu(1, model="A100"), gpu(2)])
        assert await publisher.wait_synced(WAIT)

    assert api.published(DRIVER, NODE) == ["gpu-1", "gpu-2"]
    assert api.pool(DRIVER, NODE)[0]["spec"]["devices"][0]["attributes"]["model"] == {"string": "H100"}
    problems = [entry["problem"] for entry in logs if entry["event"] == "device_invalid"]
    assert problems == ["device gpu-1: the name is used twice; the second is left out"]
    assert publisher.state.left_out == 1


async def test_an_attribute_named_with_and_without_the_drivers_domain_is_published_once(
    api: FakeApi, publisher: SlicePublisher
) -> None:
    device = PublishedDevice("gpu-0", attributes={"index": 0, f"{DRIVER}/index": 1, "other.io/index": 2})
    with capture_logs() as logs:
        await publisher.publish([device])
        assert await publisher.wait_synced(WAIT)

    (item,) = api.pool(DRIVER, NODE)
    assert item["spec"]["devices"] == [
        {"name": "gpu-0", "attributes": {f"{DRIVER}/index": {"int": 1}, "other.io/index": {"int": 2}}}
    ]
    problems = [entry["problem"] for entry in logs if entry["event"] == "device_invalid"]
    assert problems == [
        "device gpu-0: attributes[index]: named twice (with and without the driver's domain); "
        "attribute left out"
    ]


async def test_a_device_the_api_server_refuses_is_left_out_and_the_others_published(
    api: FakeApi, publisher: SlicePublisher
) -> None:
    def refuse(body):
        for index, device in enumerate(body["spec"]["devices"]):
            if device["name"] == "gpu-1":
                return [
                    {"field": f"spec.devices[{index}].attributes[model]", "message": "Invalid value: nope"}
                ]
        return None

    api.refuse = refuse
    with capture_logs() as logs:
        await publisher.publish([gpu(0), gpu(1), gpu(2)])
        assert await publisher.wait_synced(WAIT)

    assert api.published(DRIVER, NODE) == ["gpu-0", "gpu-2"]
    (refusal,) = [e for e in logs if e["event"] == "resourceslice_refused"]
    assert refusal["devices"] == ["gpu-1"]
    assert refusal["error"] == "spec.devices[1].attributes[model]: Invalid value: nope"
    assert publisher.state.left_out == 1


async def test_while_the_api_server_is_down_publishing_returns_and_the_latest_state_wins(
    api: FakeApi, publisher: SlicePublisher
) -> None:
    api.down = True
    with capture_logs() as logs:
        await publisher.publish([gpu(0)])
        await publisher.publish([gpu(0), gpu(1)])
        await until(lambda: any(e["event"] == "slices_publish_retry" for e in logs))
        await publisher.publish([gpu(5)])
        assert not publisher.state.synced and "ConnectError" in (publisher.state.error or "")
        api.down = False
        assert await publisher.wait_synced(WAIT)

    assert api.published(DRIVER, NODE) == ["gpu-5"]
    assert len([r for r in writes(api) if r[0] == "POST"]) == 1
    assert any(e["event"] == "slices_publish_recovered" for e in logs)


async def test_server_errors_and_conflicts_are_retried(api: FakeApi, publisher: SlicePublisher) -> None:
    await publisher.publish([gpu(0)])
    assert await publisher.wait_synced(WAIT)

    api.fail = [500, 409, 429]
    await publisher.publish([gpu(0, model="H200")])
    assert await publisher.wait_synced(WAIT)

    (item,) = api.pool(DRIVER, NODE)
    assert item["spec"]["devices"][0]["attributes"]["model"] == {"string": "H200"}


async def test_slices_deleted_by_someone_else_come_back(api: FakeApi, publisher: SlicePublisher) -> None:
    await publisher.publish([gpu(0), gpu(1)])
    assert await publisher.wait_synced(WAIT)

    api.delete_all()  # as the kubelet does when it starts

    await until(lambda: api.published(DRIVER, NODE) == ["gpu-0", "gpu-1"])


async def test_a_held_publisher_leaves_slices_deleted_by_someone_else_until_it_publishes_again(
    api: FakeApi, publisher: SlicePublisher
) -> None:
    """The driver lost its registration: what the kubelet removes meanwhile stays removed until it is back."""
    await publisher.publish([gpu(0), gpu(1)])
    assert await publisher.wait_synced(WAIT)
    publisher.hold()

    api.delete_all()  # the kubelet, 30 s after it deregistered the driver
    # Absence can only be watched for a while: many times the repair's delay (the fixture's 0.01 s).
    await asyncio.sleep(0.3)
    assert api.pool(DRIVER, NODE) == []

    await publisher.publish([gpu(0), gpu(1)])  # registered again, the same devices
    await until(lambda: api.published(DRIVER, NODE) == ["gpu-0", "gpu-1"])


async def test_after_a_hold_the_same_devices_published_again_are_written_back_where_they_went_missing(
    api: FakeApi, publisher: SlicePublisher
) -> None:
    await publisher.publish([gpu(0)])
    assert await publisher.wait_synced(WAIT)
    publisher.hold()  # the driver lost its registration: no repair, only the publish below
    api.delete_all()

    await publisher.publish([gpu(0)])

    await until(lambda: api.published(DRIVER, NODE) == ["gpu-0"])
    assert api.pool(DRIVER, NODE)[0]["spec"]["pool"]["generation"] == 1


@pytest.fixture
async def watching(api: FakeApi, tmp_path):
    """A publisher told where kubelet.sock is (a plain file stands for it), and that file."""
    kubelet = tmp_path / "kubelet.sock"
    kubelet.touch()
    client = api_client(fake_config(), transport=api.transport)
    publisher = SlicePublisher(client, driver=DRIVER, node=NODE, resync_delay=0.01, kubelet_socket=kubelet)
    yield publisher, kubelet
    await publisher.close()
    await client.close()


async def test_slices_a_restarted_kubelet_deleted_wait_for_the_drivers_next_publish(
    api: FakeApi, watching
) -> None:
    """A repair would offer the devices before the new kubelet registered the driver."""
    publisher, kubelet = watching
    await publisher.publish([gpu(0)])
    assert await publisher.wait_synced(WAIT)

    started = kubelet.with_name("new")
    started.touch()
    started.replace(kubelet)  # the new kubelet's socket, another file
    with capture_logs() as logs:
        api.delete_all()  # what it does as it starts
        await until(lambda: any(e["event"] == "kubelet_restarted" for e in logs))
    assert api.pool(DRIVER, NODE) == []  # held: no repair can come now

    await publisher.publish([gpu(0)])  # the new kubelet registered the driver
    await until(lambda: api.published(DRIVER, NODE) == ["gpu-0"])


async def test_slices_deleted_under_the_same_kubelet_come_back(api: FakeApi, watching) -> None:
    publisher, _ = watching
    await publisher.publish([gpu(0)])
    assert await publisher.wait_synced(WAIT)

    api.delete_all()

    await until(lambda: api.published(DRIVER, NODE) == ["gpu-0"])


async def test_a_missing_node_is_retried_and_said(api: FakeApi, publisher: SlicePublisher) -> None:
    uid = api.nodes.pop(NODE)
    with capture_logs() as logs:
        await publisher.publish([gpu(0)])
        await until(lambda: any(e["event"] == "slices_publish_retry" for e in logs))
        api.nodes[NODE] = uid
        assert await publisher.wait_synced(WAIT)

    retry = next(e for e in logs if e["event"] == "slices_publish_retry")
    assert retry["error"] == f"node {NODE} does not exist (is NODE_NAME right?)"


async def test_taints_are_published_where_the_cluster_keeps_them(
    api: FakeApi, publisher: SlicePublisher
) -> None:
    sick = PublishedDevice(
        "gpu-1",
        attributes={},
        capacity={},
        taints=(DeviceTaint("plugvisor.io/unhealthy", "aer-fatal", "NoSchedule"),),
    )
    await publisher.publish([gpu(0), sick])
    assert await publisher.wait_synced(WAIT)

    assert publisher.taints_supported is True
    assert api.published(DRIVER, NODE) == ["gpu-0", "gpu-1"]
    taints = api.pool(DRIVER, NODE)[0]["spec"]["devices"][1]["taints"]
    assert [(t["key"], t["value"], t["effect"]) for t in taints] == [
        ("plugvisor.io/unhealthy", "aer-fatal", "NoSchedule")
    ]


async def test_tainted_devices_are_withdrawn_where_the_cluster_drops_taints(
    api: FakeApi, publisher: SlicePublisher
) -> None:
    api.taints_supported = False
    sick = PublishedDevice(
        "gpu-1", attributes={}, capacity={}, taints=(DeviceTaint("plugvisor.io/unhealthy", "", "NoExecute"),)
    )
    noted = PublishedDevice(
        "gpu-2", attributes={}, capacity={}, taints=(DeviceTaint("plugvisor.io/note", "", "None"),)
    )
    with capture_logs() as logs:
        await publisher.publish([gpu(0), sick, noted])
        assert await publisher.wait_synced(WAIT)

    assert publisher.taints_supported is False
    assert api.published(DRIVER, NODE) == ["gpu-0", "gpu-2"]
    assert "taints" not in api.pool(DRIVER, NODE)[0]["spec"]["devices"][1]
    assert any(e["event"] == "device_taints_unsupported" for e in logs)
    assert publisher.state.left_out == 1

    await publisher.publish([gpu(0), PublishedDevice("gpu-1", attributes={}, capacity={}), noted])
    assert await publisher.wait_synced(WAIT)
    assert api.published(DRIVER, NODE) == ["gpu-0", "gpu-1", "gpu-2"]


async def test_withdraw_deletes_the_nodes_slices_of_the_driver_only(
    api: FakeApi, publisher: SlicePublisher
) -> None:
    await publisher.publish([gpu(i) for i in range(200)])
    assert await publisher.wait_synced(WAIT)
    other = {
        "metadata": {"name": "other"},
        "spec": {"driver": "nic.plugvisor.io", "nodeName": NODE, "pool": {}},
    }
    api.slices["other"] = other

    await publisher.withdraw()

    assert api.pool(DRIVER, NODE) == []
    assert list(api.slices) == ["other"]
    with pytest.raises(RuntimeError, match="closed"):
        await publisher.publish([gpu(0)])


def test_capacities_compare_by_value_and_taints_without_their_time() -> None:
    stored = {
        "name": "d",
        "capacity": {"memory": {"value": "1Gi"}},
        "taints": [{"key": "k", "effect": "NoSchedule", "timeAdded": "2026-01-01T00:00:00Z"}],
    }
    ours = {
        "name": "d",
        "capacity": {"memory": {"value": "1024Mi"}},
        "taints": [{"key": "k", "effect": "NoSchedule"}],
    }

    assert comparable(stored) == comparable(ours)
    assert comparable({**ours, "capacity": {"memory": {"value": "1025Mi"}}}) != comparable(stored)


async def test_slices_collected_with_a_node_made_anew_come_back_owned_by_the_new_node(
    api: FakeApi, publisher: SlicePublisher
) -> None:
    await publisher.publish([gpu(0)])
    assert await publisher.wait_synced(WAIT)

    api.nodes[NODE] = "6d1f7c1e-0000-4000-8000-000000000002"  # the Node deleted and registered again
    api.delete_all()  # the garbage collector takes the slices of the old one

    def owned_by_the_new_node() -> bool:
        slices = api.pool(DRIVER, NODE)
        return bool(slices) and slices[0]["metadata"]["ownerReferences"][0]["uid"] == api.nodes[NODE]

    await until(owned_by_the_new_node)


async def test_a_gpus_xid_taint_comes_and_goes_with_the_device_kept_in_the_slice(
    api: FakeApi, publisher: SlicePublisher
) -> None:
    xid = PublishedDevice(
        "gpu-1", attributes={}, capacity={}, taints=(DeviceTaint("gpu.plugvisor.io/xid", "79"),)
    )
    await publisher.publish([gpu(0), xid])
    assert await publisher.wait_synced(WAIT)
    assert api.pool(DRIVER, NODE)[0]["spec"]["devices"][1]["taints"][0]["key"] == "gpu.plugvisor.io/xid"

    await publisher.publish([gpu(0), PublishedDevice("gpu-1", attributes={}, capacity={})])
    assert await publisher.wait_synced(WAIT)
    assert api.published(DRIVER, NODE) == ["gpu-0", "gpu-1"]
    assert "taints" not in api.pool(DRIVER, NODE)[0]["spec"]["devices"][1]
