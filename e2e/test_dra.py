"""Every kind as a DRA driver on a real node: the lab-dra overlay's drivers beside the lab overlay's device
plugins, on upstream Kubernetes with containerd 2 and its CDI support: the local backend (`tox -e
e2e-local`) and kind's nodes (`tox -e e2e`); the emulated backend has no API server, and these skip there.

Checked as a user checks: ResourceSlices, ResourceClaims and pods through the API server with the official
client, what a container got from its own report; and on the node what only the node shows: the claims' CDI
specs, the drivers' checkpoints, the kubelet's log, the drivers' processes, the kubelet's sockets. The
backend says where this process reaches those (the local node is this machine; a kind node is a container
on it: its files and sockets under /proc/PID/root of the container, its kubelet's log from the journal in
it); the scenarios are the same. On the local backend the module runs after the device-plugin scenarios
(conftest.py orders it last), so it starts on the worker they end on and switches role once.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from plugvisor.api.podresources.v1 import api_pb2 as pr
from plugvisor.api.podresources.v1 import api_pb2_grpc as pr_grpc
from plugvisor.emulators.kubelet import EmulatedKubelet, StubDevicePlugin
from plugvisor.emulators.kubelet.model import EventKind
from plugvisor.emulators.lab import Lab

from .backends import Backend, KindBackend, LocalBackend, wait_until
from .backends.api import ApiBackend
from .backends.local import LAB_DIR
from .deployment import LAB_DRA_OVERLAY, Worker, agent_selector, agents
from .dra import (
    CDI_DIR,
    GPU,
    NAMESPACE,
    PLUGINS_REGISTRY,
    DraLab,
    by_name,
    expected_devices,
    kill_process,
    kubelet_log_lines,
    registration_serving,
    socket_identity,
    spec_file,
    stop_process,
)
from .local.cluster import KUBELET_ROOT
from .test_scenarios import _running

pytestmark = pytest.mark.e2e

POD_RESOURCES = KUBELET_ROOT / "pod-resources" / "kubelet.sock"


@pytest.fixture(scope="module")
def dra(backend: Backend) -> Iterator[DraLab]:
    if not isinstance(backend, ApiBackend):
        pytest.skip(
            "needs an API server, a scheduler and a real kubelet: the local backend (tox -e e2e-local) or"
            " kind (tox -e e2e)"
        )
    unreachable = backend.node_unreachable()
    if unreachable is not None:
        pytest.skip(f"the scenarios read the node's files and use its sockets: {unreachable}")
    if isinstance(backend, KindBackend):
        for worker in backend.workers:  # the lines the scenarios read are logged at 1 and 2
            backend.kubelet_verbosity(worker.name, 2)
    lab = DraLab(backend)
    lab.apply()
    try:
        yield lab
    finally:
        lab.remove_drivers()
        lab.close()


def _gpu_worker(dra: DraLab) -> Worker:
    worker = next(w for w in dra.cluster.workers if w.profile.gpus)
    dra.play(worker)
    return worker


def _gone(dra: DraLab, pod: str, claim: dict[str, Any]) -> None:
    """Delete ``pod``: its claim goes, and the driver unprepares it (no CDI spec, no checkpoint entry)."""
    dra.cluster.delete_pod(pod)
    name, uid = claim["metadata"]["name"], claim["metadata"]["uid"]
    wait_until(lambda: dra.claim_gone(name), timeout=dra.cluster.timeout, what=f"claim {name} deleted")
    wait_until(
        lambda: not dra.reach(spec_file(GPU, uid)).exists() and uid not in dra.checkpoint(GPU),
        timeout=dra.cluster.timeout,
        what=f"claim {name} unprepared: {spec_file(GPU, uid).name} removed, out of the checkpoint",
    )


def test_resourceslices_list_every_kinds_devices_with_the_attributes_users_select_on(dra: DraLab) -> None:
    """On each worker, each driver running there publishes one pool named after the node, owned by the Node,
    with every device the lab has for it and the attributes the kind computes from that lab: GPUs with UUID,
    model, driver version and PCIe root; ConnectX VFs with their PF and RDMA device; the FPGA port with its
    AFU and interface IDs; /dev/fuse with its path."""
    local = dra.cluster
    # The worker the node plays now first, the GPU worker last: the scenarios after this one need it.
    playing = getattr(local, "playing", None)  # the local node's role; kind's nodes play no other
    workers = sorted(local.workers, key=lambda w: (bool(w.profile.gpus), w.name != playing))
    published: dict[str, dict[str, dict[str, Any]]] = {}
    for worker in workers:
        drivers = dra.play(worker)
        local.progress(f"{worker.name}: kubectl get resourceslices\n{local.kubectl('get', 'resourceslices')}")
        for driver in drivers:
            for piece in dra.slices(driver):
                spec, owners = piece["spec"], piece["metadata"].get("ownerReferences", [])
                assert (spec["nodeName"], spec["pool"]["name"]) == (dra.node, dra.node), spec
                assert [(o["kind"], o["name"]) for o in owners] == [("Node", dra.node)], owners
            published[driver] = dra.devices(driver)
            expected = expected_devices(drivers[driver], driver, dra.lab())
            difference = _difference(published[driver], expected)
            assert published[driver] == expected, f"{driver} differs from what the kind finds:\n{difference}"
            name, device = next(iter(sorted(published[driver].items())))
            local.progress(f"{driver}: {len(published[driver])} devices; {name}: {json.dumps(device)}")
    assert set(published) == {e["name"] for a in agents(LAB_DRA_OVERLAY) for e in a.config["resources"]}
    wanted = {
        "gpu.plugvisor.io": ("uuid", "model", "driverVersion", "resource.kubernetes.io/pcieRoot"),
        "nic.plugvisor.io": ("pfName", "rdma", "rdmaDevice", "model", "resource.kubernetes.io/pcieRoot"),
        "fpga.plugvisor.io": ("afuId", "interfaceId", "model", "resource.kubernetes.io/pcieRoot"),
        "fuse.plugvisor.io": ("path",),
    }
    for driver, names in wanted.items():
        for attribute in names:
            values = by_name(published[driver], attribute)
            assert None not in values.values(), f"{driver}: devices without {attribute}: {values}"
    assert set(by_name(published["nic.plugvisor.io"], "rdma").values()) == {True}


def _difference(published: dict[str, dict[str, Any]], expected: dict[str, dict[str, Any]]) -> str:
    lines = []
    for name in sorted(set(published) | set(expected)):
        got, want = published.get(name), expected.get(name)
        if got == want:
            continue
        if got is None or want is None:
            lines.append(f"  {name}: {'only published' if want is None else 'not published'}")
            continue
        for key in sorted(set(got.get("attributes", {})) | set(want.get("attributes", {}))):
            a, b = got.get("attributes", {}).get(key), want.get("attributes", {}).get(key)
            if a != b:
                lines.append(f"  {name}: attribute {key}: published {a}, the kind finds {b}")
        if got.get("capacity") != want.get("capacity"):
            lines.append(
                f"  {name}: capacity: published {got.get('capacity')}, the kind finds {want.get('capacity')}"
            )
    return "\n".join(lines)


def test_a_claim_for_two_gpus_on_one_pcie_root_gets_exactly_those_two_through_cdi(dra: DraLab) -> None:
    """The example ResourceClaimTemplate: the scheduler allocates two GPUs of one PCIe root, the driver
    prepares the claim as a CDI spec, containerd applies it: the container has exactly those two GPUs' nodes;
    PodResources names the claim's devices, and the agent's /metrics labels them with the pod. Deleting
    the pod unprepares the claim."""
    local = dra.cluster
    worker = _gpu_worker(dra)
    template = dra.create_template("gpu-pair-same-pcie-root.yaml")
    dra.create_pod("dra-gpu-pair", template, "gpus")
    claim: dict[str, Any] = {}
    try:
        view = _running(local, "dra-gpu-pair")
        claim = dra.claim_of("dra-gpu-pair")
        results = claim["status"]["allocation"]["devices"]["results"]
        assert [(r["request"], r["driver"], r["pool"]) for r in results] == [("gpus", GPU, dra.node)] * 2
        chosen = sorted(r["device"] for r in results)
        devices = dra.devices(GPU)
        roots = by_name(devices, "resource.kubernetes.io/pcieRoot")
        assert roots[chosen[0]] == roots[chosen[1]], f"{chosen} are on {[roots[c] for c in chosen]}"
        uuids = by_name(devices, "uuid")
        lab = {d.uuid: d for d in Lab.open(dra.lab()).devices(kind="gpu")}
        nodes = {uuid: {n.path for n in lab[uuid].device_nodes} for uuid in uuids.values()}
        given = {uuids[name] for name in chosen}
        local.progress(
            f"dra-gpu-pair: claim {claim['metadata']['name']} allocated {chosen} ({roots[chosen[0]]}); "
            f"the container has {list(view.devices)}, NVIDIA_VISIBLE_DEVICES="
            f"{view.env.get('NVIDIA_VISIBLE_DEVICES')}"
        )
        for uuid, paths in nodes.items():
            if uuid in given:
                assert paths <= set(view.devices), f"the container lacks {uuid}'s {paths}"
            else:
                assert not paths & set(view.devices), f"the container has {uuid}'s {paths}, not its claim's"
        assert sorted(view.env["NVIDIA_VISIBLE_DEVICES"].split(",")) == sorted(given)
        spec = json.loads(dra.reach(spec_file(GPU, claim["metadata"]["uid"])).read_text())
        assert {n["hostPath"] for d in spec["devices"] for n in d["containerEdits"]["deviceNodes"]} >= {
            f"{LAB_DIR}{path}" for uuid in given for path in nodes[uuid]
        }
        assert claim["metadata"]["uid"] in dra.checkpoint(GPU)
        _owners_are_the_pods(dra, worker, "dra-gpu-pair", claim, chosen)
    finally:
        if claim:
            _gone(dra, "dra-gpu-pair", claim)
        else:
            local.delete_pod("dra-gpu-pair")


def _owners_are_the_pods(
    dra: DraLab, worker: Worker, pod: str, claim: dict[str, Any], chosen: list[str]
) -> None:
    """PodResources List's dynamic_resources name the claim's devices; the agent's /metrics join them."""
    with grpc.insecure_channel(f"unix://{dra.reach(POD_RESOURCES)}") as channel:
        answer = pr_grpc.PodResourcesListerStub(channel).List(pr.ListPodResourcesRequest(), timeout=30)
    (held,) = [p for p in answer.pod_resources if p.name == pod]
    (container,) = held.containers
    (dynamic,) = container.dynamic_resources
    assert dynamic.claim_name == claim["metadata"]["name"]
    assert sorted((r.driver_name, r.pool_name, r.device_name) for r in dynamic.claim_resources) == [
        (GPU, dra.node, name) for name in chosen
    ]
    (agent,) = dra.cluster._running_pods(worker.name, agent_selector("gpu", dra=True))

    def owned() -> list[str]:
        text = dra.cluster.pod_http("kube-system", agent, 9400, "/metrics")
        return [
            line
            for line in text.splitlines()
            if line.startswith(f'plugvisor_device_allocated{{resource="{GPU}"')
            and f'pod="{pod}",namespace="{NAMESPACE}",container="check"' in line
            and line.endswith(" 1.0")
        ]

    lines = wait_until(
        lambda: (found := owned()) and len(found) == len(chosen) and found,
        timeout=dra.cluster.timeout,
        what=f"the gpu DRA agent's /metrics naming {pod} as the owner of {chosen}",
    )
    assert sorted(line.split('device="')[1].split('"')[0] for line in lines) == chosen
    dra.cluster.progress("owner labels from PodResources' dynamic_resources:\n  " + "\n  ".join(lines))


