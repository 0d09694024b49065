"""One plugin process: ``plugvisor plugin KIND ...``, and what the agent's fork server runs in a child.

This is the whole of what a plugin process needs on top of the framework: the
command's options, the kind's options read from a file, JSON or flags, and
:func:`~plugvisor.deviceplugin.run_plugin`. The agent's fork server imports this
module (and nothing of the command-line group), parses each child's command line
with :func:`prepare` before it forks, and runs the result in the child;
``plugvisor plugin`` is the same command reached through the ``plugvisor`` group.

When ``PLUGVISOR_STATUS_SOCKET`` names a unix datagram socket, the plugin
reports its registrations and device counts there (:mod:`plugvisor.common.notify`).
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import click
import pydantic
import structlog

from plugvisor.common import constants, proctitle
from plugvisor.common.exitcodes import EXIT_FAILURE, EXIT_KUBELET_RESTARTED, EXIT_OK, EXIT_USAGE
from plugvisor.common.grpcenv import quiet_grpc_core
from plugvisor.common.hostpaths import (
    HostPaths,
    host_root_problem,
    kubelet_dir_problem,
    missing_kubelet_dir_problem,
)
from plugvisor.common.logs import configure_logging, last_error, log_options, note_error
from plugvisor.common.notify import StatusReporter
from plugvisor.common.sockets import live_instances
from plugvisor.common.validation import bounded, describe, huge_integer_problem, json_integer, shorten
from plugvisor.plugins.kinds import PluginKind, UnknownKindError, get_kind

# The framework's runtime (and so grpc) is imported when a plugin starts, after this.
quiet_grpc_core()

COMMAND = "plugin"
"""The first of a child's arguments: the agent hands a child ``plugin KIND --resource ...``."""
MULTIPROCESS_METRICS_ENV = "PROMETHEUS_MULTIPROC_DIR"
"""Set by the agent for its children: their metrics are aggregated by the agent's ``/metrics``."""


def _load_options_file(path: Path) -> dict[str, Any]:
    # Imported here: the agent hands its children their options as JSON, so only a
    # standalone plugin given --options-file needs a YAML parser.
    from plugvisor.common.yamlfile import YamlFileError, read_yaml

    try:
        data = read_yaml(path)
    except YamlFileError as exc:
        raise click.BadParameter(str(exc), param_hint="--options-file") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise click.BadParameter(
            f"{path} must hold a mapping of the kind's keys, not {type(data).__name__}",
            param_hint="--options-file",
        )
    return data


class _DuplicateKeyError(ValueError):
    """A JSON object names one key twice (``json`` keeps the last, silently)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook``: refuse a repeated key, as node.yaml's loader does (which count was meant?)."""
    data: dict[str, Any] = {}
    for key, value in pairs:
        if key in data:
            raise _DuplicateKeyError(f"duplicate key {shorten(key)!r}")
        data[key] = value
    return data


def _parse_options_json(text: str) -> dict[str, Any]:
    try:
        data = json.loads(text, parse_int=json_integer, object_pairs_hook=_unique_keys)
    except _DuplicateKeyError as exc:
        raise click.BadParameter(str(exc), param_hint="--options-json") from None
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not valid JSON: {exc}", param_hint="--options-json") from exc
    except RecursionError:
        raise click.BadParameter("nested too deeply to be options", param_hint="--options-json") from None
    problem = huge_integer_problem(data)
    if problem is not None:
        raise click.BadParameter(problem, param_hint="--options-json")
    if not isinstance(data, dict):
        raise click.BadParameter(
            f"must be a JSON object of the kind's keys, not {type(data).__name__}",
            param_hint="--options-json",
        )
    return data


def _finite(param: click.Parameter, value: float) -> float:
    """Refuse ``nan`` (click's ranges let it through: every comparison with it is false)."""
    if math.isnan(value):
        raise click.BadParameter("nan is not a number of seconds", param=param)
    return value


