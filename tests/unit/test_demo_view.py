"""The demo's live view fits its terminal: an 80x24 one shows the node's resources and the story."""

import io
from types import SimpleNamespace

import pytest
from rich.console import Console
from rich.text import Text

from plugvisor.demo import Demo, Node

GPU = "plugvisor.io/gpu"


def demo_on(console, tmp_path):
    demo = Demo(Node(tmp_path, tmp_path / "lab"), console, keep=False)
    resources = {
        GPU: SimpleNamespace(capacity=8, allocatable=7, unhealthy_ids={"gpu-3"}),
        "plugvisor.io/nic-vf": SimpleNamespace(capacity=16, allocatable=16, unhealthy_ids=set()),
        "plugvisor.io/fpga": SimpleNamespace(capacity=2, allocatable=2, unhealthy_ids=set()),
        "example.com/fuse": SimpleNamespace(capacity=10, allocatable=10, unhealthy_ids=set()),
    }
    containers = [SimpleNamespace(devices={GPU: ("gpu-0", "gpu-1")})]
    demo.kubelet = SimpleNamespace(
        resources=resources, pods=[SimpleNamespace(name="trainer", phase="Running", containers=containers)]
    )
    children = {
        name: {"state": "RUNNING", "pid": 4242, "restarts": 1, "restarts_by_cause": {"signal": 1},
               "devices": {"healthy": 7, "total": 8}}
        for name in resources
    }  # fmt: skip
    demo._children = lambda: children
    demo._gpu_rows = lambda: [
        (f"gpu{i}", f"0000:{i:02x}:00.0", "healthy", "default/trainer/main", "edge 45°C junction 52°C", "-")
        for i in range(8)
    ]
    demo.log = [Text(f"{n}. a step of the story, with what it measured: 12.3 ms") for n in range(30)]
    return demo


@pytest.mark.parametrize(("width", "height"), [(80, 24), (100, 30), (200, 60)])
def test_the_view_fits_the_terminal_and_keeps_the_resources_and_the_latest_narration(tmp_path, width, height):
    console = Console(file=io.StringIO(), width=width, height=height, force_terminal=True)
    demo = demo_on(console, tmp_path)
    lines = console.render_lines(demo._view(), console.options, pad=False)
    text = ["".join(segment.text for segment in line) for line in lines]
    assert len(text) < height  # the live view's cursor line below it
    assert all(len(line) <= width for line in text)
    assert any(GPU in line and " 8 " in f" {line} " and " 7 " in f" {line} " for line in text), text
    assert any("29. a step" in line for line in text)  # the newest narration line


def test_a_tall_terminal_shows_every_table(tmp_path):
    console = Console(file=io.StringIO(), width=200, height=80, force_terminal=True)
    demo = demo_on(console, tmp_path)
    text = "\n".join(
        "".join(segment.text for segment in line)
        for line in console.render_lines(demo._view(), console.options, pad=False)
    )
    for title in ("node resources", "children", "GPUs", "pods"):
        assert title in text
