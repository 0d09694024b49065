"""The lab's kinds as DRA drivers on a real cluster (overlays/lab-dra), the local one or kind's: what the
DRA scenarios (test_dra.py) and the cluster bench (bench/bench_dra_cluster.py, local only) share.

Everything a user would look at goes through the API server with the official client (slices, claims,
pods); what only the node shows is read on the node, as an operator would: the CDI specs the container
runtime reads, the drivers' checkpoints, the kubelet's log, the processes of an agent's pod. The backend
says where this process reaches the node's files and sockets (``node_path``: the local node's are this
machine's; a kind node's are in its container) and how its kubelet's log is read (``kubelet_log``). The
processes are found in this machine's /proc either way: a kind node's containers run on this kernel.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
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
from plugvisor.emulators.lab import Lab
from plugvisor.plugins import kinds

from .backends.api import ApiBackend
from .backends.common import SHELL_POD_SCRIPT, wait_until
from .backends.local import KUBELET_LOG, LAB_DIR, LocalBackend
from .deployment import LAB_DRA_OVERLAY, REPO, Agent, Worker, agent_selector, agents
from .local.cluster import KUBELET_ROOT, NODE

CDI_DIR = Path("/var/run/cdi")
"""Where the drivers write each prepared claim's CDI spec on the node (components/dra mounts it)."""
PLUGINS_REGISTRY = KUBELET_ROOT / "plugins_registry"
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


