"""Claims and slices as files: the API server's refusals, and a new pool generation only on a change."""

import json

import pytest

from plugvisor.dra.cluster import AllocatedDevice, ClaimError
from plugvisor.dra.devices import PublishedDevice, SemVer
from plugvisor.dra.local import FileClaimReader, FileSlicePublisher, claim_path, slice_path


def write_claim(directory, namespace, name, uid, results=None):
    path = claim_path(directory, namespace, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {"metadata": {"namespace": namespace, "name": name, "uid": uid}}
    if results is not None:
        document["status"] = {"allocation": {"devices": {"results": results}}}
    path.write_text(json.dumps(document))


class TestClaims:
    async def test_an_allocated_claim_gives_its_results(self, tmp_path):
        write_claim(
            tmp_path,
            "default",
            "c",
            "u1",
            [{"request": "r", "driver": "d", "pool": "p", "device": "x", "adminAccess": True}],
        )
        reader = FileClaimReader(tmp_path)
        assert await reader.allocated_devices(namespace="default", name="c", uid="u1") == [
            AllocatedDevice("r", "d", "p", "x", admin_access=True)
        ]

    @pytest.mark.parametrize(
        ("setup", "name", "uid", "message"),
        [
            (None, "c", "u1", 'resourceclaims "c" not found in namespace "default"'),
            ((), "c", "u2", "default/c now has UID u1, not u2"),
            ("unallocated", "c", "u1", "default/c is not allocated"),
            (None, "../etc", "u1", "not a valid name"),
        ],
        ids=["missing", "newer", "unallocated", "escaping-name"],
    )
    async def test_the_api_servers_refusals(self, tmp_path, setup, name, uid, message):
        if setup is not None:
            write_claim(tmp_path, "default", "c", "u1", None if setup == "unallocated" else [])
        with pytest.raises(ClaimError, match=message):
            await FileClaimReader(tmp_path).allocated_devices(namespace="default", name=name, uid=uid)


class TestSlices:
    async def test_a_slice_in_the_apis_shape_and_a_generation_per_change(self, tmp_path):
        publisher = FileSlicePublisher(tmp_path, driver="gpu.example.com", node_name="n1")
        device = PublishedDevice(
            "gpu-0", {"model": "H100", "index": 0, "ok": True, "v": SemVer("1.2.3")}, {"memory": "80Gi"}
        )
        await publisher.publish([device])
        await publisher.publish([device])
        document = json.loads(slice_path(tmp_path, "gpu.example.com", "n1").read_text())
        spec = document["spec"]
        assert (spec["driver"], spec["nodeName"], spec["pool"]) == (
            "gpu.example.com",
            "n1",
            {"name": "n1", "generation": 1, "resourceSliceCount": 1},
        )
        assert spec["devices"] == [
            {
                "name": "gpu-0",
                "attributes": {
                    "index": {"int": 0},
                    "model": {"string": "H100"},
                    "ok": {"bool": True},
                    "v": {"version": "1.2.3"},
                },
                "capacity": {"memory": {"value": "80Gi"}},
            }
        ]
        await publisher.publish([])
        assert (
            json.loads(slice_path(tmp_path, "gpu.example.com", "n1").read_text())["spec"]["pool"][
                "generation"
            ]
            == 2
        )

    async def test_withdrawing_removes_the_slice(self, tmp_path):
        publisher = FileSlicePublisher(tmp_path, driver="d.example.com", node_name="n1")
        await publisher.publish([PublishedDevice("a")])
        await publisher.withdraw()
        assert not slice_path(tmp_path, "d.example.com", "n1").exists()

    async def test_a_slice_that_cannot_be_written_is_written_at_the_next_change(self, tmp_path):
        (tmp_path / "resourceslices").write_text("a file in the way")
        publisher = FileSlicePublisher(tmp_path, driver="d.example.com", node_name="n1")
        await publisher.publish([PublishedDevice("a")])
        assert publisher.generation == 0
        (tmp_path / "resourceslices").unlink()
        await publisher.publish([PublishedDevice("a")])
        assert publisher.generation == 1


class TestClaimFilesFromOutside:
    async def test_a_megabyte_uid_in_the_file_is_shown_cut(self, tmp_path):
        write_claim(tmp_path, "default", "c", "u" * (1 << 20), [])
        with pytest.raises(ClaimError) as caught:
            await FileClaimReader(tmp_path).allocated_devices(namespace="default", name="c", uid="u1")
        assert len(str(caught.value)) < 600
        assert f"({1 << 20} characters)" in str(caught.value)

    @pytest.mark.parametrize("value", ["false", "true", 0, 1, [], {}])
    async def test_admin_access_is_a_boolean_or_nothing(self, tmp_path, value):
        result = {"request": "r", "driver": "d", "pool": "p", "device": "x", "adminAccess": value}
        write_claim(tmp_path, "default", "c", "u1", [result])
        with pytest.raises(ClaimError, match=r"results\[0\]\.adminAccess: expected true or false, got "):
            await FileClaimReader(tmp_path).allocated_devices(namespace="default", name="c", uid="u1")

    async def test_admin_access_null_or_absent_is_none(self, tmp_path):
        results = [
            {"request": "r", "driver": "d", "pool": "p", "device": "x", "adminAccess": None},
            {"request": "r", "driver": "d", "pool": "p", "device": "y"},
        ]
        write_claim(tmp_path, "default", "c", "u1", results)
        devices = await FileClaimReader(tmp_path).allocated_devices(namespace="default", name="c", uid="u1")
        assert [d.admin_access for d in devices] == [False, False]

    async def test_a_name_that_is_not_a_string_is_refused_not_converted(self, tmp_path):
        write_claim(
            tmp_path, "default", "c", "u1", [{"request": 5, "driver": "d", "pool": "p", "device": "x"}]
        )
        with pytest.raises(ClaimError, match=r"results\[0\]\.request: expected a string, got 5"):
            await FileClaimReader(tmp_path).allocated_devices(namespace="default", name="c", uid="u1")

    @pytest.mark.parametrize(
        ("content", "message"),
        [
            (b"null", "not a ResourceClaim: expected a JSON object, got null"),
            (b"[]", "not a ResourceClaim: expected a JSON object, got a list"),
            (b'{"metadata": []}', "metadata: expected an object, got a list"),
            (b'{"metadata": {"uid": 7}}', "metadata.uid: expected a string, got 7"),
            (b'{"metadata": {"uid": "u1"}, "status": []}', "status: expected an object, got a list"),
            (b'{"metadata": {"uid": "u1"}, "x": "' + b"y" * (5 << 20) + b'"}', "larger than 4 MiB"),
            (b"{nope", "not JSON: Expecting property name"),
        ],
        ids=["null", "list", "metadata-list", "uid-number", "status-list", "5MiB", "not-json"],
    )
    async def test_a_claim_file_that_is_no_claim_says_what_it_is(self, tmp_path, content, message):
        path = claim_path(tmp_path, "default", "c")
        path.parent.mkdir(parents=True)
        path.write_bytes(content)
        with pytest.raises(ClaimError) as caught:
            await FileClaimReader(tmp_path).allocated_devices(namespace="default", name="c", uid="u1")
        assert message in str(caught.value)
        assert "deleted and created again" not in str(caught.value)
        assert str(path) in str(caught.value)
