"""The node configuration file: schema, validation with errors that name the field, and child specs.

One YAML file describes the node (see docs/supervisor.md): where
the kubelet and the host are, the metrics endpoint, the supervisor's own knobs,
and one ``resources`` entry per extended resource. Each entry's ``name`` and
``kind`` are ours; every other key belongs to the kind and is validated by the
kind's own pydantic model (``plugvisor.plugins.kinds``), so a typo in a GPU
match rule is reported as ``node.yaml: resources[0].match.vendor: unknown key``
before any process starts, exactly like a typo in our own keys.

Validation runs in two passes (our keys, then each kind's keys) and the errors
of the second pass are re-rooted under ``resources[i]`` so that one renderer
(:func:`plugvisor.common.validation.describe`) prints them all.
"""

from __future__ import annotations

import ipaddress
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Final, Literal

import pydantic
import pydantic_core

from plugvisor.common import constants
from plugvisor.common.hostpaths import (
    beside_kubelet_dir,
    host_root_problem,
    kubelet_dir_problem,
    missing_kubelet_dir_problem,
    writable_dir_problem,
)
from plugvisor.common.names import dra_driver_name_problem, extended_resource_name_problem, node_name_problem
from plugvisor.common.sockets import longest_socket_path
from plugvisor.common.validation import describe, known_keys, path_problem, shorten, unknown_key
from plugvisor.common.yamlfile import YamlFileError, read_yaml
from plugvisor.plugins import kinds

DEFAULT_RUNTIME_DIR: Final = Path("/run/plugvisor")
RUNTIME_DIR_ENV: Final = "PLUGVISOR_RUNTIME_DIR"
MAX_RESOURCES: Final = 256
"""Most ``resources`` one node may configure: each is a process, and no node has more device types."""
MAX_OPTIONS_BYTES: Final = 64 * 1024
"""Largest kind options of one entry (as JSON): they travel on the child's command line."""
_STATUS_SOCKET_NAME: Final = "status.sock"  # plugvisor.supervisor.status.REPORT_SOCKET


class ConfigError(Exception):
    """The configuration cannot be used; the message names the file, the field and what was expected."""


