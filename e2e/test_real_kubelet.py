"""What only a real node can show: GPUs reaching a container through a CDI spec read by the runtime, the
bare-metal agent (`plugvisor run` as a host process, as the systemd unit runs it) serving the real kubelet,
owner labels read from the real PodResources API, plugin-watcher registration, and the emulated kubelet's
answers held against the real one's.

These run on the local backend only (`tox -e e2e-local`); elsewhere they skip, saying so.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from plugvisor.api.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from plugvisor.api.podresources.v1 import api_pb2 as pr
from plugvisor.api.podresources.v1 import api_pb2_grpc as pr_grpc
from plugvisor.common.sockets import socket_prefix

from .backends import Backend, LocalBackend, wait_until
from .backends.local import LAB_DIR
from .deployment import LAB_OVERLAY, REPO, Worker, expected_allocatable
from .test_scenarios import GPU, _running, _worker

pytestmark = pytest.mark.e2e

DEVICE_PLUGINS = Path("/var/lib/kubelet/device-plugins")
CHECKPOINT = DEVICE_PLUGINS / "kubelet_internal_checkpoint"
CDI_SPEC = Path("/var/run/cdi/plugvisor.io-gpu.json")
HOST_FUSE = "plugvisor.io/host-fuse"
WATCHER_FUSE = "plugvisor.io/host-fuse-watcher"
AGAIN = "plugvisor.io/registers-twice"


@pytest.fixture
def local(backend: Backend) -> LocalBackend:
    if not isinstance(backend, LocalBackend):
        pytest.skip("needs a real kubelet on this machine: the local backend (tox -e e2e-local)")
    return backend


def _allocation(pod_uid: str, resource: str) -> api_pb2.ContainerAllocateResponse:
    """The Allocate answer the kubelet keeps for a pod's container (its checkpoint holds it, base64)."""
    checkpoint = json.loads(CHECKPOINT.read_text())
    (entry,) = [
        e
        for e in checkpoint["Data"]["PodDeviceEntries"] or []
        if e["PodUID"] == pod_uid and e["ResourceName"] == resource
    ]
    return api_pb2.ContainerAllocateResponse.FromString(base64.b64decode(entry["AllocResp"]))


@pytest.fixture
def cdi_overlay(local: LocalBackend) -> Iterator[Worker]:
    """The lab overlay with the gpu-cdi overlay's changes: `cdi: true` and the host's /var/run/cdi mounted."""
    worker = _worker(local, has="gpus")
    local.play(worker.name)
    config = yaml.safe_load((LAB_OVERLAY / "node-gpu.yaml").read_text())
    cdi = yaml.safe_load((REPO / "deploy/kubernetes/overlays/gpu-cdi/node.yaml").read_text())["resources"][0]
    config["resources"][0] |= {"cdi": cdi["cdi"], "cdiDir": cdi["cdiDir"]}
    with tempfile.TemporaryDirectory(prefix="pv-cdi-") as scratch:
        overlay = Path(scratch)
        (overlay / "node-gpu-cdi.yaml").write_text(yaml.safe_dump(config))
        (overlay / "patch-cdi-mount.yaml").write_text(
            (REPO / "deploy/kubernetes/overlays/gpu-cdi/patch-cdi-mount.yaml").read_text()
        )
        (overlay / "kustomization.yaml").write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "kustomize.config.k8s.io/v1beta1",
                    "kind": "Kustomization",
                    "resources": [os.path.relpath(LAB_OVERLAY, overlay)],
                    "configMapGenerator": [
                        {
                            "name": "plugvisor-config-gpu",
                            "namespace": "kube-system",
                            "behavior": "replace",
                            "files": ["node.yaml=node-gpu-cdi.yaml"],
                        }
                    ],
                    "patches": [{"path": "patch-cdi-mount.yaml"}],
                }
            )
        )
        local.progress("kubectl apply -k: the lab overlay with the gpu-cdi overlay's cdi: true and CDI mount")
        local.kubectl("apply", "-k", str(overlay))
    try:
        local.kubectl(
            "-n", "kube-system", "rollout", "status", "ds/plugvisor-gpu", "--timeout=600s", timeout=660
        )
        yield worker
    finally:
        local.apply_lab_overlay()
        local.wait_daemonsets()


