"""The agent runs a ``mode: dra`` resource as a real child: claims and slices as files (no API server).

The same scenario against a real kube-apiserver is in tests/integration/dra_kube/test_agent.py.
"""

import signal

from .conftest import registered_all
from .dra_agent import DRIVER, file_world, make_lab, play


async def test_an_agents_dra_driver_registers_publishes_prepares_comes_back_and_goes_for_good(
    node, agents, tmp_path
):
    world = file_world(node.base / "api")
    await play(node, make_lab(tmp_path / "lab"), world, agents)


async def test_a_reload_that_brings_the_first_dra_entry_gives_the_fork_server_the_dra_side(
    node, kubelet, agents, tmp_path
):
    """The same kinds before and after: only the new ``mode: dra`` entry asks for another fork server."""
    lab_root = make_lab(tmp_path / "lab")
    gpu = {"name": "plugvisor.io/gpu", "kind": "gpu"}
    node.write_config([gpu], hostRoot=str(lab_root))
    agent = await agents(file_world(node.base / "api").env)
    await kubelet.wait_for(registered_all({"plugvisor.io/gpu": 8}), timeout=60)
    assert "forkserver_refreshed" not in agent.log()

    node.write_config([gpu, {"name": DRIVER, "kind": "gpu", "mode": "dra"}], hostRoot=str(lab_root))
    agent.send(signal.SIGHUP)
    await agent.wait_log("forkserver_refreshed")
    (refreshed,) = [line for line in agent.log().splitlines() if "forkserver_refreshed" in line]
    assert "dra=True" in refreshed and "kinds=['gpu']" in refreshed, refreshed
    await agent.wait_state(lambda c: DRIVER in c and c[DRIVER]["registered"], timeout=120)
    assert await agent.stop() == 0
