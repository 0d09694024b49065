"""The agent with a ``mode: dra`` resource, its driver a real child, against the emulated kubelet.

One scenario, two worlds: claims and slices as files (the driver's ``--objects-dir``, given to the
agent's children through the environment), or a real kube-apiserver (tests/integration/dra_kube).
A :class:`World` says how slices are read and claims allocated; everything else is the same agent,
the same kubelet and the same lab.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plugvisor.emulators import lab
from plugvisor.emulators.kubelet import EmulatedKubelet

from .conftest import Agent, Node

DRIVER = "gpu.plugvisor.io"
FUSE = "example.com/fuse"


@dataclass
class World:
    """Where the driver's claims and slices live, as the scenario needs to see them."""

    node_name: str
    env: dict[str, str]
    slice_devices: Callable[[], Awaitable[list[str]]]
    """The device names of this node's slices of the driver (empty when there are none)."""
    allocate: Callable[[str, list[str]], Awaitable[dict[str, Any]]]
    """Allocate a claim of this name to these devices (as the scheduler would); its ResourceClaim object."""
    objects_dir: Path | None = None
    """The emulated kubelet writes claims here (the file world only)."""
    extra: dict[str, Any] = field(default_factory=dict)


def write_config(node: Node, lab_root: Path, world: World, *, driver: bool = True) -> None:
    resources: list[dict[str, Any]] = [{"name": FUSE, "kind": "generic", "paths": ["/dev/fuse"]}]
    if driver:
        resources.insert(0, {"name": DRIVER, "kind": "gpu", "mode": "dra"})
    node.write_config(
        resources,
        hostRoot=str(lab_root),
        nodeName=world.node_name,
        metrics={"listen": "127.0.0.1:0"},
        monitoring={"podResourcesInterval": 0.3, "telemetryInterval": 0.3},
    )


def scrape(agent: Agent) -> str:
    port = int(agent.log().split("url='http://127.0.0.1:")[1].split("/")[0])
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


def series(text: str, name: str) -> dict[frozenset[tuple[str, str]], float]:
    found = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1 :].rsplit("} ", 1)
            found[frozenset(re.findall(r'(\w+)="([^"]*)"', labels))] = float(value)
    return found


async def eventually(check: Callable[[], Awaitable[bool]], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout} s")
        await asyncio.sleep(0.05)


def driver_registered(times: int) -> Callable[[EmulatedKubelet], bool]:
    return lambda k: sum(r.resource == DRIVER and r.accepted for r in k.registrations) >= times


def running_driver(children: dict[str, dict[str, Any]]) -> bool:
    child = children.get(DRIVER)
    return (
        child is not None
        and child["state"] == "RUNNING"
        and child["registered"]
        and child["slices"] == "synced"
        and child["devices"] == {"healthy": 8, "total": 8}
    )


async def play(
    node: Node, lab_root: Path, world: World, start_agent: Callable[..., Awaitable[Agent]]
) -> None:
    """Registered, slices published, a claim prepared, status and /metrics right, SIGKILL -> back, removal."""
    kubelet = EmulatedKubelet(
        node.kubelet_dir,
        objects_dir=world.objects_dir,
        node_name=world.node_name,
        write_view=False,
        pod_resources=False,
    )
    write_config(node, lab_root, world)
    async with kubelet:
        agent = await start_agent(world.env)
        await kubelet.wait_for(driver_registered(1), what="the driver registered", timeout=120)
        await agent.wait_state(running_driver, timeout=120)

        # The slices list every GPU, under the names claims use.
        names: list[str] = []

        async def eight() -> bool:
            names[:] = await world.slice_devices()
            return len(names) == 8

        await eventually(eight, "8 GPUs in the slices")

        # The agent's /metrics: the child as a DRA driver, its slices synced, its devices by pool name.
        async def metrics_right() -> bool:
            text = await asyncio.to_thread(scrape, agent)
            synced = series(text, "plugvisor_dra_slices_synced")
            info = series(text, "plugvisor_device_info")
            reported = {dict(labels)["device"] for labels in info if dict(labels)["resource"] == DRIVER}
            return synced.get(frozenset({("resource", DRIVER)})) == 1.0 and reported == set(names)

        await eventually(metrics_right, "the driver's series in /metrics")
        child_info = series(await asyncio.to_thread(scrape, agent), "plugvisor_child_info")
        assert any(
            dict(labels).get("resource") == DRIVER and ("mode", "dra") in labels for labels in child_info
        )

        # A claim for two GPUs, prepared through the kubelet: a CDI spec in the host's /var/run/cdi.
        claim = await world.allocate("gpus", names[:2])
        uid = claim["metadata"]["uid"]
        view = await kubelet.dra.prepare(claim)
        assert view.cdi_devices() == [f"k8s.{DRIVER}/claim={uid}-gpus"]
        spec = lab_root / "var/run/cdi" / f"k8s.{DRIVER}-claim_{uid}.json"
        assert spec.exists()

        # SIGKILL: the agent removes the dead sockets, starts the driver again, the kubelet registers it
        # again, and the new process unprepares what the killed one prepared.
        pid = agent.children()[DRIVER]["pid"]
        os.kill(pid, signal.SIGKILL)
        await agent.wait_state(
            lambda c: running_driver(c) and c[DRIVER]["pid"] != pid and c[DRIVER]["restarts"], timeout=120
        )
        await kubelet.wait_for(driver_registered(2), what="the driver registered again", timeout=120)
        swept = [line for line in agent.log().splitlines() if "dead_socket_removed" in line]
        assert any(f"{DRIVER}-reg.sock" in line for line in swept), agent.log()[-3000:]
        await kubelet.dra.unprepare(claim["metadata"]["namespace"], "gpus")
        assert not spec.exists()

        # Removed from node.yaml: the driver goes for good and takes its slices and sockets with it.
        write_config(node, lab_root, world, driver=False)
        agent.send(signal.SIGHUP)
        await agent.wait_state(lambda c: DRIVER not in c, timeout=60)

        async def withdrawn() -> bool:
            return await world.slice_devices() == []

        await eventually(withdrawn, "the slices withdrawn")
        assert not (kubelet.plugins_registry / f"{DRIVER}-reg.sock").exists()
        assert await agent.stop() == 0


def file_world(objects_dir: Path, node_name: str = "node-1") -> World:
    """Claims and slices as files, as ``--objects-dir`` keeps them (no API server)."""
    from plugvisor.emulators.kubelet.dra import resource_claim

    slice_file = objects_dir / "resourceslices" / f"{DRIVER}-{node_name}.json"

    async def slice_devices() -> list[str]:
        import json

        try:
            return [device["name"] for device in json.loads(slice_file.read_text())["spec"]["devices"]]
        except (OSError, ValueError):
            return []

    async def allocate(name: str, devices: list[str]) -> dict[str, Any]:
        return resource_claim("default", name, f"uid-{name}", [(name, DRIVER, node_name, d) for d in devices])

    from plugvisor.plugins.draentry import OBJECTS_DIR_ENV

    return World(node_name, {OBJECTS_DIR_ENV: str(objects_dir)}, slice_devices, allocate, objects_dir)


def make_lab(path: Path) -> Path:
    """A dgx-like lab (8 GPUs on two root complexes)."""
    lab.Lab.create(str(path), "dgx-like")
    return path
