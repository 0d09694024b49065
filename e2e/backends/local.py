"""The local cluster (e2e/local): upstream Kubernetes on this machine, its node playing each kind worker.

The node has no labels of its own: to play a worker it gets that worker's labels (kind-config.yaml) and its
lab profile at /etc/plugvisor/lab-profile.yaml, where kind mounts it. Switching roles is what an operator
would do to repurpose a node: take the lab labels off (the DaemonSet controller deletes the lab and the
agents), remove the old lab, put the new profile in place, label the node as the other worker, and wait
for the lab and that worker's agents to be rolled out. A scenario may add a role no kind worker has
(``add_role``); its lab is made by the lab's pod like every other's.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from ..deployment import PROFILE_LABEL, REPO, Worker
from ..local.cluster import BASE, NODE, ClusterError, LocalCluster, unavailable
from .api import ApiBackend
from .common import SHELL_POD_SCRIPT, Progress, run, wait_until

LAB_PROFILE = Path("/etc/plugvisor/lab-profile.yaml")
LAB_DIR = Path("/var/lib/plugvisor/lab")
IMAGES_SCRIPT = REPO / "tools/kubernetes/images.py"
KUBELET_LOG = BASE / "logs" / "kubelet.log"
"""The kubelet's log (e2e/local writes each component's stderr under its base directory)."""


def local_unavailable() -> str | None:
    """Why the local backend cannot run here (every missing piece at once), or None."""
    reasons = []
    cluster = unavailable()
    if cluster:
        reasons.append(cluster)
    if not IMAGES_SCRIPT.exists():
        reasons.append(f"{IMAGES_SCRIPT.relative_to(REPO)} is missing (it builds the images)")
    return "; ".join(reasons) or None


class LocalBackend(ApiBackend):
    """The scenarios on e2e/local's cluster; ``playing`` is the kind worker the node is now."""

    name = "local"
    pod_command = ("sh", "-c", SHELL_POD_SCRIPT)

    def __init__(self, progress: Progress) -> None:
        super().__init__(progress)
        self.cluster = LocalCluster(progress)
        self.node_names = {w.name: NODE for w in self.workers}
        self.roles: dict[str, Worker] = {w.name: w for w in self.workers}
        """What the node can play: the kind workers, and the roles scenarios add (:meth:`add_role`)."""
        self.playing: str | None = None
        self.left_behind: list[str] = []

    def kubectl(self, *args: str, timeout: float = 300) -> str:
        return run([*self.cluster.kubectl_argv(), *args], timeout=timeout)

    def setup(self) -> None:
        self.cluster.up()
        self._images()
        self._config.load_kube_config(config_file=str(self.cluster.kubeconfig))
        self.core = self._client.CoreV1Api()
        self.apply_lab_overlay()
        self.play(self.workers[0].name)

    def _images(self) -> None:
        """The project's image (its Dockerfile) and the pods' image, built without Docker and imported."""
        self.progress("images: tools/kubernetes/images.py (cached unless their inputs changed), ctr import")
        started = time.monotonic()
        result = subprocess.run(
            [sys.executable, str(IMAGES_SCRIPT), "--json", "--import", str(self.cluster.containerd_socket),
             "--ctr", str(self.cluster.bin / "ctr")],
            capture_output=True, text=True, timeout=3600, check=False,
        )  # fmt: skip
        if result.returncode != 0:
            raise ClusterError(f"images.py failed ({result.returncode}):\n{result.stderr[-4000:]}")
        images = json.loads(result.stdout)["images"]
        self.pod_image = next(i["name"] for ref, i in images.items() if ref != "plugvisor:e2e")
        self.progress(f"images ready ({time.monotonic() - started:.1f} s): {', '.join(images)}")

    def node(self, worker: str) -> str:
        self.play(worker)
        return NODE

    def add_role(self, role: Worker) -> None:
        """Let the node play ``role`` too (a profile no kind worker has), under its name."""
        self.roles[role.name] = role
        self.node_names[role.name] = NODE

    def play(self, worker: str) -> None:
        """Make the node play ``worker`` (a kind worker, or a role of :meth:`add_role`): its labels, its lab
        profile, its lab and its agents."""
        if self.playing == worker:
            return
        role = self.roles[worker]
        self.progress(f"the node plays {worker} now")
        started = time.monotonic()
        if self.playing is not None:
            labels = {key for w in self.roles.values() for key in w.labels}
            self.kubectl("label", "node", NODE, *(f"{key}-" for key in sorted(labels)))
            wait_until(
                lambda: not self.core.list_namespaced_pod("kube-system").items,
                timeout=self.timeout,
                what=f"the lab and the agents of {self.playing} gone",
                interval=1,
            )
        self.playing = None
        shutil.rmtree(LAB_DIR, ignore_errors=True)
        LAB_PROFILE.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(role.profile_path, LAB_PROFILE)
        self.kubectl("label", "node", NODE, "--overwrite", *(f"{k}={v}" for k, v in role.labels.items()))
        self.wait_daemonsets()
        self.playing = worker
        # What runs, not what the repository's overlay says: a scenario may have applied its own on top.
        kinds = sorted(
            {
                f"{pod.metadata.labels['plugvisor.io/kind']}"
                + (" (dra)" if pod.metadata.labels.get("plugvisor.io/mode") == "dra" else "")
                for pod in self.core.list_namespaced_pod(
                    "kube-system", label_selector="plugvisor.io/kind"
                ).items
            }
        )
        self.progress(
            f"{worker}: lab and agents ({', '.join(kinds)}) ready ({time.monotonic() - started:.1f} s)"
        )

    def restart_kubelet(self, worker: str) -> None:
        self.play(worker)
        self.cluster.restart_kubelet()

    def node_path(self, worker: str, path: Path) -> Path:
        """The node is this machine: its paths are this process's."""
        return path

    def kubelet_log(self, worker: str, since: float) -> str:
        return KUBELET_LOG.read_text(errors="replace")

    def teardown(self) -> None:
        if self.cluster.lock is None:  # set up without the lock: another owner's cluster is not ours to check
            return
        self.cluster.down()
        self.left_behind = self.cluster.leftovers()
        if self.left_behind:
            raise AssertionError(
                "cleanup check: the local cluster left behind\n  " + "\n  ".join(self.left_behind)
            )
        self.progress(
            "cleanup check: nothing left behind (processes, mounts, links, rules, cgroups, files, sysctls)"
        )

    def diagnose(self) -> str:
        return "\n".join(
            [
                f"--- the node plays {self.playing} ({PROFILE_LABEL})",
                super().diagnose(),
                self.cluster.logs_tail(40),
            ]
        )
