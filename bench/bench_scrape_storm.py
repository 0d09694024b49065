"""A scrape storm on a big node: 100 concurrent /metrics scrapes while children are SIGKILLed.

Run as ``python bench/bench_scrape_storm.py [--waves N] [--kills N] [--scrapers N]``. Figures are printed,
never asserted.

The node: the lab's ``big`` profile (4,096 VFs on 32 E810-like PFs) served by one ``nic`` resource, plus
three ``generic`` resources whose children are SIGKILLed; `plugvisor run` (fork server, metrics on,
watchdog on: ``WATCHDOG_USEC`` 2 s, so a ping every second) against the emulated kubelet, each in its
own process, as on a node. One scrape of that node is ~9.7 MB.

Two phases, in the same run (the machine is shared and noisy, so the quiet phase is the floor):

1. quiet: the generic children SIGKILLed one after the other; kill -> registered again (the agent's
   state file), ``/healthz`` latency (a prober process, every 20 ms), gaps between watchdog pings.
2. storm: a scraper process keeps ``--scrapers`` scrapes in flight at once (each reads the whole body),
   ``--waves`` times over; the same kills and probes meanwhile. Also: scrapes answered, renderings made
   (the agent's log is not needed: the body of each wave is compared), and the agent's peak RSS
   (``VmHWM``) and PSS beside its RSS before the storm.

Issue 20 measured, before this work: 24.6 s for a killed child to register again during such a storm,
``/healthz`` answered after 24-34 s, watchdog pings 29.8 s apart, peak memory 1.56 GB.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml
from node_memory import kernel_pss_kb

from plugvisor.emulators.lab import Lab

GENERIC = ["example.com/a", "example.com/b", "example.com/c"]

PROBE = """
import socket, sys, time
port, stop = int(sys.argv[1]), sys.argv[2]
import os
samples = []
while not os.path.exists(stop):
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=120) as s:
        s.sendall(b"GET /healthz HTTP/1.0\\r\\n\\r\\n")
        while s.recv(4096):
            pass
    samples.append(time.monotonic() - started)
    time.sleep(0.02)
print(" ".join(f"{x:.6f}" for x in samples))
"""

SCRAPER = """
import asyncio, sys, time
port, scrapers, waves = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
async def scrape():
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /metrics HTTP/1.0\\r\\n\\r\\n")
    size = 0
    while chunk := await reader.read(1 << 16):
        size += len(chunk)
    writer.close()
    return size
async def main():
    for _ in range(waves):
        started = time.monotonic()
        sizes = await asyncio.gather(*(scrape() for _ in range(scrapers)))
        print(f"{time.monotonic() - started:.3f} {min(sizes)} {max(sizes)} {len(sizes)}", flush=True)
asyncio.run(main())
"""


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ms(values: list[float]) -> str:
    if not values:
        return "no samples"
    return (
        f"p50 {statistics.median(values) * 1000:7.1f} ms  p99 {pct(values, 0.99) * 1000:7.1f} ms  "
        f"max {max(values) * 1000:7.1f} ms (n={len(values)})"
    )


class Watchdog:
    """systemd's side of NOTIFY_SOCKET: records when each WATCHDOG=1 arrives."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.pings: list[float] = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            if b"WATCHDOG=1" in data:
                self.pings.append(time.monotonic())

    def gaps(self, since: float, until: float) -> list[float]:
        pings = [p for p in self.pings if since <= p <= until]
        return [b - a for a, b in itertools.pairwise(pings)]

    def close(self) -> None:
        self._stop = True
        self._thread.join()
        self.sock.close()


def state(run: Path) -> dict[str, dict[str, Any]]:
    try:
        document = json.loads((run / "state.json").read_text())
    except (OSError, ValueError):
        return {}
    return {child["resource"]: child for child in document["children"]}


SHM = "/dev/shm" if Path("/dev/shm").is_dir() else None
"""Where the lab is written (tmpfs makes its 4,000 directories quick to create)."""

RESET_AFTER = 1.0
"""The agent's restart.resetAfter here: a child up this long is killed as a first crash (restarted at
once); with the default 10 s, back-to-back kills would measure the backoff policy, not the agent."""


async def kill_and_wait(run: Path, resource: str, timeout: float = 120) -> float:
    """SIGKILL the resource's child; seconds until a new process of it is registered (from state.json)."""
    while (started_at := state(run)[resource].get("started_at")) is None or (  # noqa: ASYNC110 - a file
        time.time() - started_at < RESET_AFTER + 0.5
    ):
        await asyncio.sleep(0.05)
    pid = state(run)[resource]["pid"]
    started = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    while True:
        child = state(run).get(resource, {})
        if child.get("pid") not in (None, pid) and child.get("registered"):
            return time.monotonic() - started
        if time.monotonic() - started > timeout:
            raise RuntimeError(f"{resource} did not come back within {timeout}s")
        await asyncio.sleep(0.005)


def memory(pid: int) -> dict[str, int]:
    fields = {}
    for row in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = row.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    fields["Pss"] = kernel_pss_kb(pid)
    return fields


