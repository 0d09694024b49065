"""NVIDIA nodes on the real kubelet, served by the gpu kind both as a device plugin and as a DRA driver
through the shipped lab overlays, whose gpu agents read NVML from the lab's stand-in (the lab's
libnvidia-ml.so.1, which pynvml loads as it loads NVIDIA's):

- ``nvidia-h200-vm``, the lab's grounded profile (one H200, driver 580.159.04 under /usr/local/nvidia):
  - the device plugin: `plugvisor.io/gpu` is allocatable; a pod gets the GPU's device nodes, its UUID in
    NVIDIA_VISIBLE_DEVICES and the driver's user-space files (the kubelet's checkpoint holds the Allocate
    answer's mounts; inside the container the libraries and tools are the lab's, byte for byte);
  - DRA: the ResourceSlice carries what NVIDIA's driver publishes from NVML (productName, architecture,
    cudaComputeCapability, the memory capacity); a claim whose CEL selects on them is allocated and
    prepared, one asking for more than an H200 is not;
  - an NVML XID (the lab's `xid-79`, raised by the stand-in as NVML's XID critical error event) makes the
    GPU unhealthy on both paths (allocatable drops, the slice's device gets the xid taint); `heal` brings
    it back once quiet for the lab overlay's `nvml.recoverAfterSeconds` (3 s).
- ``dgx-like``, an 8-GPU server (H100s, two per PCIe switch, four under each of two PCIe roots):
  - DRA: a claim written as NVIDIA's documentation writes them (product name, compute capability, driver
    version, memory, `matchAttribute: resource.kubernetes.io/pcieRoot`) gets two GPUs of one root; the
    same claim for five GPUs stays pending, its pod unschedulable, though eight GPUs match its selectors;
  - the device plugin: a pod asking for four GPUs gets the four of one root (GetPreferredAllocation).

The node plays each profile as one more role (no kind worker has it); its lab is written by the lab
overlay's pod from the image's NVML stand-in, as for the kind workers. The only thing this module changes
in the shipped overlays is where their gpu agents run (the role's profile label instead of gpu-node) and,
for the H200, the driver root its profile puts the driver under (/usr/local/nvidia, as on the real node):
the NVML state's mount is the overlays' own. Local backend only (`tox -e e2e-local`); it runs last, after
test_dra.py (conftest.py's order).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from plugvisor.common.hostpaths import multiarch_triplet
from plugvisor.emulators.lab import DeviceRecord, Lab, load_profile

from .backends import Backend, LocalBackend, wait_until
from .backends.local import LAB_DIR
from .deployment import LAB_DRA_OVERLAY, LAB_OVERLAY, PROFILE_LABEL, REPO, Worker
from .dra import GPU as DRA_GPU
from .dra import NAMESPACE, DraLab, checkpoint, spec_file
from .local.cluster import NODE
from .test_real_kubelet import _allocation
from .test_scenarios import GPU, _running, _status

pytestmark = pytest.mark.e2e

PROFILES = REPO / "src/plugvisor/emulators/lab/profiles"
ROLE = "nvidia-h200-vm"
DGX = "dgx-like"
DRIVER_ROOTS = {ROLE: "/usr/local/nvidia", DGX: "/"}
"""Where each role's profile puts NVIDIA's driver (its `driverRoot`), as the gpu resource must be told."""
DRIVER_ROOT = DRIVER_ROOTS[ROLE]
H200_MEMORY = 150754820096
"""NVML's memory total of the real H200 (nvmlDeviceGetMemoryInfo), the profile's and the stand-in's."""
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
AN_H100 = [
    f"device.attributes['{DRA_GPU}'].productName == 'NVIDIA H100 80GB HBM3'",
    f"device.attributes['{DRA_GPU}'].cudaComputeCapability.compareTo(semver('9.0.0')) >= 0",
    f"device.attributes['{DRA_GPU}'].driverVersion.compareTo(semver('550.0.0')) >= 0",
    # An "80GB" H100 reports 79.6 GiB (85520809984 bytes) to NVML, as the lab's does: 80Gi would match none.
    f"device.capacity['{DRA_GPU}'].memory.compareTo(quantity('79Gi')) >= 0",
]
"""docs/dra.md's claim: selectors as NVIDIA's documentation writes them, one CEL expression each."""
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"


