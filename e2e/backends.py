"""Where the scenarios run: an emulated node (offline) or a kind cluster, behind one small interface.

Both backends answer the questions a user asks a cluster (a node's capacity and allocatable, a pod's
phase, the device nodes and environment its container got) and perform the operations an operator
performs (create and delete pods, inject lab faults, delete an agent pod, run a command in it, restart
a kubelet). The scenarios in test_scenarios.py are written once against this interface.

- EmulatedBackend: per kind worker, a lab written from the worker's profile, `plugvisor kubelet` (the
  emulated kubelet, its own process, static pods in a directory) and one `plugvisor run` per agent of the
  lab overlay scheduled on that worker, with the overlay's node.yaml. It plays the DaemonSet controller
  (an agent that is "deleted" is started again) and the container runtime's view is the kubelet's runtime
  config for each container.
- KindBackend: the cluster of kind-config.yaml, the image built from this checkout, the lab overlay
  applied; every check goes through the API server with the official Kubernetes client.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import yaml

from .deployment import REPO, Worker, agents, workers

CLUSTER = "plugvisor-e2e"
IMAGE = "plugvisor:e2e"
T = TypeVar("T")

POD_SCRIPT = (
    "import glob, json, os, stat, time\n"
    "nodes = sorted(p for p in glob.glob('/dev/**', recursive=True) if stat.S_ISCHR(os.lstat(p).st_mode))\n"
    "print(json.dumps({'devices': nodes, 'env': dict(os.environ)}), flush=True)\n"
    "time.sleep(1e6)\n"
)
"""What a scenario pod runs: it reports the character devices and the environment it was given."""


class Progress:
    """Prints each step and how long the suite has run, live (past pytest's capture)."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.started = time.monotonic()

    def __call__(self, message: str) -> None:
        elapsed = time.monotonic() - self.started
        stream = sys.__stderr__ or sys.stderr
        stream.write(f"\n[e2e {self.backend} +{elapsed:6.1f}s] {message}")
        stream.flush()


def wait_until(predicate: Callable[[], T | None], *, timeout: float, what: str, interval: float = 0.2) -> T:
    """Poll until ``predicate`` returns something truthy; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        try:
            value = predicate()
        except (OSError, ValueError, KeyError, subprocess.SubprocessError) as exc:
            value, last_error = None, exc
        if value:
            return value
        if time.monotonic() > deadline:
            detail = f" (last error: {last_error!r})" if last_error else ""
            raise AssertionError(f"{what}: not within {timeout:.0f} s{detail}")
        time.sleep(interval)


@dataclass(frozen=True)
class PodView:
    """A pod as a user sees it: its phase, and what its container was given."""

    phase: str
    devices: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    message: str = ""


class Backend(Protocol):
    name: str
    timeout: float
    workers: list[Worker]
    progress: Progress

    def setup(self) -> None: ...
    def teardown(self) -> None: ...
    def node_resources(self, worker: str) -> tuple[dict[str, int], dict[str, int]]: ...
    def create_pod(self, worker: str, name: str, limits: dict[str, int]) -> None: ...
    def pod(self, name: str) -> PodView | None: ...
    def delete_pod(self, name: str) -> None: ...
    def lab(self, worker: str, command: str, *args: str) -> str: ...
    def lab_read(self, worker: str, path: str) -> str: ...
    def agent_exec(self, worker: str, kind: str, argv: list[str]) -> str: ...
    def delete_agent(self, worker: str, kind: str) -> None: ...
    def restart_kubelet(self, worker: str) -> None: ...
    def diagnose(self) -> str: ...


class CommandError(subprocess.SubprocessError):
    """A command of the scenario failed; waits retry it, anything else reports it with its output."""


def _run(
    argv: list[str], *, timeout: float = 120, env: dict[str, str] | None = None, cwd: Path | None = None
) -> str:
    result = subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd, check=False
    )
    if result.returncode != 0:
        raise CommandError(
            f"{' '.join(argv)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
        )
    return result.stdout


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"({path}: {exc.strerror})"


# -- offline: an emulated node per kind worker --------------------------------------------------


@dataclass
class _EmulatedNode:
    worker: Worker
    home: Path
    lab_root: Path
    kubelet: subprocess.Popen[bytes] | None = None
    watcher: subprocess.Popen[bytes] | None = None
    agents: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def kubelet_dir(self) -> Path:
        return self.home / "dp"

    @property
    def pods_dir(self) -> Path:
        return self.home / "pods"


class EmulatedBackend:
    """The kind cluster's workers, each as a lab + `plugvisor kubelet` + the overlay's `plugvisor run`s."""

    name = "emulated"
    timeout = 60.0

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.workers = workers()
        self.base = Path(tempfile.mkdtemp(prefix="/tmp/pve2e-"))
        scratch = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        self.lab_base = Path(tempfile.mkdtemp(prefix="pve2e-lab-", dir=scratch))
        self.nodes = {
            w.name: _EmulatedNode(w, self.base / w.name, self.lab_base / w.name / "lab") for w in self.workers
        }
        self.pod_nodes: dict[str, str] = {}

    def _plugvisor(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "plugvisor", *args]

    def _spawn(self, argv: list[str], log: Path) -> subprocess.Popen[bytes]:
        with log.open("ab") as out:
            return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out)

    def setup(self) -> None:
        for node in self.nodes.values():
            node.home.mkdir(parents=True)
            node.pods_dir.mkdir()
            node.kubelet_dir.mkdir()
            node.lab_root.parent.mkdir(parents=True)
            self.progress(f"{node.worker.name}: lab from {node.worker.profile_path.name}, kubelet")
            _run(
                self._plugvisor(
                    "lab", "create", str(node.lab_root), "--profile", str(node.worker.profile_path)
                )
            )
            node.watcher = self._spawn(
                self._plugvisor("lab", "watch", str(node.lab_root)), node.home / "lab.log"
            )
            node.kubelet = self._spawn(
                self._plugvisor(
                    "kubelet",
                    "--dir",
                    str(node.kubelet_dir),
                    "--pods",
                    str(node.pods_dir),
                    "--node-name",
                    node.worker.name,
                ),
                node.home / "kubelet.log",
            )
            wait_until(
                lambda n=node: (n.kubelet_dir / "kubelet.sock").exists(), timeout=30, what="kubelet.sock"
            )
            for agent in agents():
                if agent.runs_on(node.worker.labels):
                    self._start_agent(node, agent.kind)

    def _agent_config(self, node: _EmulatedNode, kind: str) -> Path:
        (agent,) = [a for a in agents() if a.kind == kind]
        config = dict(agent.config)
        config.pop("specRoot", None)  # the lab is where the runtime finds the nodes: hostRoot itself
        config |= {
            "kubeletDir": str(node.kubelet_dir),
            "hostRoot": str(node.lab_root),
            "metrics": {"listen": "127.0.0.1:0"},
            "supervisor": {**config.get("supervisor", {}), "runtimeDir": str(node.home / f"run-{kind}")},
        }
        path = node.home / f"node-{kind}.yaml"
        path.write_text(yaml.safe_dump(config))
        return path

    def _start_agent(self, node: _EmulatedNode, kind: str) -> None:
        config = self._agent_config(node, kind)
        node.agents[kind] = self._spawn(
            self._plugvisor("run", "--config", str(config), "--log-level", "info"),
            node.home / f"agent-{kind}.log",
        )

    def teardown(self) -> None:
        processes = [p for n in self.nodes.values() for p in (*n.agents.values(), n.kubelet, n.watcher) if p]
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        shutil.rmtree(self.base, ignore_errors=True)
        shutil.rmtree(self.lab_base, ignore_errors=True)

    def _view(self, node: _EmulatedNode, suffix: str) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(Path(f"{node.kubelet_dir}.{suffix}.json").read_text())
        return data

    def node_resources(self, worker: str) -> tuple[dict[str, int], dict[str, int]]:
        resources = self._view(self.nodes[worker], "kubelet")["resources"]
        capacity = {name: int(r["capacity"]) for name, r in resources.items()}
        allocatable = {name: int(r["allocatable"]) for name, r in resources.items()}
        return capacity, allocatable

    def create_pod(self, worker: str, name: str, limits: dict[str, int]) -> None:
        manifest = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {
                "containers": [
                    {
                        "name": "check",
                        "image": IMAGE,
                        "command": ["python", "-c", POD_SCRIPT],
                        "resources": {"limits": {k: str(v) for k, v in limits.items()}},
                    }
                ]
            },
        }
        node = self.nodes[worker]
        staged = node.home / f".{name}.yaml"
        staged.write_text(yaml.safe_dump(manifest))
        staged.rename(node.pods_dir / f"{name}.yaml")
        self.pod_nodes[name] = worker

    def pod(self, name: str) -> PodView | None:
        node = self.nodes[self.pod_nodes[name]]
        # A static pod is named <name>-<node name>, as a real kubelet names it.
        static_name = f"{name}-{node.worker.name.lower()}"
        for pod in self._view(node, "pods")["pods"]:
            if pod["metadata"]["name"] != static_name:
                continue
            status = pod["status"]
            (container,) = status["containerStatuses"]
            runtime = container.get("runtime") or {}
            devices = tuple(sorted(d["containerPath"] for d in runtime.get("devices", [])))
            waiting = container["state"].get("waiting", {})
            message = status.get("message") or waiting.get("message") or ""
            return PodView(status["phase"], devices, dict(runtime.get("envs", {})), message)
        return None

    def delete_pod(self, name: str) -> None:
        node = self.nodes[self.pod_nodes.pop(name)]
        with contextlib.suppress(FileNotFoundError):
            (node.pods_dir / f"{name}.yaml").unlink()

    def lab(self, worker: str, command: str, *args: str) -> str:
        return _run(self._plugvisor("lab", command, str(self.nodes[worker].lab_root), *args))

    def lab_read(self, worker: str, path: str) -> str:
        return (self.nodes[worker].lab_root / path).read_text()

    def agent_exec(self, worker: str, kind: str, argv: list[str]) -> str:
        node = self.nodes[worker]
        program = {"plugvisor": self._plugvisor(), "python": [sys.executable]}[argv[0]]
        env = {**os.environ, "PLUGVISOR_RUNTIME_DIR": str(node.home / f"run-{kind}")}
        return _run([*program, *argv[1:]], env=env)

    def delete_agent(self, worker: str, kind: str) -> None:
        """What deleting the pod does: SIGTERM, a graceful stop, and the DaemonSet starts a new one."""
        node = self.nodes[worker]
        process = node.agents[kind]
        process.send_signal(signal.SIGTERM)
        process.wait(30)
        self._start_agent(node, kind)

    def restart_kubelet(self, worker: str) -> None:
        kubelet = self.nodes[worker].kubelet
        assert kubelet is not None
        kubelet.send_signal(signal.SIGHUP)

    def diagnose(self) -> str:
        parts = []
        for node in self.nodes.values():
            for log in sorted(node.home.glob("*.log")):
                parts.append(f"--- {node.worker.name}: {log.name} (last lines)\n{_tail(log)}")
            for suffix in ("kubelet", "pods"):
                with contextlib.suppress(OSError, ValueError):
                    view = json.dumps(self._view(node, suffix), indent=1)[-4000:]
                    parts.append(f"--- {node.worker.name}: emulated kubelet {suffix} view\n{view}")
        return "\n".join(parts)


# -- a kind cluster --------------------------------------------------------------------------------


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


class KindBackend:
    """The cluster of kind-config.yaml with the lab overlay applied; checks through the API server."""

    name = "kind"
    timeout = 300.0

    def __init__(self, progress: Progress, *, keep: bool, reuse: bool) -> None:
        from kubernetes import client, config  # noqa: PLC0415 - the e2e extra, needed by this backend only

        self.progress = progress
        self.keep = keep
        self.reuse = reuse
        self.created = False
        self.workers = workers()
        self._client = client
        self._config = config
        self.core: Any = None
        self.node_names: dict[str, str] = {}

    def kubectl(self, *args: str, timeout: float = 300) -> str:
        return _run(["kubectl", "--context", f"kind-{CLUSTER}", *args], timeout=timeout)

    def setup(self) -> None:
        existing = _run(["kind", "get", "clusters"]).split()
        if CLUSTER in existing and self.reuse:
            self.progress(f"reusing kind cluster {CLUSTER}")
        else:
            if CLUSTER in existing:
                _run(["kind", "delete", "cluster", "--name", CLUSTER], timeout=300)
            self.progress("kind create cluster (a control plane, two workers)")
            _run(
                ["kind", "create", "cluster", "--config", "kind-config.yaml", "--wait", "180s"],
                timeout=900,
                cwd=REPO,  # kind resolves the relative extraMounts from where it runs
            )
            self.created = True
        self.progress(f"docker build -t {IMAGE} (the release Dockerfile) and kind load")
        _run(["docker", "build", "-t", IMAGE, str(REPO)], timeout=1200)
        _run(["kind", "load", "docker-image", IMAGE, "--name", CLUSTER], timeout=600)
        self._config.load_kube_config(context=f"kind-{CLUSTER}")
        self.core = self._client.CoreV1Api()
        for worker in self.workers:
            nodes = self.core.list_node(label_selector=f"plugvisor.io/lab-profile={worker.name}").items
            assert len(nodes) == 1, f"expected one node labelled plugvisor.io/lab-profile={worker.name}"
            self.node_names[worker.name] = nodes[0].metadata.name
        self.progress("kubectl apply -k deploy/kubernetes/overlays/lab; waiting for every DaemonSet")
        self.kubectl("apply", "-k", str(REPO / "deploy/kubernetes/overlays/lab"))
        for name in ["plugvisor-lab", *(f"plugvisor-{a.kind}" for a in agents())]:
            self.kubectl(
                "-n", "kube-system", "rollout", "status", f"ds/{name}", "--timeout=600s", timeout=660
            )

    def teardown(self) -> None:
        if self.keep or not self.created:
            self.progress(
                f"kept kind cluster {CLUSTER} (delete it with: kind delete cluster --name {CLUSTER})"
            )
            return
        subprocess.run(["kind", "delete", "cluster", "--name", CLUSTER], capture_output=True, check=False)

    def node_resources(self, worker: str) -> tuple[dict[str, int], dict[str, int]]:
        status = self.core.read_node(self.node_names[worker]).status
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
                    "nodeSelector": {"kubernetes.io/hostname": self.node_names[worker]},
                    "restartPolicy": "Never",
                    "terminationGracePeriodSeconds": 0,
                    "containers": [
                        {
                            "name": "check",
                            "image": IMAGE,
                            "imagePullPolicy": "IfNotPresent",
                            "command": ["python", "-c", POD_SCRIPT],
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
        log = self.core.read_namespaced_pod_log(name, "default")
        lines = [line for line in log.splitlines() if line.startswith("{")]
        if not lines:
            return PodView("Starting", message="no report from the container yet")
        report = json.loads(lines[-1])
        return PodView(phase, tuple(report["devices"]), report["env"], message)

    def delete_pod(self, name: str) -> None:
        with contextlib.suppress(self._client.ApiException):
            self.core.delete_namespaced_pod(name, "default", grace_period_seconds=0)

    def _pod_on(self, worker: str, selector: str) -> str:
        pods = self.core.list_namespaced_pod(
            "kube-system", label_selector=selector, field_selector=f"spec.nodeName={self.node_names[worker]}"
        ).items
        running = [p for p in pods if p.status.phase == "Running" and not p.metadata.deletion_timestamp]
        assert running, f"no running pod {selector} on {worker}"
        return str(running[0].metadata.name)

    def lab(self, worker: str, command: str, *args: str) -> str:
        pod = self._pod_on(worker, "app.kubernetes.io/name=plugvisor-lab")
        return self.kubectl(
            "-n", "kube-system", "exec", pod, "-c", "watch", "--", "plugvisor", "lab", command, "/lab", *args
        )

    def lab_read(self, worker: str, path: str) -> str:
        pod = self._pod_on(worker, "app.kubernetes.io/name=plugvisor-lab")
        return self.kubectl("-n", "kube-system", "exec", pod, "-c", "watch", "--", "cat", f"/lab/{path}")

    def agent_exec(self, worker: str, kind: str, argv: list[str]) -> str:
        pod = self._pod_on(worker, f"plugvisor.io/kind={kind}")
        return self.kubectl("-n", "kube-system", "exec", pod, "-c", "agent", "--", *argv)

    def delete_agent(self, worker: str, kind: str) -> None:
        pod = self._pod_on(worker, f"plugvisor.io/kind={kind}")
        self.core.delete_namespaced_pod(pod, "kube-system")
        wait_until(
            lambda: self._pod_on(worker, f"plugvisor.io/kind={kind}") != pod,
            timeout=self.timeout,
            what=f"the DaemonSet replaced agent pod {pod}",
            interval=1,
        )

    def restart_kubelet(self, worker: str) -> None:
        _run(["docker", "exec", self.node_names[worker], "systemctl", "restart", "kubelet"])

    def diagnose(self) -> str:
        parts = []
        for argv in (
            ["-n", "kube-system", "logs", "-l", "app.kubernetes.io/part-of=plugvisor", "--all-containers",
             "--prefix", "--tail=60"],
            *(["describe", "node", name] for name in self.node_names.values()),
            ["get", "events", "-A", "--sort-by=.lastTimestamp"],
            ["get", "pods", "-A", "-o", "wide"],
        ):  # fmt: skip
            try:
                parts.append(f"--- kubectl {' '.join(argv)}\n{self.kubectl(*argv, timeout=60)[-6000:]}")
            except subprocess.SubprocessError as exc:
                parts.append(f"--- kubectl {' '.join(argv)} failed: {exc}")
        return "\n".join(parts)
