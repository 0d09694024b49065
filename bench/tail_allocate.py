"""Where plugvisor's Allocate tail comes from: each slow call beside what the plugin process did meanwhile.

Run: python bench/tail_allocate.py [--calls 20000] [--rounds 2] [--rescan-interval 10] [--freeze yes no]

The real ``plugvisor plugin generic`` process (2,048 devices, pinned to one core as in bench_rpc.py)
runs with a tracer installed before its command starts: every garbage collection (start, end,
generation), and a heartbeat timer on its event loop that records when it runs late (the loop was
busy), all stamped on CLOCK_MONOTONIC, which ``time.perf_counter`` reads in both processes. The
client, on the other core, stamps each Allocate call the same way, with the longest time any thread
of either process spent waiting for a CPU meanwhile (the scheduler's statistics). Every call slower
than the round's p99 is then matched with what overlapped it: a collection, a thread kept off the
CPU, a busy loop. ``--freeze no`` skips the runtime's freeze after start-up (runtime.settle_collector),
``count`` first collects to count the cyclic garbage that freeze keeps; settings alternate round by
round. At exit the plugin times one full collection, over the objects it has not frozen.
"""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import argparse
import gc
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import bench_rpc

HEARTBEAT = 0.01
LOOP_LAG = 0.002
"""A heartbeat timer (every 10 ms) that runs more than this late: the plugin's event loop was busy."""


def traced_plugin(out: str, freeze: str, switch_interval: float, plugin_argv: list[str]) -> None:
    """Run the plugin command in this process with the collector and its event loop traced; dump at exit.

    ``freeze``: "yes" (as the runtime does), "no" (the runtime's freeze skipped), or "count" (first
    collect, to count the cyclic garbage that start-up left and a freeze would keep). ``switch_interval``:
    the interpreter's, when not 0.
    """
    import atexit

    from plugvisor.deviceplugin import runtime, watch

    events: list[tuple[str, float, float, int]] = []  # (what, start, end, generation or 0)
    started = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            events.append(("gc", started[0], time.perf_counter(), info["generation"]))

    make_loop = runtime.plugin_event_loop

    def traced_loop():  # a heartbeat: how late the loop runs a timer is how long it was kept busy
        loop = make_loop()

        def beat(due: float) -> None:
            now = time.perf_counter()
            if now - due > LOOP_LAG:
                events.append(("lag", due, now, 0))
            loop.call_later(HEARTBEAT, beat, now + HEARTBEAT)

        loop.call_soon(beat, time.perf_counter())
        return loop

    def dump() -> None:
        tracked = len(gc.get_objects())
        t0 = time.perf_counter()
        gc.collect()
        events.append(("full", t0, time.perf_counter(), tracked))
        Path(out).write_text(json.dumps(events))

    settle = runtime.settle_collector

    def counted_settle() -> None:
        t0 = time.perf_counter()
        garbage = gc.collect()
        events.append(("garbage", t0, time.perf_counter(), garbage))
        settle()

    scan_once = watch.DeviceWatcher.scan_once

    async def traced_scan(self: watch.DeviceWatcher) -> bool:
        t0 = time.perf_counter()
        try:
            return await scan_once(self)
        finally:
            events.append(("scan", t0, time.perf_counter(), 0))

    runtime.settle_collector = {"yes": settle, "no": lambda: None, "count": counted_settle}[freeze]
    gc.callbacks.append(on_gc)
    runtime.plugin_event_loop = traced_loop
    watch.DeviceWatcher.scan_once = traced_scan  # type: ignore[method-assign]
    if switch_interval:
        sys.setswitchinterval(switch_interval)
    atexit.register(dump)
    from plugvisor.cli import main

    main(plugin_argv, prog_name="plugvisor")


