"""Memory and start-up: PSS per process, start -> registered, `plugvisor --help`, each beside a floor.

Run: python bench/bench_footprint.py [--starts 10] [--quick]

Every figure is printed next to its target (bench/README.md) and next to a floor
measured in the same run, interleaved sample by sample, because the reference
machine is shared (2 cores, several test suites at once): absolute times move by
2-3x from one minute to the next, the ratio to the floor much less.

Floors:
- start-up: a bare ``python -c pass``; and a bare gRPC device plugin (a
  ``python -c`` script that imports grpc and the generated API, serves one
  device on a grpc.aio server and registers): the least a Python plugin can do.
- memory: the PSS of that bare plugin once registered, and of an idle ``python``.

The emulated kubelet runs in this process; "registered" is its view: the
resource registered with all its devices allocatable. Memory is "node PSS"
(bench/node_memory.py): pages divided only among the measured processes, as on a
node whose kubelet is a Go binary; the kernel's own PSS, which also divides
pages with this process (gRPC, protobuf, the interpreter) and anything else on
the machine, is printed beside it and reads lower. Floors are measured the same way.
"""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # before grpc is imported: no info lines

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

import yaml
from bytecode import compile_plugvisor
from node_memory import kernel_pss_kb, node_pss, private_kb

from plugvisor.emulators.kubelet import EmulatedKubelet

PLUGVISOR = [sys.executable, "-m", "plugvisor"]
RESOURCES = {
    "bench.example/fuse": (["/dev/fuse"], 4),
    "bench.example/serial": (["/dev/ttyUSB*"], 2),
    "bench.example/disk": (["/dev/sda"], 1),
    "bench.example/nvme": (["/dev/nvme0n1"], 1),
}

BARE_PLUGIN = r"""
import asyncio, os, sys
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
import grpc

def field(number, data):  # one length-delimited protobuf field
    return bytes([number << 3 | 2, len(data)]) + data

def options(request, context):
    return b""  # an empty DevicePluginOptions

async def list_and_watch(request, context):
    device = field(1, b"fuse") + field(2, b"Healthy")
    yield field(1, device)  # ListAndWatchResponse{devices: [{ID: fuse, health: Healthy}]}
    await asyncio.Event().wait()

async def main(kubelet_dir, resource):
    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("v1beta1.DevicePlugin", {
        "GetDevicePluginOptions": grpc.unary_unary_rpc_method_handler(options),
        "ListAndWatch": grpc.unary_stream_rpc_method_handler(list_and_watch),
    })])
    server.add_insecure_port(f"unix:{kubelet_dir}/bare.sock")
    await server.start()
    request = field(1, b"v1beta1") + field(2, b"bare.sock") + field(3, resource.encode())
    async with grpc.aio.insecure_channel(f"unix:{kubelet_dir}/kubelet.sock") as channel:
        await channel.unary_unary("/v1beta1.Registration/Register")(request)
    await server.wait_for_termination()

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""
"""The least a Python device plugin can do: grpc alone, messages encoded by hand (no protobuf runtime)."""


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def ms_line(label: str, values: list[float], floor: list[float], floor_name: str, target: str) -> None:
    ms = [v * 1000 for v in values]
    base = statistics.median(floor) * 1000
    print(
        f"  {label:<44} p50 {statistics.median(ms):7.1f} ms  p99 {pct(ms, 0.99):7.1f} ms  (n={len(ms)})  "
        f"target {target}\n  {'':<44} = {statistics.median(ms) / base:4.2f}x {floor_name} "
        f"(p50 {base:.1f} ms, same run)"
    )


Row = tuple[str, int, int, int]
"""(process name, node PSS kB, kernel PSS kB, private kB: pages no other process of the set maps)."""


def measure_pss_of(pids: list[int]) -> list[Row]:
    """A :data:`Row` per process of ``pids`` (node PSS: see bench/node_memory.py)."""
    alone = node_pss(pids)
    if alone is None:
        print("  (not root: frame numbers are hidden, node PSS shows the kernel's PSS)")
    own = private_kb(pids) or {}
    return [
        (comm(pid), (alone or {}).get(pid) or kernel_pss_kb(pid), kernel_pss_kb(pid), own.get(pid, 0))
        for pid in pids
    ]


def descendants(root: int) -> list[int]:
    """``root`` and every process below it, whatever the spawner's process tree looks like."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found = [root]
    for pid in found:
        found.extend(child for child, parent in parents.items() if parent == pid)
    return found


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