async def phase(
    name: str,
    run: Path,
    port: int,
    work: Path,
    watchdog: Watchdog,
    *,
    kills: int,
    storm: tuple[int, int] | None,
) -> None:
    stop = work / f"stop-{name}"
    probe = await asyncio.create_subprocess_exec(
        sys.executable, "-c", PROBE, str(port), str(stop), stdout=asyncio.subprocess.PIPE
    )
    scraper = None
    if storm is not None:
        scrapers, waves = storm
        scraper = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            SCRAPER,
            str(port),
            str(scrapers),
            str(waves),
            stdout=asyncio.subprocess.PIPE,
        )
    started = time.monotonic()
    back: list[float] = []
    for index in range(kills):
        back.append(await kill_and_wait(run, GENERIC[index % len(GENERIC)]))
        await asyncio.sleep(0.2)
    waves_out = b""
    if scraper is not None:
        waves_out, _ = await scraper.communicate()
    stop.touch()
    out, _ = await probe.communicate()
    ended = time.monotonic()
    healthz = [float(x) for x in out.split()]
    print(f"\n{name}:")
    print(f"  child SIGKILL -> registered again   {ms(back)}")
    print(f"  /healthz latency                     {ms(healthz)}")
    print(f"  watchdog ping gaps (1 s expected)    {ms(watchdog.gaps(started, ended))}")
    for row in waves_out.decode().splitlines():
        seconds, _, largest, count = row.split()
        print(f"  wave: {count} scrapes of {int(largest) / 1e6:.1f} MB answered in {float(seconds):.2f} s")


def node_config(lab_root: Path, kubelet_dir: Path, run: Path, port: int) -> dict[str, Any]:
    return {
        "kubeletDir": str(kubelet_dir),
        "hostRoot": str(lab_root),
        "metrics": {"listen": f"127.0.0.1:{port}"},
        "supervisor": {"runtimeDir": str(run), "restart": {"resetAfter": RESET_AFTER}},
        "resources": [
            {"name": "plugvisor.io/vf", "kind": "nic", "match": {"vendors": ["0x8086"]}},
            *({"name": name, "kind": "generic", "paths": ["/dev/null"], "count": 2} for name in GENERIC),
        ],
    }


def prepare(work: Path, short: Path, run: Path, port: int) -> None:
    """The lab (on /dev/shm when there is one) and the agent's configuration file."""
    started = time.monotonic()
    lab = Lab.create(work / "root", "big")
    (Path(lab.root) / "dev" / "null").touch()
    print(f"lab: big profile, {time.monotonic() - started:.1f} s to create")
    (short / "node.yaml").write_text(yaml.safe_dump(node_config(Path(lab.root), short / "dp", run, port)))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


async def wait_registered(run: Path) -> None:
    """Every resource registered, the 4,096 VFs counted."""
    while not (  # noqa: ASYNC110 - a file, polled
        len(children := state(run)) == 4
        and all(c["registered"] for c in children.values())
        and (children["plugvisor.io/vf"].get("devices") or {}).get("total") == 4096
    ):
        await asyncio.sleep(0.1)


async def stop(processes: list[asyncio.subprocess.Process]) -> None:
    for process in reversed(processes):
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), 30)
            except TimeoutError:
                process.kill()
                await process.wait()


def mb(kb: int) -> str:
    return f"{kb / 1024:.1f} MB"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--waves", type=int, default=5)
    parser.add_argument("--kills", type=int, default=12)
    parser.add_argument("--scrapers", type=int, default=100)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pvstorm-", dir=SHM))
    short = Path(tempfile.mkdtemp(prefix="/tmp/pvs-"))
    processes: list[asyncio.subprocess.Process] = []
    watchdog = Watchdog(short / "notify")
    try:
        run, port = short / "run", free_port()
        prepare(work, short, run, port)
        kubelet = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "plugvisor", "kubelet", "--dir", str(short / "dp"),
            stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        processes.append(kubelet)
        env = {**os.environ, "NOTIFY_SOCKET": str(short / "notify"), "WATCHDOG_USEC": "2000000"}
        agent = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "plugvisor", "run", "--config", str(short / "node.yaml"),
            env=env, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        processes.append(agent)
        await wait_registered(run)
        await asyncio.sleep(2)
        before = memory(agent.pid)
        print(f"agent before: RSS {mb(before['VmRSS'])}, PSS {mb(before['Pss'])}")
        await phase("quiet (floor)", run, port, work, watchdog, kills=args.kills, storm=None)
        storm = (args.scrapers, args.waves)
        await phase(f"storm ({storm[0]} concurrent scrapes x {storm[1]} waves)", run, port, work, watchdog,
                    kills=args.kills, storm=storm)  # fmt: skip
        after = memory(agent.pid)
        print(
            f"\nagent memory: RSS before {mb(before['VmRSS'])}, peak (VmHWM) {mb(after['VmHWM'])}, after "
            f"{mb(after['VmRSS'])}; PSS before {mb(before['Pss'])}, after {mb(after['Pss'])}"
        )
    finally:
        await stop(processes)
        watchdog.close()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(short, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