def _selector_patch(daemonset: str, role: str) -> dict[str, Any]:
    """The shipped lab overlay's gpu agent, run on the role's node instead of the gpu-node worker's."""
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": daemonset, "namespace": "kube-system"},
        "spec": {"template": {"spec": {"nodeSelector": {PROFILE_LABEL: role}}}},
    }


def _overlay(where: Path, base: Path, config: str, daemonset: str, role: str) -> Path:
    """A kustomization on top of the shipped ``base``: its gpu agent on ``role``'s node and, where the role's
    profile puts the driver elsewhere than /, its node.yaml with that driver root."""
    where.mkdir()
    (where / "patch-gpu.yaml").write_text(yaml.safe_dump(_selector_patch(daemonset, role)))
    kustomization: dict[str, Any] = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(base, where)],
        "patches": [{"path": "patch-gpu.yaml"}],
    }
    if DRIVER_ROOTS[role] != "/":
        node = yaml.safe_load((base / "node-gpu.yaml").read_text())
        (entry,) = node["resources"]
        entry["driverRoot"] = DRIVER_ROOTS[role]
        (where / "node-gpu.yaml").write_text(yaml.safe_dump(node))
        kustomization["configMapGenerator"] = [
            {
                "name": config,
                "namespace": "kube-system",
                "behavior": "replace",
                "files": ["node.yaml=node-gpu.yaml"],
            }
        ]
    (where / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return where


@pytest.fixture(scope="module")
def nvidia_node(backend: Backend) -> Iterator[Callable[[str], DraLab]]:
    """Make the node play an NVIDIA role, with the gpu kind's device plugin and DRA driver both serving it;
    the shipped overlays are put back once the module is done."""
    if not isinstance(backend, LocalBackend):
        pytest.skip("needs a real kubelet on this machine: the local backend (tox -e e2e-local)")
    local = backend
    dra = DraLab(local)
    for role in DRIVER_ROOTS:
        labels = {"plugvisor.io/lab": "true", PROFILE_LABEL: role}
        path = PROFILES / f"{role}.yaml"
        local.add_role(Worker(labels, path, load_profile(path)))
    applied: list[str] = []

    def switch(role: str) -> DraLab:
        if applied[-1:] != [role]:
            with tempfile.TemporaryDirectory(prefix="pv-nvidia-") as scratch:
                for base, config, daemonset in (
                    (LAB_OVERLAY, "plugvisor-config-gpu", "plugvisor-gpu"),
                    (LAB_DRA_OVERLAY, "plugvisor-config-gpu-dra", "plugvisor-gpu-dra"),
                ):
                    local.progress(f"kubectl apply -k: {base.name} with the gpu agent on {role}")
                    where = _overlay(Path(scratch) / base.name, base, config, daemonset, role)
                    local.kubectl("apply", "-k", str(where))
            applied.append(role)
        local.play(role)
        local.wait_daemonsets(LAB_DRA_OVERLAY)
        return dra

    try:
        yield switch
    finally:
        if applied:
            dra.remove_drivers()
            local.apply_lab_overlay()
            local.wait_daemonsets()


@pytest.fixture
def h200(nvidia_node: Callable[[str], DraLab]) -> DraLab:
    """The node plays the H200 VM."""
    return nvidia_node(ROLE)


@pytest.fixture
def dgx(nvidia_node: Callable[[str], DraLab]) -> DraLab:
    """The node plays the 8-GPU server."""
    return nvidia_node(DGX)


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

        _stays_pending(h200, "h200-needs-blackwell", "compute capability >= 10")
    finally:
        local.delete_pod("h200-needs-blackwell")
        local.delete_pod("h200-dra")
        _unprepared_and_gone(h200, claim, fits, too_new)


def _stays_pending(dra: DraLab, pod_name: str, why_impossible: str) -> None:
    """``pod_name``'s pod is unschedulable and its claim unallocated: what an impossible claim gets."""
    local = dra.local

    def unschedulable() -> str | None:
        pod = local.core.read_namespaced_pod(pod_name, NAMESPACE)
        assert pod.status.phase == "Pending", pod.status
        return next(
            (
                c.message or "(no message)"
                for c in pod.status.conditions or []
                if c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable"
            ),
            None,
        )

    why = wait_until(unschedulable, timeout=local.timeout, what=f"{pod_name} unschedulable")
    local.progress(f"{pod_name} ({why_impossible}): unschedulable: {why}")
    (waiting,) = [
        c
        for c in dra.objects.list_namespaced_custom_object(
            "resource.k8s.io", "v1", NAMESPACE, "resourceclaims"
        )["items"]
        if any(o["name"] == pod_name for o in c["metadata"].get("ownerReferences", []))
    ]
    assert not waiting.get("status", {}).get("allocation"), waiting["status"]


def _unprepared_and_gone(dra: DraLab, claim: dict[str, Any], *templates: str) -> None:
    """After a test's pods are deleted: their prepared claim (if any) unprepared, their templates deleted."""
    if claim:
        uid = claim["metadata"]["uid"]
        wait_until(
            lambda: not spec_file(DRA_GPU, uid).exists() and uid not in checkpoint(DRA_GPU),
            timeout=dra.local.timeout,
            what=f"claim {claim['metadata']['name']} unprepared",
        )
    for template in templates:
        _delete_template(dra, template)


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


# -- the 8-GPU server: one PCIe root for a pair, on both paths ----------------------------------------


def _root_of(gpu: DeviceRecord) -> str:
    """The PCIe root complex a lab GPU sits under (``pci0000:80``), from its sysfs path."""
    return gpu.sysfs_path.split("/")[2]


def _nvidia_template(dra: DraLab, name: str, count: int) -> str:
    """``count`` H100s of one PCIe root, selected as NVIDIA's documentation selects them."""
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
                                "name": "gpus",
                                "exactly": {
                                    "deviceClassName": DRA_GPU,
                                    "allocationMode": "ExactCount",
                                    "count": count,
                                    "selectors": [{"cel": {"expression": e}} for e in AN_H100],
                                },
                            }
                        ],
                        "constraints": [{"requests": ["gpus"], "matchAttribute": PCIE_ROOT}],
                    }
                }
            },
        },
    )
    return name


