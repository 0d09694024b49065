"""Real clusters: every check through the API server with the official client, every operation as an
operator performs it (kubectl apply -k, exec, delete). KindBackend and LocalBackend differ only in how the
cluster, its images and its nodes come to be, and in how a kubelet is restarted."""

from __future__ import annotations

import contextlib
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

from ..deployment import LAB_OVERLAY, Worker, agent_selector, agents, workers
from .common import IMAGE, POD_SCRIPT, PodView, Progress, parse_shell_report, wait_until


class ApiBackend:
    """The scenarios' operations on a real cluster; subclasses bring the cluster up and name the nodes."""

    name = "api"
    timeout = 300.0
    pod_image = IMAGE
    pod_command: tuple[str, ...] = ("python", "-c", POD_SCRIPT)

    def __init__(self, progress: Progress) -> None:
        from kubernetes import client, config  # noqa: PLC0415 - the e2e extra, needed by these backends only

        self.progress = progress
        self.workers: list[Worker] = workers()
        self._client = client
        self._config = config
        self.core: Any = None
        self.node_names: dict[str, str] = {}

    def setup(self) -> None:
        raise NotImplementedError

    def teardown(self) -> None:
        raise NotImplementedError

    def kubectl(self, *args: str, timeout: float = 300) -> str:
        raise NotImplementedError

    def node(self, worker: str) -> str:
        """The node that plays ``worker`` (a hook: the local backend's one node plays each in turn)."""
        return self.node_names[worker]

    def apply_lab_overlay(self) -> None:
        self.progress("kubectl apply -k deploy/kubernetes/overlays/lab")
        self.kubectl("apply", "-k", str(LAB_OVERLAY))

    def wait_daemonsets(self, overlay: Path = LAB_OVERLAY) -> None:
        for name in ["plugvisor-lab", *(a.daemonset for a in agents(overlay))]:
            self.kubectl(
                "-n", "kube-system", "rollout", "status", f"ds/{name}", "--timeout=600s", timeout=660
            )

    def node_resources(self, worker: str) -> tuple[dict[str, int], dict[str, int]]:
        status = self.core.read_node(self.node(worker)).status
        capacity = {k: int(v) for k, v in (status.capacity or {}).items() if k.startswith("plugvisor.io/")}
        allocatable = {
            k: int(v) for k, v in (status.allocatable or {}).items() if k.startswith("plugvisor.io/")
        }
        return capacity, allocatable

    def create_pod(self, worker: str, name: str, limits: dict[str, int]) -> None:
        self.core.create_namespaced_pod(
            "default",
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": name},
                "spec": {
                    "nodeSelector": {"kubernetes.io/hostname": self.node(worker)},
                    "restartPolicy": "Never",
                    "terminationGracePeriodSeconds": 0,
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "containers": [
                        {
                            "name": "check",
                            "image": self.pod_image,
                            "imagePullPolicy": "IfNotPresent",
                            "command": list(self.pod_command),
                            "resources": {"limits": {k: str(v) for k, v in limits.items()}},
                        }
                    ],
                },
            },
        )

    def pod(self, name: str) -> PodView | None:
        try:
            pod = self.core.read_namespaced_pod(name, "default")
        except self._client.ApiException as exc:
            if exc.status == 404:
                return None
            raise
        phase = pod.status.phase
        message = pod.status.message or ""
        if phase != "Running":
            return PodView(phase, message=message)
        report = self.container_report(name)
        if report is None:
            return PodView("Starting", message="no report from the container yet")
        devices, env = report
        return PodView(phase, devices, env, message)

    def container_report(self, name: str) -> tuple[tuple[str, ...], dict[str, str]] | None:
        """What the pod's container printed about itself (devices, environment), once it has."""
        import json  # noqa: PLC0415

        log = self.core.read_namespaced_pod_log(name, "default")
        if self.pod_command[0] != "python":
            return parse_shell_report(log)
        lines = [line for line in log.splitlines() if line.startswith("{")]
        if not lines:
            return None
        report = json.loads(lines[-1])
        return tuple(report["devices"]), report["env"]

    def delete_pod(self, name: str) -> None:
        with contextlib.suppress(self._client.ApiException):
            self.core.delete_namespaced_pod(name, "default", grace_period_seconds=0)
        wait_until(
            lambda: self.pod(name) is None, timeout=self.timeout, what=f"pod {name} deleted", interval=0.5
        )

    def _running_pods(self, worker: str, selector: str) -> list[str]:
        pods = self.core.list_namespaced_pod(
            "kube-system", label_selector=selector, field_selector=f"spec.nodeName={self.node(worker)}"
        ).items
        return [
            str(p.metadata.name)
            for p in pods
            if p.status.phase == "Running" and not p.metadata.deletion_timestamp
        ]

    def _pod_on(self, worker: str, selector: str) -> str:
        running = self._running_pods(worker, selector)
        assert running, f"no running pod {selector} on {worker}"
        return running[0]

    def lab(self, worker: str, command: str, *args: str) -> str:
        pod = self._pod_on(worker, "app.kubernetes.io/name=plugvisor-lab")
        return self.kubectl(
            "-n", "kube-system", "exec", pod, "-c", "watch", "--", "plugvisor", "lab", command, "/lab", *args
        )

    def lab_read(self, worker: str, path: str) -> str:
        pod = self._pod_on(worker, "app.kubernetes.io/name=plugvisor-lab")
        return self.kubectl("-n", "kube-system", "exec", pod, "-c", "watch", "--", "cat", f"/lab/{path}")

    def agent_exec(self, worker: str, kind: str, argv: list[str], *, dra: bool = False) -> str:
        pod = self._pod_on(worker, agent_selector(kind, dra=dra))
        return self.kubectl("-n", "kube-system", "exec", pod, "-c", "agent", "--", *argv)

    def delete_agent(self, worker: str, kind: str) -> None:
        selector = agent_selector(kind, dra=False)
        pod = self._pod_on(worker, selector)
        self.core.delete_namespaced_pod(pod, "kube-system")
        wait_until(  # maxSurge 0: the new pod is made once the old one is gone
            lambda: set(self._running_pods(worker, selector)) - {pod},
            timeout=self.timeout,
            what=f"the DaemonSet replaced agent pod {pod}",
            interval=1,
        )

    def restart_kubelet(self, worker: str) -> None:
        raise NotImplementedError

    # -- what only the node shows (the DRA scenarios: e2e/dra.py) --------------------------------------

    def node_unreachable(self) -> str | None:
        """Why this process cannot reach the nodes' files and sockets (:meth:`node_path`), or None."""
        return None

    def node_path(self, worker: str, path: Path) -> Path:
        """Where this process reaches ``path`` of the node that plays ``worker`` (an absolute path there):
        the node's files (CDI specs, checkpoints, the lab) and its unix sockets (the kubelet's registry and
        PodResources), to read, stat, connect to or bind, as a process on the node would."""
        raise NotImplementedError

    def kubelet_log(self, worker: str, since: float) -> str:
        """The kubelet's log on the node that plays ``worker``: klog's lines, at least those written at or
        after the wall-clock time ``since`` (older ones may come too: callers filter by each line's time)."""
        raise NotImplementedError

    def pod_http(self, namespace: str, pod: str, port: int, path: str) -> str:
        """The body of an HTTP GET of ``path`` on a pod's ``port``: here straight to the pod's IP (this
        process's host routes the pod network); a backend whose pods it cannot route to goes another way."""
        address = self.core.read_namespaced_pod(pod, namespace).status.pod_ip
        with urllib.request.urlopen(f"http://{address}:{port}{path}", timeout=10) as answer:
            return str(answer.read().decode())

    def diagnose(self) -> str:
        parts = []
        for argv in (
            ["-n", "kube-system", "logs", "-l", "app.kubernetes.io/name in (plugvisor,plugvisor-lab)",
             "--all-containers", "--prefix", "--tail=60"],
            *(["describe", "node", name] for name in sorted(set(self.node_names.values()))),
            ["describe", "pods", "-n", "default"],
            ["get", "events", "-A", "--sort-by=.lastTimestamp"],
            ["get", "pods", "-A", "-o", "wide"],
            ["get", "resourceclaims", "-A", "-o", "yaml"],
            ["get", "resourceslices", "-o", "yaml"],
        ):  # fmt: skip
            try:
                parts.append(f"--- kubectl {' '.join(argv)}\n{self.kubectl(*argv, timeout=60)[-6000:]}")
            except subprocess.SubprocessError as exc:
                parts.append(f"--- kubectl {' '.join(argv)} failed: {exc}")
        return "\n".join(parts)
