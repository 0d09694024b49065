"""Benchmarks of the gpu, nic and fpga kinds: fault-to-kubelet latency, scan of `big`, preferred allocation.

    python bench/bench_plugins.py [--rounds 40]

Prints figures; asserts nothing. Lab trees go to /dev/shm when it exists (much
faster to create than /tmp), kubelet sockets to /tmp (short paths).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import structlog

from plugvisor.common.hostpaths import HostPaths
from plugvisor.deviceplugin.runtime import DevicePluginRuntime, PluginConfig
from plugvisor.emulators import lab
from plugvisor.emulators.kubelet import EmulatedKubelet
from plugvisor.plugins import topology
from plugvisor.plugins.fpga import KIND as FPGA
from plugvisor.plugins.gpu import KIND as GPU
from plugvisor.plugins.nic import KIND as NIC


def lab_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="/dev/shm/pvb-" if Path("/dev/shm").is_dir() else "/tmp/pvb-"))


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def fault_latency(
    kind, resource: str, *, device: str, fault: str, total: int, drop: int, rounds: int
) -> list[float]:
    base, socks = lab_dir(), Path(tempfile.mkdtemp(prefix="/tmp/pvb-"))
    try:
        node = lab.Lab.create(str(base / "root"), "dgx-like")
        kubelet = EmulatedKubelet(socks / "dp", write_view=False)
        await kubelet.start()
        paths = HostPaths(root=Path(node.root), kubelet_dir=kubelet.socket_dir)
        # sysfs's path: NVML's (falling off the bus is also its XID 79, healthy again only after its quiet
        # period) is bench_nvml.py's.
        options = {"nvml": {"enabled": False}} if kind is GPU else {}
        source = kind.build(kind.options_model.model_validate(options), paths, resource=resource)
        runtime = DevicePluginRuntime(PluginConfig(resource, paths), source)
        stop = asyncio.Event()
        task = asyncio.create_task(runtime.run(stop))

        def alloc(k: EmulatedKubelet) -> int | None:
            v = k.resource(resource)
            return None if v is None else v.allocatable

        await kubelet.wait_for(lambda k: alloc(k) == total, timeout=20)
        samples: list[float] = []
        for _ in range(rounds):
            steps = ((lambda: node.fault(device, fault), total - drop), (lambda: node.heal(device), total))
            for action, want in steps:
                started = time.perf_counter()
                action()
                await kubelet.wait_for(lambda k, w=want: alloc(k) == w)
                samples.append((time.perf_counter() - started) * 1000)
        stop.set()
        await task
        await kubelet.stop()
        return samples
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(socks, ignore_errors=True)


def scan_big() -> None:
    base = lab_dir()
    try:
        started = time.perf_counter()
        node = lab.Lab.create(str(base / "root"), "big")
        print(f"big created in {time.perf_counter() - started:.2f} s under {base}")
        paths = HostPaths(root=Path(node.root))
        for kind, resource in ((GPU, "x.io/gpu"), (NIC, "x.io/nic")):
            source = kind.build(kind.options_model.model_validate({}), paths, resource=resource)
            times = []
            for _ in range(5):
                started = time.perf_counter()
                devices = source.scan().devices
                times.append(time.perf_counter() - started)
            median = statistics.median(times) * 1000
            print(f"scan of big, {kind.name}: {len(devices)} devices, median {median:.0f} ms")
    finally:
        shutil.rmtree(base, ignore_errors=True)


def machine(gpus: int, per_switch: int, numa: int) -> dict[str, topology.Placement]:
    out = {}
    per_numa = gpus // numa
    for g in range(gpus):
        n, sw = g // per_numa, g // per_switch
        out[f"g{g:03d}"] = topology.Placement(n, (f"hb{n}", f"rp{sw}", f"up{sw}", f"dn{g}", f"f{g}"), f"g{g}")
    return out


def quality(
    name: str,
    placements: dict[str, topology.Placement],
    trials: int,
    rng: random.Random,
    sizes: tuple[int, ...],
) -> None:
    index = topology.TopologyIndex(placements)
    ids = sorted(placements)
    hits = {"plugvisor": 0, "random": 0, "kubelet order": 0}
    for _ in range(trials):
        available = sorted(rng.sample(ids, rng.randint(2, len(ids))))
        size = rng.choice([s for s in sizes if s <= len(available)] or [1])
        must = rng.sample(available, 1) if rng.random() < 0.2 else []
        best = topology.optimal_score(available, must, size, placements)
        rest = [i for i in available if i not in must]
        picks = {
            "plugvisor": topology.preferred(available, must, size, index),
            "random": [*must, *rng.sample(rest, size - len(must))],
            "kubelet order": [*must, *rest[: size - len(must)]],
        }
        for key, chosen in picks.items():
            hits[key] += topology.score(chosen, placements) == best
    shown = ", ".join(f"{k} {v / trials:.1%}" for k, v in hits.items())
    print(f"preferred allocation quality on {name} ({trials} requests, best possible set): {shown}")


def speed(rng: random.Random) -> None:
    placements = {
        f"d{i}": topology.Placement(
            i // 5000, (f"hb{i // 1000}", f"rp{i // 16}", f"up{i // 4}", f"dn{i}"), f"d{i}"
        )
        for i in range(10_000)
    }
    started = time.perf_counter()
    index = topology.TopologyIndex(placements)
    build = time.perf_counter() - started
    ids = sorted(placements)
    times = []
    for _ in range(200):
        available = rng.sample(ids, rng.randint(1000, 10_000))
        size = rng.choice([1, 2, 4, 8, 16])
        started = time.perf_counter()
        topology.preferred(available, [], size, index)
        times.append((time.perf_counter() - started) * 1000)
    print(
        f"preferred allocation on 10,000 devices: index built once in {build * 1000:.0f} ms; "
        f"per request p50 {pct(times, 0.5):.1f} ms, p99 {pct(times, 0.99):.1f} ms"
    )


async def latencies(rounds: int) -> None:
    cases = [
        ("gpu", GPU, "x.io/gpu", "gpu3", "aer-fatal", 8, 1),
        ("gpu", GPU, "x.io/gpu", "gpu3", "fallen-off-bus", 8, 1),
        ("nic", NIC, "x.io/nic", "nic1", "link-down", 16, 8),
        ("nic", NIC, "x.io/nic", "nic0vf3", "aer-fatal", 16, 1),
        ("fpga", FPGA, "x.io/fpga", "fpga0", "afu-id-invalid", 1, 1),
        ("fpga", FPGA, "x.io/fpga", "fpga0", "fallen-off-bus", 1, 1),
    ]
    for label, kind, resource, device, fault, total, drop in cases:
        samples = await fault_latency(
            kind, resource, device=device, fault=fault, total=total, drop=drop, rounds=rounds
        )
        print(
            f"fault -> kubelet, {label} {fault}: p50 {pct(samples, 0.5):.1f} ms, "
            f"p99 {pct(samples, 0.99):.1f} ms ({len(samples)} changes)"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    rng = random.Random(1)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(latencies(args.rounds))
        scan_big()
        quality("dgx-like (8 GPUs, 2 per switch, 2 NUMA nodes)", machine(8, 2, 2), 2000, rng, (2, 4, 8))
        quality("16 GPUs, 4 per switch, 2 NUMA nodes", machine(16, 4, 2), 300, rng, (2, 3, 4))
        speed(rng)


if __name__ == "__main__":
    main()
