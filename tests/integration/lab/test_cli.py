"""The ``plugvisor lab`` commands, their output and their exit codes."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time

import pytest
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


def test_a_reader_that_stops_early_is_no_error(root: str) -> None:
    """`plugvisor lab show ROOT | head -1`: the closed pipe ends the command quietly, as click does for the
    other commands, not with "Broken pipe" on stderr as if the lab had failed."""
    assert run("create", root, "--profile", "dgx-like")[0] == 0
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first write: every write meets EPIPE
    try:
        result = subprocess.run(
            [sys.executable, "-m", "plugvisor", "lab", "show", root],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        os.close(write_end)
    assert result.stderr == ""
    assert result.returncode == 1


def test_a_lab_on_a_read_only_file_system_is_said_to_be_so(root: str, monkeypatch) -> None:
    """A lab on a file system mounted read-only: the error says that, not that the lock is a symlink."""
    assert run("create", root)[0] == 0
    real_open = os.open

    def read_only(path, flags, *args, **kwargs):
        if str(path).endswith("/.plugvisor-lab/lock") and flags & (os.O_RDWR | os.O_WRONLY):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only)
    code, out = run("fault", root, "gpu0", "aer-fatal")
    assert code == 1
    assert ".plugvisor-lab/lock: Read-only file system" in out
    assert "symlink" not in out


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


def _damage(root: str, how: str) -> None:
    state = f"{root}/.plugvisor-lab/state.json"
    with open(state) as handle:
        data = json.load(handle)
    os.unlink(state)
    if how == "not-utf8":
        with open(state, "wb") as handle:
            handle.write(json.dumps(data).encode()[:100] + b"\xff\xfe" + json.dumps(data).encode()[100:])
        return
    if how == "directory":
        os.mkdir(state)
        return
    if how == "fifo":
        os.mkfifo(state)
        return
    if how == "symlink-to-device":
        os.symlink("/dev/zero", state)
        return
    if how == "list":
        data = [data]
    elif how == "empty-object":
        data = {}
    elif how == "unknown-model":
        data["devices"]["gpu0"]["model"] = "nvidia-b999"
    elif how == "unknown-kind":
        data["devices"]["gpu0"]["kind"] = "tpu"
    elif how == "numa-out-of-range":
        data["devices"]["gpu0"]["numa_node"] = 7
    elif how == "path-climbs-out":
        data["devices"]["gpu0"]["functions"][0]["path"] = "sys/devices/../../../../etc/0000:01:00.0"
    elif how == "netdev-climbs-out":
        data["devices"]["nic0"]["netdev"] = "../../../x"
    elif how == "dangling-parent":
        data["devices"]["nic0vf0"]["parent"] = "nic9"
    with open(state, "w") as handle:
        json.dump(data, handle)


@pytest.mark.parametrize(
    "how",
    [
        "not-utf8",
        "directory",
        "fifo",
        "symlink-to-device",
        "list",
        "empty-object",
        "unknown-model",
        "unknown-kind",
        "numa-out-of-range",
        "path-climbs-out",
        "netdev-climbs-out",
        "dangling-parent",
    ],
)
@pytest.mark.parametrize("command", [["show"], ["fault", "gpu0", "aer-fatal"], ["check"]])
def test_damaged_state_file_exits_2_naming_it(root: str, how: str, command: list[str]) -> None:
    """A state.json that is not UTF-8, not a file, or not the lab's shape: exit 2 naming it, no traceback."""
    assert run("create", root)[0] == 0
    _damage(root, how)
    result = CliRunner().invoke(lab_group, [command[0], root, *command[1:]])
    assert result.exit_code == 2, result.output
    assert f"{root}/.plugvisor-lab/state.json" in result.output
    assert isinstance(result.exception, SystemExit)


def test_without_a_compiler_the_missing_nvml_is_said_once_and_an_nvml_fault_warns_no_one_will_see_it(
    root: str,
) -> None:
    """No cc: the lab has no NVML stand-in; create says so once, and an xid fault (recorded) says that NVML
    events cannot reach anyone on this lab."""
    env = {**os.environ, "PATH": "/nonexistent"}
    command = [sys.executable, "-m", "plugvisor", "lab"]
    created = subprocess.run(
        [*command, "create", root, "--profile", "nvidia-h200-vm"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert created.returncode == 0
    assert created.stderr.count("no C compiler (cc)") == 1
    faulted = subprocess.run(
        [*command, "fault", root, "gpu0", "xid-79"], env=env, capture_output=True, text=True, check=False
    )
    assert faulted.returncode == 0 and "faults=xid-79" in faulted.stdout
    assert "no NVML stand-in" in faulted.stderr
