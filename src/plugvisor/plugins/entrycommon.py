"""What both commands of a plugin process share: ``plugvisor plugin KIND`` as a device plugin or a DRA driver.

:mod:`plugvisor.plugins.entry` (the device plugin, and the fork server's entry
points) and :mod:`plugvisor.plugins.draentry` (the DRA driver) both import this
module and neither imports the other (a unit test and an import-linter contract
say so). Here are the options a kind reads in both modes (one click option
each, applied by both commands so that both parse and document them the same
way) and the frozen :class:`KindProcessOptions` they fill, the kind's options
read from a file, JSON or flags, the checks of the host, the process title, the
last words a failing process sends the agent, and the dispatch of a
``--mode dra`` command line to the DRA command.

That dispatch resolves the DRA command by name (:data:`DRA_COMMAND`), at the
moment a command line asks for it: a device plugin never loads the DRA side
(``plugvisor.dra`` and its API client), and the DRA module is the one that
depends on this one, never the other way.
"""

from __future__ import annotations

import importlib
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, NoReturn

import click
import pydantic
import structlog

from plugvisor.common import constants, proctitle
from plugvisor.common.exitcodes import EXIT_FAILURE, EXIT_KUBELET_RESTARTED, EXIT_OK, EXIT_USAGE
from plugvisor.common.hostpaths import (
    HostPaths,
    host_root_problem,
    kubelet_dir_problem,
    missing_kubelet_dir_problem,
)
from plugvisor.common.logs import configure_logging, last_error, log_options, note_error
from plugvisor.common.notify import StatusReporter
from plugvisor.common.validation import bounded, describe, huge_integer_problem, json_integer, shorten
from plugvisor.plugins.kinds import PluginKind, UnknownKindError, get_kind

DRA_MODE: Final = "dra"
"""``--mode dra``: the command line is the DRA driver's (:mod:`plugvisor.plugins.draentry`)."""
DRA_COMMAND: Final = ("plugvisor.plugins.draentry", "dra_plugin_command")
"""Module and attribute of the DRA driver's command, imported by :class:`ModeDispatch` only when asked for."""


@dataclass(frozen=True, slots=True, kw_only=True)
class KindProcessOptions:
    """The options of ``plugvisor plugin KIND`` that mean the same in both modes, as click parsed them."""

    kind: str
    host_root: Path
    kubelet_dir: Path
    spec_root: Path | None
    paths: tuple[str, ...]
    count: int | None
    options_file: Path | None
    options_json: str | None
    plugins_registry: Path | None
    rescan_interval: float
    monitor_dir: Path | None
    pod_resources_socket: Path | None
    pod_resources_interval: float
    telemetry_interval: float
    log_level: str
    log_format: str

    def configure_logging(self) -> None:
        """Set up structlog as ``--log-level`` and ``--log-format`` ask."""
        configure_logging(level=self.log_level, fmt="json" if self.log_format == "json" else "kv")

    def host(self) -> HostPaths:
        """The host's paths, absolute; a relative ``--spec-root`` is a usage error (exit 2) naming it."""
        if self.spec_root is not None and not self.spec_root.is_absolute():
            raise click.BadParameter(f"{self.spec_root} must be an absolute path", param_hint="--spec-root")
        return HostPaths(
            root=self.host_root.absolute(), kubelet_dir=self.kubelet_dir.absolute(), spec_root=self.spec_root
        )

    def load_kind(self) -> tuple[PluginKind[Any], Any]:
        """The kind and its validated options; an unknown kind or invalid options exit 2 naming them."""
        try:
            plugin_kind = get_kind(self.kind)
        except UnknownKindError as exc:
            raise click.BadParameter(str(exc), param_hint="KIND") from exc
        raw, source_name = kind_options(
            self.kind, self.options_file, self.options_json, self.paths, self.count
        )
        try:
            options = plugin_kind.options_model.model_validate(raw)
        except pydantic.ValidationError as exc:
            problems = describe(exc, source=source_name, model=plugin_kind.options_model)
            refuse(f"plugvisor plugin {self.kind}: invalid options\n{problems}")
        return plugin_kind, options


def wants_dra(args: list[str]) -> bool:
    """Whether a ``plugvisor plugin`` command line asks for ``--mode dra``."""
    for index, arg in enumerate(args):
        if arg == "--":
            return False
        if arg == f"--mode={DRA_MODE}" or (arg == "--mode" and args[index + 1 : index + 2] == [DRA_MODE]):
            return True
    return False


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


# The options a kind reads in both modes, one decorator each, so that each command places them
# where its help lists them; every use makes a new click option from the same declaration.
_Decorator = Callable[[Any], Any]

