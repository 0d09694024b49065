"""`plugvisor run` at scale: 1, 16, 64 and 256 resources, with the fork server and with `spawner: exec`.

Run: python bench/bench_scale.py [--sizes 1 16 64 256] [--spawners forkserver exec] [--rounds 2]
                                 [--inotify-limit N] [--inotify-budget N]

Per size and spawner, in rounds (each round a fresh agent, sizes and spawners
interleaved so that a slow spell of the shared machine hits every case):

- start -> all registered: from spawning `python -m plugvisor run` to the emulated
  kubelet (in this process) listing every resource registered with its device;
  and how many registered (every one must, every time);
- memory once settled: node PSS summed over the agent and every process below it
  (bench/node_memory.py: pages divided only among them, as on a node), the
  kernel's PSS beside it, and per resource;
- CPU at idle: the agent and its processes over 5 s, in millicores;
- kubelet restart -> all registered again (the default policy, `restart`, restarts
  every child), and how many came back;
- children restarted for any other reason than the kubelet restart (must be 0).

Floors measured in the same run: a bare grpc.aio plugin (bench_footprint.py's)
start -> registered and node PSS; the figures are also printed per resource, as
ratios to them.

Each plugin process holds an inotify instance, and Linux allows 128 per user by
default (fs.inotify.max_user_instances, shared by every process of the user); the
children that find none left poll instead (common/inotify.py), and the report says
how many did. `--inotify-limit N` raises the machine's limit to N for the run (root)
and puts the old value back afterwards; `--inotify-budget N` runs the agent in a
user namespace of its own that allows its processes N instances (a real kernel limit,
on top of the machine's: e.g. 128, the default, whatever this machine's is; it needs
util-linux's `unshare` and user namespaces). Sizes whose exec children would not fit
in memory are skipped. A round that fails keeps its directory (with the
agent's log) and says where.
"""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # before grpc is imported: no info lines

import argparse
import asyncio
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from bench_footprint import BARE_PLUGIN, descendants, terminate
from node_memory import kernel_pss_kb, node_pss

from plugvisor.emulators.kubelet import EmulatedKubelet

INOTIFY_LIMIT = Path("/proc/sys/fs/inotify/max_user_instances")
EXEC_CHILD_MB = 40
"""Room per exec'd child (a fresh interpreter: ~29 MB of its own once started, more while it starts)."""


POLICY: dict[str, str] = {}
"""``onKubeletRestart`` when ``--policy`` gives one (the default otherwise)."""


def inotify_in_use() -> int:
    """inotify instances open on the machine now (every process we can see)."""
    count = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            count += sum(1 for fd in (entry / "fd").iterdir() if str(fd.readlink()) == "anon_inode:inotify")
    return count


def available_mb() -> int:
    for row in Path("/proc/meminfo").read_text().splitlines():
        if row.startswith("MemAvailable:"):
            return int(row.split()[1]) // 1024
    return 0


