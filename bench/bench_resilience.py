"""Staying registered whatever happens: back-to-back kubelet restarts, a killed fork server, killed plugins.

Run: python bench/bench_resilience.py [--restarts 1000] [--kills 50] [--forkserver-kills 20]

1. A crash-looping kubelet (CrashLoopingKubelet: it restarts the instant each registration
   is answered) against `plugvisor plugin generic` and against `plugvisor run` under both
   kubelet-restart policies: registrations counted against restarts (every one must come
   back), and restart -> next registration p50/p99.
2. `plugvisor run` with three resources and the emulated kubelet: the fork server SIGKILLed
   again and again; resources lost (any registration ended or made anew, must be 0) and the
   time until a new fork server is ready (from the agent's log).
3. A plugin SIGKILLed: under `plugvisor run` (the supervisor restarts it) and standalone (a
   new `plugvisor plugin` started at once, as systemd's Restart=always would): kill ->
   registered again p50/p99.
"""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # before grpc is imported: no info lines

import argparse
import asyncio
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

from plugvisor.emulators.kubelet import EmulatedKubelet
from plugvisor.emulators.kubelet.crashloop import CrashLoopingKubelet

NULL = "bench.example/null"
RESOURCES = {"bench.example/null": 4, "bench.example/zero": 2, "bench.example/full": 1}
PATHS = {
    "bench.example/null": "/dev/null",
    "bench.example/zero": "/dev/zero",
    "bench.example/full": "/dev/full",
}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def line(label: str, values: list[float], target: str = "") -> None:
    if not values:
        print(f"  {label:<58} no samples")
        return
    ms = [v * 1000 for v in values]
    print(
        f"  {label:<58} p50 {statistics.median(ms):7.1f} ms  p99 {pct(ms, 0.99):7.1f} ms  "
        f"max {max(ms):7.1f} ms  (n={len(ms)}){'  target ' + target if target else ''}"
    )


def plugin_argv(kubelet_dir: Path, resource: str = NULL) -> list[str]:
    return [
        sys.executable, "-m", "plugvisor", "plugin", "generic", "--resource", resource,
        "--path", PATHS[resource], "--count", str(RESOURCES[resource]), "--kubelet-dir", str(kubelet_dir),
    ]  # fmt: skip


def write_config(base: Path, policy: str, resources: dict[str, int]) -> Path:
    config = base / "node.yaml"
    document = {
        "kubeletDir": str(base / "dp"),
        "hostRoot": "/",
        "supervisor": {
            "runtimeDir": str(base / "run"),
            "onKubeletRestart": policy,
            "restart": {"resetAfter": 0.2},
        },
        "resources": [
            {"name": name, "kind": "generic", "paths": [PATHS[name]], "count": count}
            for name, count in resources.items()
        ],
    }
    config.write_text(yaml.safe_dump(document))
    return config


async def start_agent(config: Path, log: Path) -> asyncio.subprocess.Process:
    with log.open("wb") as handle:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "plugvisor", "run", "--config", str(config), stderr=handle
        )


async def stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
    await asyncio.wait_for(proc.wait(), 30)


async def back_to_back(label: str, restarts: int, start: object) -> None:
    base = Path(tempfile.mkdtemp(prefix="/tmp/pvb-"))
    try:
        async with CrashLoopingKubelet(base / "dp", restarts=restarts) as kubelet:
            proc = await start(base)  # type: ignore[operator]
            began = time.perf_counter()
            try:
                try:
                    await kubelet.wait_for(restarts + 1, timeout=60 + restarts * 0.5)
                except TimeoutError as exc:
                    print(f"  {label}: {exc}")
                elapsed = time.perf_counter() - began
            finally:
                await stop(proc)
        got = len(kubelet.registrations)
        gaps = [
            after.at - restarted
            for restarted, after in zip(kubelet.restarted_at, kubelet.registrations[1:], strict=False)
        ]
        same = len({r.devices for r in kubelet.registrations}) == 1
        print(
            f"  {label:<58} {got}/{restarts + 1} registrations after {restarts} restarts "
            f"({elapsed:.1f} s; same devices every time: {same})"
        )
        line(f"{label}: restart -> registered again", gaps, "every one, p99 < 150 ms")
    finally:
        shutil.rmtree(base, ignore_errors=True)


def all_registered(kubelet: EmulatedKubelet) -> bool:
    for name, count in RESOURCES.items():
        view = kubelet.resource(name)
        if view is None or not view.registered or view.allocatable != count:
            return False
    return True


def null_registered(kubelet: EmulatedKubelet, replacing: str | None = None) -> bool:
    """NULL is registered (on another socket than ``replacing``, when given)."""
    view = kubelet.resource(NULL)
    return view is not None and view.registered and (replacing is None or view.endpoint != replacing)


def child_pids(agent_pid: int) -> dict[str, int]:
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            comm = (entry / "comm").read_text().strip()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == agent_pid:
            found[comm] = int(entry.name)
    return found


