"""One DRA driver process: ``plugvisor plugin KIND --mode dra --driver NAME ...``.

The same kind, the same options and the same host as a device plugin, served
to the kubelet as a Dynamic Resource Allocation driver instead
(:mod:`plugvisor.dra`, docs/dra.md). ``plugvisor plugin`` hands its command
line here when it says ``--mode dra`` (:mod:`plugvisor.plugins.entry`), and so
does a child of the agent, whose arguments are the same: the dispatch, in
:mod:`plugvisor.plugins.entrycommon`, imports this module by name when asked
for it, and this module imports that one, never :mod:`plugvisor.plugins.entry`.
The options a kind reads (``--host-root``, ``--options-json``...) are declared
there once and applied by both commands, so both modes parse and document them
the same way; they and this command's own fill one :class:`DriverOptions`.

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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, NoReturn

import click

from plugvisor.common import constants
from plugvisor.common.hostpaths import kubelet_dir_problem
from plugvisor.common.names import dra_driver_name_problem
from plugvisor.deviceplugin.errors import ConfigurationError
from plugvisor.dra.cluster import ClaimReader, PublishState, SlicePublisher
from plugvisor.dra.hooks import kind_resource
from plugvisor.plugins.entrycommon import (
    DRA_MODE,
    KindProcessOptions,
    LastWordsCommand,
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

if TYPE_CHECKING:
    from plugvisor.dra.runtime import Connect

MODE: Final = DRA_MODE
KUBE_MODULE: Final = "plugvisor.dra.kube"
OBJECTS_DIR_ENV: Final = "PLUGVISOR_DRA_OBJECTS_DIR"
"""``--objects-dir`` from the environment: how an agent's drivers on an emulated node find their files."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DriverOptions(KindProcessOptions):
    """``plugvisor plugin KIND --mode dra``: the shared options and the DRA driver's own."""

    mode: str
    driver: str | None
    node_name: str | None
    cdi_dir: str
    objects_dir: Path | None
    replace: bool
    withdraw_on_stop: bool

    @property
    def driver_name(self) -> str:
        """The driver served: ``--driver``, else ``<KIND>.plugvisor.io``."""
        return self.driver or f"{self.kind}.plugvisor.io"


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
        refuse(
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


@click.command("plugin", cls=LastWordsCommand)
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
@host_root_option
@kubelet_dir_option
@spec_root_option
@path_option
@count_option
@options_file_option
@options_json_option
@plugins_registry_option
@rescan_interval_option
@monitoring_options
def dra_plugin_command(**params: Any) -> None:
    """Run one kind as a DRA driver's kubelet plugin in this process.

    It registers through the kubelet's plugins_registry, prepares claims as CDI
    specs and publishes the node's devices as ResourceSlices (docs/dra.md).
    """
    run(DriverOptions(**params))


def run(opts: DriverOptions) -> NoReturn:
    """Serve the kind as a DRA driver until it stops; exit with its status (2 for what it refuses)."""
    from plugvisor.deviceplugin.monitorconfig import MonitorConfig
    from plugvisor.dra.runtime import DriverConfig, run_driver

    opts.configure_logging()
    plugin_kind, options = opts.load_kind()
    driver_name = opts.driver_name
    set_title(opts.kind, driver_name, dra=True)
    problem = dra_driver_name_problem(driver_name)
    if problem is not None:
        raise click.BadParameter(problem, param_hint="--driver")
    if not opts.cdi_dir.startswith("/"):
        raise click.BadParameter(f"{opts.cdi_dir} must be an absolute path", param_hint="--cdi-dir")
    host = opts.host()
    check_host(plugin_kind, host, driver_name)  # one command, two modes: the same checks
    try:
        config = DriverConfig(
            driver_name,
            opts.node_name or default_node_name(),
            host,
            cdi_dir=opts.cdi_dir,
            rescan_interval=opts.rescan_interval,
            monitoring=MonitorConfig(
                enabled=opts.monitor_dir is not None,
                monitor_dir=None if opts.monitor_dir is None else opts.monitor_dir.absolute(),
                pod_resources_socket=opts.pod_resources_socket,
                pod_resources_interval=opts.pod_resources_interval,
                telemetry_interval=opts.telemetry_interval,
            ),
            plugins_registry=opts.plugins_registry.absolute() if opts.plugins_registry is not None else None,
            replace=opts.replace,
            withdraw_on_stop=opts.withdraw_on_stop,
        )
        source = plugin_kind.build(
            options, host, resource=kind_resource(driver_name, opts.kind), log_as=driver_name
        )
    except ConfigurationError as exc:
        refuse(f"plugvisor plugin {opts.kind}: {exc}")
    for directory in (config.driver_dir, config.registry_dir):
        problem = kubelet_dir_problem(directory)
        if problem is not None:
            refuse(f"plugvisor plugin {opts.kind}: {problem}")
    objects = opts.objects_dir.absolute() if opts.objects_dir else None
    connect = _connect(driver_name, config.node_name, objects, host.kubelet_socket)
    sys.exit(run_driver(config, source, connect=connect))