def cpu_ticks(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total


@contextlib.contextmanager
def inotify_limit(wanted: int | None) -> Iterator[None]:
    """Raise fs.inotify.max_user_instances to ``wanted`` for the block; restore it unless changed since."""
    if wanted is None:
        yield
        return
    before = int(INOTIFY_LIMIT.read_text())
    if wanted <= before:
        yield
        return
    INOTIFY_LIMIT.write_text(f"{wanted}\n")
    print(f"fs.inotify.max_user_instances raised from {before} to {wanted} for this run")
    try:
        yield
    finally:
        if int(INOTIFY_LIMIT.read_text()) == wanted:
            INOTIFY_LIMIT.write_text(f"{before}\n")
            print(f"fs.inotify.max_user_instances back to {before}")


class Node:
    """``size`` generic resources, one device each, and the agent's file."""

    def __init__(self, size: int, spawner: str) -> None:
        self.base = Path(tempfile.mkdtemp(prefix="/tmp/pvs-"))
        self.size = size
        (self.base / "root/dev").mkdir(parents=True)
        for index in range(size):
            (self.base / f"root/dev/d{index:04d}").touch()
        self.kubelet_dir = self.base / "dp"
        self.runtime_dir = self.base / "run"
        self.config = self.base / "node.yaml"
        self.names = [f"scale.example/r{index:04d}" for index in range(size)]
        self._counted: tuple[tuple[int, int, int | None], int] | None = None
        self._names = frozenset(self.names)
        self._back_of: int | None = -1
        """The generation :attr:`_back` is for (-1: none yet)."""
        self._back: set[str] = set()
        """The resources seen registered with their device (since that generation)."""
        self._latest: dict[str, int] = {}
        """Each resource's latest accepted registration's kubelet generation."""
        self._read = (0, 0)
        """How many of the kubelet's registrations and events were read."""
        self.config.write_text(
            yaml.safe_dump(
                {
                    "kubeletDir": str(self.kubelet_dir),
                    "hostRoot": str(self.base / "root"),
                    "supervisor": {"runtimeDir": str(self.runtime_dir), "spawner": spawner, **POLICY},
                    "resources": [
                        {"name": name, "kind": "generic", "paths": [f"/dev/d{index:04d}"]}
                        for index, name in enumerate(self.names)
                    ],
                }
            )
        )

    def registered(self, kubelet: EmulatedKubelet, generation: int | None = None) -> int:
        """How many resources the kubelet lists as registered with their device (since ``generation``).

        Asked every 10 ms, in the emulated kubelet's own process, whose CPU is the
        machine's too: counted again only when the kubelet recorded something since,
        and then only for the resources its new records name (256 views at each of
        ~200 changes had been a third of the emulated kubelet's CPU during a restart,
        and so part of the figure). Once all are seen back, all are looked at once
        more, so that one that dropped meanwhile is not taken for back.
        """
        key = (len(kubelet.registrations), len(kubelet.events), generation)
        if self._counted is not None and self._counted[0] == key:
            return self._counted[1]
        registrations, events = kubelet.registrations, kubelet.events
        if self._back_of != generation:  # a new count: every resource is a candidate
            self._back_of, self._back, self._latest = generation, set(), {}
            candidates = set(self.names)
            self._read = (0, 0)
        else:
            candidates = {r.resource for r in registrations[self._read[0] :]}
            candidates |= {e.resource for e in events[self._read[1] :] if e.resource is not None}
        for record in registrations[self._read[0] :]:
            if record.accepted:
                self._latest[record.resource] = record.generation
        self._read = (len(registrations), len(events))
        for name in candidates & self._names:
            if self._is_back(kubelet, name, generation):
                self._back.add(name)
            else:
                self._back.discard(name)
        if len(self._back) == len(self.names):  # all seen: do they all hold now?
            self._back = {name for name in self.names if self._is_back(kubelet, name, generation)}
        self._counted = (key, len(self._back))
        return len(self._back)

    def _is_back(self, kubelet: EmulatedKubelet, name: str, generation: int | None) -> bool:
        view = kubelet.resource(name)
        if view is None or not view.registered or view.allocatable != 1:
            return False
        return generation is None or self._latest.get(name) == generation

    def polling(self) -> int:
        """How many children watch by polling, for want of inotify instances (state.json)."""
        try:
            state = json.loads((self.runtime_dir / "state.json").read_text())
        except (OSError, ValueError):
            return 0
        return sum(child.get("watch") == "polling" for child in state["children"])

    def restarts(self) -> dict[str, int]:
        """Restarts by cause, summed over the children (state.json)."""
        try:
            state = json.loads((self.runtime_dir / "state.json").read_text())
        except (OSError, ValueError):
            return {}
        causes: dict[str, int] = {}
        for child in state["children"]:
            for cause, count in child.get("restarts_by_cause", {}).items():
                causes[cause] = causes.get(cause, 0) + count
        return causes

    def cleanup(self) -> None:
        shutil.rmtree(self.base, ignore_errors=True)


@dataclass
class Figures:
    starts: list[float] = field(default_factory=list)
    registered: list[int] = field(default_factory=list)
    pss_kb: list[int] = field(default_factory=list)
    kernel_pss_kb: list[int] = field(default_factory=list)
    processes: list[int] = field(default_factory=list)
    idle_millicores: list[float] = field(default_factory=list)
    restarts: list[float] = field(default_factory=list)
    back: list[int] = field(default_factory=list)
    other_restarts: list[dict[str, int]] = field(default_factory=list)
    polling: list[int] = field(default_factory=list)
    recovery_cpu: list[tuple[float, float, float]] = field(default_factory=list)
    """CPU seconds from the kubelet restart to all back: the agent, its children, the emulated kubelet."""
    failures: list[str] = field(default_factory=list)


async def wait_count(count: Callable[[], int], wanted: int, timeout: float) -> tuple[float, int]:
    """Seconds until ``count()`` reaches ``wanted`` (or the timeout), and the last count."""
    began = time.perf_counter()
    got = count()
    while got < wanted and time.perf_counter() - began < timeout:
        await asyncio.sleep(0.01)
        got = count()
    return time.perf_counter() - began, got


def in_budget(budget: int | None, command: list[str]) -> list[str]:
    """``command``, in a user namespace allowing ``budget`` inotify instances (as it is with None)."""
    if budget is None:
        return command
    script = f'echo {budget} > /proc/sys/user/max_inotify_instances && exec "$@"'
    return ["unshare", "-U", "-r", "sh", "-c", script, "sh", *command]


async def one_round(size: int, spawner: str, figures: Figures, timeout: float, budget: int | None) -> None:
    node = Node(size, spawner)
    kubelet = EmulatedKubelet(node.kubelet_dir, write_view=False, grace_period=300)
    await kubelet.start()
    log = node.base / "agent.log"
    began = time.perf_counter()
    with log.open("wb") as stderr:
        agent = await asyncio.create_subprocess_exec(
            *in_budget(budget, [sys.executable, "-m", "plugvisor", "run", "--config", str(node.config)]),
            stderr=stderr,
        )
    try:
        _, got = await wait_count(lambda: node.registered(kubelet), size, timeout)
        figures.starts.append(time.perf_counter() - began)
        figures.registered.append(got)
        if got < size:
            figures.failures.append(f"start: {got}/{size} registered after {timeout:g} s (log {log})")
            return
        await asyncio.sleep(2.0)  # settled: first rescans, status reports, the PodResources poller
        figures.polling.append(node.polling())
        pids = descendants(agent.pid)
        alone = node_pss(pids) or {pid: kernel_pss_kb(pid) for pid in pids}
        figures.pss_kb.append(sum(alone.values()))
        figures.kernel_pss_kb.append(sum(kernel_pss_kb(pid) for pid in pids))
        figures.processes.append(len(pids))
        ticks = cpu_ticks(pids)
        await asyncio.sleep(5.0)
        figures.idle_millicores.append((cpu_ticks(pids) - ticks) / os.sysconf("SC_CLK_TCK") / 5.0 * 1000)
        agent_ticks, children_ticks = cpu_ticks([agent.pid]), cpu_ticks(pids) - cpu_ticks([agent.pid])
        kubelet_cpu = time.process_time()
        try:
            await kubelet.restart()
        except Exception as exc:  # kept with the round's directory, not lost in the unwinding below
            kept = node.base / "kubelet-restart-error.txt"
            kept.write_text(traceback.format_exc())
            figures.failures.append(f"kubelet restart raised {type(exc).__name__}: {exc} ({kept})")
            return
        generation = kubelet.generation
        seconds, back = await wait_count(lambda: node.registered(kubelet, generation), size, timeout)
        figures.restarts.append(seconds)
        # The children's processes as they are now (restarted ones are new): the total is an estimate
        # with `restart` (the ended processes' CPU is gone with them), exact with `reregister`.
        now = descendants(agent.pid)
        figures.recovery_cpu.append(
            (
                (cpu_ticks([agent.pid]) - agent_ticks) / os.sysconf("SC_CLK_TCK"),
                (cpu_ticks([pid for pid in now if pid != agent.pid]) - children_ticks)
                / os.sysconf("SC_CLK_TCK"),
                time.process_time() - kubelet_cpu,
            )
        )
        figures.back.append(back)
        if back < size:
            figures.failures.append(f"kubelet restart: {back}/{size} back after {timeout:g} s (log {log})")
        await asyncio.sleep(1.0)
        figures.other_restarts.append({k: v for k, v in node.restarts().items() if k != "kubelet-restart"})
    finally:
        await terminate(agent, 120)
        try:
            await kubelet.stop()
        except Exception as exc:  # after a failed restart: said, and the other rounds still run
            figures.failures.append(f"kubelet stop raised {type(exc).__name__}: {exc}")
        if not figures.failures:
            node.cleanup()


async def bare_floor(rounds: int) -> tuple[float, int]:
    """A bare grpc.aio plugin: start -> registered (median) and node PSS once registered."""
    times, pss = [], 0
    for _ in range(rounds):
        base = Path(tempfile.mkdtemp(prefix="/tmp/pvs-"))
        kubelet = EmulatedKubelet(base / "dp", write_view=False, grace_period=30)
        await kubelet.start()
        began = time.perf_counter()
        bare = await asyncio.create_subprocess_exec(
            sys.executable, "-c", BARE_PLUGIN, str(base / "dp"), "bench.example/bare"
        )
        try:
            await kubelet.wait_for(
                lambda k: (v := k.resource("bench.example/bare")) is not None and v.registered
            )
            times.append(time.perf_counter() - began)
            await asyncio.sleep(1.0)
            pss = (node_pss([bare.pid]) or {bare.pid: kernel_pss_kb(bare.pid)})[bare.pid]
        finally:
            bare.kill()
            await bare.wait()
            await kubelet.stop()
            shutil.rmtree(base, ignore_errors=True)
    return statistics.median(times), pss


def fits(size: int, spawner: str) -> str | None:
    """Why ``size`` resources cannot run here now (None: they can)."""
    if spawner == "exec" and size * EXEC_CHILD_MB > available_mb() // 2:
        return f"{size} interpreters need ~{size * EXEC_CHILD_MB} MB, {available_mb()} MB available"
    return None


def report(size: int, spawner: str, figures: Figures, floor_s: float, floor_kb: int) -> None:
    def p50(values: list[float]) -> float:
        return statistics.median(values)

    print(f"{size} resources, spawner {spawner}: {len(figures.starts)} rounds")
    print(f"  registered at start: {figures.registered} of {size}; after the kubelet restart: {figures.back}")
    print(f"  children watching by polling (no inotify instance left): {figures.polling}")
    for failure in figures.failures:
        print(f"  FAILED {failure}")
    if figures.starts:
        print(
            f"  start -> all registered     p50 {p50(figures.starts) * 1000:8.0f} ms  max "
            f"{max(figures.starts) * 1000:8.0f} ms  = {p50(figures.starts) / floor_s:5.1f}x a bare plugin's "
            f"start ({p50(figures.starts) / floor_s / size:.2f}x per resource)"
        )
    if figures.restarts:
        print(
            f"  kubelet restart -> all back p50 {p50(figures.restarts) * 1000:8.0f} ms  max "
            f"{max(figures.restarts) * 1000:8.0f} ms"
        )
        for agent_s, children_s, kubelet_s in figures.recovery_cpu:
            # With `restart` the children that ended took their CPU with them: no figure then.
            children = f"{children_s:.2f} s" if POLICY.get("onKubeletRestart") == "reregister" else "-"
            print(
                f"    CPU meanwhile: agent {agent_s:.2f} s, children {children}, "
                f"emulated kubelet {kubelet_s:.2f} s"
            )
    if figures.pss_kb:
        total = p50(figures.pss_kb) / 1024
        print(
            f"  node PSS {total:7.1f} MB over {figures.processes[-1]} processes ({total / size:5.1f} MB per "
            f"resource; kernel PSS {p50(figures.kernel_pss_kb) / 1024:.1f} MB) = "
            f"{total * 1024 / floor_kb:.2f}x a bare plugin ({floor_kb / 1024:.1f} MB)"
        )
        print(f"  CPU at idle {p50(figures.idle_millicores):6.1f} millicores (agent and every child, 5 s)")
    other = [restarts for restarts in figures.other_restarts if restarts]
    print(f"  restarts other than the kubelet's: {other or 'none'}")


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--spawners", nargs="+", default=["forkserver", "exec"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds for all to register")
    parser.add_argument(
        "--inotify-limit", type=int, help="raise fs.inotify.max_user_instances to this (root)"
    )
    parser.add_argument("--policy", choices=["restart", "reregister"], help="onKubeletRestart [default: its]")
    parser.add_argument(
        "--inotify-budget", type=int, help="run the agent in a user namespace allowing this many instances"
    )
    options = parser.parse_args()
    if options.policy is not None:
        POLICY["onKubeletRestart"] = options.policy
    limit = INOTIFY_LIMIT.read_text().strip()  # noqa: ASYNC240 - before anything runs
    print(
        f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} (a shared machine: read the ratios); "
        f"fs.inotify.max_user_instances {limit}, {inotify_in_use()} in use"
        + ("" if options.inotify_budget is None else f", the agent's own budget {options.inotify_budget}")
    )
    with inotify_limit(options.inotify_limit):
        floor_s, floor_kb = await bare_floor(3)
        print(f"floor: a bare grpc.aio plugin starts and registers in {floor_s * 1000:.0f} ms, "
              f"node PSS {floor_kb / 1024:.1f} MB")  # fmt: skip
        cases = [(size, spawner) for size in options.sizes for spawner in options.spawners]
        figures = {case: Figures() for case in cases}
        skipped: dict[tuple[int, str], str] = {}
        for _ in range(options.rounds):
            for size, spawner in cases:
                reason = fits(size, spawner)
                if reason is not None:
                    skipped[(size, spawner)] = reason
                    continue
                budget = options.inotify_budget
                await one_round(size, spawner, figures[(size, spawner)], options.timeout, budget)
        for size, spawner in cases:
            if not figures[(size, spawner)].starts and (size, spawner) in skipped:
                print(f"{size} resources, spawner {spawner}: skipped, {skipped[(size, spawner)]}")
            else:
                report(size, spawner, figures[(size, spawner)], floor_s, floor_kb)


if __name__ == "__main__":
    asyncio.run(main())
