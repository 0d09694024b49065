"""What the repository says the kind cluster runs: workers, their lab profiles, the lab overlays' agents.

Read from kind-config.yaml and deploy/kubernetes/overlays/lab (device plugins) or lab-dra (DRA drivers), the
files `tox -e e2e` applies, so the emulated backend plays the same node layout and configuration as the kind
cluster.
(tests/integration/deploy checks that these files agree with what `kubectl kustomize` renders.)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from plugvisor.emulators.lab import Profile, load_profile

REPO = Path(__file__).resolve().parent.parent
LAB_OVERLAY = REPO / "deploy/kubernetes/overlays/lab"
LAB_DRA_OVERLAY = REPO / "deploy/kubernetes/overlays/lab-dra"
KIND_CONFIG = REPO / "kind-config.yaml"
PROFILE_LABEL = "plugvisor.io/lab-profile"


@dataclass(frozen=True)
class Agent:
    """One agent DaemonSet of a lab overlay: its kind, node selector and node.yaml."""

    kind: str
    selector: dict[str, str]
    config: dict[str, Any]
    daemonset: str
    """Its DaemonSet's name: ``plugvisor-<kind>``, or ``plugvisor-<kind>-dra`` for a DRA driver's agent."""

    def runs_on(self, labels: dict[str, str]) -> bool:
        node = {"kubernetes.io/os": "linux", **labels}
        return all(node.get(key) == value for key, value in self.selector.items())

    @property
    def resources(self) -> list[str]:
        return [entry["name"] for entry in self.config["resources"]]


def agent_selector(kind: str, *, dra: bool) -> str:
    """A label selector for the pods of a kind's device-plugin agent, or of its DRA driver's agent (both
    carry the kind's label; a DRA overlay's agent also says plugvisor.io/mode=dra)."""
    return f"plugvisor.io/kind={kind}," + ("plugvisor.io/mode=dra" if dra else "!plugvisor.io/mode")


@dataclass(frozen=True)
class Worker:
    """A kind worker: its labels and the lab profile kind-config.yaml mounts into it."""

    labels: dict[str, str]
    profile_path: Path
    profile: Profile

    @property
    def name(self) -> str:
        return self.labels[PROFILE_LABEL]


def workers() -> list[Worker]:
    config = yaml.safe_load(KIND_CONFIG.read_text())
    found = []
    for node in config["nodes"]:
        if node["role"] != "worker":
            continue
        mount = next(
            m for m in node["extraMounts"] if m["containerPath"] == "/etc/plugvisor/lab-profile.yaml"
        )
        path = REPO / mount["hostPath"]
        found.append(Worker(dict(node["labels"]), path, load_profile(path)))
    return found


def agents(overlay: Path = LAB_OVERLAY) -> list[Agent]:
    """The agents of the lab overlay (device plugins), or of ``LAB_DRA_OVERLAY`` (DRA drivers)."""
    kustomization = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    files = {}
    for generator in kustomization["configMapGenerator"]:
        (entry,) = generator["files"]
        files[generator["name"].replace("plugvisor-config-", "plugvisor-", 1)] = (
            overlay / entry.split("=", 1)[1]
        )
    found = []
    for patch in kustomization["patches"]:
        document = yaml.safe_load((overlay / patch["path"]).read_text())
        daemonset = document["metadata"]["name"]
        config = yaml.safe_load(files[daemonset].read_text())
        selector = {
            k: v for k, v in document["spec"]["template"]["spec"]["nodeSelector"].items() if k != "$patch"
        }
        (kind,) = {entry["kind"] for entry in config["resources"]}
        found.append(Agent(kind, selector, config, daemonset))
    return found


def expected_allocatable(worker: Worker) -> dict[str, int]:
    """What each resource should offer on a worker, from its profile and the agents' configuration."""
    profile = worker.profile
    expected: dict[str, int] = {}
    for agent in agents():
        if not agent.runs_on(worker.labels):
            continue
        for entry in agent.config["resources"]:
            if entry["kind"] == "gpu":
                count = sum(g.count for g in profile.gpus if g.model.startswith("nvidia"))
            elif entry["kind"] == "nic":
                count = sum(n.count * n.num_vfs for n in profile.nics if n.model == "intel-e810")
            elif entry["kind"] == "fpga":
                count = sum(f.count for f in profile.fpgas if f.model.startswith("intel-pac"))
            else:
                count = int(entry.get("count", 1))
            expected[entry["name"]] = count
    return expected
