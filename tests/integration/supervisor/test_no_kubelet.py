"""No kubelet yet: say once what is waited for, and show it in status; a kubeletDir typo: refused, named.

It used to look like a hang: the directory was created silently, every child stayed STARTING and
`plugvisor status` said "0/3 registered" with no reason; a standalone plugin logged nothing after
`serving`.
"""

import asyncio
import subprocess
import sys

import pytest

from plugvisor.emulators.kubelet import EmulatedKubelet

from .conftest import EXPECTED, registered_all, running_registered


def status_text(node) -> str:
    return subprocess.run(
        [sys.executable, "-m", "plugvisor", "status", "--runtime-dir", str(node.runtime_dir)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip


def all_waiting(children) -> bool:
    return len(children) == 3 and all(c["waiting"] for c in children.values())


async def test_the_agent_says_once_what_it_waits_for_and_status_shows_it(node, agents):
    (node.base / "kubelet").mkdir()  # a kubelet root: the kubelet makes device-plugins when it starts
    node.kubelet_dir = node.base / "kubelet" / "device-plugins"
    node.write_config()
    agent = await agents()
    await agent.wait_state(all_waiting, timeout=30)
    socket = node.kubelet_dir / "kubelet.sock"
    assert {c["waiting"] for c in agent.children().values()} == {f"a kubelet: {socket} does not exist"}
    log = agent.log()
    assert log.count("event='kubelet_dir_created'") == 1
    assert log.count("event='waiting_for_kubelet'") == 1
    text = await asyncio.to_thread(status_text, node)
    assert "0/3 resources registered" in text
    assert f"example.com/fuse: waiting for a kubelet: {socket} does not exist" in text

    async with EmulatedKubelet(node.kubelet_dir, write_view=False) as kubelet:
        await kubelet.wait_for(registered_all(EXPECTED), timeout=30)
        await agent.wait_state(running_registered, timeout=30)
        assert all(c["waiting"] is None for c in agent.children().values())
        assert "not registered:" not in await asyncio.to_thread(status_text, node)
        assert await agent.stop() == 0


async def test_a_standalone_plugin_says_what_it_waits_for(short_dir):
    kubelet_dir = short_dir / "dp"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "plugvisor", "plugin", "generic", "--resource", "example.com/null",
        "--path", "/dev/null", "--kubelet-dir", str(kubelet_dir),
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stderr is not None
    try:
        lines = []
        async with asyncio.timeout(30):
            while "event='waiting'" not in (line := (await proc.stderr.readline()).decode()):
                assert line, "".join(lines)
                lines.append(line)
        assert f"waiting_for='a kubelet: {kubelet_dir / 'kubelet.sock'} does not exist'" in line
        assert any("event='kubelet_dir_created'" in earlier for earlier in lines)
        async with EmulatedKubelet(kubelet_dir, write_view=False) as kubelet:
            await kubelet.wait_for(lambda k: k.resource("example.com/null") is not None, timeout=30)
    finally:
        proc.terminate()
        _, rest = await asyncio.wait_for(proc.communicate(), 15)
    assert rest.decode().count("event='waiting'") == 0  # once
    assert proc.returncode == 0


@pytest.mark.parametrize(
    ("kubelet_dir", "expected"),
    [
        ("kubelt/device-plugins", "does not exist, nor does"),
        ("device-plugin", "does not exist; did you mean"),
    ],
    ids=["missing-root", "near-miss"],
)
async def test_a_kubelet_dir_no_kubelet_would_make_is_refused_naming_it_and_not_created(
    node, agents, kubelet_dir, expected
):
    node.kubelet_dir = node.base / kubelet_dir
    node.write_config()
    agent = await agents()
    assert agent.proc is not None
    assert await asyncio.wait_for(agent.proc.wait(), 60) == 2
    log = agent.log()
    assert f"kubeletDir: {node.kubelet_dir}: {expected}" in log, log
    assert not node.kubelet_dir.exists() and not (node.base / "kubelt").exists()
