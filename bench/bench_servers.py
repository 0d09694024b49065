"""Which gRPC server the Allocate path should run on: sync vs grpc.aio (default loop, uvloop), options.

Run: python bench/bench_servers.py [--calls 4000] [--rounds 8] [--only NAME ...]

Each flavour serves the same ready-made AllocateResponse (the "bare" handler of
bench_rpc.py) in its own process pinned to one core, and plugvisor's own
servicer runs on both event loops and with the server options a plugin uses;
the client is grpc's synchronous stub on the other core, as the kubelet's Go
client would be a separate process. Rounds alternate the order of the flavours
so that drift on a shared machine hits them alike; every figure is printed as
a ratio to the floor (a bare grpc.aio server on asyncio's loop) measured in the
same run, beside the target (plugvisor at or below that floor). The server's
CPU time per call (summed over its threads, from the scheduler's statistics)
is printed too: it hardly moves with the load others put on the machine.
bench/README.md says what was picked and why.
"""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # before grpc is imported: no info lines

import argparse
import asyncio
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path

import grpc

from plugvisor.api.deviceplugin.v1beta1 import api_pb2_grpc

sys.path.insert(0, str(Path(__file__).parent))
import bench_rpc  # the servicers and the client, shared

# name -> "servicer model [loop] [option ...]"
FLAVOURS = {
    "sync, 1 worker": "bare sync 1",
    "sync, 4 workers": "bare sync 4",
    "aio, asyncio loop": "bare aio asyncio",
    "aio, uvloop": "bare aio uvloop",
    "aio, no BDP probe": "bare aio asyncio nobdp",
    "aio, minimal stack": "bare aio asyncio minimal",
    "aio, latency target": "bare aio asyncio latency",
    "plugvisor, asyncio loop": "plugvisor aio asyncio",
    "plugvisor, uvloop": "plugvisor aio uvloop",
}
FLOOR = "aio, asyncio loop"

# What each option name stands for (grpc core channel arguments, applied to the server).
OPTIONS = {
    "nobdp": ("grpc.http2.bdp_probe", 0),  # no bandwidth-delay probes (pings) on the connection
    "minimal": ("grpc.minimal_stack", 1),  # no optional filters (census, message size limits, ...)
    "latency": ("grpc.optimization_target", "latency"),
}


class _SyncBare(api_pb2_grpc.DevicePluginServicer):
    def __init__(self) -> None:
        self.response = bench_rpc._Bare().response

    def Allocate(self, request, context):  # type: ignore[override]
        return self.response


def serve(spec: str, socket_path: str) -> None:
    servicer, model, *rest = spec.split()
    if model == "sync":
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=int(rest[0])))
        api_pb2_grpc.add_DevicePluginServicer_to_server(_SyncBare(), server)
        server.add_insecure_port(f"unix:{socket_path}")
        server.start()
        server.wait_for_termination()
        return
    loop, *names = rest
    options = [OPTIONS[name] for name in names] or None

    async def run() -> None:
        if servicer == "plugvisor":
            await bench_rpc._serve_plugvisor(socket_path, options=options)
        else:
            await bench_rpc._serve_bare(socket_path, options=options)

    if loop == "uvloop":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(run())
    else:
        asyncio.run(run())


def start(spec: str, socket_path: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, __file__, "--serve", spec, str(socket_path)])
    deadline = time.monotonic() + 20
    while not socket_path.exists():
        if time.monotonic() > deadline or proc.poll() is not None:
            raise SystemExit(f"{spec} server did not start")
        time.sleep(0.01)
    return proc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=4000, help="calls per flavour, over all rounds")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--only", nargs="+", metavar="NAME", help="measure these flavours (and the floor)")
    parser.add_argument("--serve", nargs=2, metavar=("SPEC", "SOCKET"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    from plugvisor.common.logs import configure_logging

    configure_logging(level="warning")
    if args.serve:
        bench_rpc._pin(1)
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
        serve(*args.serve)
        return
    flavours = dict(FLAVOURS)
    if args.only:
        unknown = set(args.only) - set(FLAVOURS)
        if unknown:
            raise SystemExit(f"--only: unknown flavours {sorted(unknown)}; known: {list(FLAVOURS)}")
        flavours = {name: spec for name, spec in FLAVOURS.items() if name in args.only or name == FLOOR}
    bench_rpc._pin(0)
    tmp = Path(tempfile.mkdtemp(prefix="/tmp/pvs-"))
    measured = {name: bench_rpc.Measured() for name in flavours}
    try:
        for round_ in range(args.rounds):
            names = list(flavours) if round_ % 2 == 0 else list(reversed(flavours))
            for i, name in enumerate(names):
                sock = tmp / f"s{round_}-{i}.sock"
                proc = start(flavours[name], sock)
                try:
                    measured[name].add(*bench_rpc._measure(sock, args.calls // args.rounds, proc.pid))
                finally:
                    proc.send_signal(signal.SIGTERM)
                    proc.wait(timeout=10)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    load = os.getloadavg()[0]
    print(
        f"Allocate round trip by server flavour ({args.calls} calls each, {args.rounds} alternating rounds;"
    )
    print(f"  client and server on separate cores; {os.cpu_count()} cores, load average {load:.1f})")
    print(
        f"  floor: {FLOOR} (a bare handler returning a ready-made answer); target: plugvisor <= 1.00x floor"
    )
    bench_rpc.print_table(measured, FLOOR)


if __name__ == "__main__":
    main()
