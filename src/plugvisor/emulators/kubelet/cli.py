"""``plugvisor kubelet --dir DIR``: the emulated kubelet as a long-running command.

Signals map to what operators do to a real kubelet: SIGHUP restarts it (every
socket in DIR deleted, ``kubelet.sock`` created again - the plugins' cue to
re-register; the checkpoint is read back), SIGUSR1 restarts it as after a node
reboot (no container survives), SIGTERM and SIGINT stop it cleanly with exit
status 0. Each event is logged as one ``key=value`` line on stderr, so a script
can follow it with ``grep``; the full state is in the JSON view files.

``--pods PODS_DIR`` makes it a node that runs pods: drop a Pod manifest in the
directory and it is admitted (Allocate, PreStartContainer), remove the file and
the pod terminates; ``<DIR>.pods.json`` shows their status. PodResources v1 is
served on ``<root>/pod-resources/kubelet.sock`` (see ``--root``), and the plugin
watcher registers device plugins whose sockets appear in ``<root>/plugins_registry``.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

import click
import structlog

from plugvisor.common import constants
from plugvisor.emulators.kubelet import gates, model, names, registration, versions
from plugvisor.emulators.kubelet import kubelet as kubelet_


def _event_logger() -> Any:
    """Build a logger that prints one key=value line per call, without global configuration."""
    return structlog.wrap_logger(
        structlog.PrintLogger(sys.stderr),
        processors=[
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.KeyValueRenderer(key_order=["timestamp", "event", "resource", "message"]),
        ],
    )


async def _serve(socket_dir: Path, *, options: dict[str, Any]) -> None:
    logger = _event_logger()

    def log_event(event: model.Event) -> None:
        fields = {**event.fields, "resource": event.resource, "message": event.message}
        fields["generation"] = event.generation
        logger.info(str(event.kind), **{key: value for key, value in fields.items() if value is not None})

    kubelet = kubelet_.EmulatedKubelet(socket_dir, on_event=log_event, **options)
    commands: asyncio.Queue[str] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    handled = {
        signal.SIGHUP: "restart",
        signal.SIGUSR1: "reboot",
        signal.SIGTERM: "stop",
        signal.SIGINT: "stop",
    }
    for signum, signalled in handled.items():
        loop.add_signal_handler(signum, commands.put_nowait, signalled)
    try:
        await kubelet.start()
        logger.info("view", message=f"view file {kubelet.view_path}", path=os.fspath(kubelet.view_path))
        while (command := await commands.get()) != "stop":
            await kubelet.restart(reboot=command == "reboot")
    finally:
        for signum in handled:
            loop.remove_signal_handler(signum)
        await kubelet.stop()


def _parse_gates(ctx: click.Context, param: click.Parameter, value: str | None) -> str:
    """Check the syntax now (one error naming the gate); the release's defaults are applied later."""
    del ctx, param
    try:
        gates.FeatureGates.parse(value or "")
    except ValueError as error:
        raise click.BadParameter(str(error)) from None
    return value or ""


def _writable_view(ctx: click.Context, param: click.Parameter, value: Path | None) -> Path | None:
    """A view file the kubelet can write: found out now, not by a kubelet that serves with no view."""
    del ctx, param
    if value is None:
        return None
    try:
        value.parent.mkdir(parents=True, exist_ok=True)
        handle, probe = tempfile.mkstemp(dir=value.parent, prefix=f".{value.name}.", suffix=".tmp")
        os.close(handle)
        os.unlink(probe)  # noqa: PTH108 - a path string from mkstemp
    except OSError as error:
        raise click.BadParameter(f"{value}: cannot write it there ({error.strerror or error})") from None
    return value


def _finite_seconds(ctx: click.Context, param: click.Parameter, value: float) -> float:
    """FloatRange lets nan and inf through: a grace period must be a number of seconds."""
    del ctx, param
    if not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a number of seconds; expected a finite number >= 0")
    return value


def _node_name(value: str) -> str:
    """The node name as the kubelet takes ``--hostname-override``: trimmed, lower-cased, a Node's name.

    A name that is no DNS-1123 subdomain would only fail later, in every static
    pod's name (``<pod>-<node>``); it is refused here, naming the option.
    """
    name = value.strip().lower()
    if not name:
        raise click.BadParameter("empty; expected the node's name (a lowercase DNS-1123 subdomain)")
    problems = names.dns1123_subdomain_errors(name)
    if problems:
        raise click.BadParameter(f"{name!r}: {'; '.join(problems)}")
    return name


