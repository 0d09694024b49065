"""The lab's kinds as DRA drivers on the local cluster (overlays/lab-dra): what the DRA scenarios
(test_dra.py) and the cluster bench (bench/bench_dra_cluster.py) share.

Everything a user would look at goes through the API server with the official client (slices, claims,
pods); what only the node shows is read on the node, as an operator would: the CDI specs the container
runtime reads, the drivers' checkpoints, the kubelet's log, the processes of an agent's pod.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import grpc
import yaml

from plugvisor.api.pluginregistration.v1 import api_pb2 as reg_pb2
from plugvisor.api.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from plugvisor.common.hostpaths import HostPaths
from plugvisor.deviceplugin.hooks import PluginLifecycle
from plugvisor.dra.devices import device_json
from plugvisor.dra.hooks import DraDescriber, kind_resource
from plugvisor.dra.pool import build_pool
from plugvisor.plugins import kinds

from .backends.common import SHELL_POD_SCRIPT, wait_until
from .backends.local import LAB_DIR, LocalBackend
from .deployment import LAB_DRA_OVERLAY, REPO, Agent, Worker, agent_selector, agents
from .local.cluster import BASE, KUBELET_ROOT, NODE

CDI_DIR = Path("/var/run/cdi")
"""Where the drivers write each prepared claim's CDI spec on the node (components/dra mounts it)."""
PLUGINS_REGISTRY = KUBELET_ROOT / "plugins_registry"
KUBELET_LOG = BASE / "logs" / "kubelet.log"
EXAMPLES = REPO / "deploy/kubernetes/examples/dra"
GPU = "gpu.plugvisor.io"
NAMESPACE = "default"
_RESOURCE = ("resource.k8s.io", "v1")


def drivers_on(worker: Worker) -> dict[str, Agent]:
    """The lab-dra agents that run on ``worker``, by the driver each serves."""
    return {
        entry["name"]: agent
        for agent in agents(LAB_DRA_OVERLAY)
        if agent.runs_on(worker.labels)
        for entry in agent.config["resources"]
    }


def expected_devices(agent: Agent, driver: str) -> dict[str, dict[str, Any]]:
    """What ``driver`` should publish from the node's lab, as ResourceSlice devices (by name).

    Computed on the node from the lab the agent reads (its /host/sys, /host/dev... are the lab's), with the
    kind and options of the agent's node.yaml, started as the driver starts it: the same scan, the same
    rules (plugvisor.testing.dra_devices, plus the kind's start and close).
    """
    (entry,) = [e for e in agent.config["resources"] if e["name"] == driver]
    options = {k: v for k, v in entry.items() if k not in ("name", "kind", "mode")}
    kind = kinds.get_kind(entry["kind"])
    source = kind.build(
        options, HostPaths(root=LAB_DIR), resource=kind_resource(driver, kind.name), log_as=driver
    )
    # Started first, as the driver starts it: the gpu kind opens NVML there (the lab's stand-in answers the
    # same here as in the agent's container, which has the lab's NVML state mounted), and adds what it reads.
    lifecycle = source if isinstance(source, PluginLifecycle) else None
    if lifecycle is not None:
        lifecycle.start()
    try:
        describer = source if isinstance(source, DraDescriber) else None
        published = build_pool(source.scan(), describer, driver=driver).devices
    finally:
        if lifecycle is not None:
            lifecycle.close()
    return {device.name: device_json(device) for device in published.values()}


def spec_file(driver: str, claim_uid: str) -> Path:
    """The CDI spec a driver writes for a prepared claim (docs/dra.md: ``k8s.<driver>-claim_<uid>.json``)."""
    return CDI_DIR / f"k8s.{driver}-claim_{claim_uid}.json"


def checkpoint(driver: str) -> dict[str, Any]:
    """The claims a driver has recorded as prepared (its checkpoint beside its socket), by claim UID."""
    document = json.loads((KUBELET_ROOT / "plugins" / driver / "prepared-claims.json").read_text())
    return {claim["uid"]: claim for claim in document["claims"]}


def kubelet_log_lines(since: float) -> Iterator[str]:
    """The kubelet's log lines (klog's) written at or after the wall-clock time ``since``."""
    for line in KUBELET_LOG.read_text(errors="replace").splitlines():
        if line[:1] in "IWE" and line[1:5].isdigit():
            try:
                if kubelet_log_time(line) >= since:
                    yield line
            except ValueError:
                continue


