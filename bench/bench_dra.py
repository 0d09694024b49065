"""A kind as a DRA driver beside the same kind as a device plugin: claim -> prepared, memory, registration.

    python bench/bench_dra.py [--rounds 200]

On a dgx-like lab, the gpu kind runs twice as real processes: as a device plugin
(`plugvisor plugin gpu`) and as a DRA driver (`plugvisor plugin gpu --mode dra
--objects-dir ...`), both registered with the emulated kubelet. Per round, in
turn (so a slow spell of the shared machine hits every figure alike):

- the device-plugin path: one Allocate call for 1 and for 8 GPUs, straight to the plugin's socket (the
  same request each time, as the kubelet repeats them: the plugin answers it from its table; see
  bench_rpc.py for new requests);
- the DRA path, claim allocated -> prepared: one NodePrepareResources call for a claim of 1 and of 8
  GPUs, the claim already "allocated" (its ResourceClaim object written where the driver reads it, as
  the API server would hold it): the driver reads the claim, checks it, runs the kind's hooks, writes
  the claim's CDI spec and its checkpoint (both fsynced) and answers; then NodeUnprepareResources;
- the same prepare with the driver's writes not flushed to disk (``durable=False`` patched in a third
  process), to show what the two fsyncs cost on this disk.

Then the node PSS of each process (bench/node_memory.py; root needed), start -> registered of each, and
the DRA driver's start -> slice published (after its registration: the driver waits for it).
Prints figures and ratios to the device-plugin path in the same run; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
import structlog
from node_memory import kernel_pss_kb, node_pss

from plugvisor.api.deviceplugin.v1beta1 import api_pb2 as dp_pb2
from plugvisor.api.dra.v1 import api_pb2 as dra_pb2
from plugvisor.emulators import lab
from plugvisor.emulators.kubelet import EmulatedKubelet
from plugvisor.emulators.kubelet.dra import resource_claim

NODE = "node-1"
DRIVER = "gpu.plugvisor.io"
RESOURCE = "plugvisor.io/gpu"
PREPARE = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources"
UNPREPARE = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources"
NOT_DURABLE = (
    "import functools, sys\n"
    "import plugvisor.common.atomicfile as a, plugvisor.dra.checkpoint as c, plugvisor.dra.cdi as s\n"
    "c.write_atomically = s.write_atomically = functools.partial(a.write_atomically, durable=False)\n"
    "from plugvisor.cli import main\n"
    "main(sys.argv[1:], prog_name='plugvisor')\n"
)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def line(label: str, values: list[float], floor: list[float] | None = None, floor_name: str = "") -> None:
    text = f"{label:<64} p50 {pct(values, 0.5):7.2f} ms  p99 {pct(values, 0.99):7.2f} ms"
    if floor:
        text += f"   ({statistics.median(values) / statistics.median(floor):.2f}x {floor_name})"
    print(text)


async def spawn(argv: list[str]) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
    )


class Bench:
    def __init__(self, rounds: int) -> None:
        self.rounds = rounds
        self.labs = Path(
            tempfile.mkdtemp(prefix="/dev/shm/pvb-" if Path("/dev/shm").is_dir() else "/tmp/pvb-")
        )
        self.base = Path(tempfile.mkdtemp(prefix="/tmp/pvb-"))
        self.root = Path(lab.Lab.create(str(self.labs / "root"), "dgx-like").root)
        self.kubelet = EmulatedKubelet(
            self.base / "device-plugins",
            objects_dir=self.base / "api",
            node_name=NODE,
            write_view=False,
            pod_resources=False,
        )
        self.procs: list[asyncio.subprocess.Process] = []
        self.uid = 0

    def common(self) -> list[str]:
        return ["--host-root", str(self.root), "--kubelet-dir", str(self.base / "device-plugins")]

    def dra_argv(self, driver: str, *, durable: bool = True) -> list[str]:
        prefix = [sys.executable, "-m", "plugvisor"] if durable else [sys.executable, "-c", NOT_DURABLE]
        return [
            *prefix,
            "plugin",
            "gpu",
            "--mode",
            "dra",
            "--driver",
            driver,
            "--objects-dir",
            str(self.base / "api"),
            "--node-name",
            NODE,
            "--cdi-dir",
            f"/cdi/{driver}",
            *self.common(),
        ]

    async def start(self, argv: list[str], ready) -> tuple[asyncio.subprocess.Process, float]:
        started = time.perf_counter()
        proc = await spawn(argv)
        self.procs.append(proc)
        await self.kubelet.wait_for(ready, timeout=60)
        return proc, (time.perf_counter() - started) * 1000

    def claim(self, driver: str, devices: list[str]) -> dra_pb2.Claim:
        """Write an allocated claim where the driver reads it (the API server's part, before the clock)."""
        self.uid += 1
        name = f"c{self.uid}"
        document = resource_claim(
            "default", name, f"uid-{self.uid}", [("gpus", driver, NODE, d) for d in devices]
        )
        path = self.base / "api" / "resourceclaims" / "default" / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(document))
        return dra_pb2.Claim(namespace="default", name=name, uid=f"uid-{self.uid}")

    async def run(self) -> None:
        await self.kubelet.start()
        try:
            dp, dp_start = await self.start(
                [sys.executable, "-m", "plugvisor", "plugin", "gpu", "--resource", RESOURCE, *self.common()],
                lambda k: (r := k.resource(RESOURCE)) is not None and r.allocatable == 8,
            )
            slice_file = self.base / "api" / "resourceslices" / f"{DRIVER}-{NODE}.json"
            sliced = asyncio.create_task(appears(slice_file, time.perf_counter()))
            dra, dra_start = await self.start(self.dra_argv(DRIVER), lambda k: DRIVER in k.dra.plugins)
            dra_slice = await sliced
            fast_driver = "fast.gpu.plugvisor.io"
            await self.start(
                self.dra_argv(fast_driver, durable=False), lambda k: fast_driver in k.dra.plugins
            )
            print(f"start -> registered, one each: device plugin {dp_start:.0f} ms, DRA {dra_start:.0f} ms")
            print(
                f"DRA start -> slice published {dra_slice:.0f} ms, "
                f"{dra_slice - dra_start:+.0f} ms from its registration (the kubelet's view)"
            )
            await self.calls()
            self.memory(dp.pid, dra.pid)
        finally:
            for proc in self.procs:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
            for proc in self.procs:
                await proc.wait()
            await self.kubelet.stop()
            shutil.rmtree(self.base, ignore_errors=True)
            shutil.rmtree(self.labs, ignore_errors=True)

    async def calls(self) -> None:
        view = self.kubelet.resource(RESOURCE)
        assert view is not None
        ids = sorted(view.devices)
        slice_file = self.base / "api" / "resourceslices" / f"{DRIVER}-{NODE}.json"
        for _ in range(200):
            if slice_file.exists():
                break
            await asyncio.sleep(0.05)
        names = [device["name"] for device in json.loads(slice_file.read_text())["spec"]["devices"]]
        dra_socket = str(self.base / "plugins" / DRIVER / "dra.sock")
        fast_socket = str(self.base / "plugins" / "fast.gpu.plugvisor.io" / "dra.sock")
        figures: dict[str, list[float]] = {}
        async with (
            grpc.aio.insecure_channel(f"unix:{view.endpoint}") as dp_channel,
            grpc.aio.insecure_channel(f"unix:{dra_socket}") as dra_channel,
            grpc.aio.insecure_channel(f"unix:{fast_socket}") as fast_channel,
        ):
            allocate = dp_channel.unary_unary(
                "/v1beta1.DevicePlugin/Allocate",
                request_serializer=dp_pb2.AllocateRequest.SerializeToString,
                response_deserializer=dp_pb2.AllocateResponse.FromString,
            )
            prepare = {
                driver: channel.unary_unary(
                    PREPARE,
                    request_serializer=dra_pb2.NodePrepareResourcesRequest.SerializeToString,
                    response_deserializer=dra_pb2.NodePrepareResourcesResponse.FromString,
                )
                for driver, channel in ((DRIVER, dra_channel), ("fast.gpu.plugvisor.io", fast_channel))
            }
            unprepare = dra_channel.unary_unary(
                UNPREPARE,
                request_serializer=dra_pb2.NodeUnprepareResourcesRequest.SerializeToString,
                response_deserializer=dra_pb2.NodeUnprepareResourcesResponse.FromString,
            )
            for _ in range(self.rounds):
                for count in (1, 8):
                    request = dp_pb2.AllocateRequest(
                        container_requests=[dp_pb2.ContainerAllocateRequest(devices_ids=ids[:count])]
                    )
                    started = time.perf_counter()
                    await allocate(request, timeout=30)
                    figures.setdefault(f"Allocate, {count}", []).append(
                        (time.perf_counter() - started) * 1000
                    )
                    for driver, label in (
                        (DRIVER, "prepare"),
                        ("fast.gpu.plugvisor.io", "prepare, no fsync"),
                    ):
                        claim = self.claim(driver, names[:count])
                        started = time.perf_counter()
                        answer = await prepare[driver](
                            dra_pb2.NodePrepareResourcesRequest(claims=[claim]), timeout=30
                        )
                        elapsed = (time.perf_counter() - started) * 1000
                        assert not answer.claims[claim.uid].error, answer.claims[claim.uid].error
                        figures.setdefault(f"{label}, {count}", []).append(elapsed)
                        if driver == DRIVER:
                            started = time.perf_counter()
                            await unprepare(dra_pb2.NodeUnprepareResourcesRequest(claims=[claim]), timeout=30)
                            figures.setdefault(f"unprepare, {count}", []).append(
                                (time.perf_counter() - started) * 1000
                            )
                        else:
                            await prepare_cleanup(fast_channel, claim)
        for count in (1, 8):
            floor = figures[f"Allocate, {count}"]
            line(f"device plugin: Allocate of {count} GPU(s) (repeated request)", floor)
            line(
                f"DRA: claim of {count} allocated -> prepared (CDI spec written)",
                figures[f"prepare, {count}"],
                floor,
                "Allocate",
            )
            line("DRA: the same without fsync", figures[f"prepare, no fsync, {count}"], floor, "Allocate")
            line(f"DRA: unprepare of {count}", figures[f"unprepare, {count}"], floor, "Allocate")

    def memory(self, dp: int, dra: int) -> None:
        pss = node_pss([dp, dra])
        kernel = {pid: kernel_pss_kb(pid) for pid in (dp, dra)}
        if pss is None:
            print("node PSS needs root; kernel PSS only:")
        for label, pid in (("device plugin (gpu)", dp), ("DRA driver (gpu)", dra)):
            node = "" if pss is None else f"node PSS {pss[pid] / 1024:.1f} MB, "
            print(f"{label:<22} {node}kernel PSS {kernel[pid] / 1024:.1f} MB (pid {pid})")
        if pss is not None:
            print(f"DRA driver / device plugin, node PSS: {pss[dra] / pss[dp]:.2f}x")


async def appears(path: Path, since: float, timeout: float = 60.0) -> float:
    """Milliseconds from ``since`` until ``path`` exists, looking every 2 ms (a file sends no event)."""
    deadline = since + timeout
    while not path.exists():  # noqa: ASYNC240 - one stat every 2 ms, in the loop on purpose
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout} s")
        await asyncio.sleep(0.002)
    return (time.perf_counter() - since) * 1000


async def prepare_cleanup(channel: grpc.aio.Channel, claim: dra_pb2.Claim) -> None:
    unprepare = channel.unary_unary(
        UNPREPARE,
        request_serializer=dra_pb2.NodeUnprepareResourcesRequest.SerializeToString,
        response_deserializer=dra_pb2.NodeUnprepareResourcesResponse.FromString,
    )
    await unprepare(dra_pb2.NodeUnprepareResourcesRequest(claims=[claim]), timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; {args.rounds} rounds")
    asyncio.run(Bench(args.rounds).run())


if __name__ == "__main__":
    main()