def test_gpus_reach_the_container_through_the_agents_cdi_spec(
    local: LocalBackend, cdi_overlay: Worker
) -> None:
    """cdi: true: Allocate names CDI devices and no DeviceSpecs; containerd reads the agent's spec and the
    container has the two GPUs' device nodes and the control nodes the spec adds."""
    worker = cdi_overlay
    wait_until(
        lambda: local.node_resources(worker.name)[1].get(GPU) == expected_allocatable(worker)[GPU],
        timeout=local.timeout,
        what="the CDI gpu agent's GPUs allocatable",
    )
    local.create_pod(worker.name, "cdi-gpus", {GPU: 2})
    try:
        view = _running(local, "cdi-gpus")
        local.progress(
            "cdi-gpus, from inside the container: character devices "
            f"{list(view.devices)}, NVIDIA_VISIBLE_DEVICES={view.env.get('NVIDIA_VISIBLE_DEVICES')}"
        )
        ids = view.env["NVIDIA_VISIBLE_DEVICES"].split(",")
        uid = local.core.read_namespaced_pod("cdi-gpus", "default").metadata.uid
        answer = _allocation(uid, GPU)
        assert not answer.devices, f"Allocate returned DeviceSpecs with cdi: true: {answer.devices}"
        assert sorted(d.name for d in answer.cdi_devices) == sorted(f"{GPU}={i}" for i in ids)
        spec = json.loads(CDI_SPEC.read_text())
        by_name = {d["name"]: d for d in spec["devices"]}
        wanted = [n["path"] for i in ids for n in by_name[i]["containerEdits"]["deviceNodes"]]
        wanted += [n["path"] for n in spec.get("containerEdits", {}).get("deviceNodes", [])]
        assert wanted, f"the CDI spec names no device node: {spec}"
        assert set(wanted) <= set(view.devices), f"the container lacks {wanted}: it has {view.devices}"
        others = {
            n["path"]
            for d in spec["devices"]
            if d["name"] not in ids
            for n in d["containerEdits"]["deviceNodes"]
        }
        assert not others & set(view.devices), f"the container got GPUs it did not ask for: {others}"
    finally:
        local.delete_pod("cdi-gpus")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class HostAgent:
    """`plugvisor run` as a host process, as deploy/systemd/plugvisor.service runs it, on the lab."""

    def __init__(self, home: Path, resources: list[dict[str, Any]] | None = None) -> None:
        self.home = home
        self.port = _free_port()
        self.runtime = home / "run"
        self.config = home / "node.yaml"
        self.config.write_text(
            yaml.safe_dump(
                {
                    "kubeletDir": str(DEVICE_PLUGINS),
                    "hostRoot": str(LAB_DIR),
                    "metrics": {"listen": f"127.0.0.1:{self.port}"},
                    "supervisor": {"runtimeDir": str(self.runtime)},
                    "monitoring": {"podResourcesInterval": 0.5},
                    "resources": resources or [
                        {"name": HOST_FUSE, "kind": "generic", "paths": ["/dev/fuse"], "count": 3},
                        {"name": WATCHER_FUSE, "kind": "generic", "paths": ["/dev/fuse"], "count": 2,
                         "registration": "plugin-watcher"},
                    ],
                }
            )
        )  # fmt: skip
        self.log = home / "agent.log"
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "plugvisor",
                    "run",
                    "--config",
                    str(self.config),
                    "--log-level",
                    "info",
                ],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
            )

    def status(self) -> dict[str, Any]:
        result = subprocess.run(
            [sys.executable, "-m", "plugvisor", "status", "--json", "--runtime-dir", str(self.runtime)],
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        status: dict[str, Any] = json.loads(result.stdout)
        return status

    def registered(self) -> dict[str, Any] | None:
        status = self.status()
        children = status["children"]
        return status if len(children) == 2 and all(c.get("registered") for c in children) else None

    def taken_over(self) -> bool:
        children = self.status()["children"]
        return len(children) == 2 and all(c.get("taken_over_by") for c in children)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as answer:
            return str(answer.read().decode())

    def stop(self) -> int | None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                return None
        return self.process.returncode


def test_plugvisor_run_on_the_host_serves_the_real_kubelet(local: LocalBackend) -> None:
    """The bare-metal agent registers (kubelet.sock and plugin watcher), a pod gets its device, /metrics
    names the pod from the real PodResources API, a kubelet restart is followed, SIGTERM stops it cleanly."""
    worker = _worker(local, has="gpus")
    local.play(worker.name)
    with tempfile.TemporaryDirectory(prefix="pvhost-") as scratch:
        agent = HostAgent(Path(scratch))
        try:
            local.progress(
                f"plugvisor run on the host: {HOST_FUSE} (kubelet.sock), {WATCHER_FUSE} (plugin watcher)"
            )
            wait_until(
                agent.registered, timeout=local.timeout, what="the host agent registered both resources"
            )
            for resource, count in ((HOST_FUSE, 3), (WATCHER_FUSE, 2)):
                wait_until(
                    lambda r=resource, c=count: local.node_resources(worker.name)[1].get(r) == c,
                    timeout=local.timeout,
                    what=f"allocatable {resource} = {count}",
                )
            local.create_pod(worker.name, "host-agent-fuse", {HOST_FUSE: 1, WATCHER_FUSE: 1})
            try:
                view = _running(local, "host-agent-fuse")
                assert "/dev/fuse" in view.devices

                def owned() -> list[str]:
                    return [
                        line
                        for line in agent.metrics().splitlines()
                        if line.startswith("plugvisor_device_allocated{")
                        and 'pod="host-agent-fuse"' in line
                        and 'namespace="default"' in line
                        and 'container="check"' in line
                        and line.endswith(" 1.0")
                    ]

                lines = wait_until(
                    owned, timeout=local.timeout, what="/metrics owner labels of host-agent-fuse"
                )
                local.progress("owner labels from the real PodResources API:\n  " + "\n  ".join(lines))
                _defaults_of_1_37(local, "host-agent-fuse")
                assert {HOST_FUSE, WATCHER_FUSE} == {
                    r for r in (HOST_FUSE, WATCHER_FUSE) for line in lines if f'resource="{r}"' in line
                }
                restarts = agent.status()["supervisor"]["kubelet_restarts"]
                local.restart_kubelet(worker.name)
                wait_until(
                    lambda: (s := agent.registered()) and s["supervisor"]["kubelet_restarts"] > restarts,
                    timeout=local.timeout,
                    what="the host agent registered with the new kubelet",
                )
                wait_until(
                    lambda: local.node_resources(worker.name)[1].get(HOST_FUSE) == 3,
                    timeout=local.timeout,
                    what=f"allocatable {HOST_FUSE} = 3 after the kubelet restart",
                )
                after = local.pod("host-agent-fuse")
                assert after is not None
                assert after.phase == "Running"
            finally:
                local.delete_pod("host-agent-fuse")
            assert agent.stop() == 0, f"the agent did not exit 0 on SIGTERM:\n{agent.log.read_text()[-3000:]}"
            wait_until(
                lambda: local.node_resources(worker.name)[1].get(HOST_FUSE) == 0,
                timeout=local.timeout,
                what=f"allocatable {HOST_FUSE} = 0 once the agent stopped",
            )
        finally:
            agent.stop()
            local.progress(f"host agent log, last lines:\n{agent.log.read_text()[-1500:]}")


def _defaults_of_1_37(local: LocalBackend, pod: str) -> None:
    """What 1.37 does with no feature gate set, as the emulator's 1.37 now does: PodResources Get answers
    (KubeletPodResourcesGet, on since 1.34), containers report device health (ResourceHealthStatus, 1.36)."""
    with grpc.insecure_channel(
        f"unix://{DEVICE_PLUGINS.parent / 'pod-resources' / 'kubelet.sock'}"
    ) as channel:
        answer = pr_grpc.PodResourcesListerStub(channel).Get(
            pr.GetPodResourcesRequest(pod_name=pod, pod_namespace="default"), timeout=30
        )
    held = {d.resource_name for c in answer.pod_resources.containers for d in c.devices}
    assert held == {HOST_FUSE, WATCHER_FUSE}, f"PodResources Get: {answer}"

    def health() -> list[dict[str, Any]] | None:  # raw JSON: the Python client may predate the field
        (status,) = json.loads(local.kubectl("get", "pod", pod, "-o", "json"))["status"]["containerStatuses"]
        return status.get("allocatedResourcesStatus") or None

    reported = wait_until(health, timeout=local.timeout, what=f"allocatedResourcesStatus of {pod}")
    assert {r["name"] for r in reported} == {HOST_FUSE, WATCHER_FUSE}, reported
    local.progress(f"with no feature gate: PodResources Get lists {sorted(held)}; status health {reported}")


def _register(kubelet_socket: Path, request: api_pb2.RegisterRequest) -> str:
    """Register on a kubelet socket; the error's code and text ("OK" when accepted)."""
    with grpc.insecure_channel(f"unix://{kubelet_socket}") as channel:
        try:
            api_pb2_grpc.RegistrationStub(channel).Register(request, timeout=30)
        except grpc.RpcError as error:
            return f"{error.code().name}: {error.details()}"  # type: ignore[attr-defined]
    return "OK"


def test_the_emulated_kubelet_refuses_bad_registrations_as_the_real_one_does(local: LocalBackend) -> None:
    """The same bad Register requests to the real kubelet and to `plugvisor kubelet`: same code, same text."""
    with tempfile.TemporaryDirectory(prefix="pvkc-") as scratch:
        emulated_dir = Path(scratch) / "device-plugins"
        emulated_dir.mkdir()
        log = Path(scratch) / "kubelet.log"
        with log.open("ab") as out:
            emulated = subprocess.Popen(
                [sys.executable, "-m", "plugvisor", "kubelet", "--dir", str(emulated_dir),
                 "--no-pod-resources", "--no-plugin-watcher"],
                stdin=subprocess.DEVNULL, stdout=out, stderr=out,
            )  # fmt: skip
        try:
            socket_file = emulated_dir / "kubelet.sock"
            wait_until(socket_file.exists, timeout=60, what="the emulated kubelet.sock")
            cases = {
                "unsupported version": api_pb2.RegisterRequest(
                    version="v1alpha1", endpoint="x.sock", resource_name="example.com/x"
                ),
                "no domain in the resource name": api_pb2.RegisterRequest(
                    version="v1beta1", endpoint="x.sock", resource_name="gpu"
                ),
                "a kubernetes.io resource": api_pb2.RegisterRequest(
                    version="v1beta1", endpoint="x.sock", resource_name="kubernetes.io/gpu"
                ),
                "nothing serves the endpoint": api_pb2.RegisterRequest(
                    version="v1beta1", endpoint="nobody-here.sock", resource_name="example.com/x"
                ),
            }
            differences = []
            for case, request in cases.items():
                real = _register(DEVICE_PLUGINS / "kubelet.sock", request)
                imitation = _register(emulated_dir / "kubelet.sock", request).replace(
                    str(emulated_dir), str(DEVICE_PLUGINS)
                )
                local.progress(f"{case}: real kubelet {real!r}; emulated {imitation!r}")
                if real != imitation:
                    differences.append(f"{case}:\n  real:     {real}\n  emulated: {imitation}")
            assert not differences, "the emulated kubelet answers differently:\n" + "\n".join(differences)
        finally:
            emulated.send_signal(signal.SIGTERM)
            emulated.wait(30)


def _lab(local: LocalBackend, where: Path) -> Path:
    """A lab of its own at ``where`` (a GPU worker's profile), for plugins run by hand."""
    profile = str(_worker(local, has="gpus").profile_path)
    subprocess.run(
        [sys.executable, "-m", "plugvisor", "lab", "create", str(where), "--profile", profile],
        check=True, capture_output=True,
    )  # fmt: skip
    return where


def _allocatable_devices(pod_resources_socket: Path, resource: str) -> int:
    """Healthy devices of ``resource`` the kubelet's device manager holds now (no node-status delay)."""
    with grpc.insecure_channel(f"unix://{pod_resources_socket}") as channel:
        answer = pr_grpc.PodResourcesListerStub(channel).GetAllocatableResources(
            pr.AllocatableResourcesRequest(), timeout=30
        )
    return sum(len(d.device_ids) for d in answer.devices if d.resource_name == resource)


def _plugin_registering_twice(
    device_plugins: Path, lab: Path, log: Path
) -> tuple[str, subprocess.Popen[bytes]]:
    """`plugvisor plugin generic` registered on ``device_plugins``, and the answer to a second Register."""
    with log.open("ab") as out:
        plugin = subprocess.Popen(
            [sys.executable, "-m", "plugvisor", "plugin", "generic", "--resource", AGAIN,
             "--host-root", str(lab), "--path", "/dev/fuse", "--count", "2",
             "--kubelet-dir", str(device_plugins)],
            stdin=subprocess.DEVNULL, stdout=out, stderr=out,
        )  # fmt: skip
    found = wait_until(
        lambda: re.search(r"event='registered' .*endpoint='([^']+)'", log.read_text()),
        timeout=60,
        what=f"{AGAIN} registered on {device_plugins}",
    )
    endpoint = found.group(1)
    request = api_pb2.RegisterRequest(version="v1beta1", endpoint=endpoint, resource_name=AGAIN)
    answer = _register(device_plugins / "kubelet.sock", request)
    return answer.replace(str(device_plugins / endpoint), "<its socket>"), plugin


def _stream_end_seen(name: str, home: Path) -> bool:
    """Whether the kubelet handled the plugin's stream end (the real one's log, the emulated one's view)."""
    if name == "real":
        log = Path("/var/lib/plugvisor-e2e/logs/kubelet.log").read_text(errors="replace")
        return f'"ListAndWatch ended unexpectedly for device plugin" err="EOF" resource="{AGAIN}"' in log
    view = home / "node" / "device-plugins.kubelet.json"
    return "the kubelet had forgotten it" in view.read_text(errors="replace")


def test_a_second_register_from_a_connected_socket_gets_the_real_kubelets_answer(local: LocalBackend) -> None:
    """1.37 refuses it (`device plugin already connected`) and forgets the running instance: once the plugin
    stops, the resource still lists its devices. `plugvisor kubelet` (1.37, the default) does the same."""
    outcomes = {}
    with tempfile.TemporaryDirectory(prefix="pvre-") as scratch:
        home = Path(scratch)
        lab = _lab(local, home / "lab")
        emulated_dir = home / "node" / "device-plugins"
        emulated_dir.mkdir(parents=True)
        with (home / "kubelet.log").open("ab") as out:
            emulated = subprocess.Popen(
                [sys.executable, "-m", "plugvisor", "kubelet", "--dir", str(emulated_dir),
                 "--no-plugin-watcher"],
                stdin=subprocess.DEVNULL, stdout=out, stderr=out,
            )  # fmt: skip
        try:
            socket_file = emulated_dir / "kubelet.sock"
            wait_until(socket_file.exists, timeout=60, what="the emulated kubelet.sock")
            for name, device_plugins in (("real", DEVICE_PLUGINS), ("emulated", emulated_dir)):
                answer, plugin = _plugin_registering_twice(device_plugins, lab, home / f"{name}-plugin.log")
                plugin.send_signal(signal.SIGTERM)
                assert plugin.wait(60) == 0
                wait_until(
                    lambda n=name: _stream_end_seen(n, home),
                    timeout=60,
                    what=f"the {name} kubelet saw the end",
                )
                # Both kubelets disconnect (empty the healthy set) in the same step that handles the end,
                # before anything else: a count read after it is the outcome.
                left = _allocatable_devices(device_plugins.parent / "pod-resources" / "kubelet.sock", AGAIN)
                outcomes[name] = (answer, left)
                local.progress(f"{name} kubelet: a second Register from the plugin's socket: {answer!r}; "
                               f"after the plugin stopped: {left} healthy {AGAIN}")  # fmt: skip
        finally:
            emulated.send_signal(signal.SIGTERM)
            emulated.wait(30)
    assert outcomes["real"] == ("UNKNOWN: device plugin already connected: <its socket>", 2)
    assert outcomes["emulated"] == outcomes["real"]


POD_RESOURCES = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
KUBELET_LOG = Path("/var/lib/plugvisor-e2e/logs/kubelet.log")


def _refused(resource: str) -> list[str]:
    """The real kubelet's refusals of a second Register from a connected socket of ``resource``."""
    prefix = socket_prefix(resource)
    log = KUBELET_LOG.read_text(errors="replace")
    return [line for line in log.splitlines() if "device plugin already connected" in line and prefix in line]


def _registrations(log: Path) -> int:
    return log.read_text(errors="replace").count("event='registered'")


@pytest.mark.parametrize("mode", ["kubelet-sock", "plugin-watcher"])
@pytest.mark.parametrize("stops_first", ["the one that took over", "the first"])
def test_two_plugins_of_one_resource_on_the_real_kubelet(
    local: LocalBackend, mode: str, stops_first: str
) -> None:
    """A plugin, a second one with --replace; whichever stops first, the other serves the resource, never
    refused (`device plugin already connected`); once both stopped, no healthy device is left."""
    resource = f"plugvisor.io/takeover-{'sock' if mode == 'kubelet-sock' else 'watcher'}-" + (
        "second" if stops_first == "the first" else "first"
    )
    worker = local.playing or local.workers[0].name
    with tempfile.TemporaryDirectory(prefix="pvto-") as scratch:
        home = Path(scratch)
        lab = _lab(local, home / "lab")

        def plugin(name: str, *args: str) -> subprocess.Popen[bytes]:
            with (home / f"{name}.log").open("ab") as out:
                return subprocess.Popen(
                    [sys.executable, "-m", "plugvisor", "plugin", "generic", "--resource", resource,
                     "--host-root", str(lab), "--path", "/dev/fuse", "--count", "2",
                     "--kubelet-dir", str(DEVICE_PLUGINS), "--registration", mode, *args],
                    stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                )  # fmt: skip

        def healthy() -> int:
            return _allocatable_devices(POD_RESOURCES, resource)

        processes = {"first": plugin("first")}
        try:
            wait_until(
                lambda: _registrations(home / "first.log") == 1 and healthy() == 2,
                timeout=60,
                what=f"{resource}: the first plugin registered",
            )
            processes["second"] = plugin("second", "--replace")
            wait_until(
                lambda: _registrations(home / "second.log") == 1 and healthy() == 2,
                timeout=60,
                what=f"{resource}: the second plugin registered",
            )
            wait_until(
                lambda: "event='taken_over'" in (home / "first.log").read_text(),
                timeout=60,
                what=f"{resource}: the first plugin saw it was taken over",
            )
            gone, left = (
                ("second", "first") if stops_first == "the one that took over" else ("first", "second")
            )
            processes[gone].send_signal(signal.SIGTERM)
            assert processes[gone].wait(60) == 0, (home / f"{gone}.log").read_text()[-3000:]
            # The one left registers again (a fresh socket: up to 1.36 the other's end zeroed the resource).
            wait_until(
                lambda: _registrations(home / f"{left}.log") == 2 and healthy() == 2,
                timeout=60,
                what=f"{resource}: the {left} plugin registered again and serves",
            )
            assert not _refused(resource), _refused(resource)
            local.progress(f"{resource}: the {gone} plugin stopped; the {left} one serves 2 devices")
            processes[left].send_signal(signal.SIGTERM)
            assert processes[left].wait(60) == 0, (home / f"{left}.log").read_text()[-3000:]
            wait_until(
                lambda: healthy() == 0, timeout=60, what=f"{resource}: no healthy device once both stopped"
            )
            wait_until(
                lambda: [counts.get(resource) for counts in local.node_resources(worker)] == [2, 0],
                timeout=local.timeout,
                what=f"{resource}: capacity 2 (kept for the grace period), allocatable 0",
            )
            assert not _refused(resource), _refused(resource)
        finally:
            for process in processes.values():
                if process.poll() is None:
                    process.kill()
                    process.wait()
            for name in processes:
                local.progress(
                    f"{name} plugin's log, last lines:\n{(home / f'{name}.log').read_text()[-1500:]}"
                )


def test_two_agents_on_the_real_kubelet_take_turns(local: LocalBackend) -> None:
    """The agent of edges' issue 20 item 5, on the real kubelet: the first says it was taken over and stands
    by; once the second agent stops, the first serves again; once it stops too, nothing is left healthy."""
    resources = {
        "plugvisor.io/two-agents-sock": "kubelet-sock",
        "plugvisor.io/two-agents-watcher": "plugin-watcher",
    }
    worker = _worker(local, has="gpus")
    local.play(worker.name)
    config = [
        {"name": name, "kind": "generic", "paths": ["/dev/fuse"], "count": 2, "registration": mode}
        for name, mode in resources.items()
    ]
    with tempfile.TemporaryDirectory(prefix="pv2a-") as scratch:
        homes = [Path(scratch) / name for name in ("first", "second")]
        for home in homes:
            home.mkdir()
        first = HostAgent(homes[0], config)
        second: HostAgent | None = None
        try:
            wait_until(first.registered, timeout=local.timeout, what="the first agent registered")
            second = HostAgent(homes[1], config)
            wait_until(second.registered, timeout=local.timeout, what="the second agent registered")
            wait_until(first.taken_over, timeout=local.timeout, what="the first agent saw it was taken over")
            assert second.stop() == 0, second.log.read_text()[-3000:]
            wait_until(first.registered, timeout=local.timeout, what="the first agent registered again")
            for resource in resources:
                wait_until(
                    lambda r=resource: _allocatable_devices(POD_RESOURCES, r) == 2,
                    timeout=60,
                    what=f"{resource}: served by the first agent",
                )
                assert not _refused(resource), _refused(resource)
            assert first.stop() == 0, first.log.read_text()[-3000:]
            for resource in resources:
                wait_until(
                    lambda r=resource: _allocatable_devices(POD_RESOURCES, r) == 0,
                    timeout=60,
                    what=f"{resource}: no healthy device once both agents stopped",
                )
                assert not _refused(resource), _refused(resource)
        finally:
            for agent in (first, second):
                if agent is not None:
                    agent.stop()
                    local.progress(
                        f"{agent.home.name} agent's log, last lines:\n{agent.log.read_text()[-1500:]}"
                    )
