"""The agent runs a ``mode: dra`` resource as a real child: claims and slices as files (no API server).

The same scenario against a real kube-apiserver is in tests/integration/dra_kube/test_agent.py.
"""

from .dra_agent import file_world, make_lab, play


async def test_an_agents_dra_driver_registers_publishes_prepares_comes_back_and_goes_for_good(
    node, agents, tmp_path
):
    world = file_world(node.base / "api")
    await play(node, make_lab(tmp_path / "lab"), world, agents)
