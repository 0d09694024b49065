"""The local cluster runs the binaries of its own build and the distribution's tools, never whatever PATH
finds first: another install's containerd shim or runc earlier on PATH is never chosen.

These render the configuration and start throw-away processes the way the cluster does; no cluster runs.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import pytest

from .local import cluster as cluster_module
from .local import hostbin
from .local.cluster import LocalCluster

DECOYS = ("containerd-shim-runc-v2", "runc", "containerd", "true", "openssl", "iptables-save", "nft")


@pytest.fixture
def decoys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory first on PATH whose binaries would each leave a mark if anything ran them."""
    directory = tmp_path / "decoys"
    directory.mkdir()
    for name in DECOYS:
        script = directory / name
        script.write_text(f"#!/bin/sh\necho {name} >> {tmp_path / 'ran'}\n")
        script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{directory}{os.pathsep}{os.environ.get('PATH', '')}")
    return directory


def _cluster(tmp_path: Path) -> LocalCluster:
    cluster = LocalCluster(progress=lambda _: None, base=tmp_path / "base")
    cluster.bin = tmp_path / "build-bin"
    cluster.bin.mkdir()
    cluster.logs = tmp_path / "base" / "logs"
    cluster.logs.mkdir(parents=True)
    (cluster.base / "containerd").mkdir()
    return cluster


def _containerd_config(cluster: LocalCluster) -> dict[str, object]:
    cluster._write_containerd_config()
    document = tomllib.loads((cluster.base / "containerd" / "config.toml").read_text())
    runtime = document["plugins"]["io.containerd.cri.v1.runtime"]
    return {
        "runtime": runtime["containerd"]["runtimes"]["runc"],
        "cni": runtime["cni"],
    }


def test_containerd_starts_the_builds_shim_by_its_absolute_path(tmp_path: Path, decoys: Path) -> None:
    """containerd 2.x speaks only its own shim's protocol: Debian's docker.io puts containerd 1.6's shim
    in /usr/bin, and a PATH lookup found that one: every sandbox failed (``type with url <id>: not
    found``)."""
    cluster = _cluster(tmp_path)
    runtime = _containerd_config(cluster)["runtime"]
    assert isinstance(runtime, dict)
    assert runtime["runtime_type"] == "io.containerd.runc.v2"
    assert runtime["runtime_path"] == str(cluster.bin / "containerd-shim-runc-v2")


def test_runc_is_the_distributions_not_the_first_on_path(tmp_path: Path, decoys: Path) -> None:
    runtime = _containerd_config(_cluster(tmp_path))["runtime"]
    assert isinstance(runtime, dict)
    binary = Path(runtime["options"]["BinaryName"])
    assert binary.is_absolute()
    assert str(binary.parent) in hostbin.SYSTEM_DIRS
    assert binary.parent != decoys


def test_the_cni_plugins_come_from_an_absolute_directory(tmp_path: Path, decoys: Path) -> None:
    cni = _containerd_config(_cluster(tmp_path))["cni"]
    assert isinstance(cni, dict)
    assert all(Path(directory).is_absolute() for directory in cni["bin_dirs"])


def test_components_run_with_the_build_first_then_the_system_directories(
    tmp_path: Path, decoys: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a component looks up itself (containerd its shim, the kubelet iptables and mount) is found in
    the build's bin directory first, then in the system directories, whatever the caller's PATH was."""
    cluster = _cluster(tmp_path)
    monkeypatch.setattr(cluster, "_write_state", lambda: None)
    shim = cluster.bin / "containerd-shim-runc-v2"
    shim.write_text("#!/bin/sh\n")
    shim.chmod(0o755)
    cluster._start(
        "probe", [hostbin.system_binary("sh"), "-c", "echo $PATH; command -v containerd-shim-runc-v2"]
    )
    popen = cluster.processes["probe"].popen
    assert popen is not None
    assert popen.wait(timeout=30) == 0
    path, found = (cluster.logs / "probe.log").read_text().splitlines()[-2:]
    assert path == os.pathsep.join([str(cluster.bin), *hostbin.SYSTEM_DIRS])
    assert found == str(shim)
    assert not (tmp_path / "ran").exists()


def test_host_tools_run_from_the_system_directories(tmp_path: Path, decoys: Path) -> None:
    """ip, iptables, nft and openssl: a bare name is looked up in the system directories only."""
    cluster_module._run(["true"])
    assert cluster_module._iptables_chains() is not None
    assert not (tmp_path / "ran").exists()


def test_a_host_tool_missing_from_the_system_directories_is_named(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(hostbin, "SYSTEM_DIRS", (str(tmp_path),))
    with pytest.raises(cluster_module.ClusterError, match=r"runc is not installed in any of"):
        cluster_module._run(["runc", "--version"])
    assert cluster_module._run(["runc", "--version"], check=False) == ""
