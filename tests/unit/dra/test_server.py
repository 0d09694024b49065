"""The DRAPlugin and DRAResourceHealth servicer, called directly: per-claim answers, every version alike."""

import asyncio

import pytest
import structlog.testing

from plugvisor.api.dra.v1 import api_pb2 as dra_v1
from plugvisor.api.dra.v1beta1 import api_pb2 as dra_v1beta1
from plugvisor.api.drahealth.v1 import api_pb2 as health_v1
from plugvisor.api.drahealth.v1alpha1 import api_pb2 as health_v1alpha1
from plugvisor.deviceplugin.cell import SnapshotCell
from plugvisor.deviceplugin.devices import Device, DeviceSpec, Health
from plugvisor.deviceplugin.hooks import Hooks
from plugvisor.deviceplugin.snapshot import Snapshot
from plugvisor.dra.checkpoint import Checkpoint
from plugvisor.dra.cluster import AllocatedDevice, ClaimError
from plugvisor.dra.pool import build_pool
from plugvisor.dra.preparer import ClaimPreparer
from plugvisor.dra.server import DraServer

DRIVER = "gpu.example.com"


class Context:
    def __init__(self, remaining=None):
        self.remaining = remaining

    def time_remaining(self):
        return self.remaining


class Claims:
    def __init__(self):
        self.results = {}

    async def allocated_devices(self, *, namespace, name, uid):
        if name == "explodes":
            raise RuntimeError("a bug in the reader")
        if name not in self.results:
            raise ClaimError(f'resourceclaims "{name}" not found')
        return self.results[name]


def snapshot(*devices):
    return Snapshot(devices)


@pytest.fixture
def server(tmp_path):
    pools = SnapshotCell(
        build_pool(
            snapshot(
                Device("GPU-0", specs=[DeviceSpec("/dev/n0", "/h/dev/n0")]),
                Device("GPU-1", health=Health.UNHEALTHY, specs=[DeviceSpec("/dev/n1", "/h/dev/n1")]),
            ),
            None,
            driver=DRIVER,
        )
    )
    claims = Claims()
    claims.results["good"] = [AllocatedDevice("gpus", DRIVER, "node-1", "gpu-0")]
    preparer = ClaimPreparer(
        driver=DRIVER,
        pool_name="node-1",
        pools=pools,
        hooks=Hooks(),
        claims=claims,
        checkpoint=Checkpoint(tmp_path / "c.json", driver=DRIVER),
        cdi_dir=tmp_path / "cdi",
    )
    return DraServer(preparer, pools, causes=lambda: {"gpu-1": "AER fatal errors: 1"}, health_interval=0.01)


def claim(name, uid):
    return dra_v1.Claim(namespace="default", name=name, uid=uid)


class TestPrepare:
    async def test_each_claim_gets_its_own_answer_and_a_bad_one_fails_only_itself(self, server):
        request = dra_v1.NodePrepareResourcesRequest(
            claims=[claim("good", "u1"), claim("missing", "u2"), claim("explodes", "u3")]
        )
        response = await server.NodePrepareResources(request, Context())
        assert set(response.claims) == {"u1", "u2", "u3"}
        good = response.claims["u1"]
        assert good.error == ""
        assert [(d.pool_name, d.device_name, list(d.request_names)) for d in good.devices] == [
            ("node-1", "gpu-0", ["gpus"])
        ]
        assert list(good.devices[0].cdi_device_ids) == ["k8s.gpu.example.com/claim=u1-gpus"]
        assert (
            response.claims["u2"].error
            == 'claim default/missing (uid u2): resourceclaims "missing" not found'
        )
        assert response.claims["u3"].error.startswith(
            "claim default/explodes (uid u3): cannot read its allocation"
        )

    async def test_a_claim_listed_twice_is_prepared_once(self, server):
        request = dra_v1.NodePrepareResourcesRequest(claims=[claim("good", "u1"), claim("good", "u1")])
        response = await server.NodePrepareResources(request, Context(remaining=10.0))
        assert list(response.claims) == ["u1"] and response.claims["u1"].error == ""

    async def test_an_empty_request_gets_an_empty_answer(self, server):
        response = await server.NodePrepareResources(dra_v1.NodePrepareResourcesRequest(), Context())
        assert not response.claims

    async def test_unprepare_answers_every_claim_known_or_not(self, server):
        await server.NodePrepareResources(
            dra_v1.NodePrepareResourcesRequest(claims=[claim("good", "u1")]), Context()
        )
        request = dra_v1.NodeUnprepareResourcesRequest(claims=[claim("good", "u1"), claim("never", "u9")])
        response = await server.NodeUnprepareResources(request, Context())
        assert {uid: answer.error for uid, answer in response.claims.items()} == {"u1": "", "u9": ""}
        assert server.preparer.prepared == {}


