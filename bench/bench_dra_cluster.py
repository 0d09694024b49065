"""DRA on a real cluster beside the device-plugin path: the same figures where they apply.

    sudo .venv/bin/python bench/bench_dra_cluster.py [--rounds 10]

Brings up the local cluster of `tox -e e2e-local` (e2e/local: upstream Kubernetes from
tools/kubernetes/build.py's binaries, containerd 2 with CDI, the images of tools/kubernetes/images.py),
applies the lab overlay (device plugins) and the lab-dra overlay (DRA drivers) and makes the node the GPU
worker, so that the gpu kind serves plugvisor.io/gpu and gpu.plugvisor.io from the same lab at once. Per
round, in turn (a slow spell of the shared machine hits both paths alike):

- the device-plugin path: a pod with `plugvisor.io/gpu: 1` in its limits; pod created -> bound (the
  scheduler's binding, from a pod watch), bound -> devices assigned (the pod's Allocate answer in the
  kubelet's checkpoint file), created -> running;
- the DRA path: a pod with a claim from deploy/kubernetes/examples/dra/gpu-one.yaml; created -> bound,
  claim allocated (its status.allocation, from a claim watch) -> prepared (the claim's CDI spec in
  /var/run/cdi), bound -> prepared, created -> running;
- a GPU fault in the lab (aer-fatal, then heal): fault -> the driver's ResourceSlice without the GPU (a
  slice watch) beside fault -> the node's allocatable plugvisor.io/gpu lower (a node watch: the
  scheduler's view of the device plugin's health);
- SIGKILL to each path's gpu process under its agent -> serving the kubelet again (the device plugin's
  socket re-registered: the agent's status; the DRA driver's registration socket answering GetInfo).

Then the node PSS (bench/node_memory.py) of each agent pod's processes and of the gpu child itself, both
idle on the same lab. Files are polled every 2 ms, watches are timed on arrival. Prints p50/p99 and the
DRA path's ratio to the device plugin's in the same run; asserts nothing.
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from node_memory import node_pss

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from e2e.backends import Progress, wait_until
from e2e.backends.local import LAB_DIR, LocalBackend
from e2e.dra import (
    CDI_DIR,
    GPU,
    NAMESPACE,
    PLUGINS_REGISTRY,
    DraLab,
    by_name,
    kill_process,
    kubelet_logged,
    registration_serving,
    socket_identity,
)
from e2e.local.cluster import KUBELET_ROOT, NODE
from plugvisor.emulators.lab import Lab

RESOURCE = "plugvisor.io/gpu"
CHECKPOINT = KUBELET_ROOT / "device-plugins" / "kubelet_internal_checkpoint"
POLL = 0.002
RESET_AFTER = 11.0
"""Seconds a child must run for its kill to be a first crash (the agent's restart.resetAfter is 10)."""


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def line(label: str, values: list[float], floor: list[float] | None = None) -> None:
    text = f"  {label:<58} p50 {1000 * pct(values, 0.5):8.1f} ms  p99 {1000 * pct(values, 0.99):8.1f} ms"
    if floor:
        text += f"   ({statistics.median(values) / statistics.median(floor):.3g}x the device plugin's)"
    print(text, flush=True)


class Timeline:
    """Things seen happen, each at the monotonic time it was first seen, from watches and file polls."""

    def __init__(self) -> None:
        self.seen: dict[tuple[str, str], float] = {}
        self.changed = threading.Condition()
        self.stopping = False

    def mark(self, what: str, key: str) -> None:
        with self.changed:
            self.seen.setdefault((what, key), time.monotonic())
            self.changed.notify_all()

    def forget(self, what: str, key: str) -> None:
        """See it anew: the next time it happens counts."""
        with self.changed:
            self.seen.pop((what, key), None)

    def when(self, what: str, key: str, timeout: float = 300) -> float:
        deadline = time.monotonic() + timeout
        with self.changed:
            while (what, key) not in self.seen:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{what} of {key} not seen within {timeout:.0f} s")
                self.changed.wait(left)
            return self.seen[(what, key)]

    def thread(self, target: Callable[[], None], name: str) -> None:
        def run() -> None:
            try:
                target()
            except Exception:
                if not self.stopping:
                    raise

        threading.Thread(target=run, name=name, daemon=True).start()


def watch_objects(timeline: Timeline, local: LocalBackend, dra: DraLab) -> list[Any]:
    """Pods bound and running, claims allocated, GPU devices in the slice, node allocatable: timed."""
    from kubernetes import watch

    watches = [watch.Watch() for _ in range(4)]

    def pods() -> None:
        for event in watches[0].stream(local.core.list_namespaced_pod, NAMESPACE):
            pod = event["object"]
            if pod.spec.node_name:
                timeline.mark("bound", pod.metadata.name)
            if pod.status.phase == "Running":
                timeline.mark("running", pod.metadata.name)

    def claims() -> None:
        for event in watches[1].stream(
            dra.objects.list_namespaced_custom_object, "resource.k8s.io", "v1", NAMESPACE, "resourceclaims"
        ):
            claim = event["object"]
            if claim.get("status", {}).get("allocation"):
                timeline.mark("allocated", claim["metadata"]["uid"])

    def slices() -> None:
        for event in watches[2].stream(
            dra.objects.list_cluster_custom_object,
            "resource.k8s.io",
            "v1",
            "resourceslices",
            field_selector=f"spec.driver={GPU},spec.nodeName={NODE}",
        ):
            names = frozenset(d["name"] for d in event["object"]["spec"].get("devices", []))
            timeline.mark("slice", ",".join(sorted(names)))

    def node() -> None:
        for event in watches[3].stream(local.core.list_node, field_selector=f"metadata.name={NODE}"):
            allocatable = (event["object"].status.allocatable or {}).get(RESOURCE, "0")
            timeline.mark("allocatable", str(allocatable))

    for target in (pods, claims, slices, node):
        timeline.thread(target, target.__name__)
    return watches


def poll_files(timeline: Timeline) -> None:
    """CDI specs appearing in /var/run/cdi; pods appearing in the kubelet's device checkpoint."""
    checkpoint_stamp = None
    while not timeline.stopping:
        try:
            for name in CDI_DIR.iterdir():
                timeline.mark("spec", name.name)
        except OSError:
            pass
        try:
            stamp = CHECKPOINT.stat().st_mtime_ns
            if stamp != checkpoint_stamp:
                checkpoint_stamp = stamp
                data = json.loads(CHECKPOINT.read_text())
                for entry in data["Data"]["PodDeviceEntries"] or []:
                    if entry["ResourceName"] == RESOURCE and base64.b64decode(entry["AllocResp"]):
                        timeline.mark("assigned", entry["PodUID"])
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(POLL)


class Bench:
    def __init__(self, rounds: int) -> None:
        self.rounds = rounds
        self.local = LocalBackend(Progress("bench"))
        self.dra = DraLab(self.local)
        self.timeline = Timeline()
        self.figures: dict[str, list[float]] = {}

    def add(self, name: str, value: float) -> None:
        self.figures.setdefault(name, []).append(value)

    def run(self) -> None:
        self.local.setup()
        try:
            self.dra.apply()
            (worker,) = [w for w in self.local.workers if w.profile.gpus]
            self.dra.play(worker)
            self.worker = worker
            template = self.dra.create_template("gpu-one.yaml")
            watches = watch_objects(self.timeline, self.local, self.dra)
            self.timeline.thread(lambda: poll_files(self.timeline), "files")
            for number in range(self.rounds):
                self.local.progress(f"round {number + 1} of {self.rounds}: pods, then a fault and its heal")
                self.device_plugin_pod(f"bench-dp-{number}")
                self.dra_pod(f"bench-dra-{number}", template)
                self.fault()
            for number in range(max(3, self.rounds // 3)):
                self.local.progress(f"kills, round {number + 1}")
                self.kill_device_plugin()
                self.kill_driver()
            memory = self.memory()
        finally:
            self.timeline.stopping = True
            for handle in locals().get("watches", []):
                handle.stop()
            self.local.teardown()
        self.report(memory)

    def device_plugin_pod(self, name: str) -> None:
        created = time.monotonic()
        self.local.create_pod(self.worker.name, name, {RESOURCE: 1})
        uid = self.local.core.read_namespaced_pod(name, NAMESPACE).metadata.uid
        bound = self.timeline.when("bound", name)
        assigned = self.timeline.when("assigned", uid)
        running = self.timeline.when("running", name)
        self.add("dp bound", bound - created)
        self.add("dp bound -> assigned", assigned - bound)
        self.add("dp running", running - created)
        self.local.delete_pod(name)

    def dra_pod(self, name: str, template: str) -> None:
        created = time.monotonic()
        self.dra.create_pod(name, template, "gpu")
        claim = self.dra.claim_of(name)
        uid = claim["metadata"]["uid"]
        allocated = self.timeline.when("allocated", uid)
        bound = self.timeline.when("bound", name)
        prepared = self.timeline.when("spec", f"k8s.{GPU}-claim_{uid}.json")
        running = self.timeline.when("running", name)
        self.add("dra bound", bound - created)
        self.add("dra allocated -> prepared", prepared - allocated)
        self.add("dra bound -> prepared", prepared - bound)
        self.add("dra running", running - created)
        self.local.delete_pod(name)
        wait_until(lambda: self.dra.claim_gone(claim["metadata"]["name"]), timeout=300, what="claim gone")

    def fault(self) -> None:
        lab = Lab.open(LAB_DIR)
        devices = self.dra.devices(GPU)
        uuid = lab.device("gpu1").uuid
        (faulty,) = [n for n, u in by_name(devices, "uuid").items() if u == uuid]
        every = sorted(devices)
        without = ",".join(n for n in every if n != faulty)
        count = len(every)
        for what, key in (("slice", without), ("slice", ",".join(every))):
            self.timeline.forget(what, key)
        for what, key in (("allocatable", str(count - 1)), ("allocatable", str(count))):
            self.timeline.forget(what, key)
        faulted = time.monotonic()
        lab.fault("gpu1", "aer-fatal")
        self.add("dra fault -> slice", self.timeline.when("slice", without) - faulted)
        self.add("dp fault -> allocatable", self.timeline.when("allocatable", str(count - 1)) - faulted)
        healed = time.monotonic()
        lab.heal("gpu1")
        self.add("dra heal -> slice", self.timeline.when("slice", ",".join(every)) - healed)
        self.add("dp heal -> allocatable", self.timeline.when("allocatable", str(count)) - healed)

    def _status(self, dra: bool) -> dict[str, Any]:
        text = self.local.agent_exec(self.worker.name, "gpu", ["plugvisor", "status", "--json"], dra=dra)
        (child,) = json.loads(text)["children"]
        return child  # type: ignore[no-any-return]

    def _registered(self, dra: bool, old_pid: int, *, settled: bool = False) -> dict[str, Any] | None:
        """The gpu child once registered (not ``old_pid``); ``settled``: up longer than the supervisor's
        ``restart.resetAfter`` (10 s), so that a kill is a first crash, restarted without backoff."""
        child = self._status(dra)
        if child["pid"] == old_pid or not child["registered"]:
            return None
        return child if not settled or child["uptime"] > RESET_AFTER else None

    def kill_device_plugin(self) -> None:
        child = wait_until(lambda: self._registered(False, -1, settled=True), timeout=300, what="dp child")
        wall = time.time()
        kill_process(self.dra.host_pid(self.worker, "gpu", child["pid"], dra=False))
        wait_until(lambda: self._registered(False, child["pid"]), timeout=300, what="dp back")
        marker = f'"Got registration request from device plugin with resource" resourceName="{RESOURCE}"'
        self.add("dp SIGKILL -> kubelet registers it", kubelet_logged(marker, wall) - wall)

    def kill_driver(self) -> None:
        registration = PLUGINS_REGISTRY / f"{GPU}-reg.sock"
        child = wait_until(lambda: self._registered(True, -1, settled=True), timeout=300, what="dra child")
        before = socket_identity(registration)
        wall = time.time()
        killed = kill_process(self.dra.host_pid(self.worker, "gpu", child["pid"]))
        wait_until(
            lambda: registration_serving(registration, before), timeout=300, what="dra back", interval=POLL
        )
        self.add("dra SIGKILL -> registration socket serving", time.monotonic() - killed)
        wait_until(lambda: self._registered(True, child["pid"]), timeout=300, what="dra registered")
        marker = f'"OperationExecutor.RegisterPlugin started" plugin={{"SocketPath":"{registration}"'
        self.add("dra SIGKILL -> kubelet registers it", kubelet_logged(marker, wall) - wall)

    def memory(self) -> dict[str, tuple[int, int] | None]:
        """Node PSS in kB of each path's gpu agent pod (every process) and of its gpu child alone."""
        found: dict[str, tuple[int, int] | None] = {}
        for label, dra in (("device plugin", False), ("DRA driver", True)):
            child = self._status(dra)
            pids = self.dra.pod_pids(self.worker, "gpu", dra=dra)
            child_pid = self.dra.host_pid(self.worker, "gpu", child["pid"], dra=dra)
            pss = node_pss(pids)
            found[label] = None if pss is None else (sum(pss.values()), pss[child_pid])
        return found

    def report(self, memory: dict[str, tuple[int, int] | None]) -> None:
        f = self.figures
        print(
            f"\nDRA beside the device plugin on a real cluster ({self.rounds} rounds, the gpu kind, one GPU)"
        )
        print("pod start")
        line("device plugin: created -> bound", f["dp bound"])
        line("DRA: created -> bound (claim allocated first)", f["dra bound"], f["dp bound"])
        line("device plugin: bound -> devices assigned (Allocate)", f["dp bound -> assigned"])
        line(
            "DRA: bound -> prepared (CDI spec written)", f["dra bound -> prepared"], f["dp bound -> assigned"]
        )
        line("DRA: claim allocated -> prepared (CDI spec written)", f["dra allocated -> prepared"])
        line("device plugin: created -> running", f["dp running"])
        line("DRA: created -> running", f["dra running"], f["dp running"])
        print("health")
        line("device plugin: fault -> node allocatable lower", f["dp fault -> allocatable"])
        line("DRA: fault -> slice without the GPU", f["dra fault -> slice"], f["dp fault -> allocatable"])
        line("device plugin: heal -> node allocatable back", f["dp heal -> allocatable"])
        line("DRA: heal -> slice with the GPU", f["dra heal -> slice"], f["dp heal -> allocatable"])
        print("restarts")
        line(
            "device plugin: SIGKILL -> the kubelet registers it (its log)",
            f["dp SIGKILL -> kubelet registers it"],
        )
        line(
            "DRA: SIGKILL -> the kubelet registers it (its log)",
            f["dra SIGKILL -> kubelet registers it"],
            f["dp SIGKILL -> kubelet registers it"],
        )
        line(
            "DRA: SIGKILL -> registration socket answers GetInfo",
            f["dra SIGKILL -> registration socket serving"],
        )
        print("memory (node PSS, idle, same lab)")
        for label, found in memory.items():
            if found is None:
                print(f"  {label}: needs root (page frame numbers)")
            else:
                print(
                    f"  {label:<14} agent pod {found[0] / 1024:6.1f} MB   gpu child {found[1] / 1024:6.1f} MB"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    Bench(parser.parse_args().rounds).run()


if __name__ == "__main__":
    main()
