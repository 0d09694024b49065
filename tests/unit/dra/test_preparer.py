"""Preparing and unpreparing claims: idempotent, per-claim errors, and nothing prepared ever lost."""

import json
from pathlib import Path

import pytest

from plugvisor.deviceplugin.cell import SnapshotCell
from plugvisor.deviceplugin.devices import Device, DeviceSpec, Health
from plugvisor.deviceplugin.hooks import ContainerAllocation, Hooks
from plugvisor.deviceplugin.snapshot import Snapshot
from plugvisor.dra import cdi
from plugvisor.dra.checkpoint import Checkpoint
from plugvisor.dra.cluster import AllocatedDevice, ClaimError, ClaimRef
from plugvisor.dra.pool import build_pool
from plugvisor.dra.preparer import ClaimPreparer, PrepareError, base_request

DRIVER = "gpu.example.com"
NODE = "node-1"
BUDGET = 30.0


def gpu(index, health=Health.HEALTHY):
    return Device(
        f"GPU-{index}",
        health=health,
        specs=[DeviceSpec(f"/dev/nvidia{index}", f"/host/dev/nvidia{index}")],
        envs={"NVIDIA_VISIBLE_DEVICES": f"GPU-{index}"},
    )


class Claims:
    """The API server's claims: (namespace, name) -> (uid, allocation), or an error to raise."""

    def __init__(self):
        self.claims = {}
        self.reads = 0
        self.error = None

    def allocate(self, claim, *devices, driver=DRIVER, pool=NODE, request="gpus", admin=False):
        self.claims[(claim.namespace, claim.name)] = (
            claim.uid,
            [AllocatedDevice(request, driver, pool, device, admin) for device in devices],
        )

    async def allocated_devices(self, *, namespace, name, uid):
        self.reads += 1
        if self.error is not None:
            raise self.error
        if (namespace, name) not in self.claims:
            raise ClaimError(f'resourceclaims "{name}" not found')
        found, results = self.claims[(namespace, name)]
        if found != uid:
            raise ClaimError(f"{namespace}/{name} now has UID {found}, not {uid}")
        return results


class Kind:
    """A kind's hooks, recording what they were called with."""

    def __init__(self):
        self.reset, self.scrubbed, self.deallocated = [], [], []
        self.fail = None

    def pre_start_container(self, snapshot):
        if self.fail == "reset":
            raise RuntimeError("the reset failed")
        self.reset.append(list(snapshot.devices))

    def post_allocate(self, allocation, snapshot):
        return ContainerAllocation(
            specs=allocation.specs, envs={**allocation.envs, "COUNT": str(len(snapshot.devices))}
        )

    def release_watch(self):
        return None

    def released(self, snapshot):
        if self.fail == "release":
            raise RuntimeError("scrub failed")
        self.scrubbed.append(list(snapshot.devices))

    def deallocate(self, snapshot):
        self.deallocated.append(list(snapshot.devices))


def make_node(cdi_dir, driver_dir):
    class Node:
        claims = Claims()
        kind = Kind()
        checkpoint = Checkpoint(driver_dir / "prepared-claims.json", driver=DRIVER)
        pools = SnapshotCell(
            build_pool(Snapshot([gpu(0), gpu(1), gpu(2, Health.UNHEALTHY)]), None, driver=DRIVER)
        )

        def preparer(self, hooks=None):
            """A driver process: a new one reads the checkpoint back, as a restarted driver does."""
            return ClaimPreparer(
                driver=DRIVER,
                pool_name=NODE,
                pools=self.pools,
                hooks=hooks
                if hooks is not None
                else Hooks(pre_start=self.kind, post_allocate=self.kind, release=self.kind),
                claims=self.claims,
                checkpoint=self.checkpoint,
                cdi_dir=self.cdi_dir,
                prepared=self.checkpoint.load(),
            )

        def spec(self, uid):
            return self.cdi_dir / cdi.spec_file_name(DRIVER, uid)

    Node.cdi_dir = cdi_dir
    return Node()


