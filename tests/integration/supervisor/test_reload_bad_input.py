"""SIGHUP with a file the agent cannot use: rejected with one line naming it, every child left running."""

import asyncio
import signal

import pytest
import yaml

from .conftest import EXPECTED, registered_all, start_registered


async def wait_for_log(agent, text: str, count: int) -> None:
    deadline = asyncio.get_running_loop().time() + 15
    while agent.log().count(text) < count:
        assert asyncio.get_running_loop().time() < deadline, agent.log()[-3000:]
        await asyncio.sleep(0.05)


async def wait_for_state(agent, check):
    """The first value of ``check(state['supervisor'])`` that holds (the state file follows the log)."""
    deadline = asyncio.get_running_loop().time() + 15
    while not (found := check((agent.state() or {}).get("supervisor", {}))):
        assert asyncio.get_running_loop().time() < deadline, agent.state()
        await asyncio.sleep(0.05)
    return found


@pytest.mark.parametrize(
    "breakage",
    [
        "a byte that is not UTF-8",
        "a repeated key",
        "a kubeletDir that cannot be created",
        "a missing hostRoot",
        "lists nested 1000 deep",
        "an integer of 5,000 digits",
        "a date that does not exist",
    ],
)
async def test_a_reload_the_node_cannot_run_keeps_the_running_configuration(node, kubelet, agents, breakage):
    # Registered in the kubelet's view too (its first ListAndWatch message comes a moment after
    # the child reports its registration), so that the check after the reload compares like with like.
    agent = await start_registered(node, kubelet, agents)
    pids = {name: child["pid"] for name, child in agent.children().items()}

    good = node.config_path.read_bytes()
    if breakage == "a byte that is not UTF-8":
        node.config_path.write_bytes(good.replace(b"/dev/fuse", b"/dev/f\xffuse"))
        expected = "is not UTF-8"
    elif (
        breakage == "lists nested 1000 deep"
    ):  # PyYAML's recursive composer: a RecursionError killed the agent
        node.config_path.write_bytes(good + b"extra: " + b"[" * 1000 + b"]" * 1000 + b"\n")
        expected = "nested more than 100 levels deep"
    elif breakage == "an integer of 5,000 digits":  # Python's int-str limit: a ValueError killed the agent
        node.config_path.write_bytes(good.replace(b"count: 4", b"count: " + b"9" * 5000))
        expected = "resources[0].count: line"
    elif breakage == "a date that does not exist":  # PyYAML's timestamp constructor: another ValueError
        node.config_path.write_bytes(good + b"extra: 2024-13-01\n")
        expected = "'2024-13-01' is not a valid timestamp (month must be in 1..12)"
    elif breakage == "a repeated key":
        node.config_path.write_bytes(good + b"hostRoot: /\n")
        expected = "duplicate key 'hostRoot'"
    else:
        document = yaml.safe_load(good)
        (node.base / "file").write_text("")
        if breakage == "a missing hostRoot":
            document["hostRoot"] = str(node.base / "typo")
            expected = "hostRoot: "
        else:
            document["kubeletDir"] = str(node.base / "file" / "dp")
            expected = "kubeletDir: "
        node.config_path.write_text(yaml.safe_dump(document))
    agent.send(signal.SIGHUP)
    await wait_for_log(agent, "reload_rejected", 1)
    assert expected in agent.log() and str(node.config_path) in agent.log()
    # plugvisor status (the state file) says so too, not only the log.
    rejected = await wait_for_state(agent, lambda supervisor: supervisor.get("reload_rejected"))
    assert expected in rejected["error"] and str(node.config_path) in rejected["error"]

    # Still the same processes, all registered; and a good file is taken again afterwards.
    assert {name: c["pid"] for name, c in agent.children().items()} == pids
    assert registered_all(EXPECTED)(kubelet)
    node.config_path.write_bytes(good)
    agent.send(signal.SIGHUP)
    await wait_for_log(agent, "reloaded", 1)
    assert {name: c["pid"] for name, c in agent.children().items()} == pids
    await wait_for_state(agent, lambda supervisor: supervisor.get("reload_rejected") is None)
    assert await agent.stop() == 0
