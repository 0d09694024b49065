"""One plugin process: ``plugvisor plugin KIND ...``, and what the agent's fork server runs in a child.

This is the whole of what a device plugin process needs on top of the framework:
the command's options (:class:`PluginOptions`, built from what click parsed), and
:func:`~plugvisor.deviceplugin.run_plugin`; what it shares with the DRA driver's
command (:mod:`plugvisor.plugins.draentry`), the kind's options read from a file,
JSON or flags among them, is :mod:`plugvisor.plugins.entrycommon`'s. The agent's fork server imports this
module (and nothing of the command-line group), parses each child's command line
with :func:`prepare` before it forks, and runs the result in the child;
``plugvisor plugin`` is the same command reached through the ``plugvisor`` group.

When ``PLUGVISOR_STATUS_SOCKET`` names a unix datagram socket, the plugin
reports its registrations and device counts there (:mod:`plugvisor.common.notify`).
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import click
import structlog

from plugvisor.common.exitcodes import EXIT_FAILURE, EXIT_OK, EXIT_USAGE
from plugvisor.common.grpcenv import quiet_grpc_core
from plugvisor.common.sockets import live_instances
from plugvisor.plugins.entrycommon import (
    DRA_MODE,
    KindProcessOptions,
    ModeDispatch,
    check_host,
    count_option,
    host_root_option,
    kubelet_dir_option,
    monitoring_options,
    options_file_option,
    options_json_option,
    path_option,
    plugins_registry_option,
    refuse,
    rescan_interval_option,
    set_title,
    spec_root_option,
)

# The framework's runtime (and so grpc) is imported when a plugin starts, after this.
quiet_grpc_core()

COMMAND = "plugin"
"""The first of a child's arguments: the agent hands a child ``plugin KIND --resource ...``."""
MULTIPROCESS_METRICS_ENV = "PROMETHEUS_MULTIPROC_DIR"
"""Set by the agent for its children: their metrics are aggregated by the agent's ``/metrics``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PluginOptions(KindProcessOptions):
    """``plugvisor plugin KIND`` as a device plugin: the shared options and the device plugin's own."""

    mode: str
    resource: str | None
    on_kubelet_restart: str
    registration: str
    replace: bool
    metrics_listen: str | None

    @property
    def resource_name(self) -> str:
        """The extended resource served: ``--resource``, else ``plugvisor.io/<KIND>``."""
        return self.resource or f"plugvisor.io/{self.kind}"


@click.command("plugin", cls=ModeDispatch)
@click.argument("kind")
@click.option(
    "--mode",
    type=click.Choice(["device-plugin", DRA_MODE]),
    default="device-plugin",
    show_default=True,
    help="dra: serve the kind as a DRA driver instead; its options: plugvisor plugin KIND --mode dra --help.",
)
@click.option(
    "--resource", help="Extended resource name, e.g. example.com/fuse [default: plugvisor.io/<KIND>]."
)
@host_root_option
@kubelet_dir_option
@spec_root_option
@path_option
@count_option
@options_file_option
@options_json_option
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
@plugins_registry_option
@click.option(
    "--replace",
    is_flag=True,
    help="Take the resource over from another plugvisor plugin already serving it on this node (the agent's "
    "children do); without it, such a plugin makes this one exit 2 naming its socket.",
)
@rescan_interval_option
@click.option(
    "--metrics-listen",
    metavar="HOST:PORT",
    help="Serve this plugin's Prometheus metrics, per-device ones included (the supervisor serves them "
    "for its children instead).",
)
@monitoring_options
def plugin_command(**params: Any) -> None:
    """Run one device plugin for one resource in this process (no configuration file needed).

    When PLUGVISOR_STATUS_SOCKET names a unix datagram socket, the plugin reports its
    registrations and device counts there in sd_notify format.
    """
    run(PluginOptions(**params))


def run(opts: PluginOptions) -> NoReturn:
    """Serve the kind as a device plugin until it stops; exit with its status (2 for what it refuses)."""
    from plugvisor.deviceplugin.errors import ConfigurationError
    from plugvisor.deviceplugin.monitorconfig import MonitorConfig
    from plugvisor.deviceplugin.runtime import DevicePluginRuntime, PluginConfig, run_plugin

    # --mode dra never gets here (ModeDispatch)
    _drop_unread_metrics(opts.metrics_listen)
    opts.configure_logging()
    resource_name = opts.resource_name
    set_title(opts.kind, resource_name)
    plugin_kind, options = opts.load_kind()
    host = opts.host()
    check_host(plugin_kind, host, resource_name)
    try:
        config = PluginConfig(
            resource_name,
            host,
            rescan_interval=opts.rescan_interval,
            on_kubelet_restart="exit" if opts.on_kubelet_restart == "exit" else "reregister",
            monitoring=MonitorConfig(
                enabled=bool(opts.metrics_listen or opts.monitor_dir),
                monitor_dir=None if opts.monitor_dir is None else opts.monitor_dir.absolute(),
                pod_resources_socket=opts.pod_resources_socket,
                pod_resources_interval=opts.pod_resources_interval,
                telemetry_interval=opts.telemetry_interval,
            ),
            registration="plugin-watcher" if opts.registration == "plugin-watcher" else "kubelet-sock",
            plugins_registry=opts.plugins_registry.absolute() if opts.plugins_registry is not None else None,
        )
        source = plugin_kind.build(options, host, resource=resource_name)
    except ConfigurationError as exc:
        refuse(f"plugvisor plugin {opts.kind}: {exc}")
    _check_not_served(opts.kind, resource_name, (host.kubelet_dir, config.registry_dir), replace=opts.replace)
    on_ready = None
    if opts.metrics_listen:
        _serve_metrics(opts.metrics_listen)

        def on_ready(runtime: DevicePluginRuntime) -> None:
            from prometheus_client import REGISTRY

            from plugvisor.common.device_metrics import DeviceCollector

            if runtime.monitor is not None:
                REGISTRY.register(DeviceCollector(runtime.monitor.view))

    sys.exit(run_plugin(config, source, on_ready=on_ready))


def _drop_unread_metrics(metrics_listen: str | None) -> None:
    """Record no process metrics when neither this process serves them nor an agent aggregates them."""
    if not metrics_listen and MULTIPROCESS_METRICS_ENV not in os.environ:
        from plugvisor.deviceplugin import metrics

        metrics.disable()


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
    """Serve ``/metrics`` on ``listen`` with bounded threads (:mod:`plugvisor.deviceplugin.metrics_http`)."""
    from plugvisor.deviceplugin import metrics_http

    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        raise click.BadParameter(f"{listen!r} is not HOST:PORT", param_hint="--metrics-listen")
    try:
        metrics_http.serve(host or "127.0.0.1", int(port))
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
