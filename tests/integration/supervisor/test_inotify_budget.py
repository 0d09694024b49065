"""The inotify budget: one instance per process, and a clear error naming the sysctl when it is spent.

Linux counts inotify instances per user for all of the user's processes (128 by default), and every
engineer and daemon on this machine is root: a test must never spend the real budget. The tests that
run out do so in a user namespace of their own, whose limit (``user.max_inotify_instances``) only its
processes see.
"""

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import RUN, Agent, processes_of, running_registered


def inotify_instances(pid: int) -> int:
    """How many inotify instances process ``pid`` holds (its descriptors that are inotify ones)."""
    count = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if os.readlink(fd) == "anon_inode:inotify":
                count += 1
        except OSError:
            continue
    return count


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
    assert await agent.stop() == 0


def _can_limit_inotify_in_a_user_namespace() -> str | None:
    if shutil.which("unshare") is None:
        return "util-linux's unshare is not installed"
    probe = subprocess.run(
        ["unshare", "-U", "-r", "sh", "-c", "echo 1 > /proc/sys/user/max_inotify_instances"],
        capture_output=True,
        check=False,
    )
    return None if probe.returncode == 0 else f"no user namespace here: {probe.stderr.decode().strip()}"


NO_USER_NAMESPACE = _can_limit_inotify_in_a_user_namespace()


def with_inotify_limit(instances: int, *command: str) -> list[str]:
    """``command`` in a new user namespace that allows its processes ``instances`` inotify instances."""
    script = f'echo {instances} > /proc/sys/user/max_inotify_instances && exec "$@"'
    return ["unshare", "-U", "-r", "sh", "-c", script, "sh", *command]


@pytest.mark.skipif(NO_USER_NAMESPACE is not None, reason=str(NO_USER_NAMESPACE))
def test_a_plugin_without_budget_exits_2_naming_the_sysctl(short_dir):
    result = subprocess.run(
        with_inotify_limit(
            0,
            sys.executable, "-m", "plugvisor", "plugin", "generic", "--path", "/dev/null",
            "--kubelet-dir", str(short_dir / "dp"),
        ),
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "too many inotify instances" in result.stderr
    assert "fs.inotify.max_user_instances" in result.stderr


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


@pytest.mark.skipif(NO_USER_NAMESPACE is not None, reason=str(NO_USER_NAMESPACE))
async def test_children_over_the_budget_say_so_and_the_others_serve(node, kubelet, agents):
    """Room for the agent and one plugin: that one registers; the two others exit 2 naming the sysctl."""
    node.write_config()
    agent = LimitedAgent(node)
    await agent.start()
    try:

        def one_serves_two_refused(children):
            exits = [c["last_exit"] for c in children.values() if c["last_exit"] is not None]
            registered = [c for c in children.values() if c["registered"]]
            return len(registered) == 1 and sum(e["cause"] == "config" for e in exits) >= 2

        await agent.wait_state(one_serves_two_refused, timeout=30)
        log = agent.log()
        assert "Traceback" not in log
        refusals = [line for line in log.splitlines() if "cannot_run" in line]
        assert refusals
        assert all("fs.inotify.max_user_instances" in line for line in refusals), refusals
    finally:
        assert await agent.stop() == 0
