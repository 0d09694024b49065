"""The early fork server: what the cheap read of the file may conclude, and when the agent adopts it."""

import os
import subprocess
from pathlib import Path

import pytest

from plugvisor.common.notify import STATUS_SOCKET_ENV
from plugvisor.supervisor import prestart, status


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--config", "/etc/plugvisor/node.yaml"], "/etc/plugvisor/node.yaml"),
        (["--log-level", "debug", "--config=/n.yaml"], "/n.yaml"),
        (["--log-level", "debug"], None),
        (["--config"], None),
    ],
)
def test_the_file_is_found_in_runs_arguments_either_way_click_accepts_it(args, expected):
    found = prestart._config_path(args)
    assert (None if found is None else str(found)) == expected


def write(fs, text: str) -> Path:
    path = Path("/etc/plugvisor/node.yaml")
    fs.create_file(path, contents=text)
    return path


def test_the_cheap_read_finds_the_kinds_the_metrics_mode_and_the_runtime_directory(fs, monkeypatch):
    monkeypatch.delenv("PLUGVISOR_RUNTIME_DIR", raising=False)
    path = write(
        fs,
        "metrics: {}\nsupervisor: {runtimeDir: /run/pv}\nresources:\n"
        "  - {name: a.com/x, kind: nic}\n"
        "  - {name: a.com/y, kind: generic}\n"
        "  - {name: a.com/z, kind: nic}\n",
    )
    assert prestart._cheap_read(path) == (("generic", "nic"), True, Path("/run/pv"))


def test_without_a_runtime_directory_it_is_the_agents_default(fs, monkeypatch):
    path = write(fs, "resources: [{name: a.com/x, kind: generic}]\n")
    monkeypatch.setenv("PLUGVISOR_RUNTIME_DIR", "/run/elsewhere")
    assert prestart._cheap_read(path) == (("generic",), False, Path("/run/elsewhere"))
    monkeypatch.delenv("PLUGVISOR_RUNTIME_DIR")
    assert prestart._cheap_read(path) == (("generic",), False, Path("/run/plugvisor"))


@pytest.mark.parametrize(
    "text",
    [
        "resources: [{name: a.com/x, kind: generic}]\nsupervisor: {spawner: exec}\n",  # no fork server at all
        "- just\n- a list\n",
        "kubeletDir: /x\n",  # no resources
        "resources: [{name: a.com/x, kind: 3}]\n",  # validation will say what is wrong
        "resources: [{name: a.com/x}]\n",
    ],
)
def test_anything_unusual_starts_nothing_early(fs, text):
    assert prestart._cheap_read(write(fs, text)) is None


def test_a_fifo_or_a_device_is_not_read_so_the_start_cannot_block(tmp_path):
    fifo = tmp_path / "node.yaml"
    os.mkfifo(fifo)  # nobody writes: opened for reading without O_NONBLOCK, this would block forever
    assert prestart._cheap_read(fifo) is None
    assert prestart._cheap_read(Path("/dev/zero")) is None


def test_deep_nesting_starts_nothing_early_and_does_not_crash(fs):
    """PyYAML's C loader dies with SIGSEGV on a small file of brackets; the strict reader refuses it first."""
    path = write(fs, "resources: " + "[" * 100_000 + "]" * 100_000 + "\n")
    assert prestart._cheap_read(path) is None


def test_a_file_larger_than_the_reader_accepts_starts_nothing_early(fs):
    assert prestart._cheap_read(write(fs, "# " + "x" * (1 << 20) + "\nresources: []\n")) is None


def test_the_environment_has_the_status_socket_metrics_only_when_served_and_nothing_of_systemd():
    base = {"PATH": "/bin", prestart.MULTIPROC_ENV: "/stale", "NOTIFY_SOCKET": "/run/systemd/notify"}
    run = Path("/run/pv")
    assert prestart.child_env(base, runtime_dir=run, multiprocess_metrics=False) == {
        "PATH": "/bin",
        STATUS_SOCKET_ENV: "/run/pv/status.sock",
    }
    assert prestart.child_env(base, runtime_dir=run, multiprocess_metrics=True) == {
        "PATH": "/bin",
        STATUS_SOCKET_ENV: "/run/pv/status.sock",
        prestart.MULTIPROC_ENV: "/run/pv/prometheus",
    }
    assert (prestart._METRICS_DIR, prestart._REPORT_SOCKET) == (status.METRICS_DIR, status.REPORT_SOCKET)


class _Running(subprocess.Popen):
    def __init__(self, returncode=None):  # a stand-in: no process is started
        self.returncode = returncode

    def poll(self):
        return self.returncode


def test_an_early_fork_server_suits_only_what_it_was_started_for_and_while_it_runs():
    run = Path("/run/pv")
    early = prestart.Prestarted(_Running(), ("generic", "gpu"), False, run)
    assert early.suits(["generic", "gpu"], multiprocess_metrics=False, runtime_dir=run)
    assert not early.suits(["generic"], multiprocess_metrics=False, runtime_dir=run)
    assert not early.suits(["generic", "gpu"], multiprocess_metrics=True, runtime_dir=run)
    assert not early.suits(["generic", "gpu"], multiprocess_metrics=False, runtime_dir=Path("/run/other"))
    dead = prestart.Prestarted(_Running(-9), ("generic",), False, run)
    assert not dead.suits(["generic"], multiprocess_metrics=False, runtime_dir=run)
