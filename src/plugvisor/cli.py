"""The ``plugvisor`` command: one entry point for the agent, single plugins, the emulators and the demo.

Exit codes are part of the interface: 0 success, 2 bad usage or invalid
configuration (the message names the file or option, the field and what was
expected), 1 anything else.
"""

# ruff: noqa: E402 - the first statements must run before the imports that follow them
from __future__ import annotations

import sys

from plugvisor.common import richless

richless.install()  # before anything imports structlog

if sys.argv[1:2] == ["run"]:
    # First of all: the agent must stop cleanly even when told to while it is still importing.
    from plugvisor.supervisor import signals

    signals.install()

import importlib
from typing import Any, Final, NamedTuple

import click

from plugvisor.common import extras
from plugvisor.common.exitcodes import EXIT_USAGE
from plugvisor.common.grpcenv import quiet_grpc_core

# Every command that loads grpc is imported lazily, after this.
quiet_grpc_core()


class LazyCommand(NamedTuple):
    """Where a subcommand lives, and its one-line summary for ``plugvisor --help``."""

    target: str
    """``module:attribute`` of the click command."""
    summary: str
    """The first paragraph of the command's docstring (a test keeps the two equal)."""


class LazyGroup(click.Group):
    """A command group whose subcommands are imported only when used.

    ``plugvisor run`` is the supervisor process, which must never load gRPC; the
    plugin, kubelet and demo commands do. Importing each command on demand keeps
    the supervisor's process (and every command's start-up) free of what it
    does not use. ``--help`` lists the commands from their summaries without
    importing any: importing all of them (gRPC, pydantic, the emulators) made it
    take 40x a bare interpreter's start-up.
    """

    def __init__(self, *args: Any, lazy: dict[str, LazyCommand], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lazy = lazy

    def list_commands(self, ctx: click.Context) -> list[str]:
        """Name every command, loaded or not."""
        return sorted({*super().list_commands(ctx), *self._lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        """Import the command's module now, on first use."""
        lazy = self._lazy.get(cmd_name)
        if lazy is None:
            return super().get_command(ctx, cmd_name)
        module_name, attr = lazy.target.split(":")
        try:
            module = importlib.import_module(module_name)
        except extras.MissingExtraError as error:
            # A node's install leaves the emulators out: one line saying which extra to install.
            click.echo(f"plugvisor {cmd_name}: {error}", err=True)
            ctx.exit(EXIT_USAGE)
        command = getattr(module, attr)
        if not isinstance(command, click.Command):
            raise TypeError(f"{lazy.target} is not a click command")
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """List the commands with their summaries, importing none of the lazy ones."""
        names = self.list_commands(ctx)
        if not names:
            return
        limit = formatter.width - 6 - max(len(name) for name in names)
        rows: list[tuple[str, str]] = []
        for name in names:
            lazy = self._lazy.get(name)
            if lazy is not None:
                # Shortened exactly as click shortens a loaded command's help.
                rows.append((name, click.Command(name, help=lazy.summary).get_short_help_str(limit)))
                continue
            command = super().get_command(ctx, name)
            if command is not None and not command.hidden:
                rows.append((name, command.get_short_help_str(limit)))
        with formatter.section("Commands"):
            formatter.write_dl(rows)


LAZY_COMMANDS: Final = {
    "plugin": LazyCommand(
        "plugvisor.plugins.entry:plugin_command",
        "Run one device plugin for one resource in this process (no configuration file needed).",
    ),
    "run": LazyCommand(
        "plugvisor.supervisor.cli:run_command",
        "Run the node agent: one supervised plugin process per configured resource.",
    ),
    "status": LazyCommand(
        "plugvisor.supervisor.cli:status_command",
        "Show each child (state, PID, uptime, restarts, last exit, devices) and who holds which device.",
    ),
    "export": LazyCommand(
        "plugvisor.supervisor.cli:export_group",
        "Write the agent's configuration in other process managers' formats.",
    ),
    "kubelet": LazyCommand(
        "plugvisor.emulators.kubelet.cli:kubelet_command",
        "Run an emulated kubelet (device plugins, DRA drivers' registration) on DIR (SIGHUP restarts it).",
    ),
    "lab": LazyCommand(
        "plugvisor.emulators.lab.cli:lab_group",
        "Emulated GPUs, FPGAs and SR-IOV NICs under a root directory, with faults and hot-plug.",
    ),
    "demo": LazyCommand(
        "plugvisor.demo:demo_command",
        "Run a whole emulated node: lab, kubelet, supervised plugins, faults, crashes, restarts.",
    ),
}


def _print_version(ctx: click.Context) -> None:
    """Print the version, read only now: the installed metadata would cost every start otherwise.

    A checkout that is not installed says ``0+unknown`` rather than failing.
    """
    import plugvisor

    click.echo(f"plugvisor, version {plugvisor.__version__}")
    ctx.exit()


@click.group(
    cls=LazyGroup,
    lazy=LAZY_COMMANDS,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110},
)
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=lambda ctx, _param, value: _print_version(ctx) if value else None,
    help="Show the version and exit.",
)
def main() -> None:
    """Kubernetes device plugins: node agent, framework, emulated kubelet and hardware lab."""