@pytest.fixture
def node(tmp_path):
    return make_node(tmp_path / "cdi", tmp_path / "plugins" / DRIVER)


CLAIM = ClaimRef("default", "two-gpus", "uid-1")
OTHER = ClaimRef("default", "one-gpu", "uid-2")


class TestPrepare:
    async def test_a_claim_gets_one_spec_with_its_edits_and_its_cdi_ids(self, node):
        node.claims.allocate(CLAIM, "gpu-0", "gpu-1")
        prepared = await node.preparer().prepare(CLAIM, budget=BUDGET)
        assert [(d.device, d.device_id, d.cdi_device_ids) for d in prepared.devices] == [
            ("gpu-0", "GPU-0", ("k8s.gpu.example.com/claim=uid-1-gpus",)),
            ("gpu-1", "GPU-1", ()),
        ]
        spec = json.loads(node.spec("uid-1").read_text())
        (device,) = spec["devices"]
        assert device["containerEdits"]["env"] == ["COUNT=2", "NVIDIA_VISIBLE_DEVICES=GPU-0,GPU-1"]
        assert [n["path"] for n in device["containerEdits"]["deviceNodes"]] == [
            "/dev/nvidia0",
            "/dev/nvidia1",
        ]
        assert node.kind.reset == [["GPU-0", "GPU-1"]]
        assert node.checkpoint.load() == {"uid-1": prepared}

    async def test_preparing_again_answers_the_same_and_does_nothing_again(self, node):
        node.claims.allocate(CLAIM, "gpu-0")
        preparer = node.preparer()
        first = await preparer.prepare(CLAIM, budget=BUDGET)
        again = await preparer.prepare(CLAIM, budget=BUDGET)
        assert again == first
        assert node.kind.reset == [["GPU-0"]]

    async def test_a_restarted_driver_answers_the_same_from_its_checkpoint(self, node):
        node.claims.allocate(CLAIM, "gpu-0")
        first = await node.preparer().prepare(CLAIM, budget=BUDGET)
        assert await node.preparer().prepare(CLAIM, budget=BUDGET) == first
        assert len(node.kind.reset) == 1

    async def test_a_spec_the_cdi_directory_lost_is_written_again(self, node):
        node.claims.allocate(CLAIM, "gpu-0")
        preparer = node.preparer()
        await preparer.prepare(CLAIM, budget=BUDGET)
        written = node.spec("uid-1").read_bytes()
        node.spec("uid-1").unlink()
        await preparer.prepare(CLAIM, budget=BUDGET)
        assert node.spec("uid-1").read_bytes() == written

    async def test_requests_get_a_cdi_device_each_and_sub_requests_count_as_their_request(self, node):
        node.claims.claims[("default", "two-gpus")] = (
            "uid-1",
            [AllocatedDevice("a/big", DRIVER, NODE, "gpu-0"), AllocatedDevice("b", DRIVER, NODE, "gpu-1")],
        )
        prepared = await node.preparer().prepare(CLAIM, budget=BUDGET)
        assert [(d.request_names, d.cdi_device_ids) for d in prepared.devices] == [
            (("a",), ("k8s.gpu.example.com/claim=uid-1-a",)),
            (("b",), ("k8s.gpu.example.com/claim=uid-1-b",)),
        ]

    async def test_another_drivers_devices_in_the_claim_are_left_to_it(self, node):
        node.claims.claims[("default", "two-gpus")] = (
            "uid-1",
            [
                AllocatedDevice("g", DRIVER, NODE, "gpu-0"),
                AllocatedDevice("n", "nic.example.com", NODE, "vf-0"),
            ],
        )
        prepared = await node.preparer().prepare(CLAIM, budget=BUDGET)
        assert prepared.device_names == ("gpu-0",)

    def test_a_sub_request_belongs_to_its_request(self):
        assert (base_request("gpus/big"), base_request("gpus")) == ("gpus", "gpus")


