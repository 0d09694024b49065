"""Two agents on one kubelet directory (different runtime directories): the second takes every resource over.

The kubelet follows the newest registration and tells the older plugin nothing. The first agent must
notice, say so once per resource, show it (status, /readyz, systemd's STATUS=) and stand by without
fighting back; when the second agent stops, the first registers again. Either way round, on kubelets up
to 1.36 (any plugin's end zeroes the resource, kubernetes#121994) and from 1.37 (a second Register from a
connected socket refused, kubernetes#135437), the resources are served while one agent runs and gone once
none does.
"""

import asyncio
import contextlib
import os
import signal
import urllib.error
import urllib.request

import pytest

from plugvisor.emulators.kubelet import EmulatedKubelet

from .conftest import EXPECTED, Agent, Node, processes_of, registered_all, running_registered


@pytest.fixture(params=["1.35", "1.37"])
async def kubelet(node: Node, request: pytest.FixtureRequest):
    """The emulated kubelet of each generation (the conftest's, with its version)."""
    emulated = EmulatedKubelet(
        node.kubelet_dir, write_view=False, grace_period=30, dial_timeout=2, kubelet_version=request.param
    )
    await emulated.start()
    yield emulated
    await emulated.stop()


def none_left(kubelet: EmulatedKubelet) -> bool:
    """Every resource at allocatable 0 (its capacity kept for the grace period)."""
    return all((v := kubelet.resource(name)) is not None and v.allocatable == 0 for name in EXPECTED)


def never_refused(kubelet: EmulatedKubelet) -> None:
    refused = [r for r in kubelet.registrations if not r.accepted]
    assert not refused, refused  # 1.37: "device plugin already connected", and the plugin forgotten


def second_agent(node: Node) -> tuple[Agent, Node]:
    """An agent of its own on the same kubelet directory and host root (not started)."""
    other = Node(node.base / "second")
    other.kubelet_dir = node.kubelet_dir
    other.root = node.root
    other.write_config()
    return Agent(other), other


def kill_what_is_left(agent: Agent, node: Node) -> None:
    if agent.proc is not None and agent.proc.returncode is None:
        agent.proc.kill()
    for pid in processes_of(node):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def readyz(agent: Agent) -> tuple[int, str]:
    port = int(agent.log().split("url='http://127.0.0.1:")[1].split("/")[0])
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def taken_over(children) -> bool:
    return len(children) == 3 and all(
        c["taken_over_by"] and not c["registered"] and c["state"] == "RUNNING" for c in children.values()
    )


async def test_the_first_agent_notices_says_so_once_stands_by_and_comes_back(node, kubelet, agents):
    node.write_config(metrics={"listen": "127.0.0.1:0"}, supervisor={"registrationTimeout": 2})
    first = await agents()
    await first.wait_state(running_registered, timeout=30)
    first_pids = {name: c["pid"] for name, c in first.children().items()}

    second, other = second_agent(node)
    try:
        await second.start()
        await second.wait_state(running_registered, timeout=30)
        await first.wait_state(taken_over, timeout=30)
        second_sockets = {c["endpoint"] for c in second.children().values()}
        assert {c["taken_over_by"] for c in first.children().values()} == second_sockets
        status, text = await asyncio.to_thread(readyz, first)
        assert status == 503
        assert "taken over by plugvisor-" in text
        # Said once per resource; no restart of the first agent's children (registrationTimeout is 2 s, and
        # a restart would take the resources back: two agents would take them from each other for ever).
        await asyncio.sleep(3)  # longer than registrationTimeout: what must not happen has had its chance
        assert first.log().count("event='resource_taken_over'") == 3
        assert {name: c["pid"] for name, c in first.children().items()} == first_pids
        assert taken_over(first.children())
        assert registered_all(EXPECTED)(kubelet)  # the kubelet has the second agent's plugins

        assert await second.stop() == 0
        await first.wait_state(running_registered, timeout=30)
        await kubelet.wait_for(registered_all(EXPECTED), timeout=30)
        assert {name: c["pid"] for name, c in first.children().items()} == first_pids
        assert all(c["taken_over_by"] is None for c in first.children().values())
        status, _ = await asyncio.to_thread(readyz, first)
        assert status == 200
        never_refused(kubelet)
        assert await first.stop() == 0
        await kubelet.wait_for(none_left, what="allocatable 0 once no agent is left")
        never_refused(kubelet)
    finally:
        kill_what_is_left(second, other)


async def test_when_the_first_agent_stops_the_second_goes_on_serving(node, kubelet, agents):
    node.write_config()
    first = await agents()
    await first.wait_state(running_registered, timeout=30)
    second, other = second_agent(node)
    try:
        await second.start()
        await second.wait_state(running_registered, timeout=30)
        await first.wait_state(taken_over, timeout=30)
        assert await first.stop() == 0
        await kubelet.wait_for(registered_all(EXPECTED), timeout=30, what="the second agent's plugins serve")
        await second.wait_state(running_registered, timeout=30)
        never_refused(kubelet)
        assert await second.stop() == 0
        await kubelet.wait_for(none_left, what="allocatable 0 once no agent is left")
        never_refused(kubelet)
    finally:
        kill_what_is_left(second, other)
