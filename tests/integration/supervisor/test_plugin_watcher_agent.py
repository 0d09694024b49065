"""The agent with a resource that registers through the plugin watcher (its socket in plugins_registry)."""

import os
import signal

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