def _eight_gpus_with_nvml(dra: DraLab) -> dict[str, dict[str, Any]]:
    def published() -> dict[str, dict[str, Any]] | None:
        devices = dra.devices(DRA_GPU)
        with_nvml = [d for d in devices.values() if "productName" in d.get("attributes", {})]
        return devices if len(devices) == 8 and len(with_nvml) == 8 else None

    found: dict[str, dict[str, Any]] = wait_until(
        published, timeout=dra.local.timeout, what=f"{DGX}: eight GPUs in the {DRA_GPU} slice, with NVML's"
    )
    return found


def _attribute(device: dict[str, Any], name: str) -> Any:
    return next(iter(device["attributes"][name].values()))


def test_a_claim_written_as_nvidias_docs_write_them_gets_two_gpus_of_one_pcie_root(dgx: DraLab) -> None:
    """The slice has eight H100s with NVML's attributes, four under each of two PCIe roots. A claim for two
    of them by product name, compute capability, driver version and memory, constrained to one pcieRoot,
    is allocated two GPUs that share a root (the slice says so, and the lab's tree) and prepared: the
    container has exactly their device nodes. The same claim for five stays unallocated, its pod
    unschedulable, though all eight GPUs match its selectors: no root has five."""
    local = dgx.local
    devices = _eight_gpus_with_nvml(dgx)
    roots = {name: _attribute(device, PCIE_ROOT) for name, device in devices.items()}
    local.progress(f"{DGX}: {DRA_GPU} devices by pcieRoot: {sorted(Counter(roots.values()).items())}")
    assert sorted(Counter(roots.values()).values()) == [4, 4], roots
    for device in devices.values():
        assert _attribute(device, "productName") == "NVIDIA H100 80GB HBM3"
        assert _attribute(device, "cudaComputeCapability") == "9.0.0"
    lab = {gpu.uuid: gpu for gpu in Lab.open(LAB_DIR).devices(kind="gpu")}
    pair = _nvidia_template(dgx, "h100-pair-one-root", 2)
    five = _nvidia_template(dgx, "h100-five-one-root", 5)
    claim: dict[str, Any] = {}
    try:
        dgx.create_pod("h100-five", five, "gpus")
        dgx.create_pod("h100-pair", pair, "gpus")
        view = _running(local, "h100-pair")
        claim = dgx.claim_of("h100-pair")
        results = claim["status"]["allocation"]["devices"]["results"]
        assert [(r["request"], r["driver"], r["pool"]) for r in results] == [("gpus", DRA_GPU, NODE)] * 2
        chosen = sorted(r["device"] for r in results)
        uuids = [_attribute(devices[name], "uuid") for name in chosen]
        local.progress(
            f"h100-pair: claim {claim['metadata']['name']} got {chosen} on {[roots[c] for c in chosen]}; "
            f"NVIDIA_VISIBLE_DEVICES={view.env.get('NVIDIA_VISIBLE_DEVICES')}"
        )
        assert roots[chosen[0]] == roots[chosen[1]], f"{chosen} are on {[roots[c] for c in chosen]}"
        assert _root_of(lab[uuids[0]]) == _root_of(lab[uuids[1]]) == roots[chosen[0]]
        assert sorted(view.env["NVIDIA_VISIBLE_DEVICES"].split(",")) == sorted(uuids)
        for uuid, gpu in lab.items():
            own = {n.path for n in gpu.device_nodes if n.path.removeprefix("/dev/nvidia").isdigit()}
            held = own & set(view.devices)
            assert held == (own if uuid in uuids else set()), f"{gpu.name}: the container has {held}"
        assert claim["metadata"]["uid"] in checkpoint(DRA_GPU)

        _stays_pending(dgx, "h100-five", "five H100s of one pcieRoot; four per root")
    finally:
        local.delete_pod("h100-five")
        local.delete_pod("h100-pair")
        _unprepared_and_gone(dgx, claim, pair, five)