class TestInputFromOutside:
    @pytest.mark.parametrize(
        "field", ["namespace", "name", "uid"], ids=["1MB-namespace", "1MB-name", "1MB-uid"]
    )
    async def test_a_megabyte_reference_gives_a_short_escaped_answer_and_log_line(self, server, field):
        parts = {"namespace": "default", "name": "good", "uid": "u1", field: "\x1b[2J" + "x" * (1 << 20)}
        request = dra_v1.NodePrepareResourcesRequest(claims=[dra_v1.Claim(**parts)])
        with structlog.testing.capture_logs() as logs:
            response = await server.NodePrepareResources(request, Context())
        (answer,) = response.claims.values()
        assert answer.error and len(answer.error) < 1000 and "\x1b" not in answer.error
        assert f"({(1 << 20) + 4} characters)" in answer.error
        (line,) = [entry for entry in logs if entry["event"] == "claim_not_prepared"]
        assert len(line["claim"]) < 1000 and "\x1b" not in line["claim"]


class TestVersions:
    async def test_a_v1_answer_is_a_valid_v1beta1_answer_field_for_field(self, server):
        request = dra_v1.NodePrepareResourcesRequest(claims=[claim("good", "u1")])
        v1 = await server.NodePrepareResources(request, Context())
        beta = dra_v1beta1.NodePrepareResourcesResponse.FromString(v1.SerializeToString())
        assert beta.claims["u1"].devices[0].device_name == "gpu-0"
        assert beta.claims["u1"].devices[0].cdi_device_ids == v1.claims["u1"].devices[0].cdi_device_ids

    def test_every_version_is_served_under_its_own_service_name(self, server):
        services = set()
        for handler in server.handlers():
            services.add(handler.service_name())
        assert services == {
            "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin",
            "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin",
            "v1.DRAResourceHealth",
            "v1alpha1.DRAResourceHealth",
        }


class TestHealth:
    async def test_every_device_is_reported_with_its_health_and_cause(self, server):
        message = server.health_message(server._pools.value)
        reported = {
            d.device.device_name: (d.device.pool_name, d.health, d.message, d.health_check_timeout_seconds)
            for d in message.devices
        }
        assert reported == {
            "gpu-0": ("node-1", health_v1.HEALTHY, "", 30),
            "gpu-1": ("node-1", health_v1.UNHEALTHY, "AER fatal errors: 1", 30),
        }
        assert all(d.last_updated_time > 0 for d in message.devices)
        alpha = health_v1alpha1.NodeWatchResourcesResponse.FromString(message.SerializeToString())
        assert alpha.devices[1].health == health_v1alpha1.UNHEALTHY

    async def test_the_stream_sends_at_once_after_a_change_and_again_before_the_kubelet_forgets(self, server):
        stream = server.NodeWatchResources(health_v1.NodeWatchResourcesRequest(), Context())
        first = await anext(stream)
        assert len(first.devices) == 2
        refreshed = await asyncio.wait_for(anext(stream), 10)
        assert len(refreshed.devices) == 2
        server._pools.publish(build_pool(snapshot(Device("GPU-0")), None, driver=DRIVER))
        changed = await asyncio.wait_for(anext(stream), 10)
        while len(changed.devices) != 1:  # a refresh may come first
            changed = await asyncio.wait_for(anext(stream), 10)
        assert server.open_health_streams == 1
        server._pools.close()
        with pytest.raises(StopAsyncIteration):
            while True:
                await asyncio.wait_for(anext(stream), 10)
        assert server.open_health_streams == 0
