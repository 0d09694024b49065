"""Allocate round trip against a bare gRPC unary call, and the 10,000-device figures.

Run: python bench/bench_rpc.py [--calls 2000]

The server runs in its own process (as a plugin does, apart from the kubelet);
the client is grpc's synchronous stub. The baseline is a bare grpc.aio server
whose handler returns a pre-built AllocateResponse of the same shape, on the
same kind of socket, measured in the same run, so the ratio isolates what the
framework adds (request checks, merge, conversion). A third server registers the
same servicer with grpc's generated handlers instead of ours (which answer a
malformed request INVALID_ARGUMENT rather than UNKNOWN), to show what that costs.
Each figure is printed beside the floor as a ratio, with the server's CPU time
per call (all its threads; it moves far less with the machine's load than the
round trip does). Then the servicer's own Python work per call is timed in
process, beside the bare handler's, with prometheus-client's values kept in
process and in the multiprocess files the agent's children write.
"""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # before grpc is imported: no info lines

import argparse
import asyncio
import hashlib
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from plugvisor.api.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc

DEVICE_COUNT = 8
DISTINCT = 2048
"""Devices of the plugvisor server, so that a client can send this many different one-device requests: more
than the servicer keeps answers for (1024), so that cycling through them makes every call a miss (request
checked, answer built), the path of a kubelet that rarely repeats a request."""


def _devices(n: int):
    from plugvisor.deviceplugin.devices import Device, DeviceSet, DeviceSpec

    return DeviceSet(
        Device(
            f"gpu{i}",
            numa_nodes=[i % 2],
            specs=[
                DeviceSpec(f"/dev/nvidia{i}", f"/dev/nvidia{i}"),
                DeviceSpec("/dev/nvidiactl", "/dev/nvidiactl"),
            ],
            envs={"VISIBLE_DEVICES": f"gpu{i}"},
        )
        for i in range(n)
    )


async def _serve_plugvisor(socket_path: str, *, generated: bool = False, options=None) -> None:
    from plugvisor.deviceplugin.cell import SnapshotCell
    from plugvisor.deviceplugin.hooks import Hooks
    from plugvisor.deviceplugin.server import PluginServer, add_plugin_servicer
    from plugvisor.deviceplugin.snapshot import Snapshot

    server = grpc.aio.server(options=options)
    servicer = PluginServer("bench.example/gpu", SnapshotCell(Snapshot(_devices(DISTINCT))), Hooks())
    if generated:
        api_pb2_grpc.add_DevicePluginServicer_to_server(servicer, server)
    else:
        add_plugin_servicer(servicer, server, resource="bench.example/gpu")
    server.add_insecure_port(f"unix:{socket_path}")
    await server.start()
    await server.wait_for_termination()


class _Bare(api_pb2_grpc.DevicePluginServicer):
    """The least a servicer can do: return a ready-made answer."""

    def __init__(self) -> None:
        self.response = api_pb2.AllocateResponse(
            container_responses=[
                api_pb2.ContainerAllocateResponse(
                    envs={"VISIBLE_DEVICES": "gpu3"},
                    devices=[
                        api_pb2.DeviceSpec(
                            container_path="/dev/nvidia3", host_path="/dev/nvidia3", permissions="rw"
                        ),
                        api_pb2.DeviceSpec(
                            container_path="/dev/nvidiactl", host_path="/dev/nvidiactl", permissions="rw"
                        ),
                    ],
                )
            ]
        )

    async def Allocate(self, request, context):  # type: ignore[override]
        return self.response


async def _serve_bare(socket_path: str, options=None) -> None:
    server = grpc.aio.server(options=options)
    api_pb2_grpc.add_DevicePluginServicer_to_server(_Bare(), server)
    server.add_insecure_port(f"unix:{socket_path}")
    await server.start()
    await server.wait_for_termination()


def _pin(cpu: int) -> None:
    """Pin this process to one core: client and server on separate cores, the same for both servers.

    Without it, which core each new server process lands on moves the median by about
    15%, more than the difference being measured.
    """
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) > 1:
        os.sched_setaffinity(0, {cpus[cpu % len(cpus)]})


GO_PLUGIN = Path(__file__).parent / "go"
"""A minimal device plugin in Go (grpc-go, the kubelet's generated API): the reference for Allocate."""


