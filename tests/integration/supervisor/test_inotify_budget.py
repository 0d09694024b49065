"""The inotify budget: one instance per process, and polling, never a refusal, when it is spent.

The tests that run out do so in a user namespace of their own, whose limit only its processes see
(``tests/integration/inotify_budget.py``): the real budget is every root process's on this machine.
"""

import asyncio
import subprocess
import sys
import urllib.request

import pytest

from plugvisor.emulators.kubelet import EmulatedKubelet

from ..inotify_budget import NO_USER_NAMESPACE, inotify_instances, with_inotify_limit
from .conftest import EXPECTED, RUN, Agent, processes_of, registered_all, running_registered

needs_user_namespace = pytest.mark.skipif(NO_USER_NAMESPACE is not None, reason=str(NO_USER_NAMESPACE))


@pytest.mark.parametrize("spawner", ["forkserver", "exec"])
async def test_the_agent_and_each_plugin_hold_one_inotify_instance(node, kubelet, agents, spawner):
    """64 resources used to need 129 instances: two per plugin (kubelet dir, device paths)."""
    node.write_config(supervisor={"spawner": spawner})
    agent = await agents()
    await agent.wait_state(running_registered, timeout=30)
    children = {child["pid"] for child in agent.children().values()}
    counts = {pid: inotify_instances(pid) for pid in {agent.pid, *processes_of(node)}}
    assert {counts[pid] for pid in children} == {1}, counts
    assert counts[agent.pid] == 1
    assert sum(counts.values()) == 1 + len(children), counts  # the fork server holds none
    assert {child["watch"] for child in agent.children().values()} == {"inotify"}
    assert await agent.stop() == 0


@needs_user_namespace
async def test_a_plugin_without_inotify_registers_and_notices_kubelet_restarts_by_polling(short_dir):
    kubelet = EmulatedKubelet(short_dir / "dp", write_view=False, grace_period=30, dial_timeout=2)
    await kubelet.start()
    log_path = short_dir / "plugin.log"
    with log_path.open("wb") as log:
        plugin = await asyncio.create_subprocess_exec(
            *with_inotify_limit(
                0,
                sys.executable, "-m", "plugvisor", "plugin", "generic", "--resource", "example.com/null",
                "--path", "/dev/null", "--kubelet-dir", str(short_dir / "dp"),
            ),
            stderr=log,
        )  # fmt: skip
    try:
        await kubelet.wait_for(registered_all({"example.com/null": 1}), timeout=30)
        assert inotify_instances(plugin.pid) == 0
        for _ in range(2):
            generation = kubelet.generation
            await kubelet.restart()
            await kubelet.wait_for(
                lambda k, g=generation + 1: (
                    registered_all({"example.com/null": 1})(k) and k.registrations[-1].generation == g
                ),
                timeout=30,
            )
    finally:
        plugin.terminate()
        assert await plugin.wait() == 0
        await kubelet.stop()
    text = log_path.read_text()
    assert "Traceback" not in text
    said = [line for line in text.splitlines() if "watching_by_polling" in line]
    assert len(said) == 1, text
    assert "fs.inotify.max_user_instances" in said[0]
    assert "resource='example.com/null'" in said[0]  # which of many plugins polls


class LimitedAgent(Agent):
    """``plugvisor run`` in a user namespace allowing ``instances`` inotify instances to all its processes."""

    instances = 2

    async def start(self) -> Agent:
        command = with_inotify_limit(
            self.instances, sys.executable, *RUN, "--config", str(self.node.config_path)
        )
        with self.log_path.open("wb") as log:
            self.proc = await asyncio.create_subprocess_exec(*command, env=self.env, stderr=log)
        return self


def status_of(node) -> str:
    return subprocess.run(
        [sys.executable, "-c", "from plugvisor.supervisor.cli import status_command; status_command()",
         "--runtime-dir", str(node.runtime_dir)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip


@needs_user_namespace
async def test_children_over_the_budget_poll_register_and_show_it(node, kubelet, agents):
    """Room for the agent and one plugin: all three register; the two others poll, and say so."""
    node.write_config(metrics={"listen": "127.0.0.1:0"})
    agent = LimitedAgent(node)
    await agent.start()
    try:

        def all_registered_two_polling(children):
            watching = sorted(str(child["watch"]) for child in children.values())
            return running_registered(children) and watching == ["inotify", "polling", "polling"]

        await agent.wait_state(all_registered_two_polling, timeout=30)
        await kubelet.wait_for(registered_all(EXPECTED), timeout=30)
        polling = [c for c in agent.children().values() if c["watch"] == "polling"]
        assert all("fs.inotify.max_user_instances" in c["watch_reason"] for c in polling)
        # One stderr for all: each line that says a process polls names it.
        said = [line for line in agent.log().splitlines() if "watching_by_polling" in line]
        assert sorted(line.split("resource=")[1].split()[0] for line in said) == sorted(
            repr(c["resource"]) for c in polling
        ), said
        assert all(c["restarts"] == 0 for c in agent.children().values())
        rows = {line.split()[0]: line.split() for line in status_of(node).splitlines()[2:5]}
        assert sorted(row[-1] for row in rows.values()) == ["inotify", "polling", "polling"]
        assert "watching files by polling, not inotify" in status_of(node)
        port = int(agent.log().split("url='http://127.0.0.1:")[1].split("/")[0])

        def scrape() -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                return response.read().decode()

        metrics = await asyncio.to_thread(scrape)
        for child in agent.children().values():
            value = "1.0" if child["watch"] == "polling" else "0.0"
            assert f'plugvisor_watch_polling{{resource="{child["resource"]}"}} {value}' in metrics
        # The children that poll see the kubelet restart too (the default policy restarts them all).
        generation = kubelet.generation
        await kubelet.restart()
        await kubelet.wait_for(
            lambda k: (
                registered_all(EXPECTED)(k)
                and all(r.generation == generation + 1 for r in k.registrations[-3:])
            ),
            timeout=30,
        )
        await agent.wait_state(running_registered, timeout=30)
        # Polling or not, each was restarted for the kubelet restart, by the agent or by itself first,
        # and says so: never a bare "exit status 0", as if it had quit.
        shown = {
            "kubelet-restart (stopped by the agent)",
            "kubelet-restart (exited to register again (exit status 3))",
        }
        for child in agent.children().values():
            last = child["last_exit"]
            assert f"{last['cause']} ({last['status']})" in shown, child
        table = status_of(node)
        assert "exit status 0" not in table and table.count("kubelet-restart (") == 3, table
        log = agent.log()
        assert "Traceback" not in log
        assert "cannot_run" not in log
    finally:
        assert await agent.stop() == 0


class AgentWithoutInotify(LimitedAgent):
    instances = 0


@needs_user_namespace
async def test_without_any_inotify_each_polling_line_names_its_process_the_agents_too(node, kubelet, agents):
    node.write_config()
    agent = AgentWithoutInotify(node)
    await agent.start()
    try:
        await agent.wait_state(running_registered, timeout=30)
        await kubelet.wait_for(registered_all(EXPECTED), timeout=30)
        said = [line for line in agent.log().splitlines() if "watching_by_polling" in line]
        names = [line.split("resource=" if "resource=" in line else "process=")[1] for line in said]
        named = sorted(name.split()[0] for name in names)
        assert named == sorted(["'agent'", *(repr(resource) for resource in EXPECTED)]), said
    finally:
        assert await agent.stop() == 0
