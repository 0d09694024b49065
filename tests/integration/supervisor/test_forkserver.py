"""The fork server is a helper, not a point of failure: killing it takes no resource down.

Plugins are the supervisor's own children (it is a child subreaper and the fork
server forks through an intermediate that exits at once), so they outlive the fork
server, and the supervisor reaps them and knows how each one ended.
"""

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import plugvisor

from .conftest import EXPECTED, SERIAL, processes_of, registered_all, running_registered, start_registered


def fork_server_of(node) -> int:
    found = [
        pid for pid in processes_of(node) if Path(f"/proc/{pid}/comm").read_text().strip() == "pv-forkserver"
    ]
    assert len(found) == 1, found
    return found[0]


async def replaced_fork_server(node, old: int) -> int:
    for _ in range(15_000):  # generous: a loaded machine starts a python slowly
        found = [
            pid
            for pid in processes_of(node)
            if pid != old and Path(f"/proc/{pid}/comm").read_text().strip() == "pv-forkserver"
        ]
        if found:
            return found[0]
        await asyncio.sleep(0.002)
    raise AssertionError("no new fork server was started")


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


async def test_killing_the_fork_server_takes_no_resource_down(node, kubelet, agents):
    """SIGKILL of the fork server, three times: no deregistration, no new PID, no failure counted."""
    agent = await start_registered(node, kubelet, agents)
    before = agent.children()
    pids = {name: child["pid"] for name, child in before.items()}
    assert all(parent_of(pid) == agent.pid for pid in pids.values()), (
        "plugins must be the supervisor's children"
    )
    registrations = len(kubelet.registrations)
    endpoints = {name: kubelet.resource(name).endpoint for name in EXPECTED}
    server = fork_server_of(node)
    for _ in range(3):
        os.kill(server, signal.SIGKILL)
        for _ in range(25):  # watch for half a second: every resource stays registered throughout
            assert registered_all(EXPECTED)(kubelet)
            await asyncio.sleep(0.02)
        server = await replaced_fork_server(node, server)
    children = agent.children()
    assert {name: child["pid"] for name, child in children.items()} == pids
    assert all(child["restarts"] == 0 and child["failures"] == 0 for child in children.values())
    assert len(kubelet.registrations) == registrations
    assert {name: kubelet.resource(name).endpoint for name in EXPECTED} == endpoints
    assert "forkserver_lost" in agent.log()


async def test_after_the_fork_server_died_the_next_crash_is_still_restarted(node, kubelet, agents):
    """A new fork server is started for the next spawn: a killed child comes back, once."""
    agent = await start_registered(node, kubelet, agents)
    old_server = fork_server_of(node)
    os.kill(old_server, signal.SIGKILL)
    before = agent.children()
    endpoint = kubelet.resource(SERIAL).endpoint
    os.kill(before[SERIAL]["pid"], signal.SIGKILL)
    await kubelet.wait_for(
        lambda k: k.resource(SERIAL).registered and k.resource(SERIAL).endpoint != endpoint, timeout=20
    )
    await agent.wait_state(lambda c: running_registered(c) and c[SERIAL]["pid"] != before[SERIAL]["pid"])
    after = agent.children()
    assert after[SERIAL]["restarts_by_cause"] == {"killed": 1}
    assert fork_server_of(node) != old_server
    assert parent_of(after[SERIAL]["pid"]) == agent.pid
    assert await agent.stop() == 0


async def test_a_killed_childs_socket_is_removed_when_it_is_reaped(node, kubelet, agents):
    """SIGKILL leaves the socket file behind; the supervisor removes it, and only it."""
    agent = await start_registered(node, kubelet, agents)
    children = agent.children()
    socket_name = children[SERIAL]["endpoint"]
    others = {children[name]["endpoint"] for name in children if name != SERIAL}
    assert {socket_name, *others} == set(node.sockets())
    os.kill(children[SERIAL]["pid"], signal.SIGKILL)
    await agent.wait_state(lambda c: running_registered(c) and c[SERIAL]["pid"] != children[SERIAL]["pid"])
    assert socket_name not in node.sockets()
    assert others < set(node.sockets()), "the live children's sockets must stay"
    assert "dead_socket_removed" in agent.log()
    assert await agent.stop() == 0


