"""A real H200 node's NVIDIA side on the real kubelet: the lab's grounded `nvidia-h200-vm` profile (one H200,
driver 580.159.04 under /usr/local/nvidia, the NVML stand-in that pynvml loads as it loads NVIDIA's
libnvidia-ml.so.1), served by the gpu kind both as a device plugin and as a DRA driver.

- The device plugin: `plugvisor.io/gpu` is allocatable; a pod gets the GPU's device nodes, its UUID in
  NVIDIA_VISIBLE_DEVICES and the driver's user-space files (the kubelet's checkpoint holds the Allocate
  answer's mounts; inside the container the libraries and tools are the lab's, byte for byte).
- DRA: the ResourceSlice carries what NVIDIA's driver publishes from NVML (productName, architecture,
  cudaComputeCapability, the memory capacity); a claim whose CEL selects on them is allocated and
  prepared, one asking for more than an H200 is not.
- An NVML XID (the lab's `xid-79`, raised by the stand-in as NVML's XID critical error event) makes the
  GPU unhealthy on both paths (allocatable drops, the slice's device gets the xid taint); `heal` brings
  it back once quiet for the lab overlay's `nvml.recoverAfterSeconds` (3 s).

The node plays this profile as one more role (it is no kind worker): its lab is written on the node, as a
real driver is installed on the host (the project's image has no C compiler to build the stand-in), and
the lab overlays' gpu agents are pointed at it with the overlay this module applies on top of them
(`driverRoot: /usr/local/nvidia`, the lab's NVML state mounted where the stand-in looks for it). Local
backend only (`tox -e e2e-local`); it runs last, after test_dra.py (conftest.py's order).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from plugvisor.common.hostpaths import multiarch_triplet
from plugvisor.emulators.lab import DeviceRecord, Lab, load_profile
from plugvisor.emulators.lab import nvml as lab_nvml

from .backends import Backend, LocalBackend, wait_until
from .backends.local import LAB_DIR
from .deployment import LAB_DRA_OVERLAY, LAB_OVERLAY, PROFILE_LABEL, REPO, Worker
from .dra import GPU as DRA_GPU
from .dra import NAMESPACE, DraLab, checkpoint, spec_file
from .local.cluster import NODE
from .test_real_kubelet import _allocation
from .test_scenarios import GPU, _running, _status

pytestmark = pytest.mark.e2e

ROLE = "nvidia-h200-vm"
PROFILE = REPO / "src/plugvisor/emulators/lab/profiles/nvidia-h200-vm.yaml"
DRIVER_ROOT = "/usr/local/nvidia"
H200_MEMORY = 150754820096
"""NVML's memory total of the real H200 (nvmlDeviceGetMemoryInfo), the profile's and the stand-in's."""
NVML_STATE = lab_nvml.STATE_DIR
"""The lab's NVML state, relative to the lab's root (.plugvisor-lab/nvml)."""
DRIVER_FILES = ("lib64/libnvidia-ml.so.1", "lib64/libcuda.so.1", "bin/nvidia-smi")
"""Driver files checked in the containers: under the driver root on the node, and where they are mounted."""
FITS_AN_H200 = (
    f'device.attributes["{DRA_GPU}"].productName == "NVIDIA H200" && '
    f'device.attributes["{DRA_GPU}"].architecture == "Hopper" && '
    f'device.attributes["{DRA_GPU}"].cudaComputeCapability.compareTo(semver("9.0.0")) >= 0 && '
    f'device.capacity["{DRA_GPU}"].memory.compareTo(quantity("140Gi")) >= 0'
)
"""NVIDIA's way of asking for a Hopper with 140 GiB (docs/migrating-from-nvidia.md), in plugvisor's domain."""
NEEDS_BLACKWELL = f'device.attributes["{DRA_GPU}"].cudaComputeCapability.compareTo(semver("10.0.0")) >= 0'


def _agent_patch(daemonset: str) -> dict[str, Any]:
    """The gpu agent on the H200 role's node, with the lab's NVML state where the stand-in finds it.

    The stand-in walks up from its own path to the directory that holds ``.plugvisor-lab/nvml``: in the
    agent's container the driver is under /host/usr (the lab's usr/), so the state goes at /host.
    """
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": daemonset, "namespace": "kube-system"},
        "spec": {
            "template": {
                "spec": {
                    "nodeSelector": {PROFILE_LABEL: ROLE},
                    "containers": [
                        {
                            "name": "agent",
                            "volumeMounts": [
                                {"name": "lab-nvml", "mountPath": f"/host/{NVML_STATE}", "readOnly": True}
                            ],
                        }
                    ],
                    "volumes": [
                        {
                            "name": "lab-nvml",
                            "hostPath": {"path": f"{LAB_DIR}/{NVML_STATE}", "type": "Directory"},
                        }
                    ],
                }
            }
        },
    }


