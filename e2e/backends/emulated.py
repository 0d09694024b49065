"""Offline: each kind worker as a lab, `plugvisor kubelet` and the lab overlay's `plugvisor run`s."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..deployment import Worker, agents, workers
from .common import IMAGE, POD_SCRIPT, PodView, Progress, run, tail, wait_until


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
            run(
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
        return run(self._plugvisor("lab", command, str(self.nodes[worker].lab_root), *args))

    def lab_read(self, worker: str, path: str) -> str:
        return (self.nodes[worker].lab_root / path).read_text()

    def agent_exec(self, worker: str, kind: str, argv: list[str]) -> str:
        node = self.nodes[worker]
        program = {"plugvisor": self._plugvisor(), "python": [sys.executable]}[argv[0]]
        env = {**os.environ, "PLUGVISOR_RUNTIME_DIR": str(node.home / f"run-{kind}")}
        return run([*program, *argv[1:]], env=env)

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
                parts.append(f"--- {node.worker.name}: {log.name} (last lines)\n{tail(log)}")
            for suffix in ("kubelet", "pods"):
                with contextlib.suppress(OSError, ValueError):
                    view = json.dumps(self._view(node, suffix), indent=1)[-4000:]
                    parts.append(f"--- {node.worker.name}: emulated kubelet {suffix} view\n{view}")
        return "\n".join(parts)
