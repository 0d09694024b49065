"""Latencies a kubelet sees: device health change -> new list, kubelet restart -> registered again.

Run: python bench/bench_kubelet.py [--changes 200] [--restarts 100]

The plugin is a separate process (a framework plugin whose devices' health is
read from marker files); the emulated kubelet runs in this process and every
figure is measured on its side, from the moment the change is made to the
moment its view shows the result.
"""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # before grpc is imported: no info lines

import argparse
import asyncio
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

RESOURCE = "bench.example/widget"
DEVICES = 8


def _serve_plugin(state_dir: str, kubelet_dir: str) -> int:
    from plugvisor.deviceplugin import (
        Device,
        Health,
        HostPaths,
        PluginConfig,
        Snapshot,
        configure_logging,
        run_plugin,
    )

    class Widgets:
        def scan(self) -> Snapshot[None]:
            sick = Path(state_dir)
            return Snapshot(
                [
                    Device(
                        f"w{i}", health=Health.UNHEALTHY if (sick / f"sick-w{i}").exists() else Health.HEALTHY
                    )
                    for i in range(DEVICES)
                ],
                watch=[sick],
            )

    configure_logging(level="warning")
    paths = HostPaths(kubelet_dir=Path(kubelet_dir))
    return run_plugin(PluginConfig(RESOURCE, paths), Widgets())


def _pcts(samples: list[float]) -> str:
    q = statistics.quantiles(samples, n=100, method="inclusive")
    return f"p50 {q[49] * 1e3:6.2f} ms   p99 {q[98] * 1e3:6.2f} ms   max {max(samples) * 1e3:6.2f} ms"


async def _run(changes: int, restarts: int) -> None:
    from plugvisor.common.logs import configure_logging
    from plugvisor.emulators.kubelet import EmulatedKubelet

    configure_logging(level="warning")
    tmp = Path(tempfile.mkdtemp(prefix="/tmp/pvb-"))
    state = tmp / "state"
    state.mkdir()
    kubelet = EmulatedKubelet(tmp / "dp", write_view=False)
    await kubelet.start()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--serve", str(state), str(tmp / "dp")
    )

    def allocatable(k: EmulatedKubelet) -> int | None:
        view = k.resource(RESOURCE)
        return view.allocatable if view is not None and view.registered else None

    try:
        await kubelet.wait_for(lambda k: allocatable(k) == DEVICES, timeout=30)
        health: list[float] = []
        for n in range(changes):
            marker = state / f"sick-w{n % DEVICES}"
            sick_after = len(list(state.iterdir())) + (-1 if marker.exists() else 1)
            expected = DEVICES - sick_after
            started = time.perf_counter()
            if marker.exists():
                marker.unlink()
            else:
                marker.touch()
            await kubelet.wait_for(lambda k, e=expected: allocatable(k) == e, timeout=10)
            health.append(time.perf_counter() - started)
        for marker in state.iterdir():
            marker.unlink()
        await kubelet.wait_for(lambda k: allocatable(k) == DEVICES, timeout=10)

        from_call: list[float] = []
        from_listen: list[float] = []
        for _ in range(restarts):
            generation = kubelet.generation
            started = time.perf_counter()
            await kubelet.stop()
            await kubelet.start()
            listening = time.perf_counter()
            await kubelet.wait_for(
                lambda k, g=generation: k.generation > g and allocatable(k) == DEVICES, timeout=10
            )
            done = time.perf_counter()
            from_call.append(done - started)
            from_listen.append(done - listening)
        accepted = sum(1 for r in kubelet.registrations if r.accepted)
    finally:
        proc.send_signal(signal.SIGTERM)
        await proc.wait()
        await kubelet.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    print(
        f"health change -> emulated kubelet has the new list ({changes} changes, plugin in its own process):"
    )
    print(f"  {_pcts(health)}   (goal: p99 < 50 ms; anchors poll every 5 s)")
    print(f"kubelet restart -> registered again with every device ({restarts} restarts):")
    print(f"  from the restart call:        {_pcts(from_call)}   (goal: p99 < 150 ms)")
    print(f"  from kubelet.sock listening:  {_pcts(from_listen)}")
    print(f"  registrations accepted: {accepted} for {restarts + 1} kubelet generations (no spurious ones)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--changes", type=int, default=200)
    parser.add_argument("--restarts", type=int, default=100)
    parser.add_argument("--serve", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        raise SystemExit(_serve_plugin(*args.serve))
    asyncio.run(_run(args.changes, args.restarts))


if __name__ == "__main__":
    main()