@click.command(name="kubelet")
@click.option(
    "--dir",
    "socket_dir",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="The device-plugins directory: kubelet.sock is served here, plugins put their sockets here.",
)
@click.option(
    "--view",
    "view_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    callback=_writable_view,
    help="Where to write the JSON view [default: <DIR>.kubelet.json, beside the directory].",
)
@click.option(
    "--grace-period",
    type=click.FloatRange(min=0),
    callback=_finite_seconds,
    default=kubelet_.DEFAULT_GRACE_PERIOD,
    show_default=True,
    metavar="SECONDS",
    help="How long a resource whose plugin went away is kept (capacity kept, allocatable 0) before removal.",
)
@click.option(
    "--pods",
    "pods_dir",
    # Must exist: a mistyped directory used to be created, silently, and never see a manifest.
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="A directory of Pod manifests (static-pod style): a file added is a pod admitted, "
    "a file removed a pod terminated.",
)
@click.option(
    "--root",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="The kubelet root dir, for <root>/pod-resources/kubelet.sock "
    "[default: DIR's parent when DIR is named device-plugins, else <DIR>.pod-resources/ beside DIR].",
)
@click.option(
    "--pod-resources-socket",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Serve PodResources v1 on this socket instead.",
)
@click.option("--no-pod-resources", is_flag=True, help="Do not serve the PodResources API.")
@click.option(
    "--pods-view",
    "pods_view_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    callback=_writable_view,
    help="Where to write pod status [default: <DIR>.pods.json].",
)
@click.option(
    "--replacement",
    type=click.Choice(registration.REPLACEMENTS),
    default=None,
    help="A second plugin for a registered resource: per-name (kubelet 1.26-1.35, the new client replaces "
    "the old) or per-socket (instances tracked per socket, zero-downtime hand-over; kubernetes#135437) "
    "[default: the release's: per-socket from 1.37].",
)
@click.option(
    "--feature-gates",
    "feature_gates",
    callback=_parse_gates,
    default=None,
    metavar="GATES",
    help="Kubelet feature gates over the release's defaults, e.g. ResourceHealthStatus=false,"
    "DeviceManagerDeallocate=true (docs/kubelet.md lists each release's defaults).",
)
@click.option(
    "--plugins-registry",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="The plugin watcher's directory (plugin-watcher registration) "
    "[default: <root>/plugins_registry, else <DIR>.plugins_registry beside DIR].",
)
@click.option("--no-plugin-watcher", is_flag=True, help="Do not watch a plugins_registry directory.")
@click.option(
    "--kubelet-version",
    default=versions.DEFAULT_VERSION,
    show_default=True,
    metavar="VERSION",
    help="The kubelet release whose device manager rules are played: "
    f"{', '.join(versions.SUPPORTED_VERSIONS)} (see docs/kubelet.md for what differs).",
)
@click.option(
    "--node-name",
    default=None,
    metavar="NAME",
    callback=lambda _ctx, _param, value: None if value is None else _node_name(value),
    help="The node's name; static pods from --pods are named <name>-<node name> [default: the host name].",
)
def kubelet_command(  # noqa: PLR0917 - click passes every option positionally
    socket_dir: Path,
    view_path: Path | None,
    grace_period: float,
    pods_dir: Path | None,
    root: Path | None,
    pod_resources_socket: Path | None,
    no_pod_resources: bool,
    pods_view_path: Path | None,
    replacement: registration.Replacement | None,
    feature_gates: str,
    plugins_registry: Path | None,
    no_plugin_watcher: bool,
    kubelet_version: str,
    node_name: str | None,
) -> None:
    r"""Run an emulated kubelet (device plugins, DRA drivers' registration) on DIR (SIGHUP restarts it).

    \b
    DRA: with --kubelet-version 1.35 or later its plugin watcher also registers DRA drivers
    (DRAPlugin sockets in --plugins-registry) with the kubelet's rules and texts, and
    with ResourceHealthStatus watches their health. Claims are prepared from the
    Python API (kubelet.dra.prepare), not from this command: see docs/dra.md.
    """
    socket_path = Path(os.path.abspath(socket_dir)) / constants.KUBELET_SOCKET_NAME  # noqa: PTH100
    if len(os.fsencode(socket_path)) > constants.MAX_UNIX_SOCKET_PATH:
        raise click.BadParameter(
            f"{socket_path} would be {len(os.fsencode(socket_path))} bytes; unix socket paths are limited "
            f"to {constants.MAX_UNIX_SOCKET_PATH}. Use a shorter directory.",
            param_hint="'--dir'",
        )
    try:
        rules = versions.rules_for(kubelet_version)
    except versions.UnsupportedVersionError as error:
        raise click.BadParameter(str(error), param_hint="'--kubelet-version'") from None
    try:
        parsed_gates = rules.gates_from_flag(feature_gates)
        rules.check_gates(parsed_gates)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="'--feature-gates'") from None
    options: dict[str, Any] = {
        "view_path": view_path,
        "grace_period": grace_period,
        "pods_dir": pods_dir,
        "root": root,
        "pod_resources": not no_pod_resources,
        "pod_resources_socket": pod_resources_socket,
        "pods_view_path": pods_view_path,
        "replacement": replacement,
        "gates": parsed_gates,
        "kubelet_version": rules.version,
        "plugin_watcher": not no_plugin_watcher,
        "plugins_registry": plugins_registry,
        "node_name": node_name,
    }
    try:
        asyncio.run(_serve(socket_dir, options=options))
    except ValueError as error:
        raise click.ClickException(str(error)) from error
    except OSError as error:
        raise click.ClickException(f"cannot serve in {socket_dir}: {error}") from error
