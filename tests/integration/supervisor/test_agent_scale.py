"""`plugvisor run` with many resources and the largest options: all start, the fork server is never lost.

The number of plugins here is bounded by the machine's inotify budget (each plugin
holds its own instances, and the budget is shared by every user of the machine);
tests/integration/supervisor/test_forkserver_protocol.py drives the spawner itself
with the configuration's limit of 256 resources, and bench/bench_scale.py the whole
agent with as many as fit.
"""

import signal

import pytest

from .conftest import EXPECTED, registered_all, running_registered

LARGE_OPTION_PATHS = 5_300
"""``/dev/fuse`` this many times: ~62 KiB of options as JSON, close to the 64 KiB the configuration allows."""


def large(name: str) -> dict:
    """A valid ``generic`` entry whose options are nearly as large as allowed (one device, /dev/fuse)."""
    return {"name": name, "kind": "generic", "paths": ["/dev/fuse"] * LARGE_OPTION_PATHS}


def fork_server_trouble(log: str) -> list[str]:
    events = ("forkserver_unwritable", "forkserver_lost", "forkserver_hung")
    return [event for event in events if event in log]


@pytest.mark.parametrize("spawner", ["forkserver", "exec"])
async def test_resources_with_the_largest_options_all_register(node, kubelet, agents, spawner):
    """Three entries of ~60 KiB each: they used to overflow the fork server's pipe, and none started."""
    resources = [large(f"example.com/large{index}") for index in range(3)]
    node.write_config(resources, supervisor={"spawner": spawner})
    agent = await agents()
    await kubelet.wait_for(registered_all({entry["name"]: 1 for entry in resources}), timeout=60)
    assert fork_server_trouble(agent.log()) == []
    assert agent.log().count("event='forkserver_ready'") == (1 if spawner == "forkserver" else 0)
    assert await agent.stop() == 0


async def test_resources_added_by_sighup_all_start(node, kubelet, agents):
    """Nine resources of ~60 KiB options added to a running three by one SIGHUP: all twelve register."""
    node.write_config()
    agent = await agents()
    await agent.wait_state(running_registered)
    added = [large(f"example.com/added{index}") for index in range(9)]
    node.write_config(node.resources() + added)
    agent.send(signal.SIGHUP)
    await kubelet.wait_for(registered_all({**EXPECTED, **{entry["name"]: 1 for entry in added}}), timeout=90)
    await agent.wait_state(
        lambda children: len(children) == 12 and all(c["registered"] for c in children.values()), timeout=30
    )
    assert fork_server_trouble(agent.log()) == []
    assert agent.log().count("event='forkserver_ready'") == 1
    assert await agent.stop() == 0