def go_plugin() -> tuple[Path | None, str]:
    """The Go plugin, built once per source change into the user's cache (never the checkout), or why not."""
    go = shutil.which("go")
    if go is None:
        return None, "go is not on PATH"
    sources = sorted(p for p in GO_PLUGIN.iterdir() if p.is_file())
    digest = hashlib.sha256(b"".join(p.name.encode() + p.read_bytes() for p in sources)).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "plugvisor" / "bench"
    binary = cache / f"goplugin-{digest}"
    if not binary.exists():
        cache.mkdir(parents=True, exist_ok=True)
        partial = binary.with_suffix(".partial")
        built = subprocess.run(
            [go, "build", "-o", str(partial), "."], cwd=GO_PLUGIN, capture_output=True, text=True, check=False
        )
        if built.returncode != 0:
            return None, f"go build failed: {built.stderr.strip()[-400:]}"
        partial.replace(binary)
    return binary, ""


PLUGIN_KINDS = ("plugin", "plugin-agent")
"""The real ``plugvisor plugin generic`` process: standalone (no metrics kept), and with its metrics in the
multiprocess files the agent aggregates (``PROMETHEUS_MULTIPROC_DIR``), as under ``plugvisor run``."""


def _start(kind: str, socket_path: Path) -> tuple[subprocess.Popen[bytes], Path]:
    """Start a server of ``kind`` and wait until its socket exists: (process, socket)."""
    env = dict(os.environ)
    if kind == "plugin-agent":
        env["PROMETHEUS_MULTIPROC_DIR"] = str(socket_path.with_suffix(".metrics"))
        Path(env["PROMETHEUS_MULTIPROC_DIR"]).mkdir()
    if kind in PLUGIN_KINDS:  # the plugin names its own socket in the kubelet directory it is given
        socket_path.mkdir()
    proc = subprocess.Popen([sys.executable, __file__, "--serve", kind, str(socket_path)], env=env)
    deadline = time.monotonic() + 30
    while True:
        found = list(socket_path.glob("*.sock")) if kind in PLUGIN_KINDS else [socket_path]
        if found and found[0].exists():
            return proc, found[0]
        if time.monotonic() > deadline or proc.poll() is not None:
            raise SystemExit(f"{kind} server did not start")
        time.sleep(0.01)


def _cpu_seconds(pid: int) -> float:
    """CPU time of every thread of a process so far (scheduler statistics: nanoseconds, not ticks)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # a thread that just ended
            continue
    return total / 1e9


def _requests(distinct: bool, devices: list[str] | None = None) -> list[api_pb2.AllocateRequest]:
    """One request for one device (repeated: every call after the first a kept answer), or one per device.

    ``devices``: the server's device IDs in its order (default: the gpuN of the bench's servers).
    """
    ids = devices or [f"gpu{i}" for i in range(DISTINCT)]
    return [
        api_pb2.AllocateRequest(container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=[i])])
        for i in (ids if distinct else ids[3:4])
    ]


def _listed_ids(stub: api_pb2_grpc.DevicePluginStub) -> list[str]:
    """The device IDs a server lists first, as the kubelet learns them."""
    stream = stub.ListAndWatch(api_pb2.Empty())
    try:
        return [device.ID for device in next(stream).devices]
    finally:
        stream.cancel()


def _measure(
    socket_path: Path,
    calls: int,
    server_pid: int | None = None,
    *,
    distinct: bool = False,
    listed: bool = False,
) -> tuple[list[float], float]:
    """Round trips of ``calls`` Allocate calls, and the server's CPU seconds per call (0 without a pid).

    The server's CPU time per call hardly moves with the load others put on the
    machine, unlike the round trip, so it shows what a change to the server's
    per-call work buys even when the latencies are noisy. ``distinct``: each call
    asks for the next of :data:`DISTINCT` devices, so none is answered from the
    servicer's kept answers. ``listed``: ask for the devices the server lists (not the gpuN of the
    bench's own servers).
    """
    with grpc.insecure_channel(f"unix:{socket_path}") as channel:
        grpc.channel_ready_future(channel).result(timeout=10)
        stub = api_pb2_grpc.DevicePluginStub(channel)
        requests = _requests(distinct, _listed_ids(stub) if listed else None)
        for request in requests[:100]:  # warm-up: connection, caches, allocator
            stub.Allocate(request)
        samples = []
        cpu = _cpu_seconds(server_pid) if server_pid else 0.0
        for n in range(calls):
            request = requests[(n + 100) % len(requests)]
            t0 = time.perf_counter()
            stub.Allocate(request)
            samples.append(time.perf_counter() - t0)
        cpu = _cpu_seconds(server_pid) - cpu if server_pid else 0.0
    return samples, cpu / calls


def _pct(samples: list[float], q: float) -> float:
    return statistics.quantiles(samples, n=100, method="inclusive")[int(q) - 1] if q < 100 else max(samples)


class Measured:
    """One server's round trips over all rounds, and its p50 and CPU time per call in each round."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self.round_p50: list[float] = []
        self.round_p99: list[float] = []
        self.round_cpu: list[float] = []

    def add(self, samples: list[float], cpu_per_call: float) -> None:
        self.samples.extend(samples)
        self.round_p50.append(statistics.median(samples))
        self.round_p99.append(_pct(samples, 99))
        self.round_cpu.append(cpu_per_call)


