"""`plugvisor demo`, the README's first command, runs the whole story and leaves nothing behind."""

import subprocess
import sys
from pathlib import Path


def test_the_demo_tells_the_whole_story_and_cleans_up():
    before = set(Path("/tmp").glob("pvdemo-*"))
    result = subprocess.run(
        [sys.executable, "-m", "plugvisor", "demo"], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    for line in (
        "both resources registered",
        "A pod asks for a serial adapter",
        "requested number of devices unavailable for demo.plugvisor.io/serial. Requested: 5, Available: 1",
        "kubelet sees ttyUSB2",
        "kubelet sees it gone",
        "every resource registered again",
        "the pod still holds ['ttyUSB0']",
        "cleaned up",
    ):
        assert line in out, f"missing {line!r} in:\n{out}"
    assert "Traceback" not in result.stderr, result.stderr
    assert set(Path("/tmp").glob("pvdemo-*")) == before