async def fork_server_kills(kills: int) -> None:
    base = Path(tempfile.mkdtemp(prefix="/tmp/pvb-"))
    log = base / "agent.log"
    try:
        async with EmulatedKubelet(base / "dp", write_view=False, grace_period=30) as kubelet:
            agent = await start_agent(write_config(base, "restart", RESOURCES), log)
            try:
                await kubelet.wait_for(all_registered, timeout=60)
                registrations = len(kubelet.registrations)
                endpoints = {name: kubelet.resource(name).endpoint for name in RESOURCES}
                lost = 0
                server = child_pids(agent.pid).get("pv-forkserver")
                for _ in range(kills):
                    assert server is not None, "no fork server"
                    ready = log.read_text().count("forkserver_ready")
                    os.kill(server, signal.SIGKILL)
                    deadline = time.perf_counter() + 30
                    while True:
                        lost += sum(1 for name in RESOURCES if not kubelet.resource(name).registered)
                        current = child_pids(agent.pid).get("pv-forkserver")
                        if current not in (None, server) or time.perf_counter() > deadline:
                            break
                        await asyncio.sleep(0.005)
                    server = current
                    # Let the new one get ready (and serve a while: one that dies young is
                    # replaced after a growing delay) before the next kill.
                    while log.read_text().count("forkserver_ready") == ready:
                        if time.perf_counter() > deadline:
                            break
                        await asyncio.sleep(0.01)
                    await asyncio.sleep(1.2)
                changed = {n for n in RESOURCES if kubelet.resource(n).endpoint != endpoints[n]}
                new_registrations = len(kubelet.registrations) - registrations
            finally:
                await stop(agent)
        ready = [
            float(m)
            for m in re.findall(r"forkserver_ready\W.*?seconds=([\d.]+) n=(?:[2-9]|\d\d)\b", log.read_text())
        ]
        print(
            f"  fork server SIGKILLed {kills} times: resources lost {lost + len(changed)}, "
            f"re-registrations {new_registrations}  target 0 and 0"
        )
        line("fork server killed -> a new one ready (its preload)", ready)
    finally:
        shutil.rmtree(base, ignore_errors=True)


async def plugin_kills_under_agent(kills: int) -> None:
    base = Path(tempfile.mkdtemp(prefix="/tmp/pvb-"))
    resources = {NULL: RESOURCES[NULL]}
    try:
        async with EmulatedKubelet(base / "dp", write_view=False, grace_period=30) as kubelet:
            agent = await start_agent(write_config(base, "restart", resources), base / "agent.log")
            times = []
            try:
                await kubelet.wait_for(null_registered, timeout=60)
                for _ in range(kills):
                    endpoint = kubelet.resource(NULL).endpoint
                    pid = next(pid for comm, pid in child_pids(agent.pid).items() if comm.startswith("pv:"))
                    began = time.perf_counter()
                    os.kill(pid, signal.SIGKILL)
                    await kubelet.wait_for(lambda k, e=endpoint: null_registered(k, replacing=e), timeout=30)
                    times.append(time.perf_counter() - began)
                    await asyncio.sleep(0.25)  # every kill a first crash (resetAfter 0.2 s)
            finally:
                await stop(agent)
        line("plugvisor run: plugin SIGKILL -> registered again", times, "p99 < 300 ms")
    finally:
        shutil.rmtree(base, ignore_errors=True)


async def plugin_kills_standalone(kills: int) -> None:
    base = Path(tempfile.mkdtemp(prefix="/tmp/pvb-"))
    try:
        async with EmulatedKubelet(base / "dp", write_view=False, grace_period=30) as kubelet:
            proc = await asyncio.create_subprocess_exec(
                *plugin_argv(base / "dp"), stderr=asyncio.subprocess.DEVNULL
            )
            times = []
            try:
                await kubelet.wait_for(null_registered, timeout=60)
                for _ in range(kills):
                    endpoint = kubelet.resource(NULL).endpoint
                    began = time.perf_counter()
                    proc.kill()
                    await proc.wait()
                    proc = await asyncio.create_subprocess_exec(
                        *plugin_argv(base / "dp"), stderr=asyncio.subprocess.DEVNULL
                    )
                    await kubelet.wait_for(lambda k, e=endpoint: null_registered(k, replacing=e), timeout=30)
                    times.append(time.perf_counter() - began)
            finally:
                await stop(proc)
        line("plugvisor plugin: SIGKILL -> a new process registered", times, "(a fresh interpreter)")
    finally:
        shutil.rmtree(base, ignore_errors=True)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--restarts", type=int, default=1000)
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--forkserver-kills", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="200 restarts, 10 kills, 5 fork-server kills")
    options = parser.parse_args()
    if options.quick:
        options.restarts, options.kills, options.forkserver_kills = 200, 10, 5

    async def standalone(base: Path) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            *plugin_argv(base / "dp"), stderr=asyncio.subprocess.DEVNULL
        )

    def agent(policy: str):
        async def start(base: Path) -> asyncio.subprocess.Process:
            return await start_agent(write_config(base, policy, {NULL: 4}), base / "agent.log")

        return start

    print("back-to-back kubelet restarts (no pause between a registration and the next restart)")
    await back_to_back("plugvisor plugin", options.restarts, standalone)
    await back_to_back("plugvisor run, onKubeletRestart=reregister", options.restarts, agent("reregister"))
    await back_to_back(
        "plugvisor run, onKubeletRestart=restart", max(1, options.restarts // 5), agent("restart")
    )
    print("fork server SIGKILL under plugvisor run (3 resources)")
    await fork_server_kills(options.forkserver_kills)
    print("plugin SIGKILL")
    await plugin_kills_under_agent(options.kills)
    await plugin_kills_standalone(options.kills)


if __name__ == "__main__":
    asyncio.run(main())
