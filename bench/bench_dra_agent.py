"""The agent's DRA driver beside its device plugin: SIGKILL -> serving again, start -> slices, memory.

    python bench/bench_dra_agent.py [--kills 20] [--files] [--drivers N]

One agent (`python -m plugvisor run`, fork-server spawner) on a dgx-like lab serves the gpu kind twice:
as the device plugin `plugvisor.io/gpu` and as the DRA driver `gpu.plugvisor.io`, both registered with
the emulated kubelet (run in this process). The driver publishes to a real kube-apiserver, the minimal
one the integration tests launch (tests/integration/dra_kube/conftest.py, the binaries of
tools/kubernetes), so it loads the API client as on a cluster; `--files` keeps its objects as files
instead (`PLUGVISOR_DRA_OBJECTS_DIR`, no API client). `--drivers N` adds drivers of the same kind
(`gpu-2.gpu.plugvisor.io`...), to see what the fork server's sharing is worth per driver.

Printed:

- from the agent's start: the device plugin registered, the driver registered (the kubelet's view),
  and the driver's slice published (polled every 2 ms), with the slice's distance from the registration;
- per SIGKILL, alternating between the two children (each kill a first crash: the backoff resets):
  the device plugin registered again (the kubelet's view, the floor); the driver's new registration
  socket answering (a connect on the new inode, polled every 1 ms), then registered again; ratios to
  the floor in the same run;
- node PSS (bench/node_memory.py; root needed) of the agent, its fork server and each child.

Asserts nothing. Run it before and after a change on the same machine, the same hour: the ratios are
what to compare.
"""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import argparse
import asyncio
import contextlib
import json
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import yaml
from node_memory import kernel_pss_kb, node_pss

from plugvisor.emulators import lab
from plugvisor.emulators.kubelet import EmulatedKubelet

sys.path.insert(0, str(Path(__file__).parent))

DRIVER = "gpu.plugvisor.io"
RESOURCE = "plugvisor.io/gpu"
NODE = "bench-node"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def line(label: str, values: list[float], floor: list[float] | None = None) -> None:
    ratio = "" if floor is None else f"  {statistics.median(values) / statistics.median(floor):.2f}x floor"
    print(
        f"  {label:<58} p50 {statistics.median(values):7.1f} ms  p99 {pct(values, 0.99):7.1f} ms  "
        f"(n={len(values)}){ratio}"
    )


Sliced = Callable[[], Awaitable[bool]]
"""Whether the driver's slice is published now."""
World = Iterator[tuple[dict[str, str], Callable[[], Awaitable[Sliced]]]]
"""The driver's environment, and what makes the world ready (in the bench's loop) and gives its check."""


@contextlib.contextmanager
def api_world(base: Path) -> World:
    """A launched kube-apiserver, the driver reaching it through KUBECONFIG, the bench's Node made."""
    from bench_slices import launched_api_server
    from lightkube.resources.core_v1 import Node
    from lightkube.resources.resource_v1 import ResourceSlice

    from plugvisor.dra.kube.config import api_client

    with launched_api_server() as (launcher, server):

        async def prepare() -> Sliced:
            admin = api_client(server.config(launcher.ADMIN_TOKEN))
            node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}}
            await admin.create(Node.from_dict(node))

            async def sliced() -> bool:
                fields = {"spec.nodeName": NODE, "spec.driver": DRIVER}
                return bool([item async for item in admin.list(ResourceSlice, fields=fields)])

            return sliced

        yield {"KUBECONFIG": str(server.kubeconfig(launcher.ADMIN_TOKEN, base / "kubeconfig"))}, prepare


@contextlib.contextmanager
def file_world(base: Path) -> World:
    """The driver's objects as files (``PLUGVISOR_DRA_OBJECTS_DIR``)."""
    path = base / "api" / "resourceslices" / f"{DRIVER}-{NODE}.json"

    async def sliced() -> bool:
        return path.exists()

    async def prepare() -> Sliced:
        return sliced

    yield {"PLUGVISOR_DRA_OBJECTS_DIR": str(base / "api")}, prepare


