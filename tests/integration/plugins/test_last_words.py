"""A plugin process that fails tells its agent why (ERROR=) before it exits: what status shows."""

import os
import socket
import subprocess
import sys

import pytest

from plugvisor.common import notify
from plugvisor.testing import short_socket_dir


@pytest.fixture
def agent_socket():
    with short_socket_dir() as directory:
        path = directory / "status.sock"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(str(path))
        sock.setblocking(False)
        yield path, sock
        sock.close()


def run_plugin(path, *args):
    env = {**os.environ, notify.STATUS_SOCKET_ENV: str(path)}
    argv = [sys.executable, "-m", "plugvisor", "plugin", *args]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)


def said(sock):
    fields = {}
    while True:
        try:
            fields.update(notify.decode(sock.recv(65536)))
        except BlockingIOError:
            return fields


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["generic", "--options-json", '{"paths": 5}'], "plugvisor plugin generic: invalid options"),
        (["generic", "--path", "/dev/null", "--kubelet-dir", "/dev/null/dp"], "--kubelet-dir: "),
        (["nosuchkind"], "unknown plugin kind"),
        (["gpu", "--mode", "dra", "--host-root", "/nonexistent"], "--host-root"),
    ],
    ids=["invalid-options", "kubelet-dir", "unknown-kind", "dra-host-root"],
)
def test_a_failing_plugin_says_why_on_its_agents_socket(agent_socket, args, expected):
    path, sock = agent_socket
    result = run_plugin(path, *args)
    assert result.returncode == 2, result.stderr
    error = said(sock).get("ERROR", "")
    assert expected in error, (error, result.stderr)
    assert "\n" not in error and len(error) < 400


def test_a_plugin_that_only_prints_its_help_says_nothing(agent_socket):
    path, sock = agent_socket
    assert run_plugin(path, "generic", "--help").returncode == 0
    assert "ERROR" not in said(sock)