class RunQueueWait:
    """Time the given threads spent runnable but not running (the scheduler's statistics, nanoseconds)."""

    def __init__(self, paths: list[Path]) -> None:
        self._fds = [os.open(path, os.O_RDONLY) for path in paths]
        self._last = [0] * len(self._fds)

    def __call__(self) -> list[int]:
        for i, fd in enumerate(self._fds):
            try:
                self._last[i] = int(os.pread(fd, 128, 0).split()[1])
            except ProcessLookupError:  # a thread that ended keeps its last figure
                continue
        return list(self._last)

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)


def measure(sock: Path, calls: int, distinct: bool, server: int) -> list[tuple[float, float, int]]:
    """Per call: (start, end) on CLOCK_MONOTONIC, and the longest any thread of either process waited for a
    CPU meanwhile (nanoseconds)."""
    import grpc

    from plugvisor.api.deviceplugin.v1beta1 import api_pb2_grpc

    with grpc.insecure_channel(f"unix:{sock}") as channel:
        grpc.channel_ready_future(channel).result(timeout=10)
        stub = api_pb2_grpc.DevicePluginStub(channel)
        requests = bench_rpc._requests(distinct, bench_rpc._listed_ids(stub))
        for request in requests[:100]:
            stub.Allocate(request)
        threads = [
            *Path(f"/proc/{server}/task").glob("*/schedstat"),
            *Path("/proc/self/task").glob("*/schedstat"),
        ]
        waited = RunQueueWait(threads)
        stamps = []
        try:
            for n in range(calls):
                request = requests[(n + 100) % len(requests)]
                w0 = waited()
                t0 = time.perf_counter()
                stub.Allocate(request)
                t1 = time.perf_counter()
                stamps.append((t0, t1, max(b - a for a, b in zip(w0, waited(), strict=True))))
        finally:
            waited.close()
    return stamps