class Node:
    """A host root with the devices, a kubelet directory, and the agent's configuration."""

    def __init__(self, resources: int) -> None:
        self.base = Path(tempfile.mkdtemp(prefix="/tmp/pvf-"))
        (self.base / "root/dev").mkdir(parents=True)
        for name in ("fuse", "ttyUSB0", "ttyUSB1", "sda", "nvme0n1"):
            (self.base / "root/dev" / name).touch()
        self.kubelet_dir = self.base / "dp"
        self.resources = dict(list(RESOURCES.items())[:resources])
        self.config = self.base / "node.yaml"
        self.config.write_text(
            yaml.safe_dump(
                {
                    "kubeletDir": str(self.kubelet_dir),
                    "hostRoot": str(self.base / "root"),
                    "supervisor": {"runtimeDir": str(self.base / "run")},
                    "resources": [
                        {"name": name, "kind": "generic", "paths": paths, "count": count}
                        for name, (paths, count) in self.resources.items()
                    ],
                }
            )
        )

    def registered(self, kubelet: EmulatedKubelet) -> bool:
        for name, (paths, count) in self.resources.items():
            view = kubelet.resource(name)
            expected = count * (2 if "ttyUSB" in paths[0] else 1)
            if view is None or not view.registered or view.allocatable != expected:
                return False
        return True

    def cleanup(self) -> None:
        shutil.rmtree(self.base, ignore_errors=True)


async def start_and_wait(
    argv: Callable[[Node], list[str]], node: Node, registered: Callable[[EmulatedKubelet], bool], *,
    measure_pss: bool = False,
) -> tuple[float, list[Row]]:  # fmt: skip
    """Spawn ``argv``; return (start -> registered seconds, [(name, node PSS, kernel PSS)] once steady)."""
    kubelet = EmulatedKubelet(node.kubelet_dir, write_view=False, grace_period=30)
    await kubelet.start()
    began = time.perf_counter()
    process = await asyncio.create_subprocess_exec(*argv(node), stderr=asyncio.subprocess.DEVNULL)
    try:
        await kubelet.wait_for(registered, timeout=60)
        elapsed = time.perf_counter() - began
        pss: list[Row] = []
        if measure_pss:
            await asyncio.sleep(1.0)  # steady state: the first rescan and status reports are done
            pss = measure_pss_of(descendants(process.pid))
        return elapsed, pss
    finally:
        await terminate(process, 10)
        await kubelet.stop()


async def terminate(process: asyncio.subprocess.Process, timeout: float) -> None:
    """SIGTERM, and SIGKILL if it is still there after ``timeout`` seconds; reaped either way."""
    process.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(process.wait(), timeout)
    except TimeoutError:
        process.kill()
        await process.wait()


def plugin_argv(node: Node) -> list[str]:
    root, kubelet_dir = str(node.base / "root"), str(node.kubelet_dir)
    return [*PLUGVISOR, "plugin", "generic", "--resource", "bench.example/fuse", "--path", "/dev/fuse",
            "--count", "4", "--host-root", root, "--kubelet-dir", kubelet_dir]  # fmt: skip


def bare_argv(node: Node) -> list[str]:
    return [sys.executable, "-c", BARE_PLUGIN, str(node.kubelet_dir), "bench.example/bare"]


def run_argv(node: Node) -> list[str]:
    return [*PLUGVISOR, "run", "--config", str(node.config)]


def bare_registered(kubelet: EmulatedKubelet) -> bool:
    view = kubelet.resource("bench.example/bare")
    return view is not None and view.registered and view.allocatable == 1


def timed(argv: list[str]) -> float:
    began = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - began


def print_pss(label: str, rows: list[Row], target: str, floor: int, floor_name: str) -> None:
    total = sum(row[1] for row in rows)
    kernel = sum(row[2] for row in rows)
    own = sum(row[3] for row in rows)
    print(
        f"  {label}: {total / 1024:.1f} MB node PSS summed over {len(rows)} processes  target {target}"
        f"  (kernel PSS {kernel / 1024:.1f} MB)"
    )
    for name, kb, kernel_kb, private in rows:
        print(
            f"    {name:<20} {kb / 1024:6.1f} MB  (kernel PSS {kernel_kb / 1024:5.1f}; its own "
            f"{private / 1024:5.1f}, the rest a share of pages others map too)"
        )
    print(
        f"    = {total / floor:4.2f}x {floor_name} ({floor / 1024:.1f} MB, same run); "
        f"{own / 1024:.1f} MB of the sum is each process's own, {(total - own) / 1024:.1f} MB shared pages"
    )


