"""One DRA driver process: ``plugvisor plugin KIND --mode dra --driver NAME ...``.

The same kind, the same options and the same host as a device plugin, served
to the kubelet as a Dynamic Resource Allocation driver instead
(:mod:`plugvisor.dra`, docs/dra.md). ``plugvisor plugin`` hands its command
line here when it says ``--mode dra`` (:mod:`plugvisor.plugins.entry`), and so
does a child of the agent, whose arguments are the same. The options a kind
reads (``--host-root``, ``--options-json``...) are the plugin command's own
option objects, so both modes parse and document them the same way.

The API server is reached through :mod:`plugvisor.dra.kube` (its
``connect``), or, with ``--objects-dir``, claims and slices are files
(:mod:`plugvisor.dra.local`): a node without an API server, for the emulated
world and tests. Exit codes and status datagrams are a plugin's.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Final

import click
import pydantic

from plugvisor.common import constants
from plugvisor.common.hostpaths import HostPaths, kubelet_dir_problem
from plugvisor.common.logs import configure_logging
from plugvisor.common.names import dra_driver_name_problem
from plugvisor.common.validation import describe
from plugvisor.deviceplugin.errors import ConfigurationError
from plugvisor.dra.cluster import ClaimReader, PublishState, SlicePublisher
from plugvisor.dra.hooks import kind_resource
from plugvisor.plugins import entry
from plugvisor.plugins.kinds import UnknownKindError, get_kind

if TYPE_CHECKING:
    from plugvisor.dra.runtime import Connect

MODE: Final = "dra"
KUBE_MODULE: Final = "plugvisor.dra.kube"
OBJECTS_DIR_ENV: Final = "PLUGVISOR_DRA_OBJECTS_DIR"
"""``--objects-dir`` from the environment: how an agent's drivers on an emulated node find their files."""
SHARED_OPTIONS: Final = (
    "host_root",
    "kubelet_dir",
    "spec_root",
    "paths",
    "count",
    "options_file",
    "options_json",
    "plugins_registry",
    "rescan_interval",
    "monitor_dir",
    "pod_resources_socket",
    "pod_resources_interval",
    "telemetry_interval",
    "log_level",
    "log_format",
)
"""The plugin command's options that mean the same for a DRA driver."""


def wants_dra(args: list[str]) -> bool:
    """Whether a ``plugvisor plugin`` command line asks for ``--mode dra``."""
    for index, arg in enumerate(args):
        if arg == "--":
            return False
        if arg == f"--mode={MODE}" or (arg == "--mode" and args[index + 1 : index + 2] == [MODE]):
            return True
    return False


def preload() -> None:
    """Import what every driver process needs, so that the agent's fork server's children inherit it.

    The API client only where the drivers use it: with ``PLUGVISOR_DRA_OBJECTS_DIR``
    in the environment (the fork server's is its children's) they keep claims
    and slices as files. Without the ``dra`` extra installed, a driver says so itself.
    """
    import plugvisor.dra.runtime  # noqa: F401

    if OBJECTS_DIR_ENV not in os.environ:
        with contextlib.suppress(ImportError):
            importlib.import_module(KUBE_MODULE)


def default_node_name() -> str:
    """The kubelet's own default: the host name, lower-cased."""
    return socket.gethostname().strip().lower()


def _connect(driver: str, node_name: str, objects_dir: Path | None, kubelet_socket: Path) -> Connect:
    """How the driver reaches its claims and its slices: files under ``objects_dir``, or the API server."""
    if objects_dir is not None:
        from plugvisor.dra.local import FileClaimReader, FileSlicePublisher

        async def local(on_state: Callable[[PublishState], None]) -> tuple[ClaimReader, SlicePublisher]:
            slices = FileSlicePublisher(objects_dir, driver=driver, node_name=node_name, on_state=on_state)
            return FileClaimReader(objects_dir), slices

        return local
    try:
        kube = importlib.import_module(KUBE_MODULE)
        connect, config_error = kube.connect, kube.KubeConfigError
    except (ImportError, AttributeError) as exc:
        entry.refuse(
            f"plugvisor plugin --mode dra: this installation has no Kubernetes API client ({KUBE_MODULE}: "
            f"{exc}); install plugvisor[dra], or give --objects-dir DIR to run the driver with claims and "
            "slices as files"
        )

    async def api(on_state: Callable[[PublishState], None]) -> tuple[ClaimReader, SlicePublisher]:
        try:
            claims: ClaimReader
            slices: SlicePublisher
            claims, slices = await connect(
                driver=driver,
                node_name=node_name,
                on_state=on_state,
                kubelet_socket=kubelet_socket,
            )
        except config_error as exc:  # no API server configured, or not a Node's name: exit 2
            raise ConfigurationError(str(exc)) from None
        return claims, slices

    return api