class SliceWatch:
    """The ResourceSlices of one driver on the node as the API server streams them, timed on arrival."""

    def __init__(self, dra: DraLab, driver: str) -> None:
        from kubernetes import watch  # noqa: PLC0415 - the e2e extra

        self.events: list[tuple[float, set[str]]] = []
        self._closed = False
        self._changed = threading.Condition()
        self._watch = watch.Watch()
        listing = dra.objects.list_cluster_custom_object(
            "resource.k8s.io",
            "v1",
            "resourceslices",
            field_selector=f"spec.driver={driver},spec.nodeName={dra.node}",
        )
        self._stream = self._watch.stream(
            dra.objects.list_cluster_custom_object,
            "resource.k8s.io",
            "v1",
            "resourceslices",
            field_selector=f"spec.driver={driver},spec.nodeName={dra.node}",
            resource_version=listing["metadata"]["resourceVersion"],
            timeout_seconds=int(dra.cluster.timeout),
        )
        self._thread = threading.Thread(target=self._run, name=f"watch {driver} slices", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for event in self._stream:
                names = {d["name"] for d in event["object"]["spec"].get("devices", [])}
                with self._changed:
                    self.events.append((time.monotonic(), names if event["type"] != "DELETED" else set()))
                    self._changed.notify_all()
        except Exception:  # the stream cut by close(), or the API server's: first() says what it missed
            if not self._closed:
                raise

    def first(self, since: float, predicate: Any, timeout: float) -> float:
        """When the first event after ``since`` whose device names satisfy ``predicate`` arrived."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for at, names in self.events:
                    if at >= since and predicate(names):
                        return at
                left = deadline - time.monotonic()
                assert left > 0, f"no such slice update within {timeout:.0f} s: {self.events}"
                self._changed.wait(left)

    def close(self) -> None:
        self._closed = True
        self._watch.stop()


def test_a_gpu_fault_withdraws_it_from_the_slice_and_heal_brings_it_back(dra: DraLab) -> None:
    """An AER fatal error on a GPU (the lab's fault) takes it out of the driver's ResourceSlice; healing puts
    it back. The time from the fault to the API server's update is measured (printed, not asserted)."""
    local = dra.cluster
    _gpu_worker(dra)
    uuid = Lab.open(dra.lab()).device("gpu1").uuid
    (name,) = [n for n, u in by_name(dra.devices(GPU), "uuid").items() if u == uuid]
    watch = SliceWatch(dra, GPU)
    healed = False
    try:
        faulted = time.monotonic()
        dra.fault("gpu1", "aer-fatal")
        withdrawn = watch.first(faulted, lambda names: names and name not in names, local.timeout)
        healing = time.monotonic()
        dra.heal("gpu1")
        healed = True
        back = watch.first(healing, lambda names: name in names, local.timeout)
    finally:
        watch.close()
        if not healed:
            dra.heal("gpu1")
    local.progress(
        f"gpu1 ({name}): aer-fatal -> withdrawn from the slice in {1000 * (withdrawn - faulted):.0f} ms; "
        f"heal -> back in {1000 * (back - healing):.0f} ms (at the API server's watchers"
        + ("" if isinstance(local, LocalBackend) else "; each through kubectl exec into the lab's pod")
        + ")"
    )
    assert name in dra.devices(GPU)


def test_a_kubelet_restart_registers_the_driver_again_and_running_pods_keep_their_devices(
    dra: DraLab,
) -> None:
    """The new kubelet registers the driver again (the agent counts it); a pod running through the restart
    keeps its container, its GPU and the claim's CDI spec; a pod started after it gets a GPU."""
    local = dra.cluster
    worker = _gpu_worker(dra)
    template = dra.create_template("gpu-one.yaml")
    registrations = wait_until(
        lambda: dra.driver_child(worker, "gpu"), timeout=local.timeout, what="the gpu driver registered"
    )["registrations"]
    dra.create_pod("dra-through-restart", template, "gpu")
    claims: dict[str, dict[str, Any]] = {}
    try:
        before = _running(local, "dra-through-restart")
        claims["dra-through-restart"] = claim = dra.claim_of("dra-through-restart")
        container = _container_id(dra, "dra-through-restart")
        local.restart_kubelet(worker.name)
        wait_until(
            lambda: (child := dra.driver_child(worker, "gpu")) and child["registrations"] > registrations,
            timeout=local.timeout,
            what="the new kubelet registered the gpu driver",
        )
        dra.wait_node_ready()
        assert _container_id(dra, "dra-through-restart") == container, "the pod's container was replaced"
        inside = local.kubectl("exec", "dra-through-restart", "--", "find", "/dev", "-type", "c").split()
        gpu_nodes = [
            d for d in before.devices if d.startswith("/dev/nvidia") and d[len("/dev/nvidia") :].isdigit()
        ]
        assert gpu_nodes and set(gpu_nodes) <= set(inside), f"after the restart the container has {inside}"
        assert dra.reach(spec_file(GPU, claim["metadata"]["uid"])).exists()
        dra.create_pod("dra-after-restart", template, "gpu")
        after = _running(local, "dra-after-restart")
        claims["dra-after-restart"] = dra.claim_of("dra-after-restart")
        got = [d for d in after.devices if d.startswith("/dev/nvidia")]
        local.progress(
            f"after the kubelet restart: dra-through-restart kept {gpu_nodes}; dra-after-restart got {got}"
        )
    finally:
        for pod in ("dra-through-restart", "dra-after-restart"):
            if pod in claims:
                _gone(dra, pod, claims[pod])
            else:
                local.delete_pod(pod)


def _container_id(dra: DraLab, pod: str) -> str:
    (status,) = dra.cluster.core.read_namespaced_pod(pod, NAMESPACE).status.container_statuses
    assert status.restart_count == 0
    return str(status.container_id)


def test_a_killed_driver_is_back_at_once_and_a_pod_deleted_meanwhile_is_unprepared(dra: DraLab) -> None:
    """SIGKILL to the gpu driver under its agent: a new process serves the kubelet again at once (measured:
    kill -> new registration socket answering, and -> the kubelet registering it), the running pod keeps its
    claim. A pod deleted while the driver cannot answer is unprepared by the next one (its CDI spec goes)."""
    local = dra.cluster
    worker = _gpu_worker(dra)
    template = dra.create_template("gpu-one.yaml")
    registration = PLUGINS_REGISTRY / f"{GPU}-reg.sock"
    reached = dra.reach(registration)  # the same socket, where this process connects to it
    claims: dict[str, dict[str, Any]] = {}
    try:
        dra.create_pod("dra-through-kill", template, "gpu")
        _running(local, "dra-through-kill")
        claims["dra-through-kill"] = kept = dra.claim_of("dra-through-kill")
        child = wait_until(lambda: dra.driver_child(worker, "gpu"), timeout=local.timeout, what="the driver")
        old = socket_identity(reached)
        wall = time.time()
        killed = kill_process(dra.host_pid(worker, "gpu", child["pid"]))
        wait_until(
            lambda: registration_serving(reached, old),
            timeout=local.timeout,
            what="a new driver",
            interval=0.005,
        )
        serving = time.monotonic()
        new = wait_until(
            lambda: (c := dra.driver_child(worker, "gpu")) and c["pid"] != child["pid"] and c,
            timeout=local.timeout,
            what="the agent's new gpu driver registered",
        )
        registered = dra.kubelet_logged(
            f'"OperationExecutor.RegisterPlugin started" plugin={{"SocketPath":"{registration}"', wall
        )
        local.progress(
            f"SIGKILL to the gpu driver (pid {child['pid']} in its pod): a new one (pid {new['pid']}) "
            f"answers on {registration.name} {1000 * (serving - killed):.0f} ms later; the kubelet "
            f"registered it {1000 * (registered - wall):.0f} ms after the kill (its log)"
        )
        assert local.pod("dra-through-kill").phase == "Running"  # type: ignore[union-attr]
        assert dra.reach(spec_file(GPU, kept["metadata"]["uid"])).exists()
        assert kept["metadata"]["uid"] in dra.checkpoint(GPU)

        dra.create_pod("dra-deleted-meanwhile", template, "gpu")
        _running(local, "dra-deleted-meanwhile")
        claims["dra-deleted-meanwhile"] = meanwhile = dra.claim_of("dra-deleted-meanwhile")
        stopped = dra.host_pid(worker, "gpu", new["pid"])
        stop_process(stopped)  # the driver cannot answer: the kubelet's unprepare waits on it, or fails
        try:
            deleted = time.time()
            local.core.delete_namespaced_pod("dra-deleted-meanwhile", NAMESPACE, grace_period_seconds=0)
            wait_until(
                lambda: _kubelet_killing(dra, "dra-deleted-meanwhile", deleted),
                timeout=local.timeout,
                what="the kubelet stopping dra-deleted-meanwhile's container",
            )
            # nobody could unprepare it yet
            assert dra.reach(spec_file(GPU, meanwhile["metadata"]["uid"])).exists()
        finally:
            kill_process(stopped)
        local.progress(
            "dra-deleted-meanwhile: deleted while the gpu driver was stopped, then the driver killed"
        )
        _gone(dra, "dra-deleted-meanwhile", meanwhile)
        del claims["dra-deleted-meanwhile"]
        assert kept["metadata"]["uid"] in dra.checkpoint(GPU)
    finally:
        for pod, claim in claims.items():
            _gone(dra, pod, claim)


def _kubelet_killing(dra: DraLab, pod: str, since: float) -> bool:
    """Whether the kubelet's log says it is stopping ``pod``'s container (the claim's unprepare is next)."""
    return any(
        "Killing container" in line and f'pod="{NAMESPACE}/{pod}"' in line
        for line in dra.kubelet_log_lines(since)
    )


class BackgroundRegistrar:
    """A DRA plugin's registration socket (a stub saying what it is told to), served by a thread of its own
    while the test goes on with the cluster."""

    def __init__(self, socket: Path, driver: str, endpoint: str) -> None:
        self.stub = StubDevicePlugin(socket, driver)
        self.stub.info_type, self.stub.info_name = "DRAPlugin", driver
        self.stub.info_versions, self.stub.info_endpoint = ("v1.DRAPlugin",), endpoint
        self._loop = asyncio.new_event_loop()
        self._done: asyncio.Event | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(
            target=self._loop.run_until_complete, args=(self._serve(),), daemon=True
        )
        self._thread.start()
        assert self._started.wait(60), "the stub registrar did not start"

    async def _serve(self) -> None:
        self._done = asyncio.Event()
        async with self.stub:
            self._started.set()
            await self._done.wait()

    def told(self) -> list[tuple[bool, str]]:
        return list(self.stub.registration_statuses)

    def close(self) -> None:
        assert self._done is not None
        self._loop.call_soon_threadsafe(self._done.set)
        self._thread.join(60)
        self._loop.close()


def test_a_newer_registration_nobody_serves_does_not_take_the_drivers_claims(dra: DraLab) -> None:
    """A second plugin registers for gpu.plugvisor.io with an endpoint nobody serves (a rolling update's new
    instance that never came up): the kubelet registers it, yet keeps calling the connected driver, and a
    claim is prepared. The emulated kubelet does the same (tests/integration/dra/test_registration_rules.py).
    """
    local = dra.cluster
    _gpu_worker(dra)
    template = dra.create_template("gpu-one.yaml")
    dead = BackgroundRegistrar(
        dra.reach(PLUGINS_REGISTRY / f"{GPU}-dead-reg.sock"),
        GPU,
        str(KUBELET_ROOT / "plugins" / GPU / "nobody.sock"),
    )
    claim: dict[str, Any] = {}
    try:
        wait_until(dead.told, timeout=local.timeout, what="the second plugin registered")
        assert dead.told()[0] == (True, "")
        dra.create_pod("dra-beside-dead", template, "gpu")
        _running(local, "dra-beside-dead")
        claim = dra.claim_of("dra-beside-dead")
        assert dra.reach(spec_file(GPU, claim["metadata"]["uid"])).exists()
        local.progress("a newer registration of gpu.plugvisor.io nobody serves: the claim went to the driver")
    finally:
        dead.close()
        if claim:
            _gone(dra, "dra-beside-dead", claim)
        else:
            local.delete_pod("dra-beside-dead")


# -- a third-party kind ------------------------------------------------------------------------------

NPU = "npu.acme.com"


@pytest.fixture
def npu_lab(dra: DraLab) -> Iterator[Path]:
    """An acme-npu-node lab on the node (examples/plugvisor-npu's lab kind), whose var/run/cdi is the node's.

    A host process's paths are resolved inside its host root, as a container's under /host: what the
    DaemonSet's hostPath mount of /var/run/cdi is to a container, a bind mount is to the lab.
    """
    if not isinstance(dra.cluster, LocalBackend):
        pytest.skip(
            "the npu agent runs as a host process on the node, started by this test from this checkout; a"
            f" {dra.cluster.name} node is a container whose image has neither Python nor plugvisor to run it"
        )
    for module, what in (("plugvisor_npu", "examples/plugvisor-npu"), ("lightkube", "the dra extra")):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{what} is not installed (tox -e e2e-local installs it): {module}")
    home = Path(tempfile.mkdtemp(prefix="/tmp/pvnpu-"))
    lab = home / "lab"
    cdi = lab / "var/run/cdi"
    mounted = False
    try:
        subprocess.run(
            [sys.executable, "-m", "plugvisor", "lab", "create", str(lab),
             "--profile", "acme-npu-node", "--mknod"],
            check=True, capture_output=True, timeout=120,
        )  # fmt: skip
        CDI_DIR.mkdir(parents=True, exist_ok=True)
        cdi.mkdir(parents=True)
        subprocess.run(
            ["mount", "--bind", str(CDI_DIR), str(cdi)], check=True, capture_output=True, timeout=60
        )
        mounted = True
        yield lab
    finally:
        if mounted:
            subprocess.run(["umount", str(cdi)], check=False, capture_output=True, timeout=60)
        shutil.rmtree(home, ignore_errors=True)


def test_a_third_party_kind_is_a_dra_driver_from_the_docs_alone(dra: DraLab, npu_lab: Path) -> None:
    """examples/plugvisor-npu, a kind with no DRA code of its own, as docs/dra.md says: one node.yaml entry
    with `mode: dra` named by its driver, the agent as a host process (as the systemd unit runs it) finding
    the API server through KUBECONFIG, and a DeviceClass for the driver. Its cards are published by serial
    number, a claim for one gets that card in the container through CDI, deleting the pod unprepares it, and
    SIGTERM stops the agent with 0."""
    local = dra.local
    config = npu_lab.parent / "node.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "kubeletDir": str(KUBELET_ROOT / "device-plugins"),
                "hostRoot": str(npu_lab),
                "nodeName": dra.node,
                "supervisor": {"runtimeDir": str(npu_lab.parent / "run")},
                "resources": [{"name": NPU, "kind": "npu", "mode": "dra"}],
            }
        )
    )
    device_class = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": NPU},
        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{NPU}"'}}]},
    }
    template = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "one-npu"},
        "spec": {"spec": {"devices": {"requests": [{"name": "npu", "exactly": {"deviceClassName": NPU}}]}}},
    }
    dra.objects.create_cluster_custom_object("resource.k8s.io", "v1", "deviceclasses", device_class)
    dra.objects.create_namespaced_custom_object(
        "resource.k8s.io", "v1", NAMESPACE, "resourceclaimtemplates", template
    )
    log = npu_lab.parent / "agent.log"
    with log.open("ab") as out:
        agent = subprocess.Popen(
            [sys.executable, "-m", "plugvisor", "run", "--config", str(config)],
            stdin=subprocess.DEVNULL, stdout=out, stderr=out,
            env={**os.environ, "KUBECONFIG": str(local.cluster.kubeconfig)},
        )  # fmt: skip
    try:
        cards = {dict(d.attributes)["serial"].lower(): d for d in Lab.open(npu_lab).devices(kind="acme-npu")}
        wait_until(
            lambda: set(dra.devices(NPU)) == set(cards),
            timeout=local.timeout,
            what=f"the {NPU} slice listing the lab's cards {sorted(cards)}",
        )
        local.progress(f"{NPU} from the host agent: {json.dumps(dra.devices(NPU))}")
        # Ready is registered with the kubelet too: a slice is published before the kubelet's plugin watcher
        # registers the driver (up to a second later), and a pod prepared in between waits a minute in the
        # kubelet's back-off (docs/dra.md, "Pods that arrive while the driver is not registered").
        wait_until(
            lambda: _host_agent_registered(npu_lab.parent / "run"),
            timeout=local.timeout,
            what=f"the kubelet registered {NPU}",
        )
        dra.create_pod("dra-npu", "one-npu", "npu")
        view = _running(local, "dra-npu")
        claim = dra.claim_of("dra-npu")
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        card = cards[result["device"]]
        given = {node.path for node in card.device_nodes}
        others = {node.path for c in cards.values() if c is not card for node in c.device_nodes}
        local.progress(f"dra-npu got {result['device']}: {sorted(given)}, ACME_VISIBLE_CARDS="
                       f"{view.env.get('ACME_VISIBLE_CARDS')}")  # fmt: skip
        assert given <= set(view.devices) and not others & set(view.devices), view.devices
        assert spec_file(NPU, claim["metadata"]["uid"]).exists()
        local.delete_pod("dra-npu")
        wait_until(
            lambda: not spec_file(NPU, claim["metadata"]["uid"]).exists(),
            timeout=local.timeout,
            what="the npu claim unprepared",
        )
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(60) == 0, log.read_text()[-3000:]
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        local.delete_pod("dra-npu")
        local.kubectl("delete", "resourceclaimtemplate/one-npu", f"deviceclass/{NPU}", "--ignore-not-found")
        local.kubectl("delete", "resourceslices", f"--field-selector=spec.driver={NPU}")
        local.progress(f"the npu host agent's log, last lines:\n{log.read_text()[-1500:]}")