def measure_cli(starts: int) -> dict[str, list[float]]:
    print("CLI")
    help_times, pass_times = [], []
    for _ in range(starts):
        pass_times.append(timed([sys.executable, "-c", "pass"]))
        help_times.append(timed([*PLUGVISOR, "--help"]))
    ms_line("plugvisor --help", help_times, pass_times, "python -c pass", "fast (no gRPC)")
    return {"help": help_times, "pass": pass_times}


async def measure_starts(starts: int) -> dict[str, object]:
    """Bare plugin, standalone plugin and agent, interleaved; PSS of the first two at the last sample."""
    print("Start -> registered")
    times: dict[str, list[float]] = {"bare": [], "plugin": [], "run4": []}
    pss: dict[str, list[Row]] = {}
    for attempt in range(starts):
        last = attempt == starts - 1
        for name, argv, resources, registered in (
            ("bare", bare_argv, 1, lambda _node: bare_registered),
            ("plugin", plugin_argv, 1, lambda node: node.registered),
            ("run4", run_argv, 4, lambda node: node.registered),
        ):
            node = Node(resources)
            try:
                elapsed, rows = await start_and_wait(argv, node, registered(node), measure_pss=last)
            finally:
                node.cleanup()
            times[name].append(elapsed)
            pss[name] = rows
    ms_line("plugvisor plugin generic", times["plugin"], times["bare"], "bare gRPC plugin", "<= 150 ms p50")
    ms_line("plugvisor run, 4 resources", times["run4"], times["bare"], "bare gRPC plugin", "<= 400 ms p50")
    print(f"  bare gRPC plugin (floor) p50 {statistics.median(times['bare']) * 1000:.1f} ms")
    return {**times, "plugin_pss": pss["plugin"], "bare_pss": pss["bare"], "run4_pss": pss["run4"]}


async def measure_memory(figures: dict[str, object]) -> dict[str, object]:
    print("Memory (PSS at steady state, after registration)")
    node = Node(resources=3)
    try:
        _, run_pss = await start_and_wait(run_argv, node, node.registered, measure_pss=True)
    finally:
        node.cleanup()
    idle = await asyncio.create_subprocess_exec(sys.executable, "-c", "import time; time.sleep(60)")
    await asyncio.sleep(0.5)
    ((_, idle_pss, idle_kernel, _),) = measure_pss_of([idle.pid])
    idle.kill()
    await idle.wait()
    bare_pss: list[Row] = figures["bare_pss"]  # type: ignore[assignment]
    bare_total = sum(row[1] for row in bare_pss)
    bare_kernel = sum(row[2] for row in bare_pss)
    print_pss("plugvisor run, 3 resources", run_pss, "<= 75 MB", bare_total, "bare gRPC plugin")
    print_pss("plugvisor plugin generic", figures["plugin_pss"], "(none)", bare_total, "bare gRPC plugin")  # type: ignore[arg-type]
    print(
        f"  floors (node PSS): bare gRPC plugin {bare_total / 1024:.1f} MB, "
        f"idle python {idle_pss / 1024:.1f} MB  "
        f"(kernel PSS {bare_kernel / 1024:.1f} and {idle_kernel / 1024:.1f} MB)"
    )
    return {"run3_pss": run_pss, "idle_pss": idle_pss}


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--starts", type=int, default=10, help="samples of each start-up figure")
    parser.add_argument("--quick", action="store_true", help="5 samples each")
    parser.add_argument("--json", type=Path, help="also write the raw figures here")
    options = parser.parse_args()
    starts = 5 if options.quick else options.starts
    load = os.getloadavg()[0]
    print(f"{os.cpu_count()} cores, load average {load:.1f} (a shared machine: read the ratios)")
    print(compile_plugvisor())
    figures: dict[str, object] = {"load": load}
    figures.update(measure_cli(starts))
    figures.update(await measure_starts(starts))
    figures.update(await measure_memory(figures))
    if options.json:
        options.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