def _overlay(where: Path, base: Path, config: str, daemonset: str) -> Path:
    """A kustomization on top of ``base``: its gpu agent's node.yaml with the H200's driver root, and
    :func:`_agent_patch`."""
    where.mkdir()
    node = yaml.safe_load((base / "node-gpu.yaml").read_text())
    (entry,) = node["resources"]
    entry["driverRoot"] = DRIVER_ROOT
    (where / "node-gpu.yaml").write_text(yaml.safe_dump(node))
    (where / "patch-gpu.yaml").write_text(yaml.safe_dump(_agent_patch(daemonset)))
    (where / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [os.path.relpath(base, where)],
                "configMapGenerator": [
                    {
                        "name": config,
                        "namespace": "kube-system",
                        "behavior": "replace",
                        "files": ["node.yaml=node-gpu.yaml"],
                    }
                ],
                "patches": [{"path": "patch-gpu.yaml"}],
            }
        )
    )
    return where


@pytest.fixture(scope="module")
def h200(backend: Backend) -> Iterator[DraLab]:
    """The node plays the H200 VM, with the gpu kind's device plugin and DRA driver both serving it."""
    if not isinstance(backend, LocalBackend):
        pytest.skip("needs a real kubelet on this machine: the local backend (tox -e e2e-local)")
    if lab_nvml.compiler() is None:
        pytest.skip("the lab's NVML stand-in is compiled on the node: it needs a C compiler (cc)")
    local = backend
    role = Worker({"plugvisor.io/lab": "true", PROFILE_LABEL: ROLE}, PROFILE, load_profile(PROFILE))
    local.add_role(role, lab_on_host=True)
    dra = DraLab(local)
    with tempfile.TemporaryDirectory(prefix="pv-h200-") as scratch:
        for base, config, daemonset in (
            (LAB_OVERLAY, "plugvisor-config-gpu", "plugvisor-gpu"),
            (LAB_DRA_OVERLAY, "plugvisor-config-gpu-dra", "plugvisor-gpu-dra"),
        ):
            local.progress(f"kubectl apply -k: {base.name} with the gpu agent on {ROLE} (driverRoot, NVML)")
            local.kubectl("apply", "-k", str(_overlay(Path(scratch) / base.name, base, config, daemonset)))
    try:
        local.play(ROLE)
        local.wait_daemonsets(LAB_DRA_OVERLAY)
        yield dra
    finally:
        dra.remove_drivers()
        local.apply_lab_overlay()
        local.wait_daemonsets()


def _lab_gpu() -> DeviceRecord:
    """The lab's one GPU, as the lab on the node records it."""
    (gpu,) = Lab.open(LAB_DIR).devices(kind="gpu")
    return gpu


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def _driver_files_in(local: LocalBackend, pod: str) -> None:
    """The container has the lab's driver files at the paths a CUDA program looks for them, byte for byte
    (the NVML stand-in itself among them): checked with the container's own md5sum."""
    inside = {
        name: f"/usr/lib/{multiarch_triplet()}/{Path(name).name}"
        if name.startswith("lib")
        else f"/usr/bin/{Path(name).name}"
        for name in DRIVER_FILES
    }
    listing = local.kubectl("exec", pod, "-c", "check", "--", "md5sum", *inside.values())
    seen = {line.split()[1]: line.split()[0] for line in listing.splitlines() if line.strip()}
    host = LAB_DIR / DRIVER_ROOT.strip("/")
    wanted = {inside[name]: _md5((host / name).resolve()) for name in DRIVER_FILES}
    assert seen == wanted, f"{pod}: the driver files differ from the lab's: {seen} != {wanted}"
    local.progress(f"{pod}: driver files in the container, the lab's byte for byte: {sorted(seen)}")


