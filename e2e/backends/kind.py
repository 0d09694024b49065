"""A kind cluster (kind-config.yaml): the image built with docker and loaded into the nodes."""

from __future__ import annotations

import functools
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from ..deployment import REPO
from .api import ApiBackend
from .common import IMAGE, Progress, run

CLUSTER = "plugvisor-e2e"


@functools.cache
def _kind_tool() -> Any:
    """tools/kind/build.py, which knows where the kind it builds and the offline node image are."""
    name = "plugvisor_kind_build"
    spec = importlib.util.spec_from_file_location(name, REPO / "tools/kind/build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def built_kind() -> Path | None:
    """The kind command tools/kind/build.py built from the module proxy, if it was built here."""
    tool = _kind_tool()
    try:
        path = tool.cache_root(tool.versions()["kind"]) / "bin" / "kind"
    except tool.UsageError:
        return None
    return path if path.exists() else None


def offline_node_image() -> Path | None:
    """The node image tools/kind/build.py made for machines without a registry, if it was made here."""
    tool = _kind_tool()
    try:
        pinned = tool.versions()
        kubernetes = str(tool.kbuild.versions()["kubernetes"]["version"])
    except (tool.UsageError, tool.kbuild.VersionsError):
        return None
    archive = (
        tool.cache_root(pinned["kind"])
        / "archives"
        / tool.kimages.archive_filename(tool.kimages.normalize_ref(tool.node_ref(kubernetes)))
    )
    return archive if archive.exists() else None


def kind_unavailable() -> str | None:
    """Why the kind backend cannot run here (every reason at once), or None.

    Where tools/kind/build.py made the offline node image (a machine without a registry:
    docs/kind.md), the reason names what this backend still lacks for that route, as measured there:
    the image makes the repository's cluster Ready by hand, but setup() runs neither it nor the
    project's image from tools/kubernetes/images.py, and ``docker build`` pulls its base.
    """
    missing = [f"{tool} is not installed" for tool in ("docker", "kubectl") if shutil.which(tool) is None]
    if shutil.which("kind") is None:
        built = built_kind()
        missing.append(
            f"kind is not on PATH (tools/kind/build.py built one: put {built.parent} on PATH)"
            if built is not None
            else "kind is not installed (or build it: python3 tools/kind/build.py --only kind)"
        )
    if shutil.which("docker") is not None:
        info = subprocess.run(["docker", "info"], capture_output=True, text=True, check=False)
        if info.returncode != 0:
            missing.append("docker is installed but no Docker engine answers (docker info failed)")
    if importlib.util.find_spec("kubernetes") is None:
        missing.append("the kubernetes Python client is not installed (the e2e extra; use tox -e e2e)")
    archive = offline_node_image()
    if archive is not None:
        missing.append(
            f"the offline node image is built ({archive}) and brings kind-config.yaml's cluster up by"
            " hand (docs/kind.md), but this backend does not use it yet: it creates the cluster without"
            " --image and tools/kind/build.py --kubeadm-patch's patches, and builds the project's image"
            " with docker build, which pulls python:3.11-slim, instead of loading tools/kubernetes/"
            "images.py's archive with kind load image-archive"
        )
    return "; ".join(missing) or None


class KindBackend(ApiBackend):
    """The cluster of kind-config.yaml with the lab overlay applied; checks through the API server."""

    name = "kind"

    def __init__(self, progress: Progress, *, keep: bool, reuse: bool) -> None:
        super().__init__(progress)
        self.keep = keep
        self.reuse = reuse
        self.created = False

    def kubectl(self, *args: str, timeout: float = 300) -> str:
        return run(["kubectl", "--context", f"kind-{CLUSTER}", *args], timeout=timeout)

    def setup(self) -> None:
        existing = run(["kind", "get", "clusters"]).split()
        if CLUSTER in existing and self.reuse:
            self.progress(f"reusing kind cluster {CLUSTER}")
        else:
            if CLUSTER in existing:
                run(["kind", "delete", "cluster", "--name", CLUSTER], timeout=300)
            self.progress("kind create cluster (a control plane, two workers)")
            run(
                ["kind", "create", "cluster", "--config", "kind-config.yaml", "--wait", "180s"],
                timeout=900,
                cwd=REPO,  # kind resolves the relative extraMounts from where it runs
            )
            self.created = True
        self.progress(f"docker build -t {IMAGE} (the release Dockerfile) and kind load")
        run(["docker", "build", "-t", IMAGE, str(REPO)], timeout=1200)
        run(["kind", "load", "docker-image", IMAGE, "--name", CLUSTER], timeout=600)
        self._config.load_kube_config(context=f"kind-{CLUSTER}")
        self.core = self._client.CoreV1Api()
        for worker in self.workers:
            nodes = self.core.list_node(label_selector=f"plugvisor.io/lab-profile={worker.name}").items
            assert len(nodes) == 1, f"expected one node labelled plugvisor.io/lab-profile={worker.name}"
            self.node_names[worker.name] = nodes[0].metadata.name
        self.apply_lab_overlay()
        self.progress("waiting for every DaemonSet")
        self.wait_daemonsets()

    def teardown(self) -> None:
        if self.keep or not self.created:
            self.progress(
                f"kept kind cluster {CLUSTER} (delete it with: kind delete cluster --name {CLUSTER})"
            )
            return
        subprocess.run(["kind", "delete", "cluster", "--name", CLUSTER], capture_output=True, check=False)

    def restart_kubelet(self, worker: str) -> None:
        run(["docker", "exec", self.node_names[worker], "systemctl", "restart", "kubelet"])
