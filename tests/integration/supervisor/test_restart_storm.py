"""A kubelet that restarts the instant each registration is answered never loses a plugin.

The worst timing a plugin meets: a crash-looping kubelet accepts a registration and,
with no pause, deletes every socket and listens again. Each of those restarts must
lead to exactly one more registration, with the same devices, both for a standalone
`plugvisor plugin` and for the children of `plugvisor run` (under either kubelet
restart policy: 1,000 rounds when the children re-register in process, 100 when
each round is a new process). The bound on the wait is generous; the count is what is asserted.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from plugvisor.emulators.kubelet.crashloop import CrashLoopingKubelet

from .conftest import Agent, Node

pytestmark = [pytest.mark.soak, pytest.mark.timeout(240)]

RESTARTS = int(os.environ.get("PLUGVISOR_STORM_RESTARTS", "1000"))
RESOURCE = "example.com/null"
NULLS = ("null-0", "null-1", "null-2", "null-3")


def assert_every_registration_complete(registrations, resource: str, devices: tuple[str, ...]) -> None:
    assert {r.resource for r in registrations} == {resource}
    assert {r.devices for r in registrations} == {devices}
    endpoints = [r.endpoint for r in registrations]
    assert len(set(endpoints)) == len(endpoints), "a registration reused a socket the kubelet had deleted"


async def test_a_standalone_plugin_registers_again_after_every_back_to_back_restart(short_dir: Path):
    kubelet_dir = short_dir / "dp"
    async with CrashLoopingKubelet(kubelet_dir, restarts=RESTARTS) as kubelet:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "plugvisor",
            "plugin",
            "generic",
            "--resource",
            RESOURCE,
            "--path",
            "/dev/null",
            "--count",
            "4",
            "--kubelet-dir",
            str(kubelet_dir),
            stderr=asyncio.subprocess.DEVNULL,
        )
        try:
            registrations = await kubelet.wait_for(RESTARTS + 1, timeout=150)
        finally:
            proc.terminate()
            assert await asyncio.wait_for(proc.wait(), 15) == 0
    assert kubelet.restarts_done == RESTARTS
    assert_every_registration_complete(registrations, RESOURCE, NULLS)


@pytest.mark.parametrize("policy", ["restart", "reregister"])
async def test_every_child_of_the_agent_registers_again_after_every_back_to_back_restart(
    short_dir: Path, policy: str
):
    node = Node(short_dir)
    node.write_config(
        resources=[{"name": RESOURCE, "kind": "generic", "paths": ["/dev/null"], "count": 4}],
        hostRoot="/",
        supervisor={"onKubeletRestart": policy},
    )
    # A restart under the "restart" policy is a new process (~90 ms here), under "reregister"
    # a new socket in the same process (~10 ms): fewer rounds keep the former's run bounded.
    restarts = RESTARTS if policy == "reregister" else max(1, RESTARTS // 10)
    agent = Agent(node)
    async with CrashLoopingKubelet(node.kubelet_dir, restarts=restarts) as kubelet:
        await agent.start()
        try:
            registrations = await kubelet.wait_for(restarts + 1, timeout=150)
            await agent.wait_state(lambda children: children[RESOURCE]["registered"], timeout=30)
        finally:
            code = await agent.stop()
        assert code == 0, agent.log()[-3000:]
    assert_every_registration_complete(registrations, RESOURCE, NULLS)