def print_pairs(measured: dict[str, Measured], reference: str, names: list[str], width: int = 26) -> None:
    """Each round's p50 and p99 as a ratio to the reference's in the same round: median and range."""
    base = measured[reference]
    print(f"  {'':{width}} {'p50 / ' + reference:>24}   {'p99 / ' + reference:>24}")
    for name in names:
        m = measured[name]
        cells = []
        for mine, theirs in ((m.round_p50, base.round_p50), (m.round_p99, base.round_p99)):
            ratios = sorted(a / b for a, b in zip(mine, theirs, strict=True))
            cells.append(f"{statistics.median(ratios):5.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f})")
        print(f"  {name:{width}} {cells[0]:>24}   {cells[1]:>24}")


def print_table(measured: dict[str, Measured], floor: str, width: int = 26) -> None:
    """Each server's figures beside the floor's.

    The p50 and CPU ratios are medians of per-round ratios (each round measures
    every server back to back, so a slow spell of the machine hits both sides of
    a ratio); p99 is over all calls, as tails need many samples.
    """
    base = measured[floor]
    print(
        f"  {'':{width}} {'p50':>9} {'/floor':>6}  {'p99':>9} {'/floor':>6}"
        f"  {'server CPU/call':>15} {'/floor':>6}"
    )
    for name, m in measured.items():
        p50, p99, cpu = statistics.median(m.samples), _pct(m.samples, 99), statistics.median(m.round_cpu)
        p50_ratio = statistics.median(a / b for a, b in zip(m.round_p50, base.round_p50, strict=True))
        cpu_ratio = statistics.median(a / b for a, b in zip(m.round_cpu, base.round_cpu, strict=True))
        print(
            f"  {name:{width}} {p50 * 1e3:6.3f} ms {p50_ratio:5.2f}x  {p99 * 1e3:6.3f} ms"
            f" {p99 / _pct(base.samples, 99):5.2f}x  {cpu * 1e6:12.1f} us {cpu_ratio:5.2f}x"
        )


