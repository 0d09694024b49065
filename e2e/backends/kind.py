"""A kind cluster (kind-config.yaml): the image built with docker and loaded into the nodes."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess

from ..deployment import REPO
from .api import ApiBackend
from .common import IMAGE, Progress, run

CLUSTER = "plugvisor-e2e"


def kind_unavailable() -> str | None:
    """Why the kind backend cannot run here (every reason at once), or None."""
    missing = [
        f"{tool} is not installed" for tool in ("docker", "kind", "kubectl") if shutil.which(tool) is None
    ]
    if shutil.which("docker") is not None:
        info = subprocess.run(["docker", "info"], capture_output=True, text=True, check=False)
        if info.returncode != 0:
            missing.append("docker is installed but no Docker engine answers (docker info failed)")
    if importlib.util.find_spec("kubernetes") is None:
        missing.append("the kubernetes Python client is not installed (the e2e extra; use tox -e e2e)")
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
