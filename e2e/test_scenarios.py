"""A node's life on emulated hardware, checked as a user would: node status, pod status, what a pod got.

The same scenarios run offline (`--backend emulated`, in the README's test command) and on the kind
cluster (`tox -e e2e`, i.e. `--backend kind`): the two kind workers' labs are written from the profiles
kind-config.yaml gives them, and the agents run with the lab overlay's configuration.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from plugvisor.common.hostpaths import multiarch_triplet

from .backends import Backend, PodView, wait_until
from .backends.common import CommandError
from .deployment import Worker, agents, expected_allocatable

pytestmark = pytest.mark.e2e

GPU = "plugvisor.io/gpu"
VF = "plugvisor.io/sriov-vf"
FPGA = "plugvisor.io/fpga"
FUSE = "plugvisor.io/fuse"


def _worker(backend: Backend, *, has: str) -> Worker:
    return next(w for w in backend.workers if getattr(w.profile, has))


def _allocatable_is(backend: Backend, worker: Worker, resource: str, count: int) -> bool:
    return backend.node_resources(worker.name)[1].get(resource) == count


def _wait_allocatable(backend: Backend, worker: Worker, resource: str, count: int) -> None:
    backend.progress(f"waiting: {worker.name} allocatable {resource}={count}")
    wait_until(
        lambda: _allocatable_is(backend, worker, resource, count),
        timeout=backend.timeout,
        what=f"{worker.name}: allocatable {resource} = {count}",
    )


def _running(backend: Backend, name: str) -> PodView:
    def ready() -> PodView | None:
        view = backend.pod(name)
        if view is not None and view.phase in ("Failed", "Succeeded"):
            raise AssertionError(f"pod {name} ended: {view.phase} {view.message}")
        return view if view is not None and view.phase == "Running" else None

    return wait_until(ready, timeout=backend.timeout, what=f"pod {name} running with its devices")


def _status(backend: Backend, worker: Worker, kind: str) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(
        backend.agent_exec(worker.name, kind, ["plugvisor", "status", "--json"])
    )
    return document


def _all_registered(backend: Backend, worker: Worker, kind: str) -> dict[str, Any] | None:
    status = _status(backend, worker, kind)
    children = status["children"]
    return status if children and all(c.get("registered") for c in children) else None


def test_every_emulated_resource_is_allocatable_on_its_worker(backend: Backend) -> None:
    """Each worker offers exactly the resources its lab has hardware for, at the profile's counts."""
    every = {name for agent in agents() for name in agent.resources}
    for worker in backend.workers:
        expected = expected_allocatable(worker)
        assert expected, f"{worker.name}: no agent of the lab overlay runs there"
        backend.progress(f"waiting: {worker.name} advertises {expected}")

        def advertised(w: Worker = worker, want: dict[str, int] = expected) -> bool:
            capacity, allocatable = backend.node_resources(w.name)
            return all(allocatable.get(k) == v and capacity.get(k) == v for k, v in want.items())

        wait_until(advertised, timeout=backend.timeout, what=f"{worker.name} advertises {expected}")
        _, allocatable = backend.node_resources(worker.name)
        for other in every - set(expected):
            assert allocatable.get(other, 0) == 0, (
                f"{worker.name} offers {other}, which its lab does not have"
            )


def test_a_pod_asking_for_two_gpus_gets_a_same_switch_pair(backend: Backend) -> None:
    """The pod runs, sees both GPUs' device nodes and the IDs in NVIDIA_VISIBLE_DEVICES, behind one switch."""
    worker = _worker(backend, has="gpus")
    _wait_allocatable(backend, worker, GPU, expected_allocatable(worker)[GPU])
    backend.create_pod(worker.name, "two-gpus", {GPU: 2})
    try:
        view = _running(backend, "two-gpus")
        ids = view.env["NVIDIA_VISIBLE_DEVICES"].split(",")
        assert len(ids) == 2
        lab = {d["uuid"]: d for d in json.loads(backend.lab(worker.name, "show", "--json"))["devices"]}
        pair = [lab[i] for i in ids]
        assert pair[0]["pcie_switch"] is not None
        assert pair[0]["pcie_switch"] == pair[1]["pcie_switch"], f"not a same-switch pair: {pair}"
        for gpu in pair:
            nodes = [n["path"] for n in gpu["device_nodes"]]
            assert set(nodes) <= set(view.devices), f"the pod lacks {nodes}: it has {view.devices}"
        assert "/dev/nvidiactl" in view.devices
    finally:
        backend.delete_pod("two-gpus")


def test_a_lab_fault_lowers_allocatable_and_heal_restores_it(backend: Backend) -> None:
    """An AER fatal error makes one GPU unhealthy; healing it brings allocatable back."""
    worker = _worker(backend, has="gpus")
    count = expected_allocatable(worker)[GPU]
    _wait_allocatable(backend, worker, GPU, count)
    backend.lab(worker.name, "fault", "gpu1", "aer-fatal")
    try:
        _wait_allocatable(backend, worker, GPU, count - 1)
    finally:
        backend.lab(worker.name, "heal", "gpu1")
    _wait_allocatable(backend, worker, GPU, count)


