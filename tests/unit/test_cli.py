"""The top-level command: lazy subcommands keep the supervisor's process free of gRPC."""

import subprocess
import sys
from importlib.metadata import version

import click
import pytest

from plugvisor.cli import LAZY_COMMANDS, main


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


def test_help_imports_none_of_the_commands():
    """`plugvisor --help` lists the commands from their summaries: no gRPC, pydantic, logging or emulator."""
    code = (
        "import sys\n"
        "from plugvisor.cli import main\n"
        "try:\n"
        "    main(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = ('grpc', 'pydantic', 'plugvisor.supervisor', 'plugvisor.emulators', 'plugvisor.plugins',\n"
        "         'plugvisor.demo', 'importlib.metadata', 'rich', 'structlog')\n"
        "print(sorted(m for m in sys.modules if m.startswith(heavy)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.splitlines()[-1] == "[]"


@pytest.mark.parametrize("name", sorted(LAZY_COMMANDS))
def test_each_summary_in_help_is_the_commands_own(name):
    command = main.get_command(click.Context(main), name)
    assert command is not None
    assert command.get_short_help_str(limit=1000) == LAZY_COMMANDS[name].summary


def test_version_is_read_from_the_installed_metadata():
    out = subprocess.run(
        [sys.executable, "-m", "plugvisor", "--version"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    assert out.strip() == f"plugvisor, version {version('plugvisor')}"


def test_structlog_is_loaded_without_rich_and_rich_still_imports():
    """structlog's development renderer would import rich's traceback machinery into every process."""
    code = (
        "import sys\n"
        "import plugvisor.cli\n"  # what the plugvisor command and `python -m plugvisor` run first
        "import plugvisor.common.logs\n"
        "import structlog\n"
        "print('rich' in sys.modules)\n"
        "print(structlog.__loader__ is structlog.__spec__.loader, type(structlog.__loader__).__name__)\n"
        "print(any(type(finder).__module__ == 'plugvisor.common.richless' for finder in sys.meta_path))\n"
        "import rich.traceback\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    # rich stays out, structlog keeps its own loader, the hook is gone, and rich imports as usual afterwards.
    assert out.stdout.split() == ["False", "True", "SourceFileLoader", "False", "ok"]


def test_a_program_using_plugvisor_as_a_library_keeps_structlogs_rich_support():
    """Only plugvisor's own programs hide rich from structlog; importing the framework changes nothing."""
    code = (
        "import sys\n"
        "import plugvisor.deviceplugin, plugvisor.common.logs, plugvisor.testing\n"
        "import structlog.dev\n"
        "print(structlog.dev.rich is not None)\n"
        "print(any(type(finder).__module__ == 'plugvisor.common.richless' for finder in sys.meta_path))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.split() == ["True", "False"]


def test_structlog_imported_before_plugvisor_is_left_alone():
    code = (
        "import sys\n"
        "import structlog\n"
        "import plugvisor.cli\n"
        "print(any(type(finder).__module__ == 'plugvisor.common.richless' for finder in sys.meta_path))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.split() == ["False"]


def test_the_kubelets_help_says_what_it_does_for_dra_drivers():
    out = subprocess.run(
        [sys.executable, "-m", "plugvisor", "kubelet", "--help"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    flat = " ".join(out.split())
    assert "DRA drivers" in flat and "docs/dra.md" in flat
