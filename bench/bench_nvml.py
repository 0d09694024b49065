"""NVML's cost to a gpu plugin, and how fast its health reaches the kubelet: on the lab's stand-in library.

Run: python bench/bench_nvml.py [--starts 10] [--faults 20]

- memory and start-up: a real ``plugvisor plugin gpu`` process on a dgx-like lab
  (8 GPUs), with NVML (``nvml: {enabled: auto}``, the default: pynvml imported,
  the library loaded, 8 GPUs read, the event thread waiting) and without
  (``enabled: false``), interleaved start by start: start -> registered with 8
  devices (the emulated kubelet's view) and the child's PSS once steady (the
  kernel's, and "node PSS", bench/node_memory.py). The difference is NVML's cost.
- XID -> Unhealthy: ``lab fault gpuN xid-79`` -> the kubelet's ListAndWatch
  shows the GPU Unhealthy (the same process, with a 1 s quiet period so that
  ``heal`` brings each GPU back for the next round), p50/p99.
- XID -> taint: the same as a DRA driver (in this process, slices as files):
  the fault -> the ``gpu.plugvisor.io/xid`` taint in the ResourceSlice, p50/p99.
- CPU per scrape: the child's CPU time (``time.process_time``) for NVML's
  telemetry of 8 GPUs (what :meth:`Nvml.readings` asks NVML at each describe),
  and for the whole describe (sysfs AER/link readings too), in this process.

The lab's library answers from files, a real driver from the GPU: the figures are
plugvisor's side (pynvml, ctypes, the event thread, the plugin's scan), not NVML's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from node_memory import kernel_pss_kb, node_pss

from plugvisor.common.hostpaths import HostPaths
from plugvisor.emulators import lab
from plugvisor.emulators.kubelet import EmulatedKubelet
from plugvisor.plugins.gpu import KIND
from plugvisor.plugins.gpu.nvml import LIBRARY, Nvml, library_candidates
from plugvisor.testing import running_dra_driver

RESOURCE = "plugvisor.io/gpu"
SHM = Path("/dev/shm")
WITH = {"nvml": {"recoverAfterSeconds": 1}}
WITHOUT = {"nvml": {"enabled": False}}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def allocatable(kubelet: EmulatedKubelet) -> int | None:
    view = kubelet.resource(RESOURCE)
    return None if view is None else view.allocatable


def health(kubelet: EmulatedKubelet, device: str) -> str | None:
    view = kubelet.resource(RESOURCE)
    return None if view is None or device not in view.devices else view.devices[device].health


async def start(
    root: Path, kubelet_dir: Path, options: dict
) -> tuple[asyncio.subprocess.Process, EmulatedKubelet, float]:
    kubelet = EmulatedKubelet(kubelet_dir, write_view=False, grace_period=30)
    await kubelet.start()
    argv = [sys.executable, "-m", "plugvisor", "plugin", "gpu", "--host-root", str(root),
            "--kubelet-dir", str(kubelet_dir), "--options-json", json.dumps(options)]  # fmt: skip
    began = time.perf_counter()
    process = await asyncio.create_subprocess_exec(*argv, stderr=asyncio.subprocess.DEVNULL)
    await kubelet.wait_for(lambda k: allocatable(k) == 8, timeout=60)
    return process, kubelet, time.perf_counter() - began


async def stop(process: asyncio.subprocess.Process, kubelet: EmulatedKubelet) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(process.wait(), 10)
    except TimeoutError:
        process.kill()
        await process.wait()
    await kubelet.stop()


async def footprint(root: Path, base: Path, starts: int) -> dict[str, dict[str, list[float]]]:
    figures: dict[str, dict[str, list[float]]] = {
        name: {"start_ms": [], "pss_kb": [], "node_pss_kb": []} for name in ("with", "without")
    }
    for round_ in range(starts):
        for name, options in (("with", WITH), ("without", WITHOUT)):
            process, kubelet, seconds = await start(root, base / f"k{round_}{name}", options)
            try:
                await asyncio.sleep(1.0)  # steady: first rescan, event thread waiting
                figures[name]["start_ms"].append(seconds * 1000)
                figures[name]["pss_kb"].append(kernel_pss_kb(process.pid))
                node = node_pss([process.pid])
                if node:
                    figures[name]["node_pss_kb"].append(node[process.pid])
            finally:
                await stop(process, kubelet)
    return figures


async def xid_latency(node: lab.Lab, base: Path, faults: int) -> list[float]:
    process, kubelet, _ = await start(Path(node.root), base / "kx", WITH)
    records = list(node.devices(kind=lab.DeviceKind.GPU))
    latencies: list[float] = []
    try:
        for i in range(faults):
            gpu = records[i % len(records)]
            began = time.perf_counter()
            node.fault(gpu.name, "xid-79")
            await kubelet.wait_for(lambda k, u=gpu.uuid: health(k, u) == "Unhealthy", timeout=30)
            latencies.append((time.perf_counter() - began) * 1000)
            node.heal(gpu.name)
            await kubelet.wait_for(lambda k: allocatable(k) == 8, timeout=30)
    finally:
        await stop(process, kubelet)
    return latencies


async def until(predicate: Callable[[], bool], pause: float) -> None:
    """Look every ``pause`` seconds: the slice is a file the driver replaces, nothing announces it."""
    while not predicate():  # noqa: ASYNC110 - nothing to wait on but the file
        await asyncio.sleep(pause)


async def taint_latency(node: lab.Lab, base: Path, faults: int) -> list[float]:
    """``xid-79`` -> the taint in the driver's ResourceSlice (the file publisher: the emulated API server)."""
    kubelet = EmulatedKubelet(
        base / "kd", objects_dir=base / "api", node_name="n1", write_view=False, pod_resources=False
    )
    await kubelet.start()
    slice_file = base / "api" / "resourceslices" / "gpu.plugvisor.io-n1.json"

    def tainted() -> set[str]:
        try:
            devices = json.loads(slice_file.read_text())["spec"]["devices"]
        except (OSError, ValueError):
            return set()
        return {
            d["attributes"]["resource.kubernetes.io/pciBusID"]["string"] for d in devices if d.get("taints")
        }

    latencies: list[float] = []
    try:
        async with running_dra_driver(kubelet, KIND, WITH, driver="gpu.plugvisor.io", root=Path(node.root)):
            records = list(node.devices(kind=lab.DeviceKind.GPU))
            for i in range(faults):
                gpu = records[i % len(records)]
                began = time.perf_counter()
                node.fault(gpu.name, "xid-79")
                await until(lambda g=gpu: g.bdf in tainted(), 0.002)
                latencies.append((time.perf_counter() - began) * 1000)
                node.heal(gpu.name)
                await until(lambda: not tainted(), 0.01)
    finally:
        await kubelet.stop()
    return latencies