class TestPrepareRefusals:
    """Each refusal is the claim's error, naming the claim; nothing is written or recorded."""

    async def refused(self, node, claim=CLAIM, preparer=None):
        with pytest.raises(PrepareError) as refusal:
            await (preparer or node.preparer()).prepare(claim, budget=BUDGET)
        message = str(refusal.value)
        assert message.startswith(f"claim {claim.namespace}/{claim.name} (uid {claim.uid}): ")
        return message

    async def test_devices_this_node_does_not_have(self, node):
        node.claims.allocate(CLAIM, "gpu-0", "gpu-7")
        assert '["gpu-7"] are not devices of driver gpu.example.com on this node' in await self.refused(node)
        assert not node.cdi_dir.exists() and node.checkpoint.load() == {}

    async def test_devices_of_another_nodes_pool(self, node):
        node.claims.allocate(CLAIM, "gpu-0", pool="node-2")
        assert "not in this node's pool 'node-1'" in await self.refused(node)

    async def test_an_unhealthy_device(self, node):
        node.claims.allocate(CLAIM, "gpu-2")
        assert '["gpu-2"] are unhealthy' in await self.refused(node)

    async def test_a_device_named_twice(self, node):
        node.claims.allocate(CLAIM, "gpu-0", "gpu-0")
        assert 'names a device more than once: ["gpu-0" 2 times]' in await self.refused(node)

    async def test_a_device_named_ten_thousand_times_is_counted_right(self, node):
        node.claims.allocate(CLAIM, *["gpu-0"] * 10_000, "gpu-1", "gpu-1")
        message = await self.refused(node)
        assert 'names a device more than once: ["gpu-0" 10000 times, "gpu-1" 2 times]' in message
        assert "more" not in message.partition("once")[2]

    @pytest.mark.parametrize(
        "request_name",
        [
            "a b\x00c",
            "../../x",
            "x" * (1 << 20),
            "Gpus",
            "gpus/",
            "/big",
            "gpus/big/x",
            "",
            "-gpus",
            "g" * 64,
        ],
        ids=[
            "nul-space",
            "escaping",
            "1MB",
            "uppercase",
            "empty-sub",
            "empty-base",
            "two-slashes",
            "empty",
            "leading-dash",
            "64-chars",
        ],
    )
    async def test_a_request_name_no_api_server_makes_prepares_nothing(self, node, request_name):
        node.claims.allocate(CLAIM, "gpu-0", request=request_name)
        message = await self.refused(node)
        assert "request name" in message and "DNS label" in message
        assert len(message) < 600 and "\x00" not in message
        assert not node.cdi_dir.exists() and node.checkpoint.load() == {}

    async def test_a_request_name_of_63_characters_and_a_sub_request_prepare(self, node):
        node.claims.allocate(CLAIM, "gpu-0", request=f"{'g' * 63}/{'b' * 63}")
        prepared = await node.preparer().prepare(CLAIM, budget=BUDGET)
        assert prepared.devices[0].request_names == ("g" * 63,)

    async def test_no_device_of_this_driver(self, node):
        node.claims.allocate(CLAIM, "vf-0", driver="nic.example.com")
        assert "has no device of driver gpu.example.com" in await self.refused(node)

    async def test_a_claim_already_prepared_with_other_devices(self, node):
        node.claims.allocate(CLAIM, "gpu-0")
        preparer = node.preparer()
        await preparer.prepare(CLAIM, budget=BUDGET)
        node.claims.allocate(CLAIM, "gpu-1")
        message = await self.refused(node, preparer=preparer)
        assert 'already prepared with devices ["gpu-0"], but its allocation now names ["gpu-1"]' in message
        assert preparer.prepared["uid-1"].device_names == ("gpu-0",)

    async def test_a_device_already_prepared_for_another_claim(self, node):
        node.claims.allocate(CLAIM, "gpu-0")
        node.claims.allocate(OTHER, "gpu-0")
        preparer = node.preparer()
        await preparer.prepare(CLAIM, budget=BUDGET)
        assert "device 'gpu-0' is already prepared for claim default/two-gpus" in await self.refused(
            node, OTHER, preparer
        )

    async def test_a_device_renamed_since_its_claim_was_prepared_is_still_that_claims(self, node):
        node.pools.publish(build_pool(Snapshot([Device("AB-1")]), None, driver=DRIVER))
        node.claims.allocate(CLAIM, "ab-1")
        preparer = node.preparer(hooks=Hooks())
        await preparer.prepare(CLAIM, budget=BUDGET)
        # A look-alike appears, and a pool built without the prepared names renames the device.
        node.pools.publish(build_pool(Snapshot([Device("AB-1"), Device("ab_1")]), None, driver=DRIVER))
        renamed = node.pools.value.names["AB-1"]
        node.claims.allocate(OTHER, renamed)
        message = await self.refused(node, OTHER, preparer)
        assert f"device '{renamed}' is already prepared for claim default/two-gpus" in message

    async def test_admin_access_shares_a_device_with_its_claim(self, node):
        node.claims.allocate(CLAIM, "gpu-0")
        node.claims.allocate(OTHER, "gpu-0", admin=True)
        preparer = node.preparer()
        await preparer.prepare(CLAIM, budget=BUDGET)
        assert (await preparer.prepare(OTHER, budget=BUDGET)).devices[0].admin_access

    async def test_a_claim_the_api_server_does_not_have(self, node):
        assert 'resourceclaims "two-gpus" not found' in await self.refused(node)

    async def test_a_newer_claim_of_that_name(self, node):
        node.claims.allocate(ClaimRef("default", "two-gpus", "uid-9"), "gpu-0")
        assert "now has UID uid-9, not uid-1" in await self.refused(node)

    async def test_an_api_server_that_fails(self, node):
        node.claims.error = ConnectionRefusedError("connection refused")
        assert "cannot read its allocation: connection refused" in await self.refused(node)

    async def test_a_kubelet_request_without_a_uid(self, node):
        with pytest.raises(PrepareError, match="the kubelet's request has no uid"):
            await node.preparer().prepare(ClaimRef("default", "x", ""), budget=BUDGET)

    @pytest.mark.parametrize(
        ("namespace", "name", "uid"),
        [
            ("default", "c", "x/../../../../escaped"),
            ("default", "c", ".."),
            ("default", "c", "\u00fc-\n"),
            ("default", "c", "a" * 300),
            ("default", "../c", "uid-3"),
            ("de/fault", "c", "uid-3"),
        ],
    )
    async def test_a_claim_reference_no_api_server_makes_touches_no_file(self, node, namespace, name, uid):
        claim = ClaimRef(namespace, name, uid)
        node.claims.allocate(claim, "gpu-0")
        preparer = node.preparer()
        with pytest.raises(PrepareError) as refusal:
            await preparer.prepare(claim, budget=BUDGET)
        assert "the kubelet's request is invalid" in str(refusal.value)
        assert "\n" not in str(refusal.value)
        assert not node.cdi_dir.exists() and node.checkpoint.load() == {}

    async def test_unprepare_of_a_uid_that_leaves_the_cdi_directory_removes_nothing(self, node, tmp_path):
        (node.cdi_dir / f"{cdi.vendor(DRIVER)}-claim_x").mkdir(parents=True)
        outside = tmp_path / "precious.json"
        outside.write_text("{}")
        with pytest.raises(PrepareError, match="the kubelet's request is invalid"):
            await node.preparer().unprepare(ClaimRef("default", "c", "x/../../precious"), budget=BUDGET)
        assert outside.exists()

    async def test_a_failing_reset_fails_the_claim_and_records_nothing(self, node):
        node.claims.allocate(CLAIM, "gpu-0")
        node.kind.fail = "reset"
        assert "resetting the devices failed: the reset failed" in await self.refused(node)
        assert node.checkpoint.load() == {}

    async def test_a_cdi_directory_that_cannot_be_written(self, node):
        node.claims.allocate(CLAIM, "gpu-0")
        node.cdi_dir.parent.mkdir(parents=True, exist_ok=True)
        node.cdi_dir.write_text("a file, not a directory")
        message = await self.refused(node)
        assert f"cannot write its CDI spec {node.spec('uid-1')}" in message
        assert node.checkpoint.load() == {}

    async def test_a_checkpoint_that_cannot_be_written_takes_the_spec_back(self, node):
        node.claims.allocate(CLAIM, "gpu-0")
        preparer = node.preparer()
        node.checkpoint.path.parent.parent.mkdir(parents=True)
        node.checkpoint.path.parent.write_text("a file where the driver's directory goes")
        assert f"cannot record it in {node.checkpoint.path}" in await self.refused(node, preparer=preparer)
        assert not node.spec("uid-1").exists()