def kubelet_logged(marker: str, since: float) -> float:
    """The wall-clock time of the kubelet's first log line with ``marker`` at or after ``since``."""
    found = wait_until(
        lambda: next((kubelet_log_time(x) for x in kubelet_log_lines(since) if marker in x), None),
        timeout=60,
        what=f"the kubelet's log saying {marker}",
    )
    return float(found)


def socket_identity(path: Path) -> tuple[int, int]:
    """A socket file's inode and change time: one bound anew differs in one of them (inodes are reused)."""
    status = path.stat()
    return status.st_ino, status.st_ctime_ns


def registration_serving(registration: Path, old: tuple[int, int]) -> bool:
    """Whether a new registration socket (not ``old``, see :func:`socket_identity`) answers GetInfo."""
    try:
        if socket_identity(registration) == old:
            return False
        with grpc.insecure_channel(f"unix://{registration}") as channel:
            reg_grpc.RegistrationStub(channel).GetInfo(reg_pb2.InfoRequest(), timeout=1)
    except (OSError, grpc.RpcError):
        return False
    return True


def kubelet_log_time(line: str) -> float:
    """The wall-clock time of a klog line (``I1125 20:27:00.307000 ...``; the year is this one)."""
    stamp = datetime.strptime(f"{time.localtime().tm_year} {line[1:21]}", "%Y %m%d %H:%M:%S.%f")
    return stamp.timestamp()