def kind_options(
    kind: str, options_file: Path | None, options_json: str | None, paths: Sequence[str], count: int | None
) -> tuple[dict[str, Any], str]:
    """The kind's raw keys from the command line, and where they came from (for the error message)."""
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
    return raw, source_name


class LastWordsCommand(click.Command):
    """A plugin command whose failure's reason goes to the agent too (:func:`tell_agent_why`).

    Every way a plugin process fails once its command line is parsed passes
    here (a usage error, options the kind refuses, ``cannot_run``, a bug), in
    both modes and for both spawners, so this is where its last words are said.
    """

    def invoke(self, ctx: click.Context) -> Any:
        """Run the command; on a failure, tell the agent why before the process exits."""
        try:
            return super().invoke(ctx)
        except click.exceptions.Exit:
            raise
        except click.ClickException as exc:
            tell_agent_why(exc.exit_code, exc.format_message())
            raise
        except SystemExit as exc:
            if isinstance(exc.code, int) or exc.code is None:
                tell_agent_why(exc.code)
            else:
                tell_agent_why(EXIT_FAILURE, str(exc.code))
            raise
        except Exception as exc:
            tell_agent_why(EXIT_FAILURE, f"{type(exc).__name__}: {exc}")
            raise


class _ModeDispatch(LastWordsCommand):
    """``plugvisor plugin``: a command line with ``--mode dra`` goes to the DRA driver's command (draentry).

    Dispatched before parsing, since the two modes take different options, for
    ``plugvisor plugin`` and for the agent's children alike.
    """

    def make_context(
        self, info_name: str | None, args: list[str], parent: click.Context | None = None, **extra: Any
    ) -> click.Context:
        """The DRA command's context when the arguments ask for it, else this command's."""
        if "dra" in args or "--mode=dra" in args:  # a device plugin never imports the DRA side
            from plugvisor.plugins import draentry

            if draentry.wants_dra(args):
                return draentry.dra_plugin_command.make_context(info_name, args, parent=parent, **extra)
        return super().make_context(info_name, args, parent=parent, **extra)

    def invoke(self, ctx: click.Context) -> Any:
        """Run the command the context was made for."""
        if ctx.command is not self:
            return ctx.command.invoke(ctx)
        return super().invoke(ctx)


def tell_agent_why(code: int | None, message: str | None = None) -> None:
    """Send the agent this process's last error (``ERROR=``) when it ends with a failure status.

    ``message``, else the latest error it logged or printed
    (:func:`~plugvisor.common.logs.last_error`). Sent before the process exits,
    so the agent (which reads its status socket before it handles exits) keeps
    it with the exit: ``plugvisor status`` and ``/readyz`` say why a resource
    loops, not only the log. Nothing is sent without an agent.
    """
    if code in (None, EXIT_OK, EXIT_KUBELET_RESTARTED):
        return
    why = message or last_error()
    if not why:
        return
    reporter = StatusReporter()
    try:
        reporter.send(ERROR=bounded(" ".join(why.split()), 300))
    finally:
        reporter.close()


def refuse(message: str) -> NoReturn:
    """Print ``message`` as the command's error and exit 2 (it is also the process's last error)."""
    click.echo(message, err=True)
    note_error(message)
    sys.exit(EXIT_USAGE)