async def test_a_hung_fork_server_is_replaced_and_leaves_no_stray_plugin(node, kubelet, agents):
    """SIGSTOP the fork server, kill a child: the spawn times out, a new helper forks it, no stray runs."""
    agent = await start_registered(node, kubelet, agents)
    hung = fork_server_of(node)
    os.kill(hung, signal.SIGSTOP)
    try:
        before = agent.children()
        os.kill(before[SERIAL]["pid"], signal.SIGKILL)
        await agent.wait_state(
            lambda c: running_registered(c) and c[SERIAL]["pid"] != before[SERIAL]["pid"], timeout=60
        )
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(hung, signal.SIGCONT)
    await kubelet.wait_for(registered_all(EXPECTED))
    assert "forkserver_hung" in agent.log()
    child = agent.children()[SERIAL]
    # The request was sent again to the new helper: no spawn failed, nothing was counted but the kill
    # (and that may be forgotten already: the child counts as up since its spawn was asked for).
    assert child["restarts_by_cause"] == {"killed": 1}, child
    assert child["failures"] <= 1, child
    await asyncio.sleep(0.5)  # a stray fork from the old helper would show up by now
    plugins = [pid for pid in processes_of(node) if Path(f"/proc/{pid}/comm").read_text().startswith("pv:")]
    assert sorted(plugins) == sorted(c["pid"] for c in agent.children().values())
    assert await agent.stop() == 0


async def test_a_fork_server_killed_before_it_is_ready_does_not_stall_spawning(node, kubelet, agents):
    """The replacement dies during its preload too: the one after it still gets the child forked."""
    agent = await start_registered(node, kubelet, agents)
    first = fork_server_of(node)
    os.kill(first, signal.SIGKILL)
    before = agent.children()
    os.kill(before[SERIAL]["pid"], signal.SIGKILL)
    second = await replaced_fork_server(node, first)
    os.kill(second, signal.SIGKILL)  # within its preload (hundreds of milliseconds)
    await agent.wait_state(
        lambda c: running_registered(c) and c[SERIAL]["pid"] != before[SERIAL]["pid"], timeout=60
    )
    assert await agent.stop() == 0


def installed_copy(node) -> Path:
    """plugvisor's files as an installation the test can upgrade in place: a copy, first on the path."""
    site = node.base / "site"
    source = Path(plugvisor.__file__).parent
    shutil.copytree(source, site / "plugvisor", ignore=shutil.ignore_patterns("__pycache__"))
    return site


def upgrade_in_place(site: Path) -> None:
    """The next release, installed over the running one: consistent with itself, not with the agent's memory.

    A module the agent has loaded gains a name that a module only plugins load (the
    plugin entry) now imports. A fresh interpreter loads both new files; a process
    forked from the agent has the old module already and cannot import the name.
    """
    old = site / "plugvisor" / "common" / "proctitle.py"
    old.write_text(old.read_text() + '\n\ndef next_release() -> None:\n    """New in the upgrade."""\n')
    entry = site / "plugvisor" / "plugins" / "entry.py"
    entry.write_text(entry.read_text() + "\nfrom plugvisor.common.proctitle import next_release  # noqa\n")


async def test_after_an_in_place_upgrade_children_are_restarted_by_exec_when_no_fork_server_can_start(
    node, kubelet, agents
):
    """plugvisor upgraded under the running agent, then its fork server dies: no new one can load the code.

    Killed children still come back (started by exec, which loads the new files
    whole), every time; the agent says once that the fork server is unavailable and
    that a restart brings it back, and `plugvisor status` shows it.
    """
    site = installed_copy(node)
    node.write_config()
    agent = await agents({"PYTHONPATH": str(site)})
    await agent.wait_state(running_registered)
    await kubelet.wait_for(registered_all(EXPECTED))
    upgrade_in_place(site)
    os.kill(fork_server_of(node), signal.SIGKILL)
    for _ in range(2):
        before = agent.children()[SERIAL]
        endpoint = kubelet.resource(SERIAL).endpoint
        os.kill(before["pid"], signal.SIGKILL)
        await agent.wait_state(
            lambda c, old=before["pid"]: running_registered(c) and c[SERIAL]["pid"] != old, timeout=60
        )
        await kubelet.wait_for(
            lambda k, old=endpoint: k.resource(SERIAL).registered and k.resource(SERIAL).endpoint != old,
            timeout=30,
        )
    await kubelet.wait_for(registered_all(EXPECTED))
    log = agent.log()
    assert log.count("event='forkserver_unavailable'") == 1, log[-3000:]
    assert "cannot import name \\'next_release\\'" in log, log[-3000:]
    assert "restart the agent" in log
    assert not [
        pid for pid in processes_of(node) if Path(f"/proc/{pid}/comm").read_text().strip() == "pv-forkserver"
    ], "the upgrade leaves no fork server running"
    assert parent_of(agent.children()[SERIAL]["pid"]) == agent.pid
    assert agent.children()[SERIAL]["restarts_by_cause"] == {"killed": 2}
    status = subprocess.run(
        [sys.executable, "-m", "plugvisor", "status", "--runtime-dir", str(node.runtime_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert "children are started by exec" in status.stdout, status.stdout + status.stderr
    assert "restart the agent" in status.stdout
    assert await agent.stop() == 0
