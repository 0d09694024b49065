"""The prepared-claims checkpoint: whole or not at all, and never half-trusted."""

import json

import pytest

from plugvisor.dra.checkpoint import Checkpoint, CheckpointError, PreparedClaim, PreparedDevice
from plugvisor.dra.cluster import ClaimRef

CLAIM = PreparedClaim(
    ClaimRef("default", "gpus", "uid-1"),
    (
        PreparedDevice(("gpus",), "node-1", "gpu-0", "GPU-0", ("k8s.x/claim=uid-1-gpus",)),
        PreparedDevice(("gpus",), "node-1", "gpu-1", "GPU-1"),
    ),
    "k8s.x-claim_uid-1.json",
    {"cdiVersion": "0.6.0", "kind": "k8s.x/claim", "devices": []},
)
OTHER = PreparedClaim(
    ClaimRef("ns", "monitor", "uid-2"), (PreparedDevice(("m",), "node-1", "gpu-0", "GPU-0", (), True),)
)


@pytest.fixture
def checkpoint(tmp_path):
    return Checkpoint(tmp_path / "driver" / "prepared-claims.json", driver="x.example.com")


class TestRoundTrip:
    def test_what_is_saved_is_loaded(self, checkpoint):
        checkpoint.save([CLAIM, OTHER])
        assert checkpoint.load() == {"uid-1": CLAIM, "uid-2": OTHER}

    def test_no_file_is_no_claims(self, checkpoint):
        assert checkpoint.load() == {}

    def test_the_same_claims_give_the_same_bytes_whatever_their_order(self, checkpoint):
        assert checkpoint.render([CLAIM, OTHER]) == checkpoint.render([OTHER, CLAIM])

    def test_the_file_is_for_its_owner_only_and_no_temporary_file_stays(self, checkpoint):
        checkpoint.save([CLAIM])
        assert checkpoint.path.stat().st_mode & 0o777 == 0o600
        assert [p.name for p in checkpoint.path.parent.iterdir()] == ["prepared-claims.json"]

    def test_a_temporary_file_left_by_a_killed_write_is_cleaned_up_by_the_next(self, checkpoint):
        checkpoint.save([CLAIM])
        leftover = checkpoint.path.with_name(".tmp-prepared-claims.json.abc123")
        leftover.write_text("half")
        checkpoint.save([OTHER])
        assert not leftover.exists()
        assert checkpoint.load() == {"uid-2": OTHER}


class TestUntrusted:
    def write(self, checkpoint, document):
        checkpoint.path.parent.mkdir(parents=True, exist_ok=True)
        checkpoint.path.write_text(document if isinstance(document, str) else json.dumps(document))

    def saved(self, checkpoint):
        checkpoint.save([CLAIM])
        return json.loads(checkpoint.path.read_text())

    def test_a_damaged_file_is_refused_naming_it(self, checkpoint):
        self.write(checkpoint, '{"format": "plugvisor.io/dra-prepared-claims", "vers')
        with pytest.raises(CheckpointError, match=f"{checkpoint.path}: not valid JSON"):
            checkpoint.load()

    def test_an_edited_file_fails_its_checksum(self, checkpoint):
        document = self.saved(checkpoint)
        document["claims"][0]["name"] = "other"
        self.write(checkpoint, document)
        with pytest.raises(CheckpointError, match="checksum mismatch"):
            checkpoint.load()

    def test_another_format_version_is_refused(self, checkpoint):
        document = self.saved(checkpoint)
        document["version"] = 2
        self.write(checkpoint, document)
        with pytest.raises(CheckpointError, match="format version 2; this plugvisor reads version 1"):
            checkpoint.load()

    def test_another_drivers_file_is_refused(self, checkpoint):
        checkpoint.save([CLAIM])
        other = Checkpoint(checkpoint.path, driver="y.example.com")
        with pytest.raises(CheckpointError, match=r"written by driver 'x\.example\.com'"):
            other.load()

    def test_something_else_entirely_is_not_our_checkpoint(self, checkpoint):
        self.write(checkpoint, {"claims": []})
        with pytest.raises(CheckpointError, match="not a plugvisor prepared-claims checkpoint"):
            checkpoint.load()

    def test_a_malformed_entry_with_a_right_checksum_is_refused(self, checkpoint):
        body = {"format": "plugvisor.io/dra-prepared-claims", "version": 1, "driver": "x.example.com"}
        body["claims"] = [{"namespace": 1}]
        from plugvisor.dra.checkpoint import _digest

        self.write(checkpoint, {**body, "checksum": _digest(body)})
        with pytest.raises(CheckpointError, match="a claim entry is malformed"):
            checkpoint.load()

    @pytest.mark.parametrize("cdi_spec", ["../../outside.json", "sub/spec.json", "..", ".hidden.json", ""])
    def test_a_spec_file_name_that_leaves_the_cdi_directory_is_refused(self, checkpoint, cdi_spec):
        """The checksum is no signature: a forged entry must not name a file to remove elsewhere."""
        checkpoint.path.parent.mkdir(parents=True)
        checkpoint.path.write_bytes(checkpoint.render([PreparedClaim(CLAIM.claim, CLAIM.devices, cdi_spec)]))
        with pytest.raises(CheckpointError, match=r"a claim entry is malformed.*not a file name"):
            checkpoint.load()

    def test_a_huge_file_is_not_read(self, checkpoint, monkeypatch):
        monkeypatch.setattr("plugvisor.dra.checkpoint.MAX_BYTES", 10)
        checkpoint.save([CLAIM])
        with pytest.raises(CheckpointError, match="larger than"):
            checkpoint.load()

    def test_a_link_in_its_place_is_not_followed(self, checkpoint, tmp_path):
        (tmp_path / "elsewhere").write_text("{}")
        checkpoint.path.parent.mkdir(parents=True)
        checkpoint.path.symlink_to(tmp_path / "elsewhere")
        with pytest.raises(CheckpointError, match="cannot open it"):
            checkpoint.load()