def test_the_h200_is_allocatable_and_a_pod_gets_it_with_the_drivers_files(h200: DraLab) -> None:
    """The device plugin on the real kubelet: one plugvisor.io/gpu; the pod has /dev/nvidia0 and the control
    nodes, the GPU's UUID, and NVIDIA's libraries and tools as the Allocate answer's read-only mounts."""
    local = h200.local
    gpu = _lab_gpu()
    wait_until(
        lambda: local.node_resources(ROLE)[1].get(GPU) == 1,
        timeout=local.timeout,
        what=f"{ROLE}: allocatable {GPU} = 1",
    )
    (child,) = [c for c in _status(local, local.roles[ROLE], "gpu")["children"] if c["resource"] == GPU]
    local.progress(f"{ROLE}: the gpu agent's child: {json.dumps(child)[:1500]}")
    local.create_pod(ROLE, "h200-gpu", {GPU: 1})
    try:
        view = _running(local, "h200-gpu")
        nodes = {n.path for n in gpu.device_nodes}
        local.progress(
            f"h200-gpu: devices {list(view.devices)}, env {view.env.get('NVIDIA_VISIBLE_DEVICES')}"
        )
        assert nodes <= set(view.devices), f"the pod lacks {nodes}: it has {view.devices}"
        assert {"/dev/nvidia0", "/dev/nvidiactl"} <= set(view.devices), view.devices
        assert view.env["NVIDIA_VISIBLE_DEVICES"] == gpu.uuid
        uid = local.core.read_namespaced_pod("h200-gpu", "default").metadata.uid
        answer = _allocation(uid, GPU)
        mounts = {m.container_path: m for m in answer.mounts}
        nvml = mounts.get(f"/usr/lib/{multiarch_triplet()}/libnvidia-ml.so.1")
        assert nvml is not None, f"no libnvidia-ml.so.1 among the Allocate answer's mounts: {sorted(mounts)}"
        assert nvml.read_only
        assert nvml.host_path == str(
            (LAB_DIR / DRIVER_ROOT.strip("/") / "lib64/libnvidia-ml.so.1").resolve()
        ), nvml
        _driver_files_in(local, "h200-gpu")
    finally:
        local.delete_pod("h200-gpu")


def _gpu_device(dra: DraLab) -> tuple[str, dict[str, Any]]:
    def published() -> tuple[str, dict[str, Any]] | None:
        devices = dra.devices(DRA_GPU)
        if len(devices) != 1:
            return None
        ((name, device),) = devices.items()
        return (name, device) if "productName" in device.get("attributes", {}) else None

    found: tuple[str, dict[str, Any]] = wait_until(
        published,
        timeout=dra.local.timeout,
        what=f"{ROLE}: the H200 in the {DRA_GPU} slice, with NVML's attributes",
    )
    return found


def _template(dra: DraLab, name: str, expression: str) -> str:
    dra.objects.create_namespaced_custom_object(
        "resource.k8s.io",
        "v1",
        NAMESPACE,
        "resourceclaimtemplates",
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": name},
            "spec": {
                "spec": {
                    "devices": {
                        "requests": [
                            {
                                "name": "gpu",
                                "exactly": {
                                    "deviceClassName": DRA_GPU,
                                    "selectors": [{"cel": {"expression": expression}}],
                                },
                            }
                        ]
                    }
                }
            },
        },
    )
    return name


def _delete_template(dra: DraLab, name: str) -> None:
    dra.objects.delete_namespaced_custom_object(
        "resource.k8s.io", "v1", NAMESPACE, "resourceclaimtemplates", name
    )