@click.command("plugin", cls=_ModeDispatch)
@click.argument("kind")
@click.option(
    "--mode",
    type=click.Choice(["device-plugin", "dra"]),
    default="device-plugin",
    show_default=True,
    help="dra: serve the kind as a DRA driver instead; its options: plugvisor plugin KIND --mode dra --help.",
)
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
    "--registration",
    type=click.Choice(["kubelet-sock", "plugin-watcher"]),
    default="kubelet-sock",
    show_default=True,
    help="kubelet-sock: call Register on kubelet.sock (and re-register after kubelet restarts); "
    "plugin-watcher: serve in the kubelet's plugins_registry and let the kubelet dial back.",
)
@click.option(
    "--plugins-registry",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="The kubelet's plugins_registry directory [default: beside --kubelet-dir: its parent's "
    "plugins_registry when it is named device-plugins, else <DIR>.plugins_registry].",
)
@click.option(
    "--replace",
    is_flag=True,
    help="Take the resource over from another plugvisor plugin already serving it on this node (the agent's "
    "children do); without it, such a plugin makes this one exit 2 naming its socket.",
)
@click.option(
    "--rescan-interval",
    type=click.FloatRange(min=0.05, max=86400),
    callback=lambda _ctx, param, value: _finite(param, value),
    default=30.0,
    show_default=True,
    help="Seconds between safety-net rescans (changes under watched paths trigger one at once).",
)
@click.option(
    "--metrics-listen",
    metavar="HOST:PORT",
    help="Serve this plugin's Prometheus metrics, per-device ones included (the supervisor serves them "
    "for its children instead).",
)
@click.option(
    "--monitor-dir",
    type=click.Path(file_okay=False, path_type=Path),
    envvar=constants.MONITOR_DIR_ENV,
    help="Write device reports there and share one PodResources poller with the other plugins using it "
    "(how the agent runs its children) [env: PLUGVISOR_MONITOR_DIR].",
)
@click.option(
    "--pod-resources-socket",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar=constants.POD_RESOURCES_SOCKET_ENV,
    help="The kubelet's PodResources socket [default: pod-resources/kubelet.sock beside --kubelet-dir].",
)
@click.option(
    "--pod-resources-interval",
    type=click.FloatRange(min=0.1, max=3600),
    envvar=constants.POD_RESOURCES_INTERVAL_ENV,
    default=5.0,
    show_default=True,
    help="Seconds between PodResources List calls (who holds which device).",
)
@click.option(
    "--telemetry-interval",
    type=click.FloatRange(min=0.1, max=3600),
    envvar=constants.TELEMETRY_INTERVAL_ENV,
    default=10.0,
    show_default=True,
    help="Seconds between sysfs telemetry samples (AER, PCIe link, hwmon, network links).",
)
@log_options()
def plugin_command(
    *,
    kind: str,
    mode: str,
    resource: str | None,
    host_root: Path,
    kubelet_dir: Path,
    spec_root: Path | None,
    paths: tuple[str, ...],
    count: int | None,
    options_file: Path | None,
    options_json: str | None,
    on_kubelet_restart: str,
    registration: str,
    plugins_registry: Path | None,
    replace: bool,
    rescan_interval: float,
    metrics_listen: str | None,
    monitor_dir: Path | None,
    pod_resources_socket: Path | None,
    pod_resources_interval: float,
    telemetry_interval: float,
    log_level: str,
    log_format: str,
) -> None:
    """Run one device plugin for one resource in this process (no configuration file needed).

    When PLUGVISOR_STATUS_SOCKET names a unix datagram socket, the plugin reports its
    registrations and device counts there in sd_notify format.
    """
    from plugvisor.deviceplugin.errors import ConfigurationError
    from plugvisor.deviceplugin.monitorconfig import MonitorConfig
    from plugvisor.deviceplugin.runtime import DevicePluginRuntime, PluginConfig, run_plugin

    del mode  # "dra" never gets here (_ModeDispatch)
    _drop_unread_metrics(metrics_listen)
    configure_logging(level=log_level, fmt="json" if log_format == "json" else "kv")
    set_title(kind, resource or f"plugvisor.io/{kind}")
    try:
        plugin_kind = get_kind(kind)
    except UnknownKindError as exc:
        raise click.BadParameter(str(exc), param_hint="KIND") from exc
    raw, source_name = kind_options(kind, options_file, options_json, paths, count)
    try:
        options = plugin_kind.options_model.model_validate(raw)
    except pydantic.ValidationError as exc:
        problems = describe(exc, source=source_name, model=plugin_kind.options_model)
        refuse(f"plugvisor plugin {kind}: invalid options\n{problems}")
    if spec_root is not None and not spec_root.is_absolute():
        raise click.BadParameter(f"{spec_root} must be an absolute path", param_hint="--spec-root")
    resource_name = resource or f"plugvisor.io/{kind}"
    host = HostPaths(root=host_root.absolute(), kubelet_dir=kubelet_dir.absolute(), spec_root=spec_root)
    _check_host(plugin_kind, host, resource_name)
    try:
        config = PluginConfig(
            resource_name,
            host,
            rescan_interval=rescan_interval,
            on_kubelet_restart="exit" if on_kubelet_restart == "exit" else "reregister",
            monitoring=MonitorConfig(
                enabled=bool(metrics_listen or monitor_dir),
                monitor_dir=None if monitor_dir is None else monitor_dir.absolute(),
                pod_resources_socket=pod_resources_socket,
                pod_resources_interval=pod_resources_interval,
                telemetry_interval=telemetry_interval,
            ),
            registration="plugin-watcher" if registration == "plugin-watcher" else "kubelet-sock",
            plugins_registry=plugins_registry.absolute() if plugins_registry is not None else None,
        )
        source = plugin_kind.build(options, host, resource=resource_name)
    except ConfigurationError as exc:
        refuse(f"plugvisor plugin {kind}: {exc}")
    _check_not_served(kind, resource_name, (host.kubelet_dir, config.registry_dir), replace=replace)
    on_ready = None
    if metrics_listen:
        _serve_metrics(metrics_listen)

        def on_ready(runtime: DevicePluginRuntime) -> None:
            from prometheus_client import REGISTRY

            from plugvisor.common.device_metrics import DeviceCollector

            if runtime.monitor is not None:
                REGISTRY.register(DeviceCollector(runtime.monitor.view))

    sys.exit(run_plugin(config, source, on_ready=on_ready))


