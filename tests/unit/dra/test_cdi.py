"""Per-claim CDI specs: what the runtime applies, and what a lost checkpoint is rebuilt from."""

import json

from plugvisor.deviceplugin.devices import DeviceSpec, Mount
from plugvisor.deviceplugin.hooks import ContainerAllocation
from plugvisor.dra import cdi
from plugvisor.dra.checkpoint import PreparedClaim, PreparedDevice
from plugvisor.dra.cluster import ClaimRef

DRIVER = "gpu.example.com"
CLAIM = PreparedClaim(
    ClaimRef("default", "gpus", "uid-1"), (PreparedDevice(("gpus",), "n", "gpu-0", "GPU-0"),)
)
GPU = ContainerAllocation(
    specs=[DeviceSpec("/dev/nvidia0", "/host/dev/nvidia0")],
    mounts=[Mount("/usr/lib/x", "/opt/lib/x", read_only=True)],
    envs={"NVIDIA_VISIBLE_DEVICES": "GPU-0"},
    annotations={"note": "x"},
)


class TestNames:
    def test_a_claims_spec_and_devices_are_named_from_the_driver_and_its_uid(self):
        assert cdi.kind(DRIVER) == "k8s.gpu.example.com/claim"
        assert cdi.spec_file_name(DRIVER, "uid-1") == "k8s.gpu.example.com-claim_uid-1.json"
        assert (
            cdi.qualified(DRIVER, cdi.device_name("uid-1", "gpus")) == "k8s.gpu.example.com/claim=uid-1-gpus"
        )


class TestRender:
    def test_an_allocation_becomes_container_edits(self):
        assert cdi.container_edits(GPU) == {
            "env": ["NVIDIA_VISIBLE_DEVICES=GPU-0"],
            "deviceNodes": [{"path": "/dev/nvidia0", "hostPath": "/host/dev/nvidia0", "permissions": "rw"}],
            "mounts": [
                {
                    "hostPath": "/opt/lib/x",
                    "containerPath": "/usr/lib/x",
                    "options": ["rbind", "rprivate", "ro"],
                }
            ],
        }

    def test_one_device_per_request_with_edits_and_the_claim_recorded(self):
        spec = cdi.render(DRIVER, CLAIM, [("gpus", GPU), ("empty", ContainerAllocation())])
        assert spec is not None
        assert [device["name"] for device in spec["devices"]] == ["uid-1-gpus"]
        assert spec["devices"][0]["annotations"] == {"note": "x"}
        record = json.loads(spec["annotations"][cdi.CLAIM_ANNOTATION])
        assert (record["namespace"], record["name"], record["uid"]) == ("default", "gpus", "uid-1")

    def test_a_claim_without_any_edit_has_no_spec(self):
        assert cdi.render(DRIVER, CLAIM, [("gpus", ContainerAllocation())]) is None

    def test_the_same_spec_is_the_same_bytes(self):
        spec = cdi.render(DRIVER, CLAIM, [("gpus", GPU)])
        assert spec is not None
        assert cdi.encode(spec) == cdi.encode(json.loads(cdi.encode(spec)))


class TestFiles:
    def test_a_spec_is_written_readable_by_the_runtime_and_removed(self, tmp_path):
        spec = cdi.render(DRIVER, CLAIM, [("gpus", GPU)])
        assert spec is not None
        path = cdi.write(tmp_path, "s.json", spec)
        assert path.stat().st_mode & 0o777 == 0o644
        assert cdi.exists(tmp_path, "s.json")
        assert cdi.remove(tmp_path, "s.json")
        assert not cdi.remove(tmp_path, "s.json")
        assert not cdi.exists(tmp_path, "s.json")

    def test_the_claims_are_recovered_from_their_specs_and_the_unreadable_ones_named(self, tmp_path):
        spec = cdi.render(DRIVER, CLAIM, [("gpus", GPU)])
        assert spec is not None
        name = cdi.spec_file_name(DRIVER, "uid-1")
        cdi.write(tmp_path, name, spec)
        (tmp_path / cdi.spec_file_name(DRIVER, "uid-9")).write_text("{not json")
        (tmp_path / "k8s.other.example.com-claim_uid-3.json").write_text("{}")
        recovered, problems = cdi.recover(tmp_path, DRIVER)
        assert list(recovered) == ["uid-1"]
        assert recovered["uid-1"].devices == CLAIM.devices
        assert recovered["uid-1"].cdi_spec == name
        assert len(problems) == 1 and "uid-9" in problems[0]

    def test_a_missing_directory_recovers_nothing_and_says_so(self, tmp_path):
        recovered, problems = cdi.recover(tmp_path / "absent", DRIVER)
        assert recovered == {}
        assert "cannot list it" in problems[0]


def test_a_release_marker_is_made_even_where_no_spec_was_written_and_read_back_by_uid(tmp_path):
    from plugvisor.dra import cdi as cdi_

    directory = tmp_path / "cdi"
    cdi_.mark_released(directory, "gpu.example.com", "uid-1")
    (directory / cdi_.spec_file_name("gpu.example.com", "uid-2")).write_text("{}")
    assert cdi_.released(directory, "gpu.example.com") == {"uid-1"}
    assert cdi_.released(directory, "nic.example.com") == set()
    cdi_.unmark_released(directory, "gpu.example.com", "uid-1")
    cdi_.unmark_released(directory, "gpu.example.com", "uid-1")  # gone already: nothing to do
    assert cdi_.released(directory, "gpu.example.com") == set()