def bench_allocate(calls: int, rounds: int) -> None:
    go, why_not = go_plugin()
    tmp = Path(tempfile.mkdtemp(prefix="/tmp/pvb-"))
    names = {
        "bare": "bare gRPC unary",
        "plugvisor": "plugvisor Allocate",
        "plugvisor-new": "  every call a new request",
        "generated": "  generated handlers",
        "plugin": "plugvisor plugin generic",
        "plugin-agent": "  metrics as under the agent",
    }
    if go is not None:
        names[f"go={go}"] = "Go plugin"
    measured = {name: Measured() for name in names.values()}
    try:
        # Interleave rounds so drift on a noisy machine hits both sides alike.
        kinds = tuple(names)
        for round_ in range(rounds):
            order = kinds if round_ % 2 == 0 else kinds[::-1]
            for i, kind in enumerate(order):
                proc, sock = _start(
                    "plugvisor" if kind == "plugvisor-new" else kind, tmp / f"{round_}-{i}.sock"
                )
                try:
                    distinct, listed = kind == "plugvisor-new", kind in PLUGIN_KINDS
                    measured[names[kind]].add(
                        *_measure(sock, calls // rounds, proc.pid, distinct=distinct, listed=listed)
                    )
                finally:
                    proc.send_signal(signal.SIGTERM)
                    proc.wait(timeout=10)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"Allocate round trip over {calls // rounds * rounds} calls (unix socket, server in its own process):"
    )
    print(f"  (client on one core, each server on the other; {rounds} alternating rounds of fresh processes;")
    print(f"  load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    print("  floor: bare gRPC unary = grpc.aio on asyncio's loop, a handler returning a ready-made answer")
    print("  targets: plugvisor Allocate p50 <= 1.00x the floor; p99 <= 1.5x the Go plugin's (paired below)")
    print_table(measured, "bare gRPC unary", width=28)
    print("  (plugvisor Allocate: one request repeated, answered from the answers kept per device-set")
    print(f"  version; every call a new request: cycling through {DISTINCT} one-device requests, each")
    print("  checked and its answer built;")
    print("  generated handlers: grpc's own registration, which answers a malformed request UNKNOWN;")
    print("  Go plugin: bench/go, grpc-go with the kubelet's generated API, each answer built afresh)")
    if go is None:
        print(f"  (no Go plugin to pair with: {why_not})")
        return
    print(f"Paired with the Go plugin, round by round ({rounds} pairs of fresh processes,")
    print(f"  {calls // rounds} calls each; median and range of the per-round ratios; target p99 <= 1.50x):")
    paired = [name for name in measured if name != "Go plugin"]
    print_pairs(measured, "Go plugin", paired, width=28)


def _in_process(handler, calls: int, repeats: int = 40, *, distinct: bool = False) -> float:
    """Least time per call of decode + ``handler`` + encode, without a socket: the servicer's own work.

    Many short runs, keeping the fastest: on a shared machine most runs are
    interrupted by something else, and the fastest is the one that was not.
    """
    from plugvisor.deviceplugin.server import tolerant_deserializer

    encoded = [request.SerializeToString() for request in _requests(distinct)]
    decode, encode = (
        tolerant_deserializer(api_pb2.AllocateRequest),
        api_pb2.AllocateResponse.SerializeToString,
    )

    async def run(n: int) -> float:
        t0 = time.perf_counter()
        for i in range(n):
            encode(await handler(decode(encoded[i % len(encoded)]), None))
        return (time.perf_counter() - t0) / n

    async def least() -> float:
        await run(calls)  # warm-up: the first call of a version builds and keeps the answer
        return min([await run(calls) for _ in range(repeats)])

    return asyncio.run(least())


def bench_servicer_work(calls: int = 2000) -> None:
    """The servicer's Python work per Allocate call, in this process, beside the bare handler's."""
    from prometheus_client import values

    from plugvisor.deviceplugin.cell import SnapshotCell
    from plugvisor.deviceplugin.hooks import Hooks
    from plugvisor.deviceplugin.server import PluginServer, _checked_unary
    from plugvisor.deviceplugin.snapshot import Snapshot

    def servicer(resource: str):
        server = PluginServer(resource, SnapshotCell(Snapshot(_devices(DISTINCT))), Hooks())
        return _checked_unary("Allocate", server.Allocate, resource)

    figures = {"bare handler": _in_process(_Bare().Allocate, calls)}
    figures["plugvisor, metrics in process"] = _in_process(servicer("bench.example/local"), calls)
    figures["  every call a new request"] = _in_process(servicer("bench.example/new"), calls, distinct=True)
    tmp = tempfile.mkdtemp(prefix="/tmp/pvb-")
    saved = values.ValueClass
    try:  # as under the agent: metric values written to mmap'ed files that the agent aggregates
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = tmp
        values.ValueClass = values.MultiProcessValue()
        figures["plugvisor, multiprocess metrics"] = _in_process(servicer("bench.example/files"), calls)
    finally:
        values.ValueClass = saved
        del os.environ["PROMETHEUS_MULTIPROC_DIR"]
        shutil.rmtree(tmp, ignore_errors=True)
    floor = figures["bare handler"]
    print("The servicer's own work per Allocate call (decode + handler + encode, in process, least of 40):")
    for name, seconds in figures.items():
        print(f"  {name:32} {seconds * 1e6:7.2f} us  {seconds / floor:5.1f}x the bare handler")


def bench_10k() -> None:
    from plugvisor.common.hostpaths import HostPaths
    from plugvisor.deviceplugin import allocation
    from plugvisor.deviceplugin.cell import SnapshotCell
    from plugvisor.deviceplugin.hooks import Hooks
    from plugvisor.deviceplugin.server import PluginServer, add_plugin_servicer, device_list_message
    from plugvisor.plugins.generic import GenericOptions, GenericSource

    tmp = Path(tempfile.mkdtemp(prefix="/tmp/pvb-"))
    try:
        (tmp / "dev").mkdir()
        (tmp / "dev" / "fuse").touch()
        source = GenericSource(GenericOptions(paths=["/dev/fuse"], count=10_000), HostPaths(root=tmp))
        t0 = time.perf_counter()
        snapshot = source.scan()
        devices = snapshot.devices
        scan = time.perf_counter() - t0
        t0 = time.perf_counter()
        message = device_list_message(devices)
        convert = time.perf_counter() - t0
        size = message.ByteSize()

        async def first_list() -> float:
            server = grpc.aio.server()
            add_plugin_servicer(
                PluginServer("bench.example/fuse", SnapshotCell(snapshot), Hooks()), server, resource="x"
            )
            server.add_insecure_port(f"unix:{tmp / 'big.sock'}")
            await server.start()
            times = []
            async with grpc.aio.insecure_channel(f"unix:{tmp / 'big.sock'}") as channel:
                stub = api_pb2_grpc.DevicePluginStub(channel)
                await stub.GetDevicePluginOptions(api_pb2.Empty())
                for _ in range(20):
                    t = time.perf_counter()
                    stream = stub.ListAndWatch(api_pb2.Empty())
                    got = await stream.read()
                    times.append(time.perf_counter() - t)
                    assert len(got.devices) == 10_000
                    stream.cancel()
            await server.stop(0)
            return statistics.median(times)

        send = asyncio.run(first_list())
        ids = list(devices)
        t0 = time.perf_counter()
        for _ in range(10):
            allocation.check_preferred(ids, ids[:2], 8, devices, index=0, resource="bench.example/fuse")
            allocation.default_preferred(ids, ids[:2], 8)
        prefer = (time.perf_counter() - t0) / 10
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("10,000 devices in one resource (generic kind, /dev/fuse x 10,000):")
    print(f"  scan                               {scan * 1e3:8.1f} ms   (goal < 1 s)")
    print(f"  list message: build {convert * 1e3:.1f} ms, size {size / 1024:.0f} KiB (kubelet limit 4 MiB)")
    print(f"  full ListAndWatch, open -> received {send * 1e3:8.1f} ms   (median of 20; goal < 50 ms)")
    print(f"  preferred allocation (checks + pick) {prefer * 1e3:6.1f} ms   (goal < 20 ms)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=12000, help="calls per server, over all rounds")
    parser.add_argument("--rounds", type=int, default=12, help="rounds of fresh processes (pairs)")
    parser.add_argument("--serve", nargs=2, metavar=("KIND", "SOCKET"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    from plugvisor.common.logs import configure_logging

    configure_logging(level="warning")
    if args.serve:
        _pin(1)
        kind, sock = args.serve
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
        # Pinned like the others, then the Go binary or the real plugin in this process's place.
        if kind.startswith("go="):
            binary = kind.removeprefix("go=")
            os.execv(binary, [binary, sock, str(DISTINCT)])
        if kind in PLUGIN_KINDS:
            plugin = ["plugin", "generic", "--resource", "bench.example/null", "--path", "/dev/null"]
            plugin += ["--count", str(DISTINCT), "--kubelet-dir", sock, "--log-level", "warning"]
            os.execv(sys.executable, [sys.executable, "-m", "plugvisor", *plugin])
        if kind == "bare":
            asyncio.run(_serve_bare(sock))
        else:  # on the event loop a plugin process runs on (runtime.run_plugin; bench/README.md says why)
            from plugvisor.deviceplugin.runtime import plugin_event_loop

            with asyncio.Runner(loop_factory=plugin_event_loop) as runner:
                runner.run(_serve_plugvisor(sock, generated=kind == "generated"))
        return
    _pin(0)
    bench_allocate(args.calls, args.rounds)
    bench_servicer_work()
    bench_10k()


if __name__ == "__main__":
    main()