def one_round(tmp: Path, args: argparse.Namespace, freeze: str, env: dict[str, str]) -> tuple[list, list]:
    kdir = tmp / "kd"
    kdir.mkdir()
    out = tmp / "events.json"
    plugin = ["plugin", "generic", "--resource", "bench.example/null", "--path", "/dev/null"]
    plugin += ["--count", str(bench_rpc.DISTINCT), "--kubelet-dir", str(kdir), "--log-level", "warning"]
    plugin += ["--rescan-interval", str(args.rescan_interval)]
    traced = [sys.executable, __file__, "--traced", str(out), freeze, str(args.switch_interval), *plugin]
    proc = subprocess.Popen(traced, env=env)
    try:
        deadline = time.monotonic() + 30
        while not (socks := list(kdir.glob("*.sock"))):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit("the plugin did not start")
            time.sleep(0.01)
        stamps = measure(socks[0], args.calls, args.distinct, proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
    events = json.loads(out.read_text())
    shutil.rmtree(kdir)
    out.unlink()
    return stamps, events


def report(label: str, stamps: list[tuple[float, float, int]], events: list[list]) -> None:
    durations = [t1 - t0 for t0, t1, _ in stamps]
    p50 = statistics.median(durations)
    p99 = bench_rpc._pct(durations, 99)
    first, last = stamps[0][0], stamps[-1][1]
    during = [e for e in events if e[2] >= first and e[1] <= last and e[0] != "full"]
    gcs = [e for e in during if e[0] == "gc"]
    slow = [(t0, t1, wait) for t0, t1, wait in stamps if t1 - t0 > p99]
    causes: Counter[str] = Counter()
    for t0, t1, wait in slow:
        overlapping = [e for e in during if e[2] >= t0 and e[1] <= t1]
        gens = sorted({e[3] for e in overlapping if e[0] == "gc"})
        if gens:
            causes[f"a gen{max(gens)} collection in the plugin"] += 1
        elif any(e[0] == "scan" for e in overlapping):
            causes["a rescan in the plugin (a thread holding the GIL)"] += 1
        elif wait / 1e9 > (t1 - t0 - p50) / 2:
            causes["a thread waiting for a CPU for most of the excess"] += 1
        elif any(e[0] == "lag" for e in overlapping):
            causes["the plugin's event loop busy (> 2 ms late)"] += 1
        else:
            causes["none of these"] += 1
    waits = sorted(wait for *_, wait in slow)
    print(f"{label}: {len(stamps)} calls, p50 {p50 * 1e3:.3f} ms, p99 {p99 * 1e3:.3f} ms")
    for gen in (0, 1, 2):
        times = [e[2] - e[1] for e in gcs if e[3] == gen]
        rate = f"{len(times) / len(stamps) * 1000:6.1f} per 1,000 calls"
        spread = (
            f"median {statistics.median(times) * 1e6:6.1f} us, max {max(times) * 1e3:5.2f} ms"
            if times
            else ""
        )
        print(f"  gen{gen} collections: {len(times):5d} ({rate}) {spread}")
    garbage = [e for e in events if e[0] == "garbage"]
    if garbage:
        _, t0, t1, found = garbage[-1]
        print(
            f"  cyclic garbage left by start-up (frozen with it): {found} objects ({(t1 - t0) * 1e3:.1f} ms)"
        )
    full = [e for e in events if e[0] == "full"]
    if full:
        _, t0, t1, tracked = full[-1]
        print(f"  a full collection at exit: {(t1 - t0) * 1e3:.1f} ms over {tracked} tracked objects")
    scans = [e for e in during if e[0] == "scan"]
    if scans:
        took = [e[2] - e[1] for e in scans]
        typical = statistics.median(took) * 1e3
        print(f"  rescans: {len(scans)}, median {typical:.1f} ms, {sum(took):.2f} s in all")
        meanwhile = [t1 - t0 for t0, t1, _ in stamps if any(e[2] >= t0 and e[1] <= t1 for e in scans)]
        if meanwhile:
            print(
                f"  calls during a rescan: {len(meanwhile)}, p50 {statistics.median(meanwhile) * 1e3:.3f} ms,"
                f" max {max(meanwhile) * 1e3:.3f} ms"
            )
    lags = [e[2] - e[1] for e in during if e[0] == "lag"]
    print(
        f"  loop late > {LOOP_LAG * 1e3:.0f} ms: {len(lags)}"
        + (f", max {max(lags) * 1e3:.1f} ms" if lags else "")
    )
    wait = statistics.median(waits) / 1e6
    print(f"  the {len(slow)} calls over p99 (median longest run-queue wait of a thread {wait:.2f} ms):")
    for cause, n in causes.most_common():
        print(f"    {cause:55} {n:4d} ({n / len(slow):4.0%})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000, help="calls per round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per collector setting")
    parser.add_argument("--distinct", action="store_true", help="every call a new request")
    parser.add_argument("--agent-metrics", action="store_true", help="metrics in multiprocess files")
    parser.add_argument(
        "--rescan-interval", type=float, default=10.0, help="the plugin's (its default: 10 s)"
    )
    parser.add_argument(
        "--freeze",
        nargs="+",
        choices=["yes", "no", "count"],
        default=["yes", "no"],
        help="the runtime's freeze after start-up: as it is, skipped, or counting what it keeps",
    )
    parser.add_argument(
        "--switch-interval", type=float, default=0.0, help="the plugin's sys.setswitchinterval (0: as it is)"
    )
    parser.add_argument("--traced", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.traced:
        bench_rpc._pin(1)
        traced_plugin(args.traced[0], args.traced[1], float(args.traced[2]), args.traced[3:])
        return
    bench_rpc._pin(0)
    tmp = Path(tempfile.mkdtemp(prefix="/tmp/pvt-"))
    env = dict(os.environ)
    try:
        if args.agent_metrics:
            env["PROMETHEUS_MULTIPROC_DIR"] = str(tmp / "metrics")
            (tmp / "metrics").mkdir()
        print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
        for round_ in range(args.rounds):
            for freeze in args.freeze if round_ % 2 == 0 else args.freeze[::-1]:
                stamps, events = one_round(tmp, args, freeze, env)
                report(f"round {round_ + 1}, freeze after start-up: {freeze}", stamps, events)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