@dataclass
class DraLab:
    """The lab-dra overlay on a local cluster, and the operations the DRA scenarios perform on it."""

    local: LocalBackend

    @property
    def objects(self) -> Any:
        """The official client's API for resource.k8s.io objects (with the backend's configuration)."""
        return self.local._client.CustomObjectsApi()

    # -- deployment -------------------------------------------------------------------------------

    def apply(self) -> None:
        """The DRA drivers beside the lab overlay's device plugins (the two overlays share the lab)."""
        self.local.progress("kubectl apply -k deploy/kubernetes/overlays/lab-dra")
        self.local.kubectl("apply", "-k", str(LAB_DRA_OVERLAY))

    def remove_drivers(self) -> None:
        """Stop the DRA drivers' agents (their slices go with the kubelet's wiping, 30 s after)."""
        self.local.kubectl(
            "-n", "kube-system", "delete", "daemonsets", "-l", "plugvisor.io/mode=dra", "--wait=false"
        )

    def play(self, worker: Worker) -> dict[str, Agent]:
        """The node plays ``worker``; its DRA drivers' slices name every device its lab has for them."""
        self.local.play(worker.name)
        self.local.wait_daemonsets(LAB_DRA_OVERLAY)
        drivers = drivers_on(worker)
        for driver, agent in drivers.items():
            wanted = set(expected_devices(agent, driver))
            wait_until(
                lambda d=driver, w=wanted: set(self.devices(d)) == w,
                timeout=self.local.timeout,
                what=f"{worker.name}: the {driver} ResourceSlices name the lab's {len(wanted)} devices",
            )
        return drivers

    # -- slices and claims ------------------------------------------------------------------------

    def slices(self, driver: str) -> list[dict[str, Any]]:
        answer = self.objects.list_cluster_custom_object(
            *_RESOURCE, "resourceslices", field_selector=f"spec.driver={driver},spec.nodeName={NODE}"
        )
        items: list[dict[str, Any]] = answer["items"]
        return items

    def devices(self, driver: str) -> dict[str, dict[str, Any]]:
        """The devices ``driver`` publishes for the node now, by name (its pool's newest generation)."""
        slices = self.slices(driver)
        if not slices:
            return {}
        newest = max(s["spec"]["pool"]["generation"] for s in slices)
        return {
            d["name"]: d
            for s in slices
            if s["spec"]["pool"]["generation"] == newest
            for d in s["spec"]["devices"]
        }

    def create_template(self, example: str) -> str:
        """The ResourceClaimTemplate of one of deploy/kubernetes/examples/dra, as it is; returns its name."""
        docs = [d for d in yaml.safe_load_all((EXAMPLES / example).read_text()) if d]
        (template,) = [d for d in docs if d["kind"] == "ResourceClaimTemplate"]
        name: str = template["metadata"]["name"]
        existing = self.objects.list_namespaced_custom_object(
            *_RESOURCE, NAMESPACE, "resourceclaimtemplates", field_selector=f"metadata.name={name}"
        )
        if not existing["items"]:
            self.objects.create_namespaced_custom_object(
                *_RESOURCE, NAMESPACE, "resourceclaimtemplates", template
            )
        return name

    def create_pod(self, name: str, template: str, claim: str) -> None:
        """A pod whose one container uses a claim made from ``template``, reporting what it got."""
        self.local.core.create_namespaced_pod(
            NAMESPACE,
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": name},
                "spec": {
                    "nodeSelector": {"kubernetes.io/hostname": NODE},
                    "restartPolicy": "Never",
                    "terminationGracePeriodSeconds": 0,
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "resourceClaims": [{"name": claim, "resourceClaimTemplateName": template}],
                    "containers": [
                        {
                            "name": "check",
                            "image": self.local.pod_image,
                            "imagePullPolicy": "IfNotPresent",
                            "command": ["sh", "-c", SHELL_POD_SCRIPT],
                            "resources": {"claims": [{"name": claim}]},
                        }
                    ],
                },
            },
        )

    def claim_of(self, pod: str) -> dict[str, Any]:
        """The ResourceClaim made for ``pod`` from its template (named in the pod's status)."""

        def named() -> str | None:
            statuses = self.local.core.read_namespaced_pod(pod, NAMESPACE).status.resource_claim_statuses
            return next((s.resource_claim_name for s in statuses or [] if s.resource_claim_name), None)

        name = wait_until(named, timeout=self.local.timeout, what=f"the claim of pod {pod}")
        claim: dict[str, Any] = self.objects.get_namespaced_custom_object(
            *_RESOURCE, NAMESPACE, "resourceclaims", name
        )
        return claim

    def claim_gone(self, name: str) -> bool:
        found = self.objects.list_namespaced_custom_object(
            *_RESOURCE, NAMESPACE, "resourceclaims", field_selector=f"metadata.name={name}"
        )
        return not found["items"]

    # -- the driver's process ---------------------------------------------------------------------

    def agent_status(self, worker: Worker, kind: str) -> dict[str, Any]:
        status: dict[str, Any] = json.loads(
            self.local.agent_exec(worker.name, kind, ["plugvisor", "status", "--json"], dra=True)
        )
        return status

    def driver_child(self, worker: Worker, kind: str) -> dict[str, Any] | None:
        """The agent's one DRA child (``plugvisor status``), once it runs and the kubelet registered it."""
        (child,) = self.agent_status(worker, kind)["children"]
        return child if child["state"] == "RUNNING" and child["registered"] else None

    def pod_pids(self, worker: Worker, kind: str, *, dra: bool = True) -> list[int]:
        """The node's PIDs of the processes of the kind's agent pod (its DRA driver's, or device plugin's)."""
        (pod,) = self.local._running_pods(worker.name, agent_selector(kind, dra=dra))
        uid = str(self.local.core.read_namespaced_pod(pod, "kube-system").metadata.uid)
        return [host for host, cgroup, _ in _processes() if f"pod{uid}" in cgroup.replace("_", "-")]

    def host_pid(self, worker: Worker, kind: str, pid: int, *, dra: bool = True) -> int:
        """The node's PID of the agent pod's process ``pid`` (its number in the pod's PID namespace)."""
        pids = set(self.pod_pids(worker, kind, dra=dra))
        for host, _, ns_pids in _processes():
            if host in pids and ns_pids[-1] == pid:
                return host
        raise AssertionError(f"no process of the {kind} agent's pod has PID {pid} in its namespace")


def _processes() -> Iterator[tuple[int, str, list[int]]]:
    """(host PID, cgroup file, NSpid) of every process on the node."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            cgroup = Path(entry.path, "cgroup").read_text()
            status = Path(entry.path, "status").read_text()
        except OSError:
            continue
        found = re.search(r"^NSpid:\s+(.*)$", status, re.MULTILINE)
        if found:
            yield int(entry.name), cgroup, [int(p) for p in found.group(1).split()]


def stop_process(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)


def kill_process(pid: int) -> float:
    """SIGKILL ``pid``; the monotonic time it was sent."""
    sent = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    return sent


def by_name(devices: Mapping[str, dict[str, Any]], attribute: str) -> dict[str, Any]:
    """One attribute's value (whatever its type) of each device, by device name."""
    return {
        name: next(iter(device.get("attributes", {}).get(attribute, {}).values()), None)
        for name, device in devices.items()
    }
