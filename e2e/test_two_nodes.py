"""Both kind workers at once: what only a cluster with two lab nodes shows.

kind-config.yaml's two workers (gpu-node, nic-fpga-node) run side by side: both serve their kinds at the
same time, each DaemonSet's agents run on the nodes whose hardware they need and nowhere else, the
scheduler places a pod by the resources it asks for (no node selector), one worker's agent going leaves the
other worker alone, and as DRA drivers (overlays/lab-dra) each worker publishes its own pool and a claim
for a device only one worker has is allocated there. Checked as a user checks, through the API server.

The emulated backend has no scheduler, and the local backend's one node plays the workers in turn: there
these skip, saying so.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from .backends import Backend, wait_until
from .backends.api import ApiBackend
from .deployment import LAB_DRA_OVERLAY, Worker, agents, expected_allocatable
from .test_scenarios import FPGA, GPU, VF, _all_registered, _running, _status, _wait_allocatable

pytestmark = pytest.mark.e2e

NAMESPACE = "default"
RESOURCE_API = ("resource.k8s.io", "v1")


@pytest.fixture(scope="module")
def cluster(backend: Backend) -> ApiBackend:
    """The backend, when it has an API server, a scheduler and a node per worker."""
    if not isinstance(backend, ApiBackend):
        pytest.skip(
            f"needs an API server and a scheduler over two nodes; the {backend.name} backend has neither"
        )
    nodes = {backend.node_names.get(w.name) for w in backend.workers}
    if len(nodes) < len(backend.workers) or len(nodes) < 2:
        pytest.skip(
            f"needs a node per worker at once; the {backend.name} backend's one node plays them in turn"
        )
    # The scenarios before may have left a lab changed (test_vfs_added_in_the_lab_become_allocatable leaves
    # 16 VFs on the E810): each worker is put back to what its profile says.
    for worker in backend.workers:
        e810 = [n for n in worker.profile.nics if n.model == "intel-e810"]
        if e810 and backend.node_resources(worker.name)[1].get(VF) != expected_allocatable(worker).get(VF):
            backend.progress(f"{worker.name}: nic0 back to the profile's {e810[0].num_vfs} VFs")
            backend.lab(worker.name, "vfs", "nic0", "0")  # as the kernel wants: to 0 first, then the count
            backend.lab(worker.name, "vfs", "nic0", str(e810[0].num_vfs))
    return backend


def _worker(cluster: ApiBackend, *, has: str) -> Worker:
    return next(w for w in cluster.workers if getattr(w.profile, has))


def _create_pod(
    cluster: ApiBackend, name: str, *, limits: dict[str, int] | None = None, claim: str | None = None
) -> None:
    """A pod with no node selector: where it runs is the scheduler's choice, from what it asks for."""
    container: dict[str, Any] = {
        "name": "check",
        "image": cluster.pod_image,
        "imagePullPolicy": "IfNotPresent",
        "command": list(cluster.pod_command),
        "resources": {"limits": {k: str(v) for k, v in (limits or {}).items()}},
    }
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 0,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "containers": [container],
    }
    if claim is not None:
        spec["resourceClaims"] = [{"name": "device", "resourceClaimTemplateName": claim}]
        container["resources"] = {"claims": [{"name": "device"}]}
    cluster.core.create_namespaced_pod(
        NAMESPACE, {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}
    )


def _node_of(cluster: ApiBackend, pod: str) -> str:
    return str(cluster.core.read_namespaced_pod(pod, NAMESPACE).spec.node_name)


def _container(cluster: ApiBackend, pod: str) -> tuple[str, int]:
    (status,) = cluster.core.read_namespaced_pod(pod, NAMESPACE).status.container_statuses
    return str(status.container_id), int(status.restart_count)


def test_both_workers_serve_their_kinds_at_once_each_agent_only_where_its_hardware_is(
    cluster: ApiBackend,
) -> None:
    """Each worker advertises its lab's resources while the other does too; every agent of each worker is
    registered; each agent DaemonSet has a pod on exactly the workers whose labels it selects."""
    for worker in cluster.workers:
        for resource, count in expected_allocatable(worker).items():
            _wait_allocatable(cluster, worker, resource, count)
    both = {w.name: cluster.node_resources(w.name)[1] for w in cluster.workers}
    cluster.progress(f"both workers at once: {both}")
    for worker in cluster.workers:
        expected = expected_allocatable(worker)
        assert {k: v for k, v in both[worker.name].items() if v} == expected, (worker.name, both)
        for agent in agents():
            if agent.runs_on(worker.labels):
                wait_until(
                    lambda w=worker, k=agent.kind: _all_registered(cluster, w, k),
                    timeout=cluster.timeout,
                    what=f"{worker.name}: the {agent.kind} agent registered every resource",
                )
    for agent in agents():
        pods = cluster.core.list_namespaced_pod(
            "kube-system", label_selector=f"plugvisor.io/kind={agent.kind},!plugvisor.io/mode"
        ).items
        placed = sorted(p.spec.node_name for p in pods if not p.metadata.deletion_timestamp)
        wanted = sorted(cluster.node(w.name) for w in cluster.workers if agent.runs_on(w.labels))
        assert placed == wanted, f"{agent.daemonset}: pods on {placed}, expected on {wanted}"


