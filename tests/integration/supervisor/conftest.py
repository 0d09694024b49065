"""Real agents against the emulated kubelet: fixtures that start them and leave nothing behind."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from plugvisor.emulators.kubelet import EmulatedKubelet

RUN = ("-m", "plugvisor", "run")
"""``plugvisor run``, as the installed command runs it (the module entry, not the click command alone)."""

NODE_ENV = "PLUGVISOR_TEST_NODE"
"""Given to each agent a test starts; every process it starts keeps it, forked or exec'd."""

FUSE = "example.com/fuse"
SERIAL = "example.com/serial"
DISK = "example.com/disk"


class Node:
    """One emulated node: a host root with device files, a kubelet dir, a runtime dir and a config file."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.root = base / "root"
        self.kubelet_dir = base / "dp"
        self.runtime_dir = base / "run"
        self.config_path = base / "node.yaml"
        self.agent_pids: set[int] = set()
        (self.root / "dev").mkdir(parents=True)
        for name in ("fuse", "ttyUSB0", "ttyUSB1", "sda"):
            (self.root / "dev" / name).touch()

    def resources(self) -> list[dict[str, Any]]:
        return [
            {"name": FUSE, "kind": "generic", "paths": ["/dev/fuse"], "count": 4},
            {"name": SERIAL, "kind": "generic", "paths": ["/dev/ttyUSB*"]},
            {"name": DISK, "kind": "generic", "paths": ["/dev/sda"]},
        ]

    def write_config(self, resources: list[dict[str, Any]] | None = None, **settings: Any) -> Path:
        supervisor = {"runtimeDir": str(self.runtime_dir), "stopTimeout": 3}
        supervisor.update(settings.pop("supervisor", {}))
        document = {
            "kubeletDir": str(self.kubelet_dir),
            "hostRoot": str(self.root),
            "supervisor": supervisor,
            "resources": self.resources() if resources is None else resources,
            **settings,
        }
        self.config_path.write_text(yaml.safe_dump(document))
        return self.config_path

    def sockets(self) -> list[str]:
        return sorted(p.name for p in self.kubelet_dir.glob("plugvisor-*.sock"))


def processes_of(node: Node) -> list[int]:
    """PIDs of every process the node's agents started (fork servers, children), not the agents themselves.

    Found by the variable :data:`NODE_ENV` in their environment block, which a forked
    process inherits from the agent and an exec'd one is given with the rest.
    """
    marker = f"{NODE_ENV}={node.base}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in (os.getpid(), *node.agent_pids):
            continue
        try:
            environ = (entry / "environ").read_bytes()
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if marker in environ.split(b"\0") and stat.rsplit(")", 1)[1].split()[0] != "Z":
            found.append(int(entry.name))
    return sorted(found)


class Agent:
    """``plugvisor run`` as a real process."""

    def __init__(self, node: Node, env: dict[str, str] | None = None) -> None:
        self.node = node
        self.env = {**os.environ, NODE_ENV: str(node.base), **(env or {})}
        self.proc: asyncio.subprocess.Process | None = None
        self.log_path = node.base / f"agent-{time.monotonic_ns()}.log"

    async def start(self) -> Agent:
        with self.log_path.open("wb") as log:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, *RUN, "--config", str(self.node.config_path), env=self.env, stderr=log
            )
        self.node.agent_pids.add(self.proc.pid)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def state(self) -> dict[str, Any] | None:
        try:
            return json.loads((self.node.runtime_dir / "state.json").read_text())
        except (OSError, ValueError):
            return None

    def children(self) -> dict[str, dict[str, Any]]:
        state = self.state()
        return {} if state is None else {child["resource"]: child for child in state["children"]}

    async def wait_state(
        self, predicate: Callable[[dict[str, dict[str, Any]]], bool], timeout: float = 15
    ) -> None:
        deadline = time.monotonic() + timeout
        while not predicate(self.children()):
            if self.proc is not None and self.proc.returncode is not None:
                raise AssertionError(f"the agent exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"state did not hold within {timeout}s: {self.children()}\n{self.log()[-3000:]}"
                )
            await asyncio.sleep(0.02)

    async def wait_log(self, event: str, timeout: float = 30) -> None:
        """Wait until the agent has logged ``event``."""
        deadline = time.monotonic() + timeout
        while f"event='{event}'" not in self.log():
            if time.monotonic() > deadline:
                raise AssertionError(f"no {event} logged within {timeout}s:\n{self.log()[-3000:]}")
            await asyncio.sleep(0.02)

    async def wait_catching(self, sig: int, timeout: float = 30) -> None:
        """Wait until the process has a handler for ``sig`` (its SigCgt mask says so)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                status = Path(f"/proc/{self.pid}/status").read_text()
            except OSError:
                status = ""
            masks = [line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")]
            caught = masks[0] if masks else "0"
            if int(caught, 16) & (1 << (sig - 1)):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"the agent never caught signal {sig}")
            await asyncio.sleep(0.001)

    def send(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    async def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> int:
        assert self.proc is not None
        if self.proc.returncode is None:
            self.proc.send_signal(sig)
        return await asyncio.wait_for(self.proc.wait(), timeout)


async def wait_gone(node: Node, timeout: float = 5.0) -> list[int]:
    """Wait until no process of ``node`` remains; returns those still there at the deadline."""
    deadline = time.monotonic() + timeout
    while (left := processes_of(node)) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return left


def registered_all(resources: dict[str, int]) -> Callable[[EmulatedKubelet], bool]:
    """Predicate: every resource is registered with a live endpoint and has the given allocatable count."""

    def check(kubelet: EmulatedKubelet) -> bool:
        for name, allocatable in resources.items():
            view = kubelet.resource(name)
            if view is None or not view.registered or view.allocatable != allocatable:
                return False
        return True

    return check


EXPECTED = {FUSE: 4, SERIAL: 2, DISK: 1}


def running_registered(children: dict[str, dict[str, Any]]) -> bool:
    """State predicate: the three default children are RUNNING and registered."""
    return len(children) == 3 and all(c["state"] == "RUNNING" and c["registered"] for c in children.values())


async def start_registered(node: Node, kubelet: EmulatedKubelet, agents: Callable[..., Any]) -> Agent:
    """The default node's agent, started, with every resource registered (its view and the kubelet's)."""
    node.write_config()
    agent: Agent = await agents()
    await agent.wait_state(running_registered)
    await kubelet.wait_for(registered_all(EXPECTED))
    return agent


@pytest.fixture
def node(short_dir: Path) -> Node:
    return Node(short_dir)


@pytest.fixture
async def kubelet(node: Node) -> AsyncIterator[EmulatedKubelet]:
    emulated = EmulatedKubelet(node.kubelet_dir, write_view=False, grace_period=30, dial_timeout=2)
    await emulated.start()
    yield emulated
    await emulated.stop()


@pytest.fixture
async def agents(node: Node) -> AsyncIterator[Callable[..., Any]]:
    """Start agents; at the end every process of the node is gone, killed if it must be (no orphans)."""
    started: list[Agent] = []

    async def start(env: dict[str, str] | None = None) -> Agent:
        agent = Agent(node, env)
        started.append(agent)
        return await agent.start()

    yield start
    for agent in started:
        if agent.proc is not None and agent.proc.returncode is None:
            agent.proc.kill()
            await agent.proc.wait()
    left = await wait_gone(node, timeout=5)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"processes outlived the test: {left}"
