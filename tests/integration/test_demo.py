"""`plugvisor demo`, the README's first command, plays the whole node story and leaves nothing behind."""

import re
import subprocess
import sys
from pathlib import Path


def leftovers() -> set[Path]:
    return {*Path("/tmp").glob("pvdemo-*"), *Path("/dev/shm").glob("pvdemo-*")}


def test_the_demo_tells_the_whole_story_and_cleans_up():
    before = leftovers()
    result = subprocess.run(
        [sys.executable, "-m", "plugvisor", "demo", "--no-live", "--pace", "0.01"],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    for pattern in (
        r"8 GPUs on 4 PCIe switches and 2 NUMA nodes",
        r"done: agent start -> every resource registered in [\d.]+ ms",
        r"pod trainer is Running: gpu\d \+ gpu\d \(both under PCIe switch sw\d\)",
        r"done: gpu\d unhealthy: allocatable 7",
        r"done: gpu\d healthy again: allocatable 8",
        r"done: gpu\d overheat -> in /metrics with its pod in [\d.]+ ms",
        r"/metrics: gpu\d junction 11\d °C \(critical 110\), pod default/trainer/train",
        r"gpu\d\s+│ \S+\s+│ healthy\s+│ default/trainer/train\s+│ edge \d+°C junction \d+°C",
        r"done: killed child -> registered again on a new socket",
        r"done: kubelet restart -> every resource registered again",
        r"done: 16 VFs advertised, no restart",
        r"plugvisor\.io/gpu\s+│ RUNNING .*│ 2 \(killed 1, kubelet-restart 1\)",
        r"cleaned up; bye",
    ):
        assert re.search(pattern, out), f"missing /{pattern}/ in:\n{out}"
    assert "Traceback" not in result.stderr, result.stderr
    assert leftovers() == before
    no_orphans = subprocess.run(
        ["pgrep", "-f", "pv-forkserver|pv:plugvisor.io"], capture_output=True, check=False
    )
    assert no_orphans.stdout == b"", no_orphans.stdout