host_root_option: Final[_Decorator] = click.option(
    "--host-root",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("/"),
    show_default=True,
    help="Where sys/, dev/ and proc/ are read (an emulated lab root in emulation).",
)
kubelet_dir_option: Final[_Decorator] = click.option(
    "--kubelet-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path(constants.DEVICE_PLUGIN_PATH),
    show_default=True,
    help="The kubelet's device-plugins directory (holds kubelet.sock).",
)
spec_root_option: Final[_Decorator] = click.option(
    "--spec-root",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Prefix of host paths handed to the kubelet [default: --host-root]; '/' when the host is mounted.",
)
path_option: Final[_Decorator] = click.option(
    "--path", "paths", multiple=True, help="generic: a path or glob under the host root (repeatable)."
)
count_option: Final[_Decorator] = click.option(
    "--count", type=click.IntRange(min=1), help="generic: how many times each device is handed out."
)
options_file_option: Final[_Decorator] = click.option(
    "--options-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="YAML mapping of the kind's configuration keys (as in a resources entry).",
)
options_json_option: Final[_Decorator] = click.option(
    "--options-json",
    help="The kind's configuration keys as one JSON object (how the supervisor hands a child its entry).",
)
plugins_registry_option: Final[_Decorator] = click.option(
    "--plugins-registry",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="The kubelet's plugins_registry directory [default: beside --kubelet-dir: its parent's "
    "plugins_registry when it is named device-plugins, else <DIR>.plugins_registry].",
)
rescan_interval_option: Final[_Decorator] = click.option(
    "--rescan-interval",
    type=click.FloatRange(min=0.05, max=86400),
    callback=lambda _ctx, param, value: _finite(param, value),
    default=30.0,
    show_default=True,
    help="Seconds between safety-net rescans (changes under watched paths trigger one at once).",
)
monitor_dir_option: Final[_Decorator] = click.option(
    "--monitor-dir",
    type=click.Path(file_okay=False, path_type=Path),
    envvar=constants.MONITOR_DIR_ENV,
    help="Write device reports there and share one PodResources poller with the other plugins using it "
    "(how the agent runs its children) [env: PLUGVISOR_MONITOR_DIR].",
)
pod_resources_socket_option: Final[_Decorator] = click.option(
    "--pod-resources-socket",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar=constants.POD_RESOURCES_SOCKET_ENV,
    help="The kubelet's PodResources socket [default: pod-resources/kubelet.sock beside --kubelet-dir].",
)
pod_resources_interval_option: Final[_Decorator] = click.option(
    "--pod-resources-interval",
    type=click.FloatRange(min=0.1, max=3600),
    envvar=constants.POD_RESOURCES_INTERVAL_ENV,
    default=5.0,
    show_default=True,
    help="Seconds between PodResources List calls (who holds which device).",
)
telemetry_interval_option: Final[_Decorator] = click.option(
    "--telemetry-interval",
    type=click.FloatRange(min=0.1, max=3600),
    envvar=constants.TELEMETRY_INTERVAL_ENV,
    default=10.0,
    show_default=True,
    help="Seconds between sysfs telemetry samples (AER, PCIe link, hwmon, network links).",
)
log_options_option: Final[_Decorator] = log_options()


def monitoring_options(func: Any) -> Any:
    """``--monitor-dir`` to ``--telemetry-interval`` and the log options: the end of both commands' lists."""
    for decorate in reversed(
        (
            monitor_dir_option,
            pod_resources_socket_option,
            pod_resources_interval_option,
            telemetry_interval_option,
            log_options_option,
        )
    ):
        func = decorate(func)
    return func


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
    raise SystemExit(EXIT_USAGE)


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


class ModeDispatch(LastWordsCommand):
    """``plugvisor plugin``: a command line with ``--mode dra`` goes to the DRA driver's command.

    Dispatched before parsing, since the two modes take different options, for
    ``plugvisor plugin`` and for the agent's children alike. The DRA command is
    imported by name (:data:`DRA_COMMAND`) only then, so a device plugin never
    loads the DRA side, and the DRA module, which imports this one, is never
    imported by it at load time.
    """

    def make_context(
        self, info_name: str | None, args: list[str], parent: click.Context | None = None, **extra: Any
    ) -> click.Context:
        """The DRA command's context when the arguments ask for it, else this command's."""
        if wants_dra(args):
            module, attribute = DRA_COMMAND
            command: click.Command = getattr(importlib.import_module(module), attribute)
            return command.make_context(info_name, args, parent=parent, **extra)
        return super().make_context(info_name, args, parent=parent, **extra)

    def invoke(self, ctx: click.Context) -> Any:
        """Run the command the context was made for."""
        if ctx.command is not self:
            return ctx.command.invoke(ctx)
        return super().invoke(ctx)


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


def check_host(kind: PluginKind[Any], host: HostPaths, resource: str) -> None:
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
