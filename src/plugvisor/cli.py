"""The ``plugvisor`` command: one entry point for the agent, single plugins, the emulators and the demo.

Exit codes are part of the interface: 0 success, 2 bad usage or invalid
configuration (the message names the file or option, the field and what was
expected), 1 anything else.
"""

from __future__ import annotations

import os

# gRPC core prints info-level lines (a GOAWAY on every peer restart) to stderr, and reads this
# setting when it is first imported: so here, before anything below imports grpc. Our own
# structured log says what matters; an explicit GRPC_VERBOSITY in the environment still wins.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import importlib
import json
import sys
from pathlib import Path
from typing import Any, Final

import click
import pydantic
import yaml

from plugvisor import __version__
from plugvisor.api import constants
from plugvisor.deviceplugin.hostpaths import HostPaths
from plugvisor.deviceplugin.logs import configure_logging
from plugvisor.validation import describe

EXIT_USAGE: Final = 2

_LOG_OPTIONS: Final = [
    click.option(
        "--log-level",
        type=click.Choice(["debug", "info", "warning", "error"]),
        default="info",
        show_default=True,
        help="Least severe log level printed (to stderr).",
    ),
    click.option(
        "--log-format",
        type=click.Choice(["kv", "json"]),
        default="kv",
        show_default=True,
        help="One line per event, key=value or JSON.",
    ),
]


def log_options(func: Any) -> Any:
    """Add the shared --log-level/--log-format options to a command."""
    for option in reversed(_LOG_OPTIONS):
        func = option(func)
    return func


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


def _load_options_file(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise click.BadParameter(f"cannot read {path}: {exc.strerror}", param_hint="--options-file") from exc
    except yaml.YAMLError as exc:
        raise click.BadParameter(f"{path} is not valid YAML: {exc}", param_hint="--options-file") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise click.BadParameter(
            f"{path} must hold a mapping of the kind's keys, not {type(data).__name__}",
            param_hint="--options-file",
        )
    return data


def _parse_options_json(text: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not valid JSON: {exc}", param_hint="--options-json") from exc
    if not isinstance(data, dict):
        raise click.BadParameter(
            f"must be a JSON object of the kind's keys, not {type(data).__name__}",
            param_hint="--options-json",
        )
    return data


@main.command("plugin")
@click.argument("kind")
@click.option(
    "--resource", help="Extended resource name, e.g. example.com/fuse [default: plugvisor.io/<KIND>]."
)
@click.option(
    "--host-root",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("/"),
    show_default=True,
    help="Where sys/, dev/ and proc/ are read (an emulated lab root in emulation).",
)
@click.option(
    "--kubelet-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path(constants.DEVICE_PLUGIN_PATH),
    show_default=True,
    help="The kubelet's device-plugins directory (holds kubelet.sock).",
)
@click.option(
    "--spec-root",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Prefix of host paths handed to the kubelet [default: --host-root]; '/' when the host is mounted.",
)
@click.option(
    "--path", "paths", multiple=True, help="generic: a path or glob under the host root (repeatable)."
)
@click.option(
    "--count", type=click.IntRange(min=1), help="generic: how many times each device is handed out."
)
@click.option(
    "--options-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="YAML mapping of the kind's configuration keys (as in a resources entry).",
)
@click.option(
    "--options-json",
    help="The kind's configuration keys as one JSON object (how the supervisor hands a child its entry).",
)
@click.option(
    "--on-kubelet-restart",
    type=click.Choice(["reregister", "exit"]),
    default="reregister",
    show_default=True,
    help="reregister: serve a fresh socket and register again in process; exit: exit with status 3 "
    "so that a supervisor restarts the process.",
)
@click.option(
    "--rescan-interval",
    type=click.FloatRange(min=0.05),
    default=30.0,
    show_default=True,
    help="Seconds between safety-net rescans (changes under watched paths trigger one at once).",
)
@click.option(
    "--metrics-listen",
    metavar="HOST:PORT",
    help="Serve this plugin's Prometheus metrics (the supervisor serves them for its children instead).",
)
@log_options
def plugin_command(
    *,
    kind: str,
    resource: str | None,
    host_root: Path,
    kubelet_dir: Path,
    spec_root: Path | None,
    paths: tuple[str, ...],
    count: int | None,
    options_file: Path | None,
    options_json: str | None,
    on_kubelet_restart: str,
    rescan_interval: float,
    metrics_listen: str | None,
    log_level: str,
    log_format: str,
) -> None:
    """Run one device plugin for one resource in this process (no configuration file needed).

    When PLUGVISOR_STATUS_SOCKET names a unix datagram socket, the plugin reports its
    registrations and device counts there in sd_notify format (see plugvisor.deviceplugin.status).
    """
    from plugvisor.deviceplugin.errors import ConfigurationError
    from plugvisor.deviceplugin.runtime import PluginConfig, run_plugin
    from plugvisor.plugins.kinds import UnknownKindError, get_kind

    configure_logging(level=log_level, fmt="json" if log_format == "json" else "kv")
    try:
        plugin_kind = get_kind(kind)
    except UnknownKindError as exc:
        raise click.BadParameter(str(exc), param_hint="KIND") from exc
    if options_file and options_json:
        raise click.UsageError("give --options-file or --options-json, not both")
    raw: dict[str, Any] = _load_options_file(options_file) if options_file else {}
    if options_json is not None:
        raw = _parse_options_json(options_json)
    if paths or count is not None:
        if kind != "generic":
            raise click.UsageError("--path and --count apply to the generic kind only; use --options-file")
        if paths:
            raw["paths"] = list(paths)
        if count is not None:
            raw["count"] = count
    source_name = (
        str(options_file) if options_file else "--options-json" if options_json else "command-line options"
    )
    try:
        options = plugin_kind.options_model.model_validate(raw)
    except pydantic.ValidationError as exc:
        click.echo(f"plugvisor plugin {kind}: invalid options\n{describe(exc, source=source_name)}", err=True)
        sys.exit(EXIT_USAGE)
    resource_name = resource or f"plugvisor.io/{kind}"
    host = HostPaths(root=host_root.absolute(), kubelet_dir=kubelet_dir.absolute(), spec_root=spec_root)
    try:
        config = PluginConfig(
            resource_name,
            host,
            rescan_interval=rescan_interval,
            on_kubelet_restart="exit" if on_kubelet_restart == "exit" else "reregister",
        )
        source = plugin_kind.build(options, host, resource=resource_name)
    except ConfigurationError as exc:
        click.echo(f"plugvisor plugin {kind}: {exc}", err=True)
        sys.exit(EXIT_USAGE)
    if metrics_listen:
        _serve_metrics(metrics_listen)
    sys.exit(run_plugin(config, source))


def _serve_metrics(listen: str) -> None:
    from prometheus_client import start_http_server

    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        raise click.BadParameter(f"{listen!r} is not HOST:PORT", param_hint="--metrics-listen")
    try:
        start_http_server(int(port), addr=host or "127.0.0.1")
    except OSError as exc:
        raise click.BadParameter(
            f"cannot listen on {listen}: {exc.strerror}", param_hint="--metrics-listen"
        ) from exc