class _Model(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(
        extra="forbid", frozen=True, populate_by_name=True, allow_inf_nan=False
    )


def _listen_address(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{value!r} must be HOST:PORT, e.g. 127.0.0.1:9400 (port 0 picks a free one)")
    host = host.strip("[]")
    if host not in ("", "localhost"):
        try:
            ipaddress.ip_address(host)
        except ValueError as exc:
            raise ValueError(f"{value!r}: host must be an IP address or localhost") from exc
    return value


class MetricsConfig(_Model):
    """Prometheus ``/metrics``, ``/healthz`` and ``/readyz``; loopback unless told otherwise."""

    listen: Annotated[str, pydantic.AfterValidator(_listen_address)] = "127.0.0.1:9400"

    @property
    def host(self) -> str:
        """The address to bind."""
        return self.listen.rpartition(":")[0].strip("[]") or "0.0.0.0"  # noqa: S104 - explicit ":PORT" only

    @property
    def port(self) -> int:
        """The port to bind (0: any free port)."""
        return int(self.listen.rpartition(":")[2])


class RestartConfig(_Model):
    """Backoff of unexpected exits (see :class:`plugvisor.supervisor.backoff.BackoffPolicy`)."""

    initial_delay: Annotated[float, pydantic.Field(gt=0, le=3600, alias="initialDelay")] = 0.25
    max_delay: Annotated[float, pydantic.Field(gt=0, le=3600, alias="maxDelay")] = 30.0
    multiplier: Annotated[float, pydantic.Field(ge=1, le=100)] = 2.0
    jitter: Annotated[float, pydantic.Field(ge=0, le=1)] = 0.2
    reset_after: Annotated[float, pydantic.Field(gt=0, le=86400, alias="resetAfter")] = 10.0
    crash_loop_after: Annotated[int, pydantic.Field(ge=2, le=1000, alias="crashLoopAfter")] = 5

    @pydantic.model_validator(mode="after")
    def _ordered(self) -> RestartConfig:
        if self.max_delay < self.initial_delay:
            raise ValueError("maxDelay must be at least initialDelay")
        return self


class SupervisorConfig(_Model):
    """The supervisor's own knobs (all optional)."""

    spawner: Literal["forkserver", "exec"] = "forkserver"
    on_kubelet_restart: Literal["reregister", "restart"] = pydantic.Field(
        default="restart", alias="onKubeletRestart"
    )
    stop_timeout: Annotated[float, pydantic.Field(gt=0, le=300, alias="stopTimeout")] = 5.0
    registration_timeout: Annotated[float, pydantic.Field(gt=0, le=3600, alias="registrationTimeout")] = 30.0
    """A child still unregistered this long after the kubelet came up (or it started) is restarted."""
    runtime_dir: Path | None = pydantic.Field(default=None, alias="runtimeDir")
    restart: RestartConfig = RestartConfig()

    @pydantic.field_validator("runtime_dir", mode="after")
    @classmethod
    def _runtime_dir(cls, value: Path | None) -> Path | None:
        if value is None:
            return value
        _check_path(value)
        longest = len(os.fsencode(value / _STATUS_SOCKET_NAME))
        if longest > constants.MAX_UNIX_SOCKET_PATH:
            raise ValueError(
                f"too long for the status socket in it: {longest} bytes, "
                f"unix sockets allow {constants.MAX_UNIX_SOCKET_PATH}"
            )
        return value


class MonitoringConfig(_Model):
    """Per-device monitoring (docs/monitoring.md): who holds which device, and sysfs telemetry.

    ``podResourcesSocket`` defaults to ``pod-resources/kubelet.sock`` beside the
    kubelet directory. One child of the agent polls it every
    ``podResourcesInterval`` seconds (the kubelet allows 100 calls/s for the
    whole node); every child samples telemetry every ``telemetryInterval``.
    """

    enabled: bool = True
    pod_resources_socket: Path | None = pydantic.Field(default=None, alias="podResourcesSocket")
    pod_resources_interval: Annotated[
        float, pydantic.Field(ge=0.1, le=3600, alias="podResourcesInterval")
    ] = 5.0
    telemetry_interval: Annotated[float, pydantic.Field(ge=0.1, le=3600, alias="telemetryInterval")] = 10.0


API_MODES: Final = ("device-plugin", "dra")


class ResourceConfig(pydantic.BaseModel):
    """One ``resources`` entry: ``name`` and ``kind`` plus the kind's own keys (kept as written).

    ``mode`` says which kubelet API the kind is served through: ``device-plugin``
    (the default; ``name`` is the extended resource, e.g. ``plugvisor.io/gpu``) or
    ``dra`` (``name`` is the driver, a DNS subdomain such as ``gpu.plugvisor.io``;
    it always registers through the plugin watcher). Any other value is handed to
    the kind as its own ``mode`` key, for what took that name before DRA (the
    fpga kind's ``mode: af|region|xilinx``, now ``family``, still taken with a
    warning), and the resource is a device plugin; a kind without such a key
    makes it the error "expected device-plugin or dra".
    """

    model_config = pydantic.ConfigDict(extra="allow", frozen=True)

    # Before `name`, whose rule depends on it (pydantic validates fields in this order).
    mode: str = "device-plugin"
    name: str
    kind: Annotated[str, pydantic.StringConstraints(min_length=1)]
    registration: Literal["kubelet-sock", "plugin-watcher"] = "kubelet-sock"
    """How the child registers: Register on kubelet.sock, or a plugins_registry socket the kubelet dials."""
    rescan_interval: Annotated[
        float | None, pydantic.Field(ge=0.05, le=86400, allow_inf_nan=False, alias="rescanInterval")
    ] = None
    """Seconds between the child's periodic rescans (``plugvisor plugin --rescan-interval``; 30 when
    absent): the bound on noticing a change inotify does not report, such as an attribute written in place."""

    @pydantic.field_validator("name")
    @classmethod
    def _resource_or_driver_name(cls, value: str, info: pydantic.ValidationInfo) -> str:
        dra = info.data.get("mode") == "dra"
        problem = dra_driver_name_problem(value) if dra else extended_resource_name_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value

    @pydantic.model_validator(mode="after")
    def _dra_registers_through_the_watcher(self) -> ResourceConfig:
        if self.dra and "registration" in self.model_fields_set and self.registration != "plugin-watcher":
            raise ValueError(
                "a DRA driver registers through the kubelet's plugin watcher: leave out registration"
            )
        return self

    @property
    def dra(self) -> bool:
        """Whether the kind is served as a DRA driver (else as a device plugin)."""
        return self.mode == "dra"

    @property
    def options(self) -> dict[str, Any]:
        """The kind's keys, exactly as the file has them (handed to the child as JSON)."""
        options = dict(self.model_extra or {})
        if self.mode not in API_MODES:
            options["mode"] = self.mode
        return options


class NodeConfig(_Model):
    """The whole file."""

    kubelet_dir: Path = pydantic.Field(default=Path(constants.DEVICE_PLUGIN_PATH), alias="kubeletDir")
    node_name: str | None = pydantic.Field(default=None, alias="nodeName")
    """The Node the DRA drivers publish for (default: ``NODE_NAME``, else the host name)."""
    host_root: Path = pydantic.Field(default=Path("/"), alias="hostRoot")
    spec_root: Path | None = pydantic.Field(default=None, alias="specRoot")
    metrics: MetricsConfig | None = None
    supervisor: SupervisorConfig = SupervisorConfig()
    monitoring: MonitoringConfig = MonitoringConfig()
    resources: Annotated[list[ResourceConfig], pydantic.Field(min_length=1)]

    @pydantic.field_validator("kubelet_dir", "host_root", "spec_root", mode="after")
    @classmethod
    def _absolute(cls, value: Path | None) -> Path | None:
        if value is not None:
            _check_path(value)
        return value

    @pydantic.field_validator("node_name", mode="after")
    @classmethod
    def _node_name(cls, value: str | None) -> str | None:
        problem = None if value is None else node_name_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value

    @property
    def dra_plugins_dir(self) -> Path:
        """Where DRA drivers keep their directories (``/var/lib/kubelet/plugins``): beside ``kubeletDir``."""
        return beside_kubelet_dir(self.kubelet_dir, constants.DRA_PLUGINS_DIR_NAME)

    @property
    def plugins_registry(self) -> Path:
        """Where plugin-watcher children serve their sockets: beside ``kubeletDir``, as the plugins do."""
        return beside_kubelet_dir(self.kubelet_dir, constants.PLUGINS_REGISTRY_DIR_NAME)

    @property
    def runtime_dir(self) -> Path:
        """Where the state file, the status socket and the metrics files live."""
        if self.supervisor.runtime_dir is not None:
            return self.supervisor.runtime_dir
        return Path(os.environ.get(RUNTIME_DIR_ENV) or DEFAULT_RUNTIME_DIR)


def _check_path(value: Path) -> None:
    """An absolute path the kernel can open (no NUL, no control character, at most PATH_MAX bytes)."""
    problem = path_problem(str(value))
    if problem is not None:
        raise ValueError(problem)


def _custom(
    kind: str, message: str, loc: tuple[int | str, ...], value: Any
) -> pydantic_core.InitErrorDetails:
    return {"type": pydantic_core.PydanticCustomError(kind, message), "loc": loc, "input": value}


def _longest_socket_path(config: NodeConfig, resource: ResourceConfig) -> int:
    """The longest socket path ``resource``'s child serves, in bytes.

    A plugin-watcher child serves in plugins_registry, which may be the longer directory
    (``D.plugins_registry`` beside a kubeletDir ``D`` not named device-plugins).
    """
    if resource.dra:
        return max(len(os.fsencode(path)) for path in dra_socket_paths(config.kubelet_dir, resource.name))
    directories = [config.kubelet_dir]
    if resource.registration == "plugin-watcher":
        directories.append(config.plugins_registry)
    return max(longest_socket_path(directory, resource.name) for directory in directories)


def _entry_errors(config: NodeConfig) -> list[pydantic_core.InitErrorDetails]:
    """Check what spans entries, and each entry's kind keys with the kind's model.

    Errors are rooted under ``resources[i]`` so that they read like the first pass's.
    """
    errors: list[pydantic_core.InitErrorDetails] = []
    seen: dict[str, int] = {}
    for index, resource in enumerate(config.resources):
        if resource.name in seen:
            message = f"{resource.name} is already configured by resources[{seen[resource.name]}]"
            errors.append(_custom("duplicate_resource", message, ("resources", index, "name"), resource.name))
        seen.setdefault(resource.name, index)
        longest = _longest_socket_path(config, resource)
        if longest > constants.MAX_UNIX_SOCKET_PATH:
            message = (
                f"too long for the sockets of {resource.name}: {longest} bytes, "
                f"unix sockets allow {constants.MAX_UNIX_SOCKET_PATH}"
            )
            errors.append(_custom("socket_path_too_long", message, ("kubeletDir",), str(config.kubelet_dir)))
        try:
            kind = kinds.get_kind(resource.kind)
        except kinds.UnknownKindError as exc:
            errors.append(_custom("unknown_kind", str(exc), ("resources", index, "kind"), resource.kind))
            continue
        except Exception as exc:
            message = f"kind {resource.kind!r} is installed but cannot be loaded: {exc!r}"
            errors.append(_custom("broken_kind", message, ("resources", index, "kind"), resource.kind))
            continue
        size = len(json.dumps(resource.options, separators=(",", ":")))
        if size > MAX_OPTIONS_BYTES:
            message = f"the kind's keys take {size} bytes as JSON; at most {MAX_OPTIONS_BYTES} are allowed"
            errors.append(_custom("options_too_large", message, ("resources", index), "..."))
            continue
        try:
            kind.options_model.model_validate(resource.options)
        except pydantic.ValidationError as exc:
            for item in exc.errors():
                if item["loc"] == ("mode",) and item["type"] == "extra_forbidden":
                    # Not the kind's old key either (the fpga kind's family, once called mode).
                    message = f"expected device-plugin or dra, got {shorten(resource.mode)!r}"
                    errors.append(
                        _custom("unknown_mode", message, ("resources", index, "mode"), resource.mode)
                    )
                    continue
                if item["type"] == "extra_forbidden":  # our keys are as valid here as the kind's
                    within = item["loc"][:-1]
                    known = known_keys(kind.options_model, within)
                    if not within:
                        known += known_keys(ResourceConfig, ())
                    message = unknown_key(item["loc"][-1], known)
                    loc = ("resources", index, *item["loc"])
                    errors.append(_custom("unknown_key", message, loc, item["input"]))
                    continue
                detail: pydantic_core.InitErrorDetails = {
                    "type": item["type"],
                    "loc": ("resources", index, *item["loc"]),
                    "input": item["input"],
                }
                if "ctx" in item:
                    detail["ctx"] = item["ctx"]
                errors.append(detail)
    return errors


def parse_config(data: Any, *, source: str) -> NodeConfig:
    """Validate an already-parsed document; :class:`ConfigError` lists every problem found."""
    if not isinstance(data, dict):
        kind = "an empty file" if data is None else type(data).__name__
        raise ConfigError(f"{source}: (top level): expected a mapping with a 'resources' list, got {kind}")
    resources = data.get("resources")
    if isinstance(resources, list) and len(resources) > MAX_RESOURCES:
        # Checked before validating anything: 200,000 entries would take minutes and gigabytes to reject.
        raise ConfigError(
            f"{source}: resources: {len(resources)} entries; at most {MAX_RESOURCES} resources per node"
        )
    try:
        config = NodeConfig.model_validate(data)
    except pydantic.ValidationError as exc:
        raise ConfigError(describe(exc, source=source, model=NodeConfig)) from None
    errors = _entry_errors(config)
    if errors:
        combined = pydantic.ValidationError.from_exception_data("NodeConfig", errors)
        raise ConfigError(describe(combined, source=source))
    return config


def load_config(path: Path) -> NodeConfig:
    """Read and validate the file at ``path``; every way the file can be bad is a :class:`ConfigError`.

    That includes a file that is not UTF-8, repeats a key, is a directory or a
    FIFO, or is absurdly large (:func:`plugvisor.common.yamlfile.read_yaml`): on SIGHUP
    the agent then keeps its running configuration instead of dying.
    """
    try:
        data = read_yaml(path)
    except YamlFileError as exc:
        raise ConfigError(str(exc)) from None
    return parse_config(data, source=str(path))


def load_node_config(path: Path) -> NodeConfig:
    """:func:`load_config`, then check that this node can run it (the agent's start and every reload).

    The kubelet and runtime directories must be creatable and writable and the
    host root a directory; otherwise every child would fail the same way, over
    and over, or the agent would die at start with a traceback. Not part of
    :func:`load_config`: ``export`` and ``status`` may read a file meant for
    another machine.
    """
    config = load_config(path)
    problems = [
        f"{path}: {field}: {problem}"
        for field, problem in (
            (
                "kubeletDir",
                kubelet_dir_problem(config.kubelet_dir) or missing_kubelet_dir_problem(config.kubelet_dir),
            ),
            ("hostRoot", host_root_problem(config.host_root)),
        )
        if problem is not None
    ]
    if not problems and any(resource.registration == "plugin-watcher" for resource in config.resources):
        registry = config.plugins_registry
        watcher = writable_dir_problem(registry, purpose="plugin-watcher children serve their sockets there")
        if watcher is not None:
            problems.append(f"{path}: kubeletDir: {watcher} (resources with registration: plugin-watcher)")
    if not problems:  # only then create the runtime directory: a refused file leaves nothing behind
        purpose = "the agent keeps its state file there"
        runtime = writable_dir_problem(config.runtime_dir, purpose=purpose, mode=0o755)
        if runtime is not None:
            problems.append(f"{path}: supervisor.runtimeDir: {runtime}")
    if problems:
        raise ConfigError("\n".join(problems))
    return config


def dra_socket_paths(kubelet_dir: Path, driver: str) -> tuple[Path, Path]:
    """A DRA driver's registration socket and DRA socket, where the kubelet (or the emulated one) looks."""
    registry = beside_kubelet_dir(kubelet_dir, constants.PLUGINS_REGISTRY_DIR_NAME)
    plugins = beside_kubelet_dir(kubelet_dir, constants.DRA_PLUGINS_DIR_NAME)
    return (
        registry / f"{driver}{constants.DRA_REGISTRATION_SOCKET_SUFFIX}",
        plugins / driver / constants.DRA_SOCKET_NAME,
    )


@dataclass(frozen=True, slots=True)
class ChildSpec:
    """Everything that defines one child process; two equal specs mean "no need to restart".

    ``args`` follow the ``plugvisor`` program name (``plugin KIND --resource ...``):
    the exec spawner prefixes ``python -m plugvisor``, the fork server hands them to
    the already-imported command.
    """

    resource: str
    kind: str
    args: tuple[str, ...]
    mode: str = "device-plugin"
    revision: str = ""
    """The revision of an outside kind's installed code (:func:`~plugvisor.plugins.kinds.kind_revision`):
    a reinstalled kind's children differ from the running ones, so a reload restarts them."""

    def argv(self) -> list[str]:
        """The full command line for fork+exec (and for supervisord)."""
        return [sys.executable, "-m", "plugvisor", *self.args]


def child_specs(
    config: NodeConfig, *, log_format: str = "kv", log_level: str = "info"
) -> dict[str, ChildSpec]:
    """One spec per resource, in file order, keyed by resource name.

    With ``onKubeletRestart: restart`` the child is told to exit (status 3) when
    the kubelet restarts, so that the supervisor starts a fresh process at once;
    with ``reregister`` it registers again in process and the supervisor only watches.
    """
    policy = "exit" if config.supervisor.on_kubelet_restart == "restart" else "reregister"
    specs: dict[str, ChildSpec] = {}
    for resource in config.resources:
        shared = [
            "--host-root",
            str(config.host_root),
            "--kubelet-dir",
            str(config.kubelet_dir),
            "--options-json",
            json.dumps(resource.options, sort_keys=True, separators=(",", ":")),
            # The agent owns its resources: a plugin started by hand for one of them is taken over
            # (with a warning), where a plugin started by hand refuses to take over the agent's.
            "--replace",
            "--log-format",
            log_format,
            "--log-level",
            log_level,
        ]
        if config.spec_root is not None:
            shared += ["--spec-root", str(config.spec_root)]
        if resource.rescan_interval is not None:
            shared += ["--rescan-interval", repr(resource.rescan_interval)]
        revision = kinds.kind_revision(resource.kind)
        if resource.dra:
            # A DRA driver (plugvisor.plugins.draentry) has no kubelet-restart policy: the kubelet's
            # plugin watcher dials its registration socket again when it starts, so the driver keeps
            # running (its prepared claims, its slices) and the agent only follows.
            args = ["plugin", resource.kind, "--mode", "dra", "--driver", resource.name, *shared]
            if config.node_name is not None:
                args += ["--node-name", config.node_name]
            specs[resource.name] = ChildSpec(
                resource.name, resource.kind, tuple(args), mode="dra", revision=revision
            )
            continue
        args = ["plugin", resource.kind, "--resource", resource.name, *shared]
        args += ["--on-kubelet-restart", policy, "--registration", resource.registration]
        specs[resource.name] = ChildSpec(resource.name, resource.kind, tuple(args), revision=revision)
    return specs
