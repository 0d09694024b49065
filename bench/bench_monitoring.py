"""Per-device monitoring: /metrics scrape time and size, describe (telemetry) cost, PodResources calls.

Run as ``python bench/bench_monitoring.py [--repeat N] [--poll-seconds S]``. Figures are printed, never
asserted.

1. A real node: a dgx-like lab with AMD-like GPUs (hwmon) and one NIC with 64 VFs; the gpu and nic kinds
   scan and describe it; their reports go through the files the agent uses; one container holds 2 GPUs
   and 8 VFs. Measured: ``describe`` per resource (what each plugin process pays every telemetry
   interval) and the supervisor's scrape of the per-device families (read the files, render).
2. 10,000 devices in 4 resources, each with the readings of a GPU (3 AER, 4 link, degraded, 6 hwmon),
   2,000 of them held: scrape time and size.
3. PodResources ``List`` calls per minute with 4 plugin processes sharing one monitor directory (the
   agent's arrangement) at the default 5 s interval, counted by the emulated kubelet, against what 4
   independent pollers would make.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import prometheus_client

from plugvisor.common import device_metrics, monitoring
from plugvisor.common.hostpaths import HostPaths
from plugvisor.common.monitoring import DeviceDescription, Holder, Owners, Reading
from plugvisor.deviceplugin.device_monitor import build_report
from plugvisor.deviceplugin.owners import OwnerWatch
from plugvisor.emulators import lab as lab_
from plugvisor.emulators.kubelet import EmulatedKubelet
from plugvisor.emulators.lab.profiles import GpuGroup, NicGroup, builtin
from plugvisor.plugins.kinds import get_kind


def timed(func: Callable[[], object], repeat: int) -> tuple[list[float], object]:
    out, result = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        result = func()
        out.append(time.perf_counter() - start)
    return out, result


def summary(samples: list[float]) -> str:
    median, best = statistics.median(samples) * 1000, min(samples) * 1000
    return f"median {median:8.2f} ms  min {best:8.2f} ms (n={len(samples)})"


def scrape(monitor_dir: Path, live: dict[str, int | None]) -> bytes:
    """What the agent's /metrics does for the per-device part: read the files, write the text."""
    return device_metrics.render(monitoring.directory_view(monitor_dir, live))


def scrape_generic(monitor_dir: Path, live: dict[str, int | None]) -> bytes:
    """The same through prometheus-client's generic writer (what a standalone plugin uses)."""
    registry = prometheus_client.CollectorRegistry(auto_describe=False)
    registry.register(device_metrics.DeviceCollector(lambda: monitoring.directory_view(monitor_dir, live)))
    return prometheus_client.generate_latest(registry)


