"""The agent with a resource that registers through the plugin watcher (its socket in plugins_registry)."""

import asyncio
import os
import signal
import subprocess

import pytest

from plugvisor.emulators.kubelet import EmulatedKubelet

from .conftest import FUSE


def registered(kubelet):
    view = kubelet.resource(FUSE)
    return view is not None and view.registered and view.allocatable == 4


def running_registered(children):
    return FUSE in children and children[FUSE]["state"] == "RUNNING" and children[FUSE]["registered"]


async def test_a_plugin_watcher_resource_stays_registered_and_a_killed_childs_socket_is_swept(node, agents):
    """Its socket is not in the kubelet's directory: that is no outdated registration (each one was taken
    for one, and the child restarted, forever); and a SIGKILLed child's socket there is removed."""
    node.kubelet_dir = node.base / "device-plugins"  # the kubelet's layout: plugins_registry beside it
    registry = node.base / "plugins_registry"
    node.write_config(
        resources=[
            {
                "name": FUSE,
                "kind": "generic",
                "paths": ["/dev/fuse"],
                "count": 4,
                "registration": "plugin-watcher",
            }
        ]
    )
    async with EmulatedKubelet(node.kubelet_dir) as kubelet:
        agent = await agents()
        await agent.wait_state(running_registered, timeout=30)
        await kubelet.wait_for(registered, timeout=30)
        child = agent.children()[FUSE]
        assert child["restarts"] == 0, agent.log()[-3000:]
        assert "registration_outdated" not in agent.log()
        (old_socket,) = registry.glob("plugvisor-*.sock")

        os.kill(child["pid"], signal.SIGKILL)
        await agent.wait_state(lambda c: running_registered(c) and c[FUSE]["pid"] != child["pid"], timeout=30)
        await kubelet.wait_for(registered, timeout=30)
        assert not old_socket.exists(), "the killed child's socket was left for the plugin watcher to dial"
        assert len(list(registry.glob("plugvisor-*.sock"))) == 1
        assert await agent.stop() == 0


def watcher_node(node):
    node.kubelet_dir = node.base / "device-plugins"  # the kubelet's layout: plugins_registry beside it
    resource = {"name": FUSE, "kind": "generic", "paths": ["/dev/fuse"], "count": 4}
    node.write_config(
        resources=[{**resource, "registration": "plugin-watcher"}],
        supervisor={"registrationTimeout": 3},
    )
    return node.base / "plugins_registry"


async def test_a_deleted_registry_socket_is_reported_and_served_afresh(node, agents):
    """The kubelet deregisters it: the child says so (status: unregistered, why) and serves a new one."""
    registry = watcher_node(node)
    async with EmulatedKubelet(node.kubelet_dir) as kubelet:
        agent = await agents()
        await agent.wait_state(running_registered, timeout=30)
        await kubelet.wait_for(registered, timeout=30)
        pid = agent.children()[FUSE]["pid"]
        (socket,) = registry.glob("plugvisor-*.sock")
        socket.unlink()
        await agent.wait_state(
            lambda c: running_registered(c) and c[FUSE]["registrations"] == 2 and c[FUSE]["pid"] == pid,
            timeout=30,
        )
        await kubelet.wait_for(registered, timeout=30)
        (fresh,) = registry.glob("plugvisor-*.sock")
        assert fresh != socket
        assert "event='registration_lost'" in agent.log()
        assert await agent.stop() == 0


async def test_a_child_that_cannot_register_again_is_restarted_after_registration_timeout(node, agents):
    """It used to look registered for ever; now the safety net applies (the plugin watcher is gone here)."""
    registry = watcher_node(node)
    async with EmulatedKubelet(node.kubelet_dir) as kubelet:
        agent = await agents()
        await agent.wait_state(running_registered, timeout=30)
        await kubelet._plugin_watcher.stop()  # the kubelet's plugin watcher stops dialling anything
        (socket,) = registry.glob("plugvisor-*.sock")
        socket.unlink()
        await agent.wait_state(lambda c: not c[FUSE]["registered"], timeout=30)
        assert "its socket" in agent.children()[FUSE]["unregistered_reason"]
        await agent.wait_state(lambda c: c[FUSE]["restarts_by_cause"].get("unregistered", 0) >= 1, timeout=30)
        assert await agent.stop() == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a read-only tmpfs needs root")
async def test_a_read_only_plugins_registry_refuses_the_agent_with_exit_2(node, agents):
    registry = watcher_node(node)
    registry.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro", "tmpfs", str(registry)], check=False).returncode:
        pytest.skip("this environment cannot mount tmpfs")
    try:
        agent = await agents()
        code = await asyncio.wait_for(agent.proc.wait(), 60)
    finally:
        subprocess.run(["umount", str(registry)], check=True)
    assert code == 2
    assert f"kubeletDir: {registry}: on a read-only filesystem" in agent.log()
    assert "Traceback" not in agent.log()
