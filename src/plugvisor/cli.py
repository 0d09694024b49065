"""The ``plugvisor`` command: one entry point for the agent, single plugins, the emulators and the demo.

Exit codes are part of the interface: 0 success, 2 bad usage or invalid
configuration (the message names the file or option, the field and what was
expected), 1 anything else.
"""

from __future__ import annotations

import sys

if sys.argv[1:2] == ["run"]:
    # First of all: the agent must stop cleanly even when told to while it is still
    # importing, and its fork server starts importing now, beside it (see
    # plugvisor.supervisor.prestart, which imports nothing heavy).
    from plugvisor.supervisor import prestart

    prestart.begin(sys.argv[2:])

import importlib
from typing import Any, Final

import click

from plugvisor import __version__
from plugvisor.common.logs import quiet_grpc_core

# Every command that loads grpc is imported lazily, after this.
quiet_grpc_core()


class LazyGroup(click.Group):
    """A command group whose subcommands are imported only when used.

    ``plugvisor run`` is the supervisor process, which must never load gRPC; the
    plugin, kubelet and demo commands do. Importing each command on demand keeps
    the supervisor's process (and every command's start-up) free of what it
    does not use.
    """

    def __init__(self, *args: Any, lazy: dict[str, str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lazy = lazy

    def list_commands(self, ctx: click.Context) -> list[str]:
        """Name every command, loaded or not."""
        return sorted({*super().list_commands(ctx), *self._lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        """Import the command's module now, on first use."""
        target = self._lazy.get(cmd_name)
        if target is None:
            return super().get_command(ctx, cmd_name)
        module_name, attr = target.split(":")
        command = getattr(importlib.import_module(module_name), attr)
        if not isinstance(command, click.Command):
            raise TypeError(f"{target} is not a click command")
        return command


LAZY_COMMANDS: Final = {
    "plugin": "plugvisor.plugins.entry:plugin_command",
    "run": "plugvisor.supervisor.cli:run_command",
    "status": "plugvisor.supervisor.cli:status_command",
    "export": "plugvisor.supervisor.cli:export_group",
    "kubelet": "plugvisor.emulators.kubelet.cli:kubelet_command",
    "lab": "plugvisor.emulators.lab.cli:lab_group",
    "demo": "plugvisor.demo:demo_command",
}


@click.group(
    cls=LazyGroup,
    lazy=LAZY_COMMANDS,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110},
)
@click.version_option(__version__, prog_name="plugvisor")
def main() -> None:
    """Kubernetes device plugins: node agent, framework, emulated kubelet and hardware lab."""