def _host_agent_registered(runtime_dir: Path) -> bool:
    status = subprocess.run(
        [sys.executable, "-m", "plugvisor", "status", "--json", "--runtime-dir", str(runtime_dir)],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return all(child["registered"] for child in json.loads(status.stdout)["children"])


# -- the emulated kubelet held against the real one -----------------------------------------------------

REGISTRATIONS: dict[str, list[dict[str, Any]]] = {
    "v1 and v1beta1": [{"versions": ("v1.DRAPlugin", "v1beta1.DRAPlugin", "v1.DRAResourceHealth")}],
    "v1beta1 only (a 1.32-1.33 driver)": [{"versions": ("v1beta1.DRAPlugin",)}],
    "no DRAPlugin service the kubelet speaks": [{"versions": ("v2.DRAPlugin", "v1.DRAResourceHealth")}],
    "no services": [{"versions": ()}],
    "a name that is no DNS subdomain": [{"name": "Not_A_DNS_Subdomain"}],
    "no name": [{"name": ""}],
    "no endpoint (the registration socket)": [{"endpoint": ""}],
    "an unknown plugin type": [{"type": "DRAplugin"}],
    "two plugins of one driver, one endpoint": [{}, {}],
    "two plugins of one driver, two endpoints": [{}, {"endpoint": "{root}/plugins/{name}/other.sock"}],
}
"""Registrations a DRA driver's kubelet plugin could make (GetInfo's answers; none serves its endpoint)."""
Logged = Callable[[Path], str | None]
"""What a kubelet logged as a registration socket's first failed registration, if it did."""


def _registrars(registry: Path, root: Path) -> list[tuple[str, Any]]:
    """One stub registration socket per registration of REGISTRATIONS, each case with its own driver name."""
    stubs = []
    for number, (case, plugins) in enumerate(REGISTRATIONS.items()):
        driver = f"case{number}.parity.plugvisor.io"
        for index, plugin in enumerate(plugins):
            name = plugin.get("name", driver)
            stub = StubDevicePlugin(registry / f"pv-parity-{number}-{index}-reg.sock", driver)
            stub.info_type = plugin.get("type", "DRAPlugin")
            stub.info_name = name
            stub.info_versions = plugin.get("versions", ("v1.DRAPlugin", "v1beta1.DRAPlugin"))
            stub.info_endpoint = plugin.get("endpoint", "{root}/plugins/{name}/dra.sock").format(
                root=root, name=driver
            )
            stubs.append((case, stub))
    return stubs


async def _register_all(
    registry: Path, root: Path, logged: Logged, timeout: float, seen_as: Callable[[Path], Path] = Path
) -> dict[str, list[Any]]:
    """Serve every registrar on ``registry``; per case, what each plugin was told first and what the kubelet
    logged about it (its first failed registration), paths written relative to ``root``. ``seen_as`` is a
    socket's path as the kubelet sees it (where this process reaches the node's files another way)."""
    stubs = _registrars(registry, root)
    for _, stub in stubs:
        await stub.start()
    try:
        async with asyncio.timeout(timeout):
            # Polled: what the real kubelet logs is a file.
            while not all(stub.registration_statuses for _, stub in stubs) or any(  # noqa: ASYNC110
                not stub.registration_statuses[0][0] and logged(stub.socket_path) is None for _, stub in stubs
            ):
                await asyncio.sleep(0.2)
    finally:
        for _, stub in stubs:
            await stub.stop()

    def relative(text: str | None, stub: Any) -> str | None:
        return (
            None
            if text is None
            else text.replace(str(seen_as(stub.socket_path)), "<socket>")
            .replace(str(stub.socket_path), "<socket>")
            .replace(str(root), "<root>")
        )

    outcomes: dict[str, list[Any]] = {case: [] for case in REGISTRATIONS}
    for case, stub in stubs:
        registered, error = stub.registration_statuses[0]
        outcomes[case].append((registered, relative(error, stub), relative(logged(stub.socket_path), stub)))
    return {case: sorted(found, key=repr) for case, found in outcomes.items()}


def _real_kubelet_failures(dra: DraLab, since: float) -> Logged:
    """The real kubelet's failed registration of a socket (in its registry: the path it logs), from its log
    (goroutinemap's retry line). The log is read at most every half second: every socket asks in turn."""
    read: list[tuple[float, list[str]]] = []

    def lines() -> list[str]:
        if not read or time.monotonic() - read[0][0] > 0.5:
            read[:] = [(time.monotonic(), list(kubelet_log_lines(since, dra.kubelet_log(since))))]
        return read[0][1]

    def logged(socket: Path) -> str | None:
        marker = f'Operation for "{PLUGINS_REGISTRY / socket.name}" failed.'
        return next(
            (line.split(" Error: ", 1)[1] for line in lines() if marker in line and " Error: " in line),
            None,
        )

    return logged


def test_the_emulated_kubelet_registers_dra_plugins_as_the_real_one_does(dra: DraLab) -> None:
    """The same DRA registrations (good ones, bad versions, names, types, duplicate endpoints) made to the
    real kubelet's plugin watcher and to `plugvisor kubelet`'s: each plugin is told the same
    (NotifyRegistrationStatus), and each kubelet logs the same failure for each refused one."""
    local = dra.cluster
    if dra.worker is None and not isinstance(dra.cluster, LocalBackend):
        _gpu_worker(dra)  # run alone on kind: a worker's kubelet; the GPU worker's, as the others use
    since = time.time()
    real = asyncio.run(
        _register_all(
            dra.reach(PLUGINS_REGISTRY),
            KUBELET_ROOT,
            _real_kubelet_failures(dra, since),
            60,
            lambda socket: PLUGINS_REGISTRY / socket.name,
        )
    )
    base = Path(tempfile.mkdtemp(prefix="/tmp/pvpar-"))
    try:

        async def emulated() -> dict[str, list[Any]]:
            kubelet = EmulatedKubelet(base / "device-plugins", write_view=False, pod_resources=False)

            def logged(socket: Path) -> str | None:
                return next(
                    (
                        e.message
                        for e in kubelet.events
                        if e.kind is EventKind.REGISTRATION_FAILED
                        and e.fields.get("path") == str(socket)
                        and "retry_in" in e.fields
                    ),
                    None,
                )

            async with kubelet:
                assert kubelet.plugins_registry is not None
                return await _register_all(kubelet.plugins_registry, base, logged, 60)

        imitation = asyncio.run(emulated())
    finally:
        shutil.rmtree(base, ignore_errors=True)
    differences = []
    for case in REGISTRATIONS:
        local.progress(f"DRA registration, {case}: real kubelet {real[case]}")
        if real[case] != imitation[case]:
            differences.append(f"{case}:\n  real:     {real[case]}\n  emulated: {imitation[case]}")
    assert not differences, "the emulated kubelet answers DRA registrations differently:\n" + "\n".join(
        differences
    )