def test_a_pod_asking_the_device_plugin_for_four_gpus_gets_the_four_of_one_pcie_root(dgx: DraLab) -> None:
    """GetPreferredAllocation on the real kubelet: of eight GPUs under two roots, four go to a pod together
    only from one root (a NUMA node's two switches), never split over the two."""
    local = dgx.local
    wait_until(
        lambda: local.node_resources(DGX)[1].get(GPU) == 8,
        timeout=local.timeout,
        what=f"{DGX}: allocatable {GPU} = 8",
    )
    local.create_pod(DGX, "h100-four", {GPU: 4})
    try:
        view = _running(local, "h100-four")
        lab = {gpu.uuid: gpu for gpu in Lab.open(LAB_DIR).devices(kind="gpu")}
        given = [lab[uuid] for uuid in view.env["NVIDIA_VISIBLE_DEVICES"].split(",")]
        local.progress(
            f"h100-four: {[g.name for g in given]} under {sorted({_root_of(g) for g in given})}, "
            f"switches {sorted({str(g.pcie_switch) for g in given})}"
        )
        assert len(given) == 4
        assert len({_root_of(g) for g in given}) == 1, [g.sysfs_path for g in given]
        assert len({g.pcie_switch for g in given}) == 2, "a root's four GPUs are two switches' pairs"
    finally:
        local.delete_pod("h100-four")