def test_a_claim_selecting_on_nvml_attributes_gets_the_h200(h200: DraLab) -> None:
    """The slice carries NVML's productName, architecture, compute capability and memory; a claim asking
    for a Hopper with 140 GiB gets the H200 (prepared: CDI spec, checkpoint, device nodes and driver files in
    the container); a claim asking for compute capability 10 stays unallocated, its pod unschedulable."""
    local = h200.local
    gpu = _lab_gpu()
    name, device = _gpu_device(h200)
    attributes = {key: next(iter(value.values())) for key, value in device["attributes"].items()}
    local.progress(f"{DRA_GPU}: {name}: {json.dumps(device)}")
    assert attributes["uuid"] == gpu.uuid
    assert attributes["productName"] == "NVIDIA H200"
    assert attributes["architecture"] == "Hopper"
    assert attributes["cudaComputeCapability"] == "9.0.0"
    assert attributes["driverVersion"] == "580.159.4"
    assert attributes["cudaDriverVersion"] == "13.0.0"
    from kubernetes.utils import parse_quantity  # noqa: PLC0415 - the e2e extra

    assert parse_quantity(device["capacity"]["memory"]["value"]) == H200_MEMORY
    fits = _template(h200, "h200-fits", FITS_AN_H200)
    too_new = _template(h200, "h200-too-new", NEEDS_BLACKWELL)
    claim: dict[str, Any] = {}
    try:
        h200.create_pod("h200-needs-blackwell", too_new, "gpu")
        h200.create_pod("h200-dra", fits, "gpu")
        view = _running(local, "h200-dra")
        claim = h200.claim_of("h200-dra")
        results = claim["status"]["allocation"]["devices"]["results"]
        assert [(r["driver"], r["pool"], r["device"]) for r in results] == [(DRA_GPU, NODE, name)]
        assert claim["metadata"]["uid"] in checkpoint(DRA_GPU)
        spec = json.loads(spec_file(DRA_GPU, claim["metadata"]["uid"]).read_text())
        local.progress(
            f"h200-dra: claim {claim['metadata']['name']} got {name}; devices {list(view.devices)}"
        )
        assert {n.path for n in gpu.device_nodes} <= set(view.devices), view.devices
        assert view.env["NVIDIA_VISIBLE_DEVICES"] == gpu.uuid
        mounted = {m["containerPath"] for m in spec.get("containerEdits", {}).get("mounts", [])}
        mounted |= {
            m["containerPath"] for d in spec["devices"] for m in d["containerEdits"].get("mounts", [])
        }
        assert f"/usr/lib/{multiarch_triplet()}/libnvidia-ml.so.1" in mounted, spec
        _driver_files_in(local, "h200-dra")

        def unschedulable() -> str | None:
            pod = local.core.read_namespaced_pod("h200-needs-blackwell", NAMESPACE)
            assert pod.status.phase == "Pending", pod.status
            return next(
                (
                    c.message or "(no message)"
                    for c in pod.status.conditions or []
                    if c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable"
                ),
                None,
            )

        why = wait_until(unschedulable, timeout=local.timeout, what="h200-needs-blackwell unschedulable")
        local.progress(f"h200-needs-blackwell (compute capability >= 10): unschedulable: {why}")
        (waiting,) = [
            c
            for c in h200.objects.list_namespaced_custom_object(
                "resource.k8s.io", "v1", NAMESPACE, "resourceclaims"
            )["items"]
            if any(o["name"] == "h200-needs-blackwell" for o in c["metadata"].get("ownerReferences", []))
        ]
        assert not waiting.get("status", {}).get("allocation"), waiting["status"]
    finally:
        local.delete_pod("h200-needs-blackwell")
        local.delete_pod("h200-dra")
        if claim:
            uid = claim["metadata"]["uid"]
            wait_until(
                lambda: not spec_file(DRA_GPU, uid).exists() and uid not in checkpoint(DRA_GPU),
                timeout=local.timeout,
                what=f"claim {claim['metadata']['name']} unprepared",
            )
        for template in (fits, too_new):
            _delete_template(h200, template)


def _taints(dra: DraLab) -> list[dict[str, Any]]:
    ((_, device),) = dra.devices(DRA_GPU).items()
    taints: list[dict[str, Any]] = device.get("taints", [])
    return taints


def test_an_nvml_xid_makes_the_h200_unhealthy_on_both_paths_and_heal_brings_it_back(h200: DraLab) -> None:
    """XID 79 from NVML: allocatable plugvisor.io/gpu 0 with the XID as the cause, and the slice's device
    tainted gpu.plugvisor.io/xid=79 (NoSchedule); healed and quiet for 3 s, both are back."""
    local = h200.local
    wait_until(
        lambda: local.node_resources(ROLE)[1].get(GPU) == 1,
        timeout=local.timeout,
        what=f"allocatable {GPU} = 1",
    )
    _gpu_device(h200)
    assert not _taints(h200)
    local.lab(ROLE, "fault", _lab_gpu().name, "xid-79")
    try:
        wait_until(
            lambda: local.node_resources(ROLE)[1].get(GPU) == 0,
            timeout=local.timeout,
            what=f"{ROLE}: allocatable {GPU} = 0 after the XID",
        )
        (child,) = [c for c in _status(local, local.roles[ROLE], "gpu")["children"] if c["resource"] == GPU]
        causes = [d["cause"] for d in child["devices_detail"] if not d["healthy"]]
        assert len(causes) == 1 and causes[0].startswith("xid 79"), f"plugvisor status: {child}"
        taints = wait_until(
            lambda: _taints(h200), timeout=local.timeout, what=f"the {DRA_GPU} device tainted"
        )
        assert [(t["key"], t.get("value"), t["effect"]) for t in taints] == [
            (f"{DRA_GPU}/xid", "79", "NoSchedule")
        ], taints
        local.progress(f"{ROLE}: xid-79: unhealthy ({causes[0]}); slice taints {taints}")
    finally:
        local.lab(ROLE, "heal", _lab_gpu().name)
    wait_until(
        lambda: local.node_resources(ROLE)[1].get(GPU) == 1,
        timeout=local.timeout,
        what=f"{ROLE}: allocatable {GPU} = 1 after heal",
    )
    wait_until(lambda: not _taints(h200), timeout=local.timeout, what=f"the {DRA_GPU} device's taint gone")
