"""Time to create the lab's profiles, and to apply the changes tests make most.

Run as ``python bench/bench_lab.py [--repeat N] [--dir DIR ...]``. Figures are
printed, never asserted. By default it measures on /tmp (the disk a CI run uses)
and on /dev/shm (tmpfs), because file creation cost dominates ``big`` and differs
by an order of magnitude between the two.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from plugvisor.emulators.lab import Lab, builtin, layout
from plugvisor.emulators.lab import render as render_


def timed(func: Callable[[], object], repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        start = time.perf_counter()
        func()
        out.append(time.perf_counter() - start)
    return out


def summary(samples: list[float]) -> str:
    median, best = statistics.median(samples) * 1000, min(samples) * 1000
    return f"median {median:8.1f} ms  min {best:8.1f} ms  (n={len(samples)})"


def bench_create(base: str, profile: str, repeat: int) -> None:
    samples = []
    for _ in range(repeat):
        work = tempfile.mkdtemp(prefix=f"{base}/pvlab-bench-")
        try:
            start = time.perf_counter()
            Lab.create(f"{work}/root", profile)
            samples.append(time.perf_counter() - start)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    print(f"  create {profile:<15} {summary(samples)}")


def bench_changes(base: str, repeat: int) -> None:
    work = tempfile.mkdtemp(prefix=f"{base}/pvlab-bench-")
    try:
        lab = Lab.create(f"{work}/root", "dgx-like")

        def fault_heal() -> None:
            lab.fault("gpu0", "fallen-off-bus")
            lab.heal("gpu0")

        def vfs() -> None:
            lab.set_num_vfs("nic0", 0)
            lab.set_num_vfs("nic0", 64)

        print(f"  dgx-like fault+heal      {summary(timed(fault_heal, repeat))}")
        print(f"  dgx-like numvfs 0 -> 64  {summary(timed(vfs, repeat))}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", action="append", dest="dirs")
    args = parser.parse_args()
    dirs = args.dirs or [d for d in ("/tmp", "/dev/shm") if Path(d).is_dir()]
    big = builtin("big")
    start = time.perf_counter()
    state = layout.build(big)
    spec = render_.whole(state)
    took = time.perf_counter() - start
    print(f"big: {len(state.devices)} devices, {len(spec)} tree entries; layout+render {took:.2f} s")
    for base in dirs:
        print(f"on {base}:")
        for profile in ("small", "dgx-like", "big"):
            bench_create(base, profile, 1 if profile == "big" else args.repeat)
        bench_changes(base, args.repeat)


if __name__ == "__main__":
    main()