class TestApiServerDown:
    async def test_a_prepared_claim_is_answered_from_the_checkpoint(self, node):
        node.claims.allocate(CLAIM, "gpu-0")
        first = await node.preparer().prepare(CLAIM, budget=BUDGET)
        node.claims.error = TimeoutError()
        assert await node.preparer().prepare(CLAIM, budget=BUDGET) == first


class TestUnprepare:
    async def test_the_devices_are_released_the_spec_removed_and_the_claim_forgotten(self, node):
        node.claims.allocate(CLAIM, "gpu-0", "gpu-1")
        preparer = node.preparer()
        await preparer.prepare(CLAIM, budget=BUDGET)
        await preparer.unprepare(CLAIM, budget=BUDGET)
        assert node.kind.scrubbed == [["GPU-0", "GPU-1"]]
        assert not node.spec("uid-1").exists()
        assert node.checkpoint.load() == {} and preparer.prepared == {}

    async def test_a_restarted_driver_unprepares_what_it_prepared_before(self, node):
        node.claims.allocate(CLAIM, "gpu-0")
        await node.preparer().prepare(CLAIM, budget=BUDGET)
        await node.preparer().unprepare(CLAIM, budget=BUDGET)
        assert node.kind.scrubbed == [["GPU-0"]]
        assert not node.spec("uid-1").exists() and node.checkpoint.load() == {}

    async def test_unpreparing_twice_is_unpreparing_once(self, node):
        node.claims.allocate(CLAIM, "gpu-0")
        preparer = node.preparer()
        await preparer.prepare(CLAIM, budget=BUDGET)
        await preparer.unprepare(CLAIM, budget=BUDGET)
        await preparer.unprepare(CLAIM, budget=BUDGET)
        assert len(node.kind.scrubbed) == 1

    async def test_a_failing_release_keeps_the_claim_for_the_kubelets_retry(self, node):
        node.claims.allocate(CLAIM, "gpu-0")
        preparer = node.preparer()
        await preparer.prepare(CLAIM, budget=BUDGET)
        node.kind.fail = "release"
        with pytest.raises(PrepareError, match="the release hook failed: scrub failed"):
            await preparer.unprepare(CLAIM, budget=BUDGET)
        assert node.spec("uid-1").exists() and "uid-1" in node.checkpoint.load()
        node.kind.fail = None
        await preparer.unprepare(CLAIM, budget=BUDGET)
        assert node.checkpoint.load() == {}

    async def test_a_kill_between_the_spec_and_the_checkpoint_loses_nothing(self, node):
        """The state a SIGKILL there leaves: the spec written, the checkpoint without the claim."""
        node.claims.allocate(CLAIM, "gpu-0")
        await node.preparer().prepare(CLAIM, budget=BUDGET)
        node.checkpoint.save([])  # as if the process died before recording the claim
        assert node.spec("uid-1").exists()
        restarted = node.preparer()
        await restarted.unprepare(CLAIM, budget=BUDGET)  # the pod went away meanwhile
        assert not node.spec("uid-1").exists()
        again = node.preparer()
        await again.prepare(CLAIM, budget=BUDGET)  # or the kubelet retried the prepare
        assert "uid-1" in node.checkpoint.load() and node.spec("uid-1").exists()

    async def test_a_released_device_that_is_gone_is_left_out_of_the_release(self, node):
        node.claims.allocate(CLAIM, "gpu-0", "gpu-1")
        preparer = node.preparer()
        await preparer.prepare(CLAIM, budget=BUDGET)
        node.pools.publish(build_pool(Snapshot([gpu(1)]), None, driver=DRIVER))
        await preparer.unprepare(CLAIM, budget=BUDGET)
        assert node.kind.scrubbed == [["GPU-1"]]

    async def test_a_spec_that_cannot_be_removed_is_removed_at_the_retry_without_releasing_again(self, node):
        node.claims.allocate(CLAIM, "gpu-0")
        preparer = node.preparer()
        await preparer.prepare(CLAIM, budget=BUDGET)
        spec = node.spec("uid-1")
        spec.unlink()
        spec.mkdir()
        (spec / "x").touch()  # unlink() of a non-empty directory fails
        with pytest.raises(PrepareError, match=f"cannot remove its CDI spec {spec}: Is a directory"):
            await preparer.unprepare(CLAIM, budget=BUDGET)
        assert "uid-1" in node.checkpoint.load()  # the checkpoint says so until the spec is gone
        (spec / "x").unlink()
        spec.rmdir()
        await preparer.unprepare(CLAIM, budget=BUDGET)
        assert node.kind.scrubbed == [["GPU-0"]] and node.checkpoint.load() == {}


