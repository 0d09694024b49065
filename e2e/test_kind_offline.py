"""What the kind backend's offline route (e2e/kind) gives kind and dockerd, and the machine lock it shares
with the local cluster: checked without Docker, a cluster or root."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from . import machine_lock
from .deployment import KIND_CONFIG, REPO
from .kind import engine, offline


def test_the_config_kind_gets_is_the_users_plus_the_node_images_patches(tmp_path: Path) -> None:
    """Same nodes, labels and mounts (made absolute), and build.py --kubeadm-patch's documents appended;
    kind-config.yaml itself is not touched."""
    before = KIND_CONFIG.read_text()
    written = yaml.safe_load(offline.write_config(tmp_path / "kind.yaml").read_text())
    users = yaml.safe_load(before)
    assert KIND_CONFIG.read_text() == before
    assert [n["role"] for n in written["nodes"]] == [n["role"] for n in users["nodes"]]
    assert [n.get("labels") for n in written["nodes"]] == [n.get("labels") for n in users["nodes"]]
    for mine, theirs in zip(written["nodes"], users["nodes"], strict=True):
        for mount, original in zip(mine.get("extraMounts", []), theirs.get("extraMounts", []), strict=True):
            assert Path(mount["hostPath"]) == (REPO / original["hostPath"]).resolve()
            assert Path(mount["hostPath"]).is_file()
    patches = written["kubeadmConfigPatches"]
    assert [yaml.safe_load(p)["kind"] for p in patches] == ["ClusterConfiguration", "KubeletConfiguration"]
    assert yaml.safe_load(patches[1])["failCgroupV1"] is False
    assert yaml.safe_load(patches[0])["etcd"]["local"]["imageTag"].endswith("-0")


def test_the_suites_dockerd_runs_capfit_by_default_and_keeps_everything_outside_etc() -> None:
    """kind cannot choose the runtime of its node containers: capfit must be the daemon's default; the
    daemon's data, exec root and socket are the run's own, so nothing of it outlives the run."""
    config = engine.daemon_config()
    assert config["default-runtime"] == "capfit"
    assert config["runtimes"] == {"capfit": {"path": str(REPO / "tools/kind/capfit.py")}}
    assert (REPO / "tools/kind/capfit.py").stat().st_mode & 0o111
    roots = [config["data-root"], config["exec-root"], config["pidfile"], *config["hosts"]]
    assert all(
        str(r).removeprefix("unix://").startswith(("/run/plugvisor-kind/", "/var/lib/plugvisor-kind/"))
        for r in roots
    )
    assert not engine.CONFIG.is_relative_to("/etc")


def test_a_second_owner_of_the_machine_lock_waits_then_gives_up_naming_the_first(tmp_path: Path) -> None:
    """One cluster at a time: while the lock is held, another acquire says it waits, and after its timeout
    fails naming the holder's PID; once released it is taken at once."""
    lock = tmp_path / "e2e.lock"
    said: list[str] = []
    first = machine_lock.acquire(5, path=lock, progress=said.append)
    try:
        with pytest.raises(machine_lock.LockBusyError, match=r"owner: pid \d+"):
            machine_lock.acquire(0.5, path=lock, progress=said.append, what="the kind run")
        assert said and said[0].startswith("the kind run waits for the other cluster")
    finally:
        machine_lock.release(first)
    machine_lock.release(machine_lock.acquire(0, path=lock, progress=said.append))
