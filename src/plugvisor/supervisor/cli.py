"""The supervisor's commands: ``plugvisor run``, ``plugvisor status``, ``plugvisor export supervisord``.

Wired into the ``plugvisor`` group by ``plugvisor.cli``; they live here, beside
the code they drive, and import nothing that loads gRPC. Exit codes follow the
product: 0 success, 2 invalid configuration or a state file that is not the
agent's (the message names the file and the field), 1 anything else (including
"no agent running" for ``status``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from plugvisor.common import proctitle
from plugvisor.common.exitcodes import EXIT_FAILURE, EXIT_USAGE
from plugvisor.common.logs import configure_logging, log_options
from plugvisor.supervisor import signals
from plugvisor.supervisor import status as status_
from plugvisor.supervisor.config import DEFAULT_RUNTIME_DIR, RUNTIME_DIR_ENV, ConfigError, load_config

_CONFIG = click.option(
    "--config",
    "config_path",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="The node configuration file (YAML).",
)


@click.command("run")
@_CONFIG
@log_options(scope="for the agent and its children")
def run_command(*, config_path: Path, log_level: str, log_format: str) -> None:
    """Run the node agent: one supervised plugin process per configured resource.

    SIGTERM or SIGINT stops every child and exits 0; SIGHUP reloads the file and
    restarts only the children whose configuration changed (an invalid file is
    rejected and the running set kept). Under systemd (Type=notify) readiness is
    announced once every resource is registered.
    """
    signals.install()  # before anything slow: a stop from now on is a clean stop
    # What ps and top show, whether started as `plugvisor run` or `python -m plugvisor run`.
    proctitle.set_name("plugvisor")
    proctitle.set_title(f"plugvisor agent --config {config_path}")
    # Imported when run: `plugvisor status` and `export` need neither the agent nor prometheus-client.
    from plugvisor.supervisor.agent import run_agent  # noqa: PLC0415

    configure_logging(level=log_level, fmt="json" if log_format == "json" else "kv")
    try:
        code = run_agent(config_path, log_format=log_format, log_level=log_level)
    except ConfigError as exc:
        click.echo(f"plugvisor run: invalid configuration\n{exc}", err=True)
        sys.exit(EXIT_USAGE)
    sys.exit(code)


@click.command("status")
@click.option("--json", "as_json", is_flag=True, help="Print the full state as JSON (for scripts).")
@click.option(
    "--runtime-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help=f"The agent's runtime directory [default: $PLUGVISOR_RUNTIME_DIR or {DEFAULT_RUNTIME_DIR}].",
)
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Find the runtime directory from this configuration file (supervisor.runtimeDir).",
)
def status_command(*, as_json: bool, runtime_dir: Path | None, config_path: Path | None) -> None:
    """Show each child (state, PID, uptime, restarts, last exit, devices) and who holds which device."""
    if runtime_dir is None and config_path is not None:
        try:
            runtime_dir = load_config(config_path).runtime_dir
        except ConfigError as exc:
            click.echo(f"plugvisor status: invalid configuration\n{exc}", err=True)
            sys.exit(EXIT_USAGE)
    if runtime_dir is None:
        runtime_dir = Path(os.environ.get(RUNTIME_DIR_ENV) or DEFAULT_RUNTIME_DIR)
    try:
        document = status_.read_state(runtime_dir)
    except status_.BadStateError as exc:
        click.echo(f"plugvisor status: {exc}", err=True)
        sys.exit(EXIT_USAGE)
    except status_.NoAgentError as exc:
        click.echo(f"plugvisor status: {exc}", err=True)
        sys.exit(EXIT_FAILURE)
    status_.attach_devices(document, runtime_dir)
    if as_json:
        click.echo(json.dumps(document, indent=2, sort_keys=True))
    else:
        click.echo(status_.render(document))


@click.group("export")
def export_group() -> None:
    """Write the agent's configuration in other process managers' formats."""


@export_group.command("supervisord")
@_CONFIG
@click.option(
    "--output",
    "-o",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write to this file instead of standard output.",
)
def export_supervisord_command(*, config_path: Path, output: Path | None) -> None:
    """Print supervisord [program:x] sections equivalent to `plugvisor run --config FILE`."""
    from plugvisor.supervisor.supervisord import export_supervisord  # noqa: PLC0415 - only this command needs it

    try:
        config = load_config(config_path)
    except ConfigError as exc:
        click.echo(f"plugvisor export supervisord: invalid configuration\n{exc}", err=True)
        sys.exit(EXIT_USAGE)
    text = export_supervisord(config, source=str(config_path))
    if output is None:
        click.echo(text, nl=False)
        return
    if output.is_symlink() or (output.exists() and not output.is_file()):
        # Root writing through a link someone planted at a /tmp name would overwrite the link's target;
        # renaming over a device or a FIFO (/dev/stdout) would replace a system file.
        what = "a symbolic link" if output.is_symlink() else "not a regular file"
        click.echo(
            f"plugvisor export supervisord: --output: {output} is {what}; expected a regular file's name "
            "(or no --output, for standard output)",
            err=True,
        )
        sys.exit(EXIT_USAGE)
    try:
        # O_NOFOLLOW too: a link planted between the check above and this open is refused, not followed.
        fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
    except OSError as exc:
        click.echo(f"plugvisor export supervisord: --output: cannot write {output}: {exc.strerror}", err=True)
        sys.exit(EXIT_FAILURE)
