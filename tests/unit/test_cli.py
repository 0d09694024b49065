"""The top-level command: lazy subcommands keep the supervisor's process free of gRPC."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize("command", ["run", "status", "export", "lab"])
def test_commands_that_must_not_load_grpc_do_not(command):
    code = (
        "import sys, click\n"
        "from plugvisor.cli import main\n"
        f"main.get_command(click.Context(main), {command!r})\n"
        "assert 'grpc' not in sys.modules, sorted(m for m in sys.modules if 'grpc' in m)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_help_lists_every_command():
    out = subprocess.run(
        [sys.executable, "-m", "plugvisor", "--help"], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    for name in ("run", "status", "export", "plugin", "kubelet", "lab", "demo"):
        assert f"  {name} " in out


def test_an_unknown_command_is_a_usage_error():
    result = subprocess.run(
        [sys.executable, "-m", "plugvisor", "frobnicate"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "No such command 'frobnicate'" in result.stderr


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["demo", "--pace", "-1"], "--pace"),
        (["plugin", "gpu", "--pod-resources-interval", "0"], "--pod-resources-interval"),
        (["plugin", "gpu", "--telemetry-interval", "soon"], "--telemetry-interval"),
    ],
)
def test_bad_monitoring_and_pace_values_are_usage_errors_naming_the_option(argv, named):
    result = subprocess.run(
        [sys.executable, "-m", "plugvisor", *argv], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 2
    assert named in result.stderr