KUBELET = Path("/var/lib/kubelet")
CDI = Path("/var/run/cdi")
NO_SPACE = "No space left on device"


@pytest.fixture
def disks(fs):
    """The kubelet's disk (the checkpoint) and the CDI tmpfs (the specs), each of its own size, to fill."""

    class Disks:
        def fill(self, mount):
            """Take all the space left on ``mount``."""
            fs.create_file(mount / "filler", st_size=fs.get_disk_usage(mount).free)

        def free(self, mount):
            (mount / "filler").unlink()

    for mount in (KUBELET, CDI):
        fs.add_mount_point(str(mount), total_size=1 << 20)
    return Disks()


@pytest.fixture
def full_disk_node(disks):
    node = make_node(CDI, KUBELET / "plugins" / DRIVER)
    node.disks = disks
    return node


def temporary_files(directory):
    """What a write left behind in ``directory`` (none if it was never made)."""
    if not directory.exists():
        return []
    return [path.name for path in directory.iterdir() if path.name.startswith(".tmp-")]


class TestFullDisk:
    """ENOSPC at each write: the claim's state stays what was done, hooks never run twice, retries finish."""

    async def test_an_unprepare_whose_checkpoint_cannot_be_written_releases_once_and_finishes_later(
        self, full_disk_node
    ):
        node = full_disk_node
        node.claims.allocate(CLAIM, "gpu-0")
        preparer = node.preparer(
            hooks=Hooks(pre_start=node.kind, post_allocate=node.kind, deallocate=node.kind, release=node.kind)
        )
        await preparer.prepare(CLAIM, budget=BUDGET)
        node.disks.fill(KUBELET)
        for _ in range(2):  # the kubelet retries while the disk is full
            with pytest.raises(PrepareError) as failure:
                await preparer.unprepare(CLAIM, budget=BUDGET)
            assert str(failure.value) == (
                f"claim default/two-gpus (uid uid-1): cannot record its removal in {node.checkpoint.path}: "
                f"{NO_SPACE}"
            )
            assert (node.kind.deallocated, node.kind.scrubbed) == ([["GPU-0"]], [["GPU-0"]])
            assert not node.spec("uid-1").exists()
            assert preparer.prepared == {}  # released: no longer prepared, whatever the file still says
        assert temporary_files(node.checkpoint.path.parent) == []
        node.disks.free(KUBELET)
        await preparer.unprepare(CLAIM, budget=BUDGET)
        assert (node.kind.deallocated, node.kind.scrubbed) == ([["GPU-0"]], [["GPU-0"]])
        assert node.checkpoint.load() == {} and preparer.prepared == {}

    async def test_a_driver_restarted_before_the_removal_was_recorded_does_not_release_again(
        self, full_disk_node
    ):
        node = full_disk_node
        node.claims.allocate(CLAIM, "gpu-0")
        node.claims.allocate(OTHER, "gpu-1")
        preparer = node.preparer()
        await preparer.prepare(CLAIM, budget=BUDGET)
        await preparer.prepare(OTHER, budget=BUDGET)
        node.disks.fill(KUBELET)
        with pytest.raises(PrepareError, match=NO_SPACE):
            await preparer.unprepare(CLAIM, budget=BUDGET)
        assert set(node.checkpoint.load()) == {"uid-1", "uid-2"}  # the file could not say it
        restarted = node.preparer()  # a new driver process, the disk still full
        assert set(restarted.prepared) == {"uid-2"}  # uid-1 is known released, its device free
        with pytest.raises(PrepareError, match=NO_SPACE):
            await restarted.unprepare(CLAIM, budget=BUDGET)  # the kubelet's retry: only the write is left
        node.disks.free(KUBELET)
        await node.preparer().unprepare(CLAIM, budget=BUDGET)  # and once more after another restart
        assert node.kind.scrubbed == [["GPU-0"]]  # released once, whatever the restarts
        assert set(node.checkpoint.load()) == {"uid-2"}
        assert sorted(path.name for path in CDI.iterdir()) == [cdi.spec_file_name(DRIVER, "uid-2")]

    async def test_a_claim_prepared_again_after_a_restart_with_a_half_recorded_unprepare_is_prepared(
        self, full_disk_node
    ):
        node = full_disk_node
        node.claims.allocate(CLAIM, "gpu-0")
        preparer = node.preparer()
        await preparer.prepare(CLAIM, budget=BUDGET)
        node.disks.fill(KUBELET)
        with pytest.raises(PrepareError, match=NO_SPACE):
            await preparer.unprepare(CLAIM, budget=BUDGET)
        node.disks.free(KUBELET)
        again = await node.preparer().prepare(CLAIM, budget=BUDGET)  # a new pod of the claim
        assert node.kind.reset == [["GPU-0"], ["GPU-0"]]
        restarted = node.preparer()
        assert restarted.prepared == {"uid-1": again}  # the new preparation is no released one
        await restarted.unprepare(CLAIM, budget=BUDGET)
        assert node.kind.scrubbed == [["GPU-0"], ["GPU-0"]]

    async def half_unprepared(self, node):
        """A preparer whose claim was released but not recorded (a full disk); the disk has room again."""
        node.claims.allocate(CLAIM, "gpu-0")
        preparer = node.preparer()
        await preparer.prepare(CLAIM, budget=BUDGET)
        node.disks.fill(KUBELET)
        with pytest.raises(PrepareError, match=NO_SPACE):
            await preparer.unprepare(CLAIM, budget=BUDGET)
        node.disks.free(KUBELET)
        return preparer

    async def test_a_released_claim_that_is_still_recorded_frees_its_device(self, full_disk_node):
        node = full_disk_node
        preparer = await self.half_unprepared(node)
        node.claims.allocate(OTHER, "gpu-0")
        await preparer.prepare(OTHER, budget=BUDGET)  # its checkpoint no longer lists the released claim
        assert set(node.checkpoint.load()) == {"uid-2"}
        await preparer.unprepare(CLAIM, budget=BUDGET)  # the kubelet's retry: nothing left to do
        assert node.kind.scrubbed == [["GPU-0"]]
        assert set(node.checkpoint.load()) == {"uid-2"} and node.spec("uid-2").exists()

    async def test_a_claim_prepared_again_after_a_half_recorded_unprepare_is_prepared_anew(
        self, full_disk_node
    ):
        node = full_disk_node
        preparer = await self.half_unprepared(node)
        again = await preparer.prepare(CLAIM, budget=BUDGET)  # a new pod of the claim: not the old answer
        assert node.kind.reset == [["GPU-0"], ["GPU-0"]] and node.spec("uid-1").exists()
        assert node.checkpoint.load() == {"uid-1": again}
        await preparer.unprepare(CLAIM, budget=BUDGET)
        assert node.kind.scrubbed == [["GPU-0"], ["GPU-0"]]

    @pytest.mark.parametrize(
        ("full", "error"),
        [
            (CDI, "cannot write its CDI spec {spec}"),
            (KUBELET, "cannot record it in {checkpoint}"),  # the spec written is taken back
        ],
        ids=["spec", "checkpoint"],
    )
    async def test_a_prepare_that_cannot_be_written_leaves_nothing_and_succeeds_later(
        self, full_disk_node, full, error
    ):
        node = full_disk_node
        node.claims.allocate(CLAIM, "gpu-0")
        preparer = node.preparer()
        node.disks.fill(full)
        with pytest.raises(PrepareError) as failure:
            await preparer.prepare(CLAIM, budget=BUDGET)
        what = error.format(spec=node.spec("uid-1"), checkpoint=node.checkpoint.path)
        assert str(failure.value) == f"claim default/two-gpus (uid uid-1): {what}: {NO_SPACE}"
        assert preparer.prepared == {} and node.checkpoint.load() == {} and not node.spec("uid-1").exists()
        assert temporary_files(CDI) == temporary_files(node.checkpoint.path.parent) == []
        await preparer.unprepare(CLAIM, budget=BUDGET)  # the kubelet's clean-up of a failed pod
        assert node.kind.scrubbed == []  # never prepared: nothing to release
        node.disks.free(full)
        prepared = await preparer.prepare(CLAIM, budget=BUDGET)
        assert node.checkpoint.load() == {"uid-1": prepared} and node.spec("uid-1").exists()
        await preparer.unprepare(CLAIM, budget=BUDGET)
        assert node.kind.scrubbed == [["GPU-0"]]

    async def test_a_restarted_driver_reads_a_full_disk_checkpoint_as_the_last_one_written(
        self, full_disk_node
    ):
        node = full_disk_node
        node.claims.allocate(CLAIM, "gpu-0")
        node.claims.allocate(OTHER, "gpu-1")
        preparer = node.preparer()
        first = await preparer.prepare(CLAIM, budget=BUDGET)
        node.disks.fill(KUBELET)
        with pytest.raises(PrepareError, match=NO_SPACE):
            await preparer.prepare(OTHER, budget=BUDGET)
        assert node.preparer().prepared == {"uid-1": first}


class TestHooksAreOptional:
    async def test_a_kind_without_hooks_is_prepared_with_the_default_allocation(self, node):
        node.claims.allocate(CLAIM, "gpu-1")
        preparer = node.preparer(hooks=Hooks())
        await preparer.prepare(CLAIM, budget=BUDGET)
        spec = json.loads(node.spec("uid-1").read_text())
        assert spec["devices"][0]["containerEdits"]["env"] == ["NVIDIA_VISIBLE_DEVICES=GPU-1"]
        await preparer.unprepare(CLAIM, budget=BUDGET)
        assert node.checkpoint.load() == {}

    async def test_a_device_without_edits_needs_no_spec(self, node):
        node.pools.publish(build_pool(Snapshot([Device("bare")]), None, driver=DRIVER))
        node.claims.allocate(CLAIM, "bare")
        prepared = await node.preparer(hooks=Hooks()).prepare(CLAIM, budget=BUDGET)
        assert prepared.cdi_spec is None and prepared.devices[0].cdi_device_ids == ()
        assert not Path(node.cdi_dir).exists()