def test_the_scheduler_puts_a_gpu_pod_on_the_gpu_worker_and_a_vf_pod_on_the_other(
    cluster: ApiBackend,
) -> None:
    """Two pods with no node selector, one asking for GPUs, one for a VF: each runs on the only worker that
    has what it asks for, with its devices."""
    gpu_worker, nic_worker = _worker(cluster, has="gpus"), _worker(cluster, has="nics")
    assert gpu_worker != nic_worker
    _create_pod(cluster, "wants-gpus", limits={GPU: 2})
    _create_pod(cluster, "wants-a-vf", limits={VF: 1})
    try:
        gpus, vf = _running(cluster, "wants-gpus"), _running(cluster, "wants-a-vf")
        placed = {
            "wants-gpus": _node_of(cluster, "wants-gpus"),
            "wants-a-vf": _node_of(cluster, "wants-a-vf"),
        }
        cluster.progress(f"placed by the scheduler: {placed}")
        assert placed == {
            "wants-gpus": cluster.node(gpu_worker.name),
            "wants-a-vf": cluster.node(nic_worker.name),
        }
        assert len(gpus.env["NVIDIA_VISIBLE_DEVICES"].split(",")) == 2
        assert "/dev/nvidiactl" in gpus.devices
        assert not any(d.startswith("/dev/nvidia") for d in vf.devices), vf.devices
    finally:
        cluster.delete_pod("wants-gpus")
        cluster.delete_pod("wants-a-vf")


def test_killing_one_workers_agent_leaves_the_other_workers_pods_and_registrations_alone(
    cluster: ApiBackend,
) -> None:
    """The gpu worker's agent pod is killed (deleted with no grace) and replaced; meanwhile the NIC worker's
    agents keep their processes and registration counts, its pod holding a VF keeps its container, and its
    allocatable does not move."""
    gpu_worker, nic_worker = _worker(cluster, has="gpus"), _worker(cluster, has="nics")
    kinds = [a.kind for a in agents() if a.runs_on(nic_worker.labels)]
    _create_pod(cluster, "holds-a-vf", limits={VF: 1})
    try:
        _running(cluster, "holds-a-vf")
        assert _node_of(cluster, "holds-a-vf") == cluster.node(nic_worker.name)
        container = _container(cluster, "holds-a-vf")
        before = {kind: _registered_processes(cluster, nic_worker, kind) for kind in kinds}
        allocatable = cluster.node_resources(nic_worker.name)[1]
        pod = cluster._pod_on(gpu_worker.name, "plugvisor.io/kind=gpu,!plugvisor.io/mode")
        old = _status(cluster, gpu_worker, "gpu")["supervisor"]["pid"]
        cluster.core.delete_namespaced_pod(pod, "kube-system", grace_period_seconds=0)
        wait_until(
            lambda: (
                set(cluster._running_pods(gpu_worker.name, "plugvisor.io/kind=gpu,!plugvisor.io/mode"))
                - {pod}
            ),
            timeout=cluster.timeout,
            what=f"the DaemonSet replaced the killed agent pod {pod}",
            interval=1,
        )
        wait_until(
            lambda: _all_registered(cluster, gpu_worker, "gpu"),
            timeout=cluster.timeout,
            what="the gpu worker's new agent registered",
        )
        _wait_allocatable(cluster, gpu_worker, GPU, expected_allocatable(gpu_worker)[GPU])
        cluster.progress(
            f"gpu agent {pod} (supervisor pid {old}) killed and replaced; the NIC worker: {before}"
        )
        after = {kind: _registered_processes(cluster, nic_worker, kind) for kind in kinds}
        assert after == before, f"the NIC worker's agents changed: {before} -> {after}"
        assert _container(cluster, "holds-a-vf") == container
        assert cluster.pod("holds-a-vf").phase == "Running"  # type: ignore[union-attr]
        assert cluster.node_resources(nic_worker.name)[1] == allocatable
    finally:
        cluster.delete_pod("holds-a-vf")


def _registered_processes(cluster: ApiBackend, worker: Worker, kind: str) -> dict[str, Any]:
    """An agent's supervisor PID, and per resource its child's PID and registration count."""
    status = wait_until(
        lambda: _all_registered(cluster, worker, kind), timeout=cluster.timeout, what=f"{kind} registered"
    )
    children = {c["resource"]: (c["pid"], c["registrations"]) for c in status["children"]}
    return {"supervisor": status["supervisor"]["pid"], "children": children}


# -- DRA: the lab-dra overlay's drivers beside the device plugins -------------------------------------------