START_COST = r"""
import sys, time
from pathlib import Path
from plugvisor.common.hostpaths import HostPaths
from plugvisor.plugins.gpu import KIND
source = KIND.build({}, HostPaths(root=Path(sys.argv[1])), resource="plugvisor.io/gpu")
began = time.perf_counter()
import pynvml
imported = time.perf_counter()
source.start()
opened = time.perf_counter()
assert source.nvml is not None
print((imported - began) * 1000, (opened - imported) * 1000)
source.close()
"""


def start_cost(root: Path, samples: int) -> tuple[list[float], list[float]]:
    """In fresh interpreters: ms to import pynvml, and ms for the rest of NVML's start (load, init, GPUs)."""
    imports: list[float] = []
    opens: list[float] = []
    for _ in range(samples):
        done = subprocess.run(
            [sys.executable, "-c", START_COST, str(root)], capture_output=True, text=True, check=True
        )
        first, second = done.stdout.split()[-2:]
        imports.append(float(first))
        opens.append(float(second))
    return imports, opens


def scrape_cpu(root: Path, rounds: int = 200) -> tuple[float, float]:
    """CPU ms of NVML's telemetry of 8 GPUs, and of the gpu source's whole describe, per scrape."""
    source = KIND.build({}, HostPaths(root=root), resource=RESOURCE)
    source.start()
    try:
        nvml = source.nvml
        assert isinstance(nvml, Nvml), "NVML did not open on the lab"
        snapshot = source.scan()
        for bus_id in nvml.bus_ids:  # warm: function pointers resolved, logs settled
            nvml.readings(bus_id)
        began = time.process_time()
        for _ in range(rounds):
            for bus_id in nvml.bus_ids:
                nvml.readings(bus_id)
        readings = (time.process_time() - began) * 1000 / rounds
        began = time.process_time()
        for _ in range(rounds):
            source.describe(snapshot)
        describe = (time.process_time() - began) * 1000 / rounds
    finally:
        source.close()
    return readings, describe


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=10)
    parser.add_argument("--faults", type=int, default=20)
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="/tmp/pvb-"))
    under = SHM if SHM.is_dir() else base  # noqa: ASYNC240 - once, before anything runs
    labs = Path(tempfile.mkdtemp(prefix="pvb-", dir=under))
    try:
        node = lab.Lab.create(str(labs / "root"), "dgx-like")
        root = Path(node.root)
        if not any(p.exists() for p in library_candidates(HostPaths(root=root), "/")):
            print(f"the lab wrote no {LIBRARY}: it needs a C compiler (cc) for its NVML stand-in")
            return
        imports, opens = start_cost(root, args.starts * 2)
        print(
            f"NVML's start in a gpu child (fresh interpreter, {len(imports)} samples): import pynvml p50"
            f" {statistics.median(imports):.1f} ms (the agent's fork server preloads it), load, init, 8 GPUs"
            f" + event thread p50 {statistics.median(opens):.1f} ms (target <= 20 ms together)"
        )
        figures = await footprint(root, base, args.starts)
        print(f"gpu plugin on dgx-like (8 GPUs), {args.starts} starts each, interleaved")
        for key, unit, target in (
            ("start_ms", "ms", 20.0),
            ("pss_kb", "KB", 3072.0),
            ("node_pss_kb", "KB", 3072.0),
        ):
            with_, without = figures["with"][key], figures["without"][key]
            if not with_ or not without:
                continue
            cost = statistics.median(with_) - statistics.median(without)
            mid_with, mid_without = statistics.median(with_), statistics.median(without)
            print(
                f"  {key:12} with NVML p50 {mid_with:8.1f} {unit}, without {mid_without:8.1f} {unit}:"
                f" NVML costs {cost:7.1f} {unit} (target <= {target:.0f} {unit})"
            )
        latencies = await xid_latency(node, base, args.faults)
        print(
            f"xid-79 -> kubelet Unhealthy over {len(latencies)} faults: p50 {pct(latencies, 0.5):.1f} ms,"
            f" p99 {pct(latencies, 0.99):.1f} ms, max {max(latencies):.1f} ms (target < 1000 ms)"
        )
        taints = await taint_latency(node, base, args.faults)
        print(
            f"xid-79 -> taint in the DRA driver's slice over {len(taints)} faults:"
            f" p50 {pct(taints, 0.5):.1f} ms,"
            f" p99 {pct(taints, 0.99):.1f} ms (target < 1000 ms)"
        )
        readings, describe = scrape_cpu(root)
        print(
            f"CPU per scrape of 8 GPUs: NVML telemetry {readings:.2f} ms (target <= 5 ms);"
            f" the whole describe (sysfs too) {describe:.2f} ms"
        )
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(labs, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
