"""Two agents on one kubelet directory (different runtime directories): the second takes every resource over.

The kubelet follows the newest registration and tells the older plugin nothing. The first agent must
notice, say so once per resource, show it (status, /readyz, systemd's STATUS=) and stand by without
fighting back; when the second agent stops, the first registers again.
"""

import asyncio
import contextlib
import os
import signal
import urllib.error
import urllib.request

from .conftest import EXPECTED, Agent, Node, processes_of, registered_all, running_registered


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

    other = Node(node.base / "second")
    other.kubelet_dir = node.kubelet_dir
    other.root = node.root
    other.write_config()
    second = Agent(other)
    await second.start()
    try:
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
        assert await first.stop() == 0
    finally:
        if second.proc is not None and second.proc.returncode is None:
            second.proc.kill()
            await second.proc.wait()
        for pid in processes_of(other):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