@pytest.fixture(scope="module")
def dra(cluster: ApiBackend) -> Iterator[Any]:
    """overlays/lab-dra applied (every kind also as a DRA driver); its drivers removed afterwards."""
    cluster.progress("kubectl apply -k deploy/kubernetes/overlays/lab-dra")
    cluster.kubectl("apply", "-k", str(LAB_DRA_OVERLAY))
    try:
        cluster.wait_daemonsets(LAB_DRA_OVERLAY)
        yield cluster._client.CustomObjectsApi()
    finally:
        cluster.kubectl(
            "-n", "kube-system", "delete", "daemonsets", "-l", "plugvisor.io/mode=dra", "--wait=false"
        )


def _drivers(worker: Worker) -> set[str]:
    return {
        e["name"] for a in agents(LAB_DRA_OVERLAY) if a.runs_on(worker.labels) for e in a.config["resources"]
    }


def _slices(objects: Any, driver: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = objects.list_cluster_custom_object(
        *RESOURCE_API, "resourceslices", field_selector=f"spec.driver={driver}"
    )["items"]
    return found


def test_each_worker_publishes_its_own_pool_for_each_driver_that_runs_there(
    cluster: ApiBackend, dra: Any
) -> None:
    """For every driver, one pool per worker it runs on, named after that worker's node and owned by it, with
    devices; none for a worker without its hardware. fuse.plugvisor.io runs on both: two pools."""
    every = set().union(*(_drivers(w) for w in cluster.workers))
    nodes = {cluster.node(w.name): w for w in cluster.workers}

    def pools(driver: str) -> dict[str, int] | None:
        found: dict[str, int] = {}
        for piece in _slices(dra, driver):
            spec = piece["spec"]
            found[spec["pool"]["name"]] = found.get(spec["pool"]["name"], 0) + len(spec.get("devices", []))
        wanted = {node for node, w in nodes.items() if driver in _drivers(w)}
        return found if set(found) == wanted and all(found.values()) else None

    published = {
        driver: wait_until(
            lambda d=driver: pools(d), timeout=cluster.timeout, what=f"{driver}: a pool per worker"
        )
        for driver in sorted(every)
    }
    cluster.progress(f"pools (node: devices) per driver: {published}")
    for driver in every:
        for piece in _slices(dra, driver):
            spec, owners = piece["spec"], piece["metadata"].get("ownerReferences", [])
            assert spec["nodeName"] == spec["pool"]["name"], spec
            assert [(o["kind"], o["name"]) for o in owners] == [("Node", spec["nodeName"])], owners
    assert len(published["fuse.plugvisor.io"]) == 2


def test_a_claim_for_a_device_only_the_second_worker_has_is_allocated_there(
    cluster: ApiBackend, dra: Any
) -> None:
    """A ResourceClaimTemplate asking for an FPGA (fpga.plugvisor.io: only nic-fpga-node has one), a pod with
    no node selector using it: the claim is allocated from that node's pool, the pod runs there and gets the
    FPGA port's device node through the claim's CDI spec."""
    fpga_worker = _worker(cluster, has="fpgas")
    node = cluster.node(fpga_worker.name)
    template = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "one-fpga"},
        "spec": {
            "spec": {
                "devices": {
                    "requests": [{"name": "fpga", "exactly": {"deviceClassName": "fpga.plugvisor.io"}}]
                }
            }
        },
    }
    dra.create_namespaced_custom_object(*RESOURCE_API, NAMESPACE, "resourceclaimtemplates", template)
    try:
        _create_pod(cluster, "dra-fpga", claim="one-fpga")
        try:
            view = _running(cluster, "dra-fpga")
            statuses = cluster.core.read_namespaced_pod("dra-fpga", NAMESPACE).status.resource_claim_statuses
            (name,) = [s.resource_claim_name for s in statuses]
            claim = dra.get_namespaced_custom_object(*RESOURCE_API, NAMESPACE, "resourceclaims", name)
            results = claim["status"]["allocation"]["devices"]["results"]
            cluster.progress(f"dra-fpga on {_node_of(cluster, 'dra-fpga')}: claim {name} allocated {results}")
            assert [(r["driver"], r["pool"]) for r in results] == [("fpga.plugvisor.io", node)]
            assert _node_of(cluster, "dra-fpga") == node
            assert "/dev/dfl-port.0" in view.devices, view.devices
        finally:
            cluster.delete_pod("dra-fpga")
    finally:
        cluster.kubectl("delete", "resourceclaimtemplate", "one-fpga", "--ignore-not-found")


def test_a_fpga_pod_is_not_placed_on_the_gpu_worker(cluster: ApiBackend) -> None:
    """The device-plugin way too: an FPGA pod with no node selector runs on the only worker with an FPGA."""
    fpga_worker = _worker(cluster, has="fpgas")
    _create_pod(cluster, "wants-fpga", limits={FPGA: 1})
    try:
        view = _running(cluster, "wants-fpga")
        assert _node_of(cluster, "wants-fpga") == cluster.node(fpga_worker.name)
        assert view.env["FPGA_VISIBLE_DEVICES"] == "dfl-port.0"
    finally:
        cluster.delete_pod("wants-fpga")