def set_title(kind: str, served: str, *, dra: bool = False) -> None:
    """Show in ``ps`` which resource (or DRA driver) this process serves, and a short name in ``top``.

    A child of the agent would otherwise show the agent's command line (it is
    forked from it), an exec'd one its whole options as JSON.
    """
    if dra:
        proctitle.set_name(f"pv:{served.split('.', 1)[0]}-dra")
        proctitle.set_title(f"plugvisor plugin {kind} {served} (dra)")
    else:
        proctitle.set_name("pv:" + served.rsplit("/", 1)[-1])
        proctitle.set_title(f"plugvisor plugin {kind} {served}")


def _drop_unread_metrics(metrics_listen: str | None) -> None:
    """Record no process metrics when neither this process serves them nor an agent aggregates them."""
    if not metrics_listen and MULTIPROCESS_METRICS_ENV not in os.environ:
        from plugvisor.deviceplugin import metrics

        metrics.disable()


def _check_host(kind: PluginKind[Any], host: HostPaths, resource: str) -> None:
    """Exit 2 naming the option when the host root or kubelet directory cannot work; warn when no PCI bus.

    A mistyped --host-root used to give zero devices and no word about why, and an
    unwritable --kubelet-dir a traceback from deep inside gRPC.
    """
    for option, problem in (
        ("--host-root", host_root_problem(host.root)),
        (
            "--kubelet-dir",
            kubelet_dir_problem(host.kubelet_dir) or missing_kubelet_dir_problem(host.kubelet_dir),
        ),
    ):
        if problem is not None:
            refuse(f"plugvisor plugin {kind.name}: {option}: {problem}")
    if kind.reads_pci and not (host.sysfs / "bus/pci/devices").is_dir():
        structlog.get_logger("plugvisor.plugin").warning(
            "no_pci_bus",
            resource=resource,
            path=str(host.sysfs / "bus/pci/devices"),
            meaning="no PCI device can be found under this host root; check --host-root",
        )