@click.command("plugin", cls=entry.LastWordsCommand)
@click.argument("kind")
@click.option(
    "--mode",
    type=click.Choice([MODE]),
    required=True,
    help="dra: serve the kind as a Dynamic Resource Allocation driver (without it: a device plugin).",
)
@click.option("--driver", help="The DRA driver's name, a DNS subdomain [default: <KIND>.plugvisor.io].")
@click.option(
    "--node-name",
    envvar="NODE_NAME",
    help="This node's name: the pool the driver publishes [env: NODE_NAME; default: the host name].",
)
@click.option(
    "--cdi-dir",
    default=constants.DEFAULT_CDI_DIR,
    show_default=True,
    help="Where the claims' CDI specs go (a host path, resolved inside --host-root).",
)
@click.option(
    "--objects-dir",
    type=click.Path(file_okay=False, path_type=Path),
    envvar=OBJECTS_DIR_ENV,
    help="Run without an API server: read allocated ResourceClaims from DIR/resourceclaims and write the "
    f"ResourceSlice to DIR/resourceslices (the emulated world, tests) [env: {OBJECTS_DIR_ENV}].",
)
@click.option(
    "--replace",
    is_flag=True,
    help="Take the driver's sockets over from another live process serving them (the agent's children do).",
)
@click.option(
    "--withdraw-on-stop",
    is_flag=True,
    help="Delete the node's ResourceSlices of the driver at a clean stop (a driver that goes for good).",
)
def dra_plugin_command(
    *,
    kind: str,
    mode: str,
    driver: str | None,
    node_name: str | None,
    cdi_dir: str,
    objects_dir: Path | None,
    replace: bool,
    withdraw_on_stop: bool,
    host_root: Path,
    kubelet_dir: Path,
    spec_root: Path | None,
    paths: tuple[str, ...],
    count: int | None,
    options_file: Path | None,
    options_json: str | None,
    plugins_registry: Path | None,
    rescan_interval: float,
    monitor_dir: Path | None,
    pod_resources_socket: Path | None,
    pod_resources_interval: float,
    telemetry_interval: float,
    log_level: str,
    log_format: str,
) -> None:
    """Run one kind as a DRA driver's kubelet plugin in this process.

    It registers through the kubelet's plugins_registry, prepares claims as CDI
    specs and publishes the node's devices as ResourceSlices (docs/dra.md).
    """
    from plugvisor.deviceplugin.monitorconfig import MonitorConfig
    from plugvisor.dra.runtime import DriverConfig, run_driver

    del mode
    configure_logging(level=log_level, fmt="json" if log_format == "json" else "kv")
    try:
        plugin_kind = get_kind(kind)
    except UnknownKindError as exc:
        raise click.BadParameter(str(exc), param_hint="KIND") from exc
    raw, source_name = entry.kind_options(kind, options_file, options_json, paths, count)
    try:
        options = plugin_kind.options_model.model_validate(raw)
    except pydantic.ValidationError as exc:
        entry.refuse(f"plugvisor plugin {kind}: invalid options\n{describe(exc, source=source_name)}")
    driver_name = driver or f"{kind}.plugvisor.io"
    entry.set_title(kind, driver_name, dra=True)
    problem = dra_driver_name_problem(driver_name)
    if problem is not None:
        raise click.BadParameter(problem, param_hint="--driver")
    if not cdi_dir.startswith("/"):
        raise click.BadParameter(f"{cdi_dir} must be an absolute path", param_hint="--cdi-dir")
    if spec_root is not None and not spec_root.is_absolute():
        raise click.BadParameter(f"{spec_root} must be an absolute path", param_hint="--spec-root")
    host = HostPaths(root=host_root.absolute(), kubelet_dir=kubelet_dir.absolute(), spec_root=spec_root)
    entry._check_host(plugin_kind, host, driver_name)  # one command, two modes: the same checks
    try:
        config = DriverConfig(
            driver_name,
            node_name or default_node_name(),
            host,
            cdi_dir=cdi_dir,
            rescan_interval=rescan_interval,
            monitoring=MonitorConfig(
                enabled=monitor_dir is not None,
                monitor_dir=None if monitor_dir is None else monitor_dir.absolute(),
                pod_resources_socket=pod_resources_socket,
                pod_resources_interval=pod_resources_interval,
                telemetry_interval=telemetry_interval,
            ),
            plugins_registry=plugins_registry.absolute() if plugins_registry is not None else None,
            replace=replace,
            withdraw_on_stop=withdraw_on_stop,
        )
        source = plugin_kind.build(options, host, resource=kind_resource(driver_name, kind))
    except ConfigurationError as exc:
        entry.refuse(f"plugvisor plugin {kind}: {exc}")
    for directory in (config.driver_dir, config.registry_dir):
        problem = kubelet_dir_problem(directory)
        if problem is not None:
            entry.refuse(f"plugvisor plugin {kind}: {problem}")
    objects = objects_dir.absolute() if objects_dir else None
    connect = _connect(driver_name, config.node_name, objects, host.kubelet_socket)
    sys.exit(run_driver(config, source, connect=connect))


dra_plugin_command.params.extend(
    param for param in entry.plugin_command.params if param.name in SHARED_OPTIONS
)