def expected_devices(agent: Agent, driver: str, lab: Path = LAB_DIR) -> dict[str, dict[str, Any]]:
    """What ``driver`` should publish from the node's lab, as ResourceSlice devices (by name).

    Computed from the lab the agent reads (its /host/sys, /host/dev... are the lab's), reached at ``lab``
    (the node's /var/lib/plugvisor/lab, as this process reaches it), with the kind and options of the
    agent's node.yaml, started as the driver starts it: the same scan, the same rules
    (plugvisor.testing.dra_devices, plus the kind's start and close).
    """
    (entry,) = [e for e in agent.config["resources"] if e["name"] == driver]
    options = {k: v for k, v in entry.items() if k not in ("name", "kind", "mode")}
    kind = kinds.get_kind(entry["kind"])
    source = kind.build(
        options, HostPaths(root=lab), resource=kind_resource(driver, kind.name), log_as=driver
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


def checkpoint_file(driver: str) -> Path:
    """A driver's checkpoint on the node: the claims it has prepared, beside its socket."""
    return KUBELET_ROOT / "plugins" / driver / "prepared-claims.json"


def checkpoint(driver: str, file: Path | None = None) -> dict[str, Any]:
    """The claims a driver has recorded as prepared (its checkpoint, read at ``file``: by default where the
    local node keeps it), by claim UID."""
    document = json.loads((file or checkpoint_file(driver)).read_text())
    return {claim["uid"]: claim for claim in document["claims"]}


def kubelet_log_lines(since: float, log: str | None = None) -> Iterator[str]:
    """The kubelet's log lines (klog's) written at or after the wall-clock time ``since``, from ``log`` (by
    default the local node's log file)."""
    text = KUBELET_LOG.read_text(errors="replace") if log is None else log
    for line in text.splitlines():
        if line[:1] in "IWE" and line[1:5].isdigit():
            try:
                if kubelet_log_time(line) >= since:
                    yield line
            except ValueError:
                continue


def kubelet_logged(marker: str, since: float, read: Callable[[], str] | None = None) -> float:
    """The wall-clock time of the kubelet's first log line with ``marker`` at or after ``since`` (the log as
    ``read`` returns it; by default the local node's file)."""

    def first() -> float | None:
        lines = kubelet_log_lines(since, None if read is None else read())
        return next((kubelet_log_time(x) for x in lines if marker in x), None)

    found = wait_until(
        first,
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
    """The lab-dra overlay on a real cluster, and the operations the DRA scenarios perform on it.

    ``worker`` is the worker the scenarios look at now (:meth:`play`): on the local backend the one its
    node plays, on kind the node that is that worker; slices, pods and the node's files are that node's.
    """

    cluster: ApiBackend
    worker: Worker | None = None
    _copies: Path | None = field(default=None, init=False, repr=False)
    """Where :meth:`lab` copies kind nodes' labs to (made on the first copy)."""
    _copied: dict[str, Path] = field(default_factory=dict, init=False, repr=False)
    """The newest copy of each worker's lab."""

    @property
    def objects(self) -> Any:
        """The official client's API for resource.k8s.io objects (with the backend's configuration)."""
        return self.cluster._client.CustomObjectsApi()

    @property
    def local(self) -> LocalBackend:
        """The cluster, where only the local backend will do (test_nvidia.py, the cluster bench)."""
        assert isinstance(self.cluster, LocalBackend), f"needs the local backend, not {self.cluster.name}"
        return self.cluster

    @property
    def node(self) -> str:
        """The name of the node of the worker played now (the local backend's one node plays every role,
        those test_nvidia.py adds included, whether or not :meth:`play` chose it)."""
        if isinstance(self.cluster, LocalBackend):
            return NODE
        assert self.worker is not None, "no worker chosen yet (DraLab.play)"
        return str(self.cluster.node_names[self.worker.name])

    # -- on the node ------------------------------------------------------------------------------

    def reach(self, path: Path) -> Path:
        """Where this process reaches ``path`` of the node played now (see ApiBackend.node_path)."""
        if isinstance(self.cluster, LocalBackend):
            return path
        assert self.worker is not None, "no worker chosen yet (DraLab.play)"
        return self.cluster.node_path(self.worker.name, path)

    def lab(self, *, fresh: bool = False) -> Path:
        """The node's lab (/var/lib/plugvisor/lab) where this process reads it as a lab: on the local node the
        lab itself; from a kind node a copy (``cp -a``: device nodes and links as they are; made anew when
        ``fresh`` or none was made for this worker yet), since a lab found through /proc/PID/root resolves
        to paths of this machine's root (the NVML stand-in looks for its state up from its own real path).
        Faults and heals go to the lab itself (:meth:`fault`)."""
        if isinstance(self.cluster, LocalBackend):
            return LAB_DIR
        assert self.worker is not None, "no worker chosen yet (DraLab.play)"
        if fresh or self.worker.name not in self._copied:
            if self._copies is None:
                self._copies = Path(tempfile.mkdtemp(prefix="pvdralab-"))
            copy = self._copies / f"{self.worker.name}-{time.monotonic_ns()}"
            subprocess.run(
                ["cp", "-a", str(self.reach(LAB_DIR)), str(copy)],
                check=True, capture_output=True, timeout=300,
            )  # fmt: skip
            self._copied[self.worker.name] = copy
        return self._copied[self.worker.name]

    def fault(self, device: str, kind: str) -> None:
        """Inject a lab fault on the node played now: with the lab's API on the local node (this machine),
        through the lab's pod (``plugvisor lab fault``) on a kind node."""
        if isinstance(self.cluster, LocalBackend):
            Lab.open(LAB_DIR).fault(device, kind)
            return
        assert self.worker is not None, "no worker chosen yet (DraLab.play)"
        self.cluster.lab(self.worker.name, "fault", device, kind)

    def heal(self, device: str) -> None:
        """Undo every fault of ``device`` on the node played now (as :meth:`fault` injects them)."""
        if isinstance(self.cluster, LocalBackend):
            Lab.open(LAB_DIR).heal(device)
            return
        assert self.worker is not None, "no worker chosen yet (DraLab.play)"
        self.cluster.lab(self.worker.name, "heal", device)

    def close(self) -> None:
        """Remove the copies of the nodes' labs :meth:`lab` made."""
        if self._copies is not None:
            shutil.rmtree(self._copies, ignore_errors=True)
            self._copies = None

    def checkpoint(self, driver: str) -> dict[str, Any]:
        """The claims ``driver`` has recorded as prepared on the node played now, by claim UID."""
        return checkpoint(driver, self.reach(checkpoint_file(driver)))

    def kubelet_log(self, since: float) -> str:
        if isinstance(self.cluster, LocalBackend):
            return KUBELET_LOG.read_text(errors="replace")
        assert self.worker is not None, "no worker chosen yet (DraLab.play)"
        return self.cluster.kubelet_log(self.worker.name, since)

    def kubelet_log_lines(self, since: float) -> Iterator[str]:
        """The kubelet's klog lines on the node played now, written at or after ``since``."""
        return kubelet_log_lines(since, self.kubelet_log(since))

    def kubelet_logged(self, marker: str, since: float) -> float:
        """When the node's kubelet first logged ``marker`` at or after ``since`` (waiting for it)."""
        return kubelet_logged(marker, since, lambda: self.kubelet_log(since))

    def wait_node_ready(self) -> None:
        """The node played now is Ready (after a kubelet restart, say)."""
        if isinstance(self.cluster, LocalBackend):
            self.cluster.cluster.wait_node_ready()
            return
        node = self.node

        def ready() -> bool:
            conditions = self.cluster.core.read_node(node).status.conditions or []
            return any(c.type == "Ready" and c.status == "True" for c in conditions)

        wait_until(ready, timeout=self.cluster.timeout, what=f"node {node} Ready")

    # -- deployment -------------------------------------------------------------------------------

    def apply(self) -> None:
        """The DRA drivers beside the lab overlay's device plugins (the two overlays share the lab)."""
        self.cluster.progress("kubectl apply -k deploy/kubernetes/overlays/lab-dra")
        self.cluster.kubectl("apply", "-k", str(LAB_DRA_OVERLAY))

    def remove_drivers(self) -> None:
        """Stop the DRA drivers' agents (their slices go with the kubelet's wiping, 30 s after)."""
        self.cluster.kubectl(
            "-n", "kube-system", "delete", "daemonsets", "-l", "plugvisor.io/mode=dra", "--wait=false"
        )

    def play(self, worker: Worker) -> dict[str, Agent]:
        """The scenarios look at ``worker`` now (the local node plays it; a kind node is it); its DRA drivers'
        slices name every device its lab has for them."""
        if isinstance(self.cluster, LocalBackend):
            self.cluster.play(worker.name)
        self.worker = worker
        self.cluster.wait_daemonsets(LAB_DRA_OVERLAY)
        drivers = drivers_on(worker)
        lab = self.lab(fresh=True)
        for driver, agent in drivers.items():
            wanted = set(expected_devices(agent, driver, lab))
            wait_until(
                lambda d=driver, w=wanted: set(self.devices(d)) == w,
                timeout=self.cluster.timeout,
                what=f"{worker.name}: the {driver} ResourceSlices name the lab's {len(wanted)} devices",
            )
        return drivers

    # -- slices and claims ------------------------------------------------------------------------

    def slices(self, driver: str) -> list[dict[str, Any]]:
        answer = self.objects.list_cluster_custom_object(
            *_RESOURCE, "resourceslices", field_selector=f"spec.driver={driver},spec.nodeName={self.node}"
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
        self.cluster.core.create_namespaced_pod(
            NAMESPACE,
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": name},
                "spec": {
                    "nodeSelector": {"kubernetes.io/hostname": self.node},
                    "restartPolicy": "Never",
                    "terminationGracePeriodSeconds": 0,
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "resourceClaims": [{"name": claim, "resourceClaimTemplateName": template}],
                    "containers": [
                        {
                            "name": "check",
                            "image": self.cluster.pod_image,
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
            statuses = self.cluster.core.read_namespaced_pod(pod, NAMESPACE).status.resource_claim_statuses
            return next((s.resource_claim_name for s in statuses or [] if s.resource_claim_name), None)

        name = wait_until(named, timeout=self.cluster.timeout, what=f"the claim of pod {pod}")
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
            self.cluster.agent_exec(worker.name, kind, ["plugvisor", "status", "--json"], dra=True)
        )
        return status

    def driver_child(self, worker: Worker, kind: str) -> dict[str, Any] | None:
        """The agent's one DRA child (``plugvisor status``), once it runs and the kubelet registered it."""
        (child,) = self.agent_status(worker, kind)["children"]
        return child if child["state"] == "RUNNING" and child["registered"] else None

    def pod_pids(self, worker: Worker, kind: str, *, dra: bool = True) -> list[int]:
        """The node's PIDs of the processes of the kind's agent pod (its DRA driver's, or device plugin's)."""
        (pod,) = self.cluster._running_pods(worker.name, agent_selector(kind, dra=dra))
        uid = str(self.cluster.core.read_namespaced_pod(pod, "kube-system").metadata.uid)
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