def bench_node(repeat: int) -> None:
    work = Path(
        tempfile.mkdtemp(prefix="pvmon-bench-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
    )
    try:
        profile = builtin("dgx-like").model_copy(
            update={
                "gpus": [GpuGroup(model="amd-mi300x", count=8, per_switch=2)],
                "nics": [NicGroup(model="intel-e810", count=1, total_vfs=64, num_vfs=64, numa_nodes=[0])],
            }
        )
        node = lab_.Lab.create(work / "root", profile)
        paths = HostPaths(root=Path(node.root), kubelet_dir=work / "dp")
        monitor_dir = work / "monitor"
        holders: dict[tuple[str, str], tuple[Holder, ...]] = {}
        live: dict[str, int | None] = {}
        print("8 GPUs + 64 VFs (a dgx-like node with AMD-like GPUs and one 64-VF NIC):")
        for kind_name, resource, options in (
            ("gpu", "plugvisor.io/gpu", {}),
            ("nic", "plugvisor.io/nic", {}),
        ):
            kind = get_kind(kind_name)
            source = kind.build(kind.options_model.model_validate(options), paths, resource=resource)
            snapshot = source.scan()
            devices = snapshot.devices
            samples, descriptions = timed(lambda s=source, d=snapshot: s.describe(d), repeat)  # type: ignore[attr-defined]
            print(f"  describe {kind_name} ({len(devices)} devices, sysfs reads): {summary(samples)}")
            report = build_report(resource, devices, descriptions)  # type: ignore[arg-type]
            monitoring.write_report(monitor_dir, report)
            live[resource] = os.getpid()
            for device_id in list(devices)[: 2 if kind_name == "gpu" else 8]:
                holders[(resource, device_id)] = (Holder("ml", "trainer", "train"),)
        monitoring.write_owners(monitor_dir, Owners(holders=holders, up=True, last_success=time.time()))
        samples, text = timed(lambda: scrape(monitor_dir, live), repeat)
        assert isinstance(text, bytes)
        series = sum(1 for line in text.splitlines() if line and not line.startswith(b"#"))
        print(
            f"  scrape (read files + render): {summary(samples)}; {len(text) / 1024:.1f} KiB, {series} series"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


def synthetic(resource: str, count: int, start: int) -> monitoring.ResourceReport:
    readings = [
        *(
            Reading("plugvisor_device_aer_errors", 0.0, {"severity": s})
            for s in ("fatal", "nonfatal", "correctable")
        ),
        *(Reading("plugvisor_device_pcie_link_speed_gts", 32.0, {"link": k}) for k in ("current", "max")),
        *(Reading("plugvisor_device_pcie_link_width_lanes", 16.0, {"link": k}) for k in ("current", "max")),
        Reading("plugvisor_device_pcie_link_degraded", 0.0),
        *(
            Reading("plugvisor_device_temperature_celsius", 40.0, {"sensor": s})
            for s in ("edge", "junction", "mem")
        ),
        *(
            Reading("plugvisor_device_temperature_critical_celsius", 100.0, {"sensor": s})
            for s in ("edge", "junction", "mem")
        ),
    ]
    devices = tuple(
        monitoring.DeviceReport(
            f"dev-{start + i:05d}",
            True,
            (i % 2,),
            DeviceDescription(
                kind="gpu", pci_address=f"0000:{i // 256 % 256:02x}:{i % 32:02x}.{i % 8}", readings=readings
            ),
        )
        for i in range(count)
    )
    return monitoring.ResourceReport(resource, os.getpid(), time.time(), devices)


def bench_10k(repeat: int) -> None:
    work = Path(tempfile.mkdtemp(prefix="pvmon-bench-"))
    try:
        live: dict[str, int | None] = {}
        holders: dict[tuple[str, str], tuple[Holder, ...]] = {}
        for r in range(4):
            resource = f"example.com/dev{r}"
            report = synthetic(resource, 2500, r * 2500)
            monitoring.write_report(work, report)
            live[resource] = os.getpid()
            for device in report.devices[:500]:
                holders[(resource, device.id)] = (Holder(f"ns{r}", f"pod-{device.id}", "main"),)
        monitoring.write_owners(work, Owners(holders=holders, up=True, last_success=time.time()))
        files = sum(p.stat().st_size for p in work.rglob("*.json"))
        samples, text = timed(lambda: scrape(work, live), repeat)
        generic, _ = timed(lambda: scrape_generic(work, live), 1)
        assert isinstance(text, bytes)
        series = sum(1 for line in text.splitlines() if line and not line.startswith(b"#"))
        print("10,000 devices (4 resources, GPU-like readings, 2,000 held):")
        print(f"  report files: {files / 1024 / 1024:.1f} MiB")
        size = len(text) / 1024 / 1024
        print(f"  scrape (read files + render): {summary(samples)}; {size:.1f} MiB, {series} series")
        ratio = statistics.median(generic) / statistics.median(samples)
        print(f"  prometheus-client's writer instead: {summary(generic)} ({ratio:.1f}x the agent's)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


async def count_calls(seconds: float, interval: float, *, shared: bool) -> int:
    work = Path(tempfile.mkdtemp(prefix="/tmp/pvmon-"))
    kubelet = EmulatedKubelet(work / "dp", write_view=False)
    await kubelet.start()
    try:
        assert kubelet.pod_resources_socket is not None
        monitor_dir = work / "monitor"
        monitor_dir.mkdir()
        watches = [
            OwnerWatch(
                socket=kubelet.pod_resources_socket,
                interval=interval,
                monitor_dir=monitor_dir if shared else None,
            )
            for _ in range(4)
        ]
        tasks = [asyncio.create_task(w.run()) for w in watches]
        await asyncio.sleep(seconds)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if shared:
            return max(w.owners.value.calls_ok + w.owners.value.calls_failed for w in watches)
        return sum(w.owners.value.calls_ok + w.owners.value.calls_failed for w in watches)
    finally:
        await kubelet.stop()
        shutil.rmtree(work, ignore_errors=True)


def bench_calls(seconds: float) -> None:
    interval = 5.0
    print(f"PodResources List calls, 4 plugin processes, interval {interval:g} s, over {seconds:g} s:")
    shared = asyncio.run(count_calls(seconds, interval, shared=True))
    alone = asyncio.run(count_calls(seconds, interval, shared=False))
    print(f"  one poller per agent (flock): {shared} calls = {shared * 60 / seconds:.1f}/min")
    print(f"  a poller per process:         {alone} calls = {alone * 60 / seconds:.1f}/min")
    print("  kubelet limit: 100 calls/s (6,000/min), burst 10, for every client of the node")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--poll-seconds", type=float, default=30.0)
    args = parser.parse_args()
    bench_node(args.repeat)
    bench_10k(max(3, args.repeat // 4))
    bench_calls(args.poll_seconds)


if __name__ == "__main__":
    main()