def _check_not_served(kind: str, resource: str, directories: Sequence[Path], *, replace: bool) -> None:
    """Exit 2 when another live plugvisor plugin serves ``resource`` here, unless told to replace it.

    A second registration for a resource makes the kubelet follow the newer
    plugin; kubelets before kubernetes#135437 then mark every device of the
    resource unhealthy when either plugin stops, and none of them tells the
    older plugin, which keeps running as if registered. A plugin started by hand
    beside the agent (or twice) is an operator's slip that would silently take
    a resource off the node later, so it is refused up front, naming the socket.
    """
    live = [path for directory in dict.fromkeys(directories) for path in live_instances(directory, resource)]
    if not live:
        return
    if replace:
        structlog.get_logger("plugvisor.plugin").warning(
            "replacing_live_plugin",
            resource=resource,
            sockets=[str(path) for path in live],
            meaning="the kubelet will follow this plugin; the other keeps running until stopped",
        )
        return
    refuse(
        f"plugvisor plugin {kind}: {resource} is already served on this node by the plugin on "
        f"{', '.join(str(path) for path in live)}; a second plugin for one resource makes the kubelet drop "
        "the first, and an older kubelet marks every device unhealthy once either stops. Stop the other "
        "(`plugvisor status` shows the agent's), or pass --replace to take the resource over."
    )


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


def preload() -> None:
    """Import what every plugin process needs, so that the fork server's children inherit it.

    What the framework imports only at first use is included: device monitoring
    and the PodResources API (the agent's children monitor when its monitoring
    is on, kinds with a release hook poll PodResources always), and
    prometheus-client when the agent aggregates its children's metrics (it hands
    them, and this process, ``PROMETHEUS_MULTIPROC_DIR``; without it the children
    record none, see :func:`_drop_unread_metrics`). Imported in each child
    instead, a module costs every child its own copy.
    """
    if MULTIPROCESS_METRICS_ENV in os.environ:
        import prometheus_client  # noqa: F401

    import plugvisor.api.podresources.v1.api_pb2_grpc
    import plugvisor.deviceplugin.device_monitor
    import plugvisor.deviceplugin.runtime  # noqa: F401


def prepare(args: Sequence[str]) -> Callable[[], int]:
    """Parse ``args`` (``plugin KIND ...``, as the agent writes them) now; what it returns runs the command.

    The fork server calls this before it forks each child, and the child calls
    what it gets: the command line is parsed once, in the fork server, instead of
    in every child. Parsing writes to pages a forked child shares with the fork
    server (click's objects: measured, ~2.3 MB of copied pages per child, ~1 MB of
    them first-use caches); parsed there, they stay shared. Parsing reads no file
    (options given through the environment come from the fork server's, which is
    the child's); whatever is wrong is reported by the child, exactly as
    ``plugvisor plugin`` reports it, with its exit status.
    """
    if not args or args[0] != COMMAND:
        message = f"plugvisor: a plugin process takes '{COMMAND} KIND ...', got {list(args)!r}\n"
        return functools.partial(_fail, message, EXIT_USAGE)
    try:
        context = plugin_command.make_context(f"plugvisor {COMMAND}", list(args[1:]))
    except click.ClickException as exc:
        return functools.partial(_shown, exc)
    except click.exceptions.Exit as exc:  # --help, printed already
        return functools.partial(_fail, "", exc.exit_code)
    return functools.partial(_invoke, context)


def _fail(message: str, code: int) -> int:
    sys.stderr.write(message)
    return code


def _shown(exc: click.ClickException) -> int:
    exc.show()
    return exc.exit_code


def _invoke(context: click.Context) -> int:
    """Run the parsed command the way click's standalone mode does: every way out is an exit status."""
    try:
        with context:
            plugin_command.invoke(context)
    except click.ClickException as exc:
        return _shown(exc)
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except (click.Abort, EOFError, KeyboardInterrupt):
        click.echo("Aborted!", err=True)
        return EXIT_FAILURE
    except SystemExit as exc:
        return _exit_status(exc)
    return EXIT_OK


def _exit_status(exc: SystemExit) -> int:
    if exc.code is None:
        return EXIT_OK
    if isinstance(exc.code, int):
        return exc.code
    sys.stderr.write(f"{exc.code}\n")
    return EXIT_FAILURE
