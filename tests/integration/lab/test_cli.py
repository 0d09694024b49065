"""The ``plugvisor lab`` commands, their output and their exit codes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from click.testing import CliRunner

from plugvisor.emulators.lab.cli import lab_group


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(lab_group, list(args))
    return result.exit_code, result.output


def test_create_show_fault_heal(root: str) -> None:
    """The whole command surface works end to end, and show --json reports faults."""
    assert run("create", root, "--profile", "dgx-like")[0] == 0
    code, out = run("fault", root, "gpu3", "fallen-off-bus")
    assert (code, "fallen-off-bus" in out) == (0, True)
    data = json.loads(run("show", root, "--json")[1])
    gpu3 = next(d for d in data["devices"] if d["name"] == "gpu3")
    assert gpu3["faults"] == ["fallen-off-bus"]
    assert {"sw0", "sw1", "sw2", "sw3"} == {s["name"] for s in data["switches"]}
    assert run("heal", root, "gpu3")[0] == 0
    assert run("unplug", root, "nic1")[0] == 0
    assert "unplugged" in run("show", root)[1]
    assert run("plug", root, "nic1")[0] == 0
    assert run("vfs", root, "nic0", "0")[0] == 0
    assert run("check", root) == (0, "no problems found\n")


def test_exit_codes(root: str) -> None:
    """Bad usage and invalid profiles exit 2 naming the input; EBUSY and refusals exit 1."""
    bad = root + "-bad.yaml"
    os.makedirs(os.path.dirname(bad), exist_ok=True)
    with open(bad, "w") as handle:
        handle.write("name: bad\nnics:\n  - model: intel-e810\n    count: 1\n    numVfs: 999\n")
    code, out = run("create", root, "--profile", bad)
    assert code == 2
    assert bad in out and "nics[0].numVfs" in out
    assert not os.path.exists(root)
    assert run("create", root, "--profile", "no-such-profile")[0] == 2
    assert run("create", root)[0] == 0
    assert run("fault", root, "gpu9", "aer-fatal")[0] == 2
    code, out = run("vfs", root, "nic0", "2")
    assert (code, "write 0 first" in out) == (1, True)
    assert run("create", "/sys/plugvisor-test")[0] == 1
    assert run("show", os.path.dirname(root))[0] == 1


def test_watch_stops_on_sigterm(root: str) -> None:
    """`lab watch` applies a write made by someone else and exits 0 on SIGTERM."""
    assert run("create", root)[0] == 0
    code = "from plugvisor.emulators.lab.cli import lab_group; lab_group()"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "watch", root], stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stderr is not None
        line = ""
        while "watching sriov_numvfs" not in line:
            line = proc.stderr.readline()
            assert line, "watcher exited early"
        data = json.loads(run("show", root, "--json")[1])
        bdf = next(d["bdf"] for d in data["devices"] if d["name"] == "nic0")
        with open(f"{root}/sys/bus/pci/devices/{bdf}/sriov_numvfs", "w") as handle:
            handle.write("0")
        for _ in range(1000):
            if json.loads(run("show", root, "--json")[1])["devices"][-1]["name"] == "nic0":
                break
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert "1 writes applied" in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