class Bench:
    def __init__(self, base: Path, root: Path, env: dict[str, str], *, objects: bool, drivers: int) -> None:
        self.base = base
        self.runtime_dir = base / "run"
        self.kubelet = EmulatedKubelet(
            base / "device-plugins",
            objects_dir=base / "api" if objects else None,
            node_name=NODE,
            write_view=False,
            pod_resources=False,
            grace_period=30,
        )
        self.registration = self.kubelet.plugins_registry / f"{DRIVER}-reg.sock"
        self.env = env
        config = {
            "kubeletDir": str(base / "device-plugins"),
            "hostRoot": str(root),
            "nodeName": NODE,
            "supervisor": {"runtimeDir": str(self.runtime_dir), "restart": {"resetAfter": 0.2}},
            "resources": [
                {"name": RESOURCE, "kind": "gpu"},
                {"name": DRIVER, "kind": "gpu", "mode": "dra"},
                *({"name": f"gpu-{n}.{DRIVER}", "kind": "gpu", "mode": "dra"} for n in range(2, drivers + 1)),
            ],
        }
        self.resources = 1 + drivers
        (base / "node.yaml").write_text(yaml.safe_dump(config))

    def children(self) -> dict[str, dict]:
        try:
            state = json.loads((self.runtime_dir / "state.json").read_text())
        except (OSError, ValueError):
            return {}
        return {child["resource"]: child for child in state["children"]}

    async def settled(self) -> None:
        while True:
            children = self.children()
            up = [c["registered"] and c["state"] == "RUNNING" for c in children.values()]
            if len(up) == self.resources and all(up):
                return
            await asyncio.sleep(0.01)

    def registrations(self, resource: str) -> int:
        return sum(r.resource == resource and r.accepted for r in self.kubelet.registrations)

    async def start(self, sliced: Sliced) -> asyncio.subprocess.Process:
        began = time.perf_counter()
        agent = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "plugvisor",
            "run",
            "--config",
            str(self.base / "node.yaml"),
            stderr=asyncio.subprocess.DEVNULL,
            env={**os.environ, **self.env},
        )
        times: dict[str, float] = {}
        while len(times) < 3:
            now = (time.perf_counter() - began) * 1000
            view = self.kubelet.resource(RESOURCE)
            if "dp" not in times and view is not None and view.registered:
                times["dp"] = now
            if "dra" not in times and self.registrations(DRIVER):
                times["dra"] = now
            if "slice" not in times and await sliced():
                times["slice"] = now
            if now > 120_000:
                raise TimeoutError(f"the agent did not start within 120 s: {times}")
            await asyncio.sleep(0.002)
        print(
            f"agent start -> device plugin registered {times['dp']:.0f} ms, driver registered "
            f"{times['dra']:.0f} ms, driver's slice published {times['slice']:.0f} ms "
            f"({times['slice'] - times['dra']:+.0f} ms from its registration)"
        )
        return agent

    async def kill_plugin(self) -> float:
        child = self.children()[RESOURCE]
        view = self.kubelet.resource(RESOURCE)
        assert view is not None
        endpoint = view.endpoint
        began = time.perf_counter()
        os.kill(child["pid"], signal.SIGKILL)
        await self.kubelet.wait_for(
            lambda k: (v := k.resource(RESOURCE)) is not None and v.registered and v.endpoint != endpoint,
            timeout=60,
        )
        return (time.perf_counter() - began) * 1000

    async def kill_driver(self) -> tuple[float, float]:
        child = self.children()[DRIVER]
        before = self.registrations(DRIVER)
        old = _identity(self.registration)
        began = time.perf_counter()
        os.kill(child["pid"], signal.SIGKILL)
        while not await asyncio.to_thread(answers, self.registration, old):
            if time.perf_counter() - began > 60:
                raise TimeoutError("the driver's registration socket did not answer again within 60 s")
            await asyncio.sleep(0.001)
        answered = (time.perf_counter() - began) * 1000
        await self.kubelet.wait_for(lambda k: self.registrations(DRIVER) > before, timeout=60)
        return answered, (time.perf_counter() - began) * 1000

    def memory(self, agent: int) -> None:
        children = self.children()
        kids = {child["pid"]: f"{child['resource']} ({child['kind']})" for child in children.values()}
        helpers = [
            int(entry.name)
            for entry in Path("/proc").iterdir()
            if entry.name.isdigit() and _ppid(entry) == agent and int(entry.name) not in kids
        ]
        names = {agent: "agent", **dict.fromkeys(helpers, "fork server"), **kids}
        pss = node_pss(list(names))
        if pss is None:
            print("node PSS needs root; kernel PSS only:")
        for pid, name in names.items():
            node = "" if pss is None else f"node PSS {pss[pid] / 1024:6.1f} MB, "
            print(f"  {name:<28} {node}kernel PSS {kernel_pss_kb(pid) / 1024:6.1f} MB (pid {pid})")
        if pss is not None:
            print(f"  summed node PSS: {sum(pss.values()) / 1024:.1f} MB")

    async def run(self, prepare: Callable[[], Awaitable[Sliced]], kills: int) -> None:
        sliced = await prepare()
        await self.kubelet.start()
        agent = await self.start(sliced)
        try:
            await self.settled()
            self.memory(agent.pid)
            floor: list[float] = []
            answered: list[float] = []
            registered: list[float] = []
            for _ in range(kills):
                floor.append(await self.kill_plugin())
                await self.settled()
                await asyncio.sleep(0.21)  # every kill a first crash: the backoff resets
                socket_ms, registered_ms = await self.kill_driver()
                answered.append(socket_ms)
                registered.append(registered_ms)
                await self.settled()
                await asyncio.sleep(0.21)
            line("device plugin: SIGKILL -> registered again (floor)", floor)
            line("DRA driver: SIGKILL -> registration socket answers", answered, floor)
            line("DRA driver: SIGKILL -> registered again", registered, floor)
            self.memory(agent.pid)
        finally:
            agent.send_signal(signal.SIGTERM)
            await agent.wait()
            await self.kubelet.stop()


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        info = path.stat()
    except OSError:
        return None
    return info.st_ino, info.st_ctime_ns


def answers(path: Path, old: tuple[int, int] | None) -> bool:
    """Whether a new socket file (the killed process's may accept until its last thread is gone) answers."""
    identity = _identity(path)
    if identity is None or identity == old:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.connect(str(path))
    except OSError:
        return False
    return True


def _ppid(entry: Path) -> int:
    try:
        return int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--files", action="store_true", help="the driver's objects as files (no API client)")
    parser.add_argument("--drivers", type=int, default=1, help="DRA drivers beside the device plugin")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="/tmp/pvda-"))
    labs = Path(tempfile.mkdtemp(prefix="/dev/shm/pvda-" if Path("/dev/shm").is_dir() else "/tmp/pvda-"))
    try:
        lab.Lab.create(str(labs / "root"), "dgx-like")
        world = file_world if args.files else api_world
        with world(base) as (env, prepare):
            bench = Bench(base, labs / "root", env, objects=args.files, drivers=args.drivers)
            objects = "files" if args.files else "a kube-apiserver"
            print(f"the driver's objects: {objects}; load average {os.getloadavg()}")
            asyncio.run(bench.run(prepare, args.kills))
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(labs, ignore_errors=True)


if __name__ == "__main__":
    main()