def test_an_nvml_xid_makes_a_gpu_unhealthy_and_heal_brings_it_back(backend: Backend) -> None:
    """An XID critical error, reported by NVML (the lab's stand-in library, through pynvml), makes one GPU
    unhealthy with the XID as the cause; once healed and quiet for the configured period it is back."""
    worker = _worker(backend, has="gpus")
    # The driver's library markers are written with the stand-in or not at all; NVML's state files are
    # written either way, so they cannot tell. (A lab made by the lab overlays' pod has it too: the image
    # carries the stand-in its build stage compiled.)
    marker = f"usr/lib/{multiarch_triplet()}/libcuda.so.1"
    try:
        backend.lab_read(worker.name, marker)
    except (FileNotFoundError, CommandError):
        pytest.skip(f"{worker.name}: the lab has no NVML stand-in (no C compiler where it was created)")
    count = expected_allocatable(worker)[GPU]
    _wait_allocatable(backend, worker, GPU, count)
    backend.lab(worker.name, "fault", "gpu2", "xid-79")
    try:
        _wait_allocatable(backend, worker, GPU, count - 1)
        (gpu,) = [c for c in _status(backend, worker, "gpu")["children"] if c["resource"] == GPU]
        causes = [d["cause"] for d in gpu["devices_detail"] if not d["healthy"]]
        assert len(causes) == 1 and causes[0].startswith("xid 79"), f"plugvisor status: {gpu}"
    finally:
        backend.lab(worker.name, "heal", "gpu2")
    _wait_allocatable(backend, worker, GPU, count)


def test_a_deleted_agent_pod_is_replaced_and_registers_again(backend: Backend) -> None:
    """The DaemonSet's new agent registers every resource of the node again."""
    worker = _worker(backend, has="gpus")
    before = _status(backend, worker, "gpu")["supervisor"]["pid"]
    backend.delete_agent(worker.name, "gpu")
    status = wait_until(
        lambda: _all_registered(backend, worker, "gpu"),
        timeout=backend.timeout,
        what="the new agent registered every resource",
    )
    if backend.name == "emulated":
        assert status["supervisor"]["pid"] != before
    _wait_allocatable(backend, worker, GPU, expected_allocatable(worker)[GPU])


def test_a_killed_plugin_child_is_restarted_by_the_supervisor(backend: Backend) -> None:
    """SIGKILL to the gpu plugin process inside the agent: a new child registers, nothing else restarts."""
    worker = _worker(backend, has="gpus")
    status = wait_until(
        lambda: _all_registered(backend, worker, "gpu"), timeout=backend.timeout, what="registered"
    )
    (child,) = [c for c in status["children"] if c["resource"] == GPU]
    supervisor = status["supervisor"]["pid"]
    backend.agent_exec(worker.name, "gpu", ["python", "-c", f"import os; os.kill({child['pid']}, 9)"])

    def replaced() -> dict[str, Any] | None:
        now = _all_registered(backend, worker, "gpu")
        if now is None:
            return None
        (new,) = [c for c in now["children"] if c["resource"] == GPU]
        return now if new["pid"] != child["pid"] else None

    after = wait_until(replaced, timeout=backend.timeout, what="a new gpu child registered")
    assert after["supervisor"]["pid"] == supervisor
    _wait_allocatable(backend, worker, GPU, expected_allocatable(worker)[GPU])


def test_a_kubelet_restart_registers_every_resource_again_and_keeps_running_pods(backend: Backend) -> None:
    """Every agent of the node sees the restart and registers again; a pod holding a device keeps running."""
    worker = _worker(backend, has="gpus")
    kinds = [a.kind for a in agents() if a.runs_on(worker.labels)]
    backend.create_pod(worker.name, "holds-fuse", {FUSE: 1})
    try:
        _running(backend, "holds-fuse")
        seen = {kind: _status(backend, worker, kind)["supervisor"]["kubelet_restarts"] for kind in kinds}
        backend.restart_kubelet(worker.name)
        for kind in kinds:

            def again(k: str = kind) -> dict[str, Any] | None:
                status = _all_registered(backend, worker, k)
                return status if status and status["supervisor"]["kubelet_restarts"] > seen[k] else None

            wait_until(
                again, timeout=backend.timeout, what=f"the {kind} agent registered with the new kubelet"
            )
        for resource, count in expected_allocatable(worker).items():
            _wait_allocatable(backend, worker, resource, count)
        view = backend.pod("holds-fuse")
        assert view is not None
        assert view.phase == "Running"
    finally:
        backend.delete_pod("holds-fuse")


def test_an_fpga_pod_triggers_pre_start_container(backend: Backend) -> None:
    """Before the container starts, the plugin re-initialises its DFL port (the lab shows ap1_event = 1)."""
    worker = _worker(backend, has="fpgas")
    _wait_allocatable(backend, worker, FPGA, expected_allocatable(worker)[FPGA])
    fpga = next(
        d for d in json.loads(backend.lab(worker.name, "show", "--json"))["devices"] if d["kind"] == "fpga"
    )
    event = f"{fpga['sysfs_path']}/fpga_region/region0/dfl-port.0/ap1_event"
    assert backend.lab_read(worker.name, event).strip() == "0"
    backend.create_pod(worker.name, "uses-fpga", {FPGA: 1})
    try:
        view = _running(backend, "uses-fpga")
        assert "/dev/dfl-port.0" in view.devices
        assert view.env["FPGA_VISIBLE_DEVICES"] == "dfl-port.0"
        assert backend.lab_read(worker.name, event).strip() == "1"
    finally:
        backend.delete_pod("uses-fpga")


def test_vfs_added_in_the_lab_become_allocatable(backend: Backend) -> None:
    """sriov_numvfs 8 -> 0 -> 16 on the PF: 16 VFs are offered, with no agent restart."""
    worker = _worker(backend, has="nics")
    _wait_allocatable(backend, worker, VF, expected_allocatable(worker)[VF])
    backend.lab(worker.name, "vfs", "nic0", "0")
    _wait_allocatable(backend, worker, VF, 0)
    backend.lab(worker.name, "vfs", "nic0", "16")
    _wait_allocatable(backend, worker, VF, 16)
