"""The supervisor's figures: restarts, kubelet restarts, start-up and memory, per spawner and policy.

Run: python bench/bench_supervisor.py [--kills 100] [--restarts 100] [--quick]

`plugvisor run` is a separate process supervising three `generic` resources; the
emulated kubelet runs in this process and every latency is measured on its
side, from the moment of the event (SIGKILL sent, kubelet restarted, agent
process spawned) to the moment its view shows every affected resource
registered again. Memory is the summed node PSS of the supervisor, the fork
server (when used) and the three children (bench/node_memory.py: pages divided
only among those processes, as on a node; the kernel's PSS, which this process
and others on the machine lower, is printed beside it). The agent is started as
`python -m plugvisor run`, the way the installed command runs (its fork server
is forked from it once its imports are done). Targets are in bench/README.md.
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
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from bytecode import compile_plugvisor
from node_memory import kernel_pss_kb, node_pss

from plugvisor.emulators.kubelet import EmulatedKubelet

RESOURCES = {"bench.example/fuse": 4, "bench.example/serial": 2, "bench.example/disk": 1}
RUN = ("-m", "plugvisor", "run")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def line(label: str, values: list[float], target: str = "") -> None:
    ms = [v * 1000 for v in values]
    print(
        f"  {label:<52} p50 {statistics.median(ms):7.1f} ms  p99 {pct(ms, 0.99):7.1f} ms  "
        f"max {max(ms):7.1f} ms  (n={len(ms)}){'  target ' + target if target else ''}"
    )


class Node:
    def __init__(self, spawner: str, policy: str) -> None:
        self.base = Path(tempfile.mkdtemp(prefix="/tmp/pvb-"))
        (self.base / "root/dev").mkdir(parents=True)
        for name in ("fuse", "ttyUSB0", "ttyUSB1", "sda"):
            (self.base / "root/dev" / name).touch()
        self.kubelet_dir = self.base / "dp"
        self.runtime_dir = self.base / "run"
        self.config = self.base / "node.yaml"
        paths = {"bench.example/fuse": ["/dev/fuse"], "bench.example/serial": ["/dev/ttyUSB*"],
                 "bench.example/disk": ["/dev/sda"]}  # fmt: skip
        document = {
            "kubeletDir": str(self.kubelet_dir),
            "hostRoot": str(self.base / "root"),
            "supervisor": {
                "runtimeDir": str(self.runtime_dir),
                "spawner": spawner,
                "onKubeletRestart": policy,
                # Every kill in the bench is a "first crash": up 0.2 s resets the backoff.
                "restart": {"resetAfter": 0.2},
            },
            "resources": [
                {
                    "name": name,
                    "kind": "generic",
                    "paths": paths[name],
                    **({"count": 4} if "fuse" in name else {}),
                }
                for name in RESOURCES
            ],
        }
        self.config.write_text(yaml.safe_dump(document))

    def state(self) -> dict[str, Any]:
        return json.loads((self.runtime_dir / "state.json").read_text())

    def cleanup(self) -> None:
        shutil.rmtree(self.base, ignore_errors=True)


def all_registered(kubelet: EmulatedKubelet, generation: int | None = None) -> bool:
    for name, count in RESOURCES.items():
        view = kubelet.resource(name)
        if view is None or not view.registered or view.allocatable != count:
            return False
    if generation is not None:
        latest = {r.resource: r.generation for r in kubelet.registrations if r.accepted}
        return all(latest.get(name) == generation for name in RESOURCES)
    return True


async def run_case(spawner: str, policy: str, *, kills: int, restarts: int, starts: int) -> None:
    print(f"spawner={spawner} onKubeletRestart={policy}")
    start_times: list[float] = []
    for attempt in range(starts):
        node = Node(spawner, policy)
        kubelet = EmulatedKubelet(node.kubelet_dir, write_view=False, grace_period=30)
        await kubelet.start()
        began = time.perf_counter()
        agent = await asyncio.create_subprocess_exec(
            sys.executable, *RUN, "--config", str(node.config), stderr=asyncio.subprocess.DEVNULL
        )
        try:
            await kubelet.wait_for(all_registered, timeout=30)
            start_times.append(time.perf_counter() - began)
            if attempt < starts - 1:
                continue
            await measure_running(node, kubelet, agent.pid, kills=kills, restarts=restarts)
        finally:
            agent.send_signal(signal.SIGTERM)
            await agent.wait()
            await kubelet.stop()
            node.cleanup()
    line("agent start -> every resource registered", start_times, "< 1 s")


async def measure_running(
    node: Node, kubelet: EmulatedKubelet, agent_pid: int, *, kills: int, restarts: int
) -> None:
    while not all(c["registered"] for c in node.state()["children"]):  # noqa: ASYNC110 - a file, polled
        await asyncio.sleep(0.01)
    state = node.state()
    pids = [agent_pid] + [c["pid"] for c in state["children"]]
    entries = list(Path("/proc").iterdir())  # noqa: ASYNC240 - a benchmark's bookkeeping
    forkserver = [p for p in entries if p.name.isdigit() and _ppid(p) == agent_pid]
    pids += [int(p.name) for p in forkserver if int(p.name) not in pids]
    alone = node_pss(pids) or {pid: kernel_pss_kb(pid) for pid in pids}
    total = sum(alone.values())
    kernel = sum(kernel_pss_kb(pid) for pid in pids)
    processes = f"supervisor + helpers + 3 children ({len(pids)} processes)"
    print(
        f"  node PSS summed over {processes}: {total / 1024:.1f} MB  target <= 75 MB"
        f"  (kernel PSS {kernel / 1024:.1f} MB)"
    )
    names = list(RESOURCES)
    kill_times: list[float] = []
    for i in range(kills):
        name = names[i % len(names)]
        child = next(c for c in node.state()["children"] if c["resource"] == name)
        endpoint = kubelet.resource(name).endpoint
        began = time.perf_counter()
        os.kill(child["pid"], signal.SIGKILL)
        await kubelet.wait_for(
            lambda k, n=name, e=endpoint: k.resource(n).registered and k.resource(n).endpoint != e, timeout=30
        )
        kill_times.append(time.perf_counter() - began)
        while not all(c["registered"] for c in node.state()["children"]):  # noqa: ASYNC110 - a file, polled
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.21)  # let the backoff reset: every kill is a first crash
    if kill_times:
        line("child SIGKILL -> registered again", kill_times, "p99 <= 100 ms")
    restart_times: list[float] = []
    for _ in range(restarts):
        began = time.perf_counter()
        await kubelet.restart()
        generation = kubelet.generation
        await kubelet.wait_for(lambda k, g=generation: all_registered(k, g), timeout=30)
        restart_times.append(time.perf_counter() - began)
        await asyncio.sleep(0.02)
    if restart_times:
        line("kubelet restart -> every resource registered again", restart_times, "p99 < 150 ms")


def _ppid(entry: Path) -> int:
    try:
        return int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kills", type=int, default=100)
    parser.add_argument("--restarts", type=int, default=100)
    parser.add_argument("--starts", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="20 of each, 3 starts")
    options = parser.parse_args()
    if options.quick:
        options.kills = options.restarts = 20
        options.starts = 3
    print(compile_plugvisor())
    for spawner, policy in (("forkserver", "reregister"), ("forkserver", "restart"), ("exec", "reregister"),
                            ("exec", "restart")):  # fmt: skip
        await run_case(spawner, policy, kills=options.kills, restarts=options.restarts, starts=options.starts)


if __name__ == "__main__":
    asyncio.run(main())
