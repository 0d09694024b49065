"""One device plugin, start to finish: discover, serve, register, and re-register after kubelet restarts.

Order matters and follows what the kubelet requires: discovery's first scan
finishes before the server starts (so the first ListAndWatch message is the real
list, not an empty one that would zero the resource), and the server serves
before Register is called (the kubelet dials back inside Register since 1.25).

Until the supervisor takes over the restarts, this runtime re-registers in
process: on a kubelet restart it starts a fresh server on a fresh socket and
registers again, while discovery keeps running untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import structlog
import uvloop

from plugvisor.common import constants
from plugvisor.common.exitcodes import EXIT_CONFIGURATION, EXIT_FAILURE, EXIT_KUBELET_RESTARTED, EXIT_OK
from plugvisor.common.hostpaths import HostPaths
from plugvisor.common.monitoring import Owners
from plugvisor.common.names import extended_resource_name_problem
from plugvisor.common.notify import StatusReporter
from plugvisor.deviceplugin import metrics
from plugvisor.deviceplugin.cell import SnapshotCell
from plugvisor.deviceplugin.device_monitor import DeviceDescriber, DeviceMonitor, MonitorConfig
from plugvisor.deviceplugin.endpoint import PluginEndpoint
from plugvisor.deviceplugin.errors import ConfigurationError, RegistrationRejectedError, SocketInUseError
from plugvisor.deviceplugin.hooks import DeviceSource, Hooks, resolve_hooks
from plugvisor.deviceplugin.registration import (
    SIBLING_STOPPED,
    EndpointLostError,
    KubeletDirState,
    Registrar,
)
from plugvisor.deviceplugin.release import PodResourcesWatch, Releases, default_pod_resources_socket
from plugvisor.deviceplugin.server import PluginServer
from plugvisor.deviceplugin.snapshot import Snapshot
from plugvisor.deviceplugin.watch import DeviceWatcher
from plugvisor.deviceplugin.watcherregistration import WatcherRegistrar

KubeletRestartPolicy = Literal["reregister", "exit"]
RegistrationMode = Literal["kubelet-sock", "plugin-watcher"]
REGISTRATION_MODES: tuple[RegistrationMode, ...] = ("kubelet-sock", "plugin-watcher")


class KubeletRestartedError(Exception):
    """The kubelet restarted and the policy says the process should exit (its owner restarts it)."""


@dataclass(frozen=True, slots=True)
class PluginConfig:
    """Everything one plugin process needs besides its device source.

    ``on_kubelet_restart``: ``"reregister"`` (default) serves a fresh socket and
    registers again in process; ``"exit"`` ends the run with
    :data:`EXIT_KUBELET_RESTARTED` so that a supervisor owning restarts starts a
    new process at once.

    ``registration``: ``"kubelet-sock"`` (default) calls Register on
    ``kubelet.sock`` and handles kubelet restarts as above; ``"plugin-watcher"``
    serves the socket in ``plugins_registry`` (default: beside the kubelet
    directory, ``<kubelet_dir>/../plugins_registry``) and lets the kubelet dial
    back, on its restarts too (see :mod:`.watcherregistration`; the restart policy
    then does not apply).
    """

    resource: str
    paths: HostPaths = field(default_factory=HostPaths)
    rescan_interval: float = 30.0
    register_timeout: float = 30.0
    on_kubelet_restart: KubeletRestartPolicy = "reregister"
    monitoring: MonitorConfig = field(default_factory=MonitorConfig)
    registration: RegistrationMode = "kubelet-sock"
    plugins_registry: Path | None = None

    @property
    def registry_dir(self) -> Path:
        """Where the plugin-watcher socket goes: ``plugins_registry``, or the kubelet's default beside DIR."""
        if self.plugins_registry is not None:
            return self.plugins_registry
        return self.paths.kubelet_dir.parent / constants.PLUGINS_REGISTRY_DIR_NAME

    def __post_init__(self) -> None:
        problem = extended_resource_name_problem(self.resource)
        if problem is not None:
            raise ConfigurationError(f"resource name {problem}")
        if self.rescan_interval <= 0:
            raise ConfigurationError(f"rescan interval must be positive, got {self.rescan_interval}")
        if self.register_timeout <= 0:
            raise ConfigurationError(f"register timeout must be positive, got {self.register_timeout}")
        if self.registration not in REGISTRATION_MODES:
            raise ConfigurationError(
                f"registration must be 'kubelet-sock' or 'plugin-watcher', got {self.registration!r}"
            )
        if self.on_kubelet_restart not in ("reregister", "exit"):
            raise ConfigurationError(
                f"on_kubelet_restart must be 'reregister' or 'exit', got {self.on_kubelet_restart!r}"
            )


@dataclass(frozen=True, slots=True)
class Registration:
    """One successful registration, as seen from the plugin."""

    number: int
    endpoint: str
    seconds: float
    reason: str


class DevicePluginRuntime:
    """Runs one resource's plugin until told to stop, and owns everything that runs for it.

    ``snapshot`` is a cell holding the latest published scan; ``registrations`` a
    cell that tests, benchmarks and the supervisor's readiness can await: it holds
    the latest successful :class:`Registration`. Besides discovery, the server
    and registration, the runtime runs the source's lifecycle (``start`` before
    discovery, ``close`` after everything stopped) and, for a
    :class:`~plugvisor.deviceplugin.hooks.ReleaseHandler`, the PodResources
    release watch (``release_watch``, None until it runs).
    """

    def __init__(
        self,
        config: PluginConfig,
        source: DeviceSource,
        *,
        hooks: Hooks | None = None,
        status: StatusReporter | None = None,
    ) -> None:
        self.config = config
        self.status = status if status is not None else StatusReporter()
        self.snapshot: SnapshotCell[Snapshot[Any]] = SnapshotCell(Snapshot())
        self.hooks = hooks if hooks is not None else resolve_hooks(source)
        self.releases: Releases | None = None
        self.release_watch: PodResourcesWatch | None = None
        if self.hooks.release is not None:
            self.releases = Releases(self.hooks.release, self.snapshot, resource=config.resource)
        self.server = PluginServer(config.resource, self.snapshot, self.hooks, releases=self.releases)
        self.watcher = DeviceWatcher(
            source, self.snapshot, rescan_interval=config.rescan_interval, resource=config.resource
        )
        self.registrations: SnapshotCell[Registration | None] = SnapshotCell(None)
        self.monitor: DeviceMonitor | None = None
        watch = config.monitoring
        if watch.enabled:
            self.monitor = DeviceMonitor(
                config.resource,
                self.snapshot,
                source if isinstance(source, DeviceDescriber) else None,
                watch,
                pod_resources_socket=watch.pod_resources_socket
                or default_pod_resources_socket(config.paths.kubelet_dir),
            )
        self.endpoint: PluginEndpoint | None = None
        self.serving = asyncio.Event()
        """Set once the first endpoint serves: the first scan is done and the server has started."""
        self._log = structlog.get_logger("plugvisor.plugin").bind(resource=config.resource)

    async def run(self, stop: asyncio.Event) -> None:
        """Discover, serve, register; re-register after each kubelet restart; return when ``stop`` is set."""
        lifecycle_hook = self.hooks.lifecycle
        if lifecycle_hook is not None:
            await asyncio.to_thread(lifecycle_hook.start)
        try:
            await self._run(stop)
        finally:
            if lifecycle_hook is not None:
                try:
                    await asyncio.to_thread(lifecycle_hook.close)
                except Exception:  # closing must not hide why the plugin stopped
                    self._log.exception("close_failed")

    async def _run(self, stop: asyncio.Event) -> None:
        dir_watch = KubeletDirState(self.config.paths.kubelet_dir)
        dir_watch.open()
        registrar = Registrar(
            dir_watch, resource=self.config.resource, register_timeout=self.config.register_timeout
        )
        tasks = [
            asyncio.create_task(self.watcher.run(), name="discovery"),
            asyncio.create_task(dir_watch.run(), name="kubelet-dir-watch"),
        ]
        if self.status.enabled:
            tasks.append(asyncio.create_task(self._report_devices(), name="status"))
        release_watch = self._release_watch()
        if release_watch is not None:
            shared = self._shared_owners(release_watch)
            watching = release_watch.run() if shared is None else release_watch.follow(shared)
            tasks.append(asyncio.create_task(watching, name="release-watch"))
        if self.monitor is not None:
            tasks.append(asyncio.create_task(self.monitor.run(), name="monitor"))
        lifecycle = asyncio.create_task(self._serve_and_register(registrar), name="serve-and-register")
        stopper = asyncio.create_task(stop.wait(), name="stop")
        try:
            done, _ = await asyncio.wait([lifecycle, stopper, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not stopper and not task.cancelled():
                    error = task.exception()
                    if error is not None:
                        raise error
        finally:
            for task in [lifecycle, stopper, *tasks]:
                task.cancel()
            for task in [lifecycle, stopper, *tasks]:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            # End the ListAndWatch streams first, so they finish as a normal end of stream
            # (what the kubelet expects of a plugin going away), then stop the server.
            self.snapshot.close()
            if self.endpoint is not None:
                await self.endpoint.stop(grace=0.5)
            dir_watch.close()
            self.status.close()
            self._log.info("stopped")

    async def _serve_and_register(self, registrar: Registrar) -> None:
        await self.watcher.first_scan_done.wait()
        if self.config.registration == "plugin-watcher":
            await self._serve_for_plugin_watcher()
            return
        reason = "start"
        number = 0
        endpoint: PluginEndpoint | None = None
        while True:
            detected = time.monotonic()
            if endpoint is None:
                proposed = self.server.proposed_handler()
                endpoint = PluginEndpoint(
                    self.server,
                    self.config.paths.kubelet_dir,
                    self.config.resource,
                    extra_handlers=(proposed,) if proposed is not None else (),
                )
                await endpoint.start()
                self.serving.set()
                # Said before registering, so that whoever reaps this process knows which socket
                # it leaves behind should it be killed before it could register.
                self.status.send(ENDPOINT=endpoint.name)
                old, self.endpoint = self.endpoint, endpoint
                if old is not None:
                    await old.stop(grace=0)
            try:
                await registrar.register(endpoint.name, self.server.options)
            except EndpointLostError as exc:
                reason = "plugin socket deleted before registration"
                self._log.info("kubelet_restart_detected", reason=reason, detail=str(exc))
                endpoint = None
                continue
            number += 1
            metrics.PLUGIN_REGISTRATIONS.labels(self.config.resource).inc()
            self.registrations.publish(
                Registration(number, endpoint.name, round(time.monotonic() - detected, 6), reason)
            )
            devices = self.snapshot.value.devices
            self.status.send(
                REGISTERED=number,
                ENDPOINT=endpoint.name,
                DEVICES=f"{len(devices.healthy_ids)}/{len(devices)}",
            )
            reason = await registrar.wait_for_restart()
            if reason == SIBLING_STOPPED:
                # Not a kubelet restart: the kubelet may have followed that plugin and forgotten us.
                # Registering again on the socket we serve brings the resource back (the same
                # kubelet dials it once more), whatever the restart policy, and nobody else has to
                # learn of a new socket.
                self._log.info("registering_again", reason=reason, endpoint=endpoint.name)
                continue
            self._log.info("kubelet_restart_detected", reason=reason)
            self.status.send(KUBELET_RESTART=reason)
            if self.config.on_kubelet_restart == "exit":
                raise KubeletRestartedError(reason)
            endpoint = None

    async def _serve_for_plugin_watcher(self) -> None:
        """Serve in ``plugins_registry`` and count every time the kubelet dials back (restarts included)."""
        registrar = WatcherRegistrar(self.config.resource)
        proposed = self.server.proposed_handler()
        registry = self.config.registry_dir
        registry.mkdir(parents=True, exist_ok=True)
        endpoint = PluginEndpoint(
            self.server,
            registry,
            self.config.resource,
            extra_handlers=(registrar.handler(), *((proposed,) if proposed is not None else ())),
        )
        await endpoint.start()
        self.serving.set()
        self.endpoint = endpoint
        reason = "start"
        number = 0
        while True:
            verdict = await registrar.wait_registered()
            number += 1
            metrics.PLUGIN_REGISTRATIONS.labels(self.config.resource).inc()
            self.registrations.publish(Registration(number, endpoint.name, verdict.seconds, reason))
            devices = self.snapshot.value.devices
            self.status.send(
                REGISTERED=number,
                ENDPOINT=endpoint.name,
                DEVICES=f"{len(devices.healthy_ids)}/{len(devices)}",
            )
            self._log.info("registered", via="plugin-watcher", number=number, seconds=verdict.seconds)
            reason = "kubelet dialled back"

    async def _report_devices(self) -> None:
        seen = -1
        while True:
            seen, snapshot = await self.snapshot.wait_newer(seen)
            devices = snapshot.devices
            self.status.send(DEVICES=f"{len(devices.healthy_ids)}/{len(devices)}")

    def _shared_owners(self, watch: PodResourcesWatch) -> SnapshotCell[Owners] | None:
        """The agent-wide owners, when monitoring polls the same PodResources socket: one caller, not two.

        Release detection then follows the monitoring poll interval rather than the kind's own.
        """
        monitor = self.monitor
        if monitor is None or monitor.owner_watch is None or monitor.owner_watch.socket != watch.socket:
            return None
        return monitor.owner_watch.owners

    def _release_watch(self) -> PodResourcesWatch | None:
        """The PodResources watch the source asks for, if it handles releases and wants one."""
        handler, releases = self.hooks.release, self.releases
        if handler is None or releases is None:
            return None
        wanted = handler.release_watch()
        if wanted is None:
            return None
        socket = wanted.socket or default_pod_resources_socket(self.config.paths.kubelet_dir)
        self.release_watch = PodResourcesWatch(
            socket=socket,
            resource=self.config.resource,
            interval=wanted.interval,
            on_release=releases.release,
            on_held=releases.held,
        )
        return self.release_watch


ExitCode = int


def settle_collector() -> None:
    """Take everything the start-up made out of the cyclic garbage collector's sight: it lives as long as us.

    A plugin process holds tens of thousands of objects from its imports, its
    configuration and its server (58,000 for ``generic``), and a full collection
    walks them all: 50-70 ms with the event loop stopped (bench/tail_allocate.py),
    which any call in flight waits out. Collections of the generation they sit in
    come whenever enough newer objects have survived, as each rescan's devices do.
    Frozen, they are never walked again (objects are still freed by reference
    counting); a full collection then walks only what came after, and a
    collection costs what the plugin's current state costs. What start-up left
    as cyclic garbage is frozen too and never reclaimed (none, as
    ``bench/tail_allocate.py --freeze count`` measures it). :func:`run_plugin`
    calls this once the plugin serves; a program that runs
    :class:`DevicePluginRuntime` inside its own process decides for itself.
    """
    gc.freeze()


def plugin_event_loop() -> asyncio.AbstractEventLoop:
    """The event loop a plugin process runs on: libuv's (uvloop), not asyncio's own.

    With plugvisor's servicer, the server's CPU time per Allocate call measured
    4-16% lower than on asyncio's loop, which put the round trip at or below a
    bare grpc.aio server on asyncio's loop, for 2-3 MB of PSS per process
    (bench/bench_servers.py; bench/README.md says how it was picked). Imported
    at module level so that the agent's fork server, which preloads this
    module, shares it with every child.
    """
    return uvloop.new_event_loop()


def run_plugin(
    config: PluginConfig,
    source: DeviceSource,
    *,
    hooks: Hooks | None = None,
    on_ready: Callable[[DevicePluginRuntime], None] | None = None,
) -> ExitCode:
    """Run a plugin in this process until SIGTERM or SIGINT; returns the process exit code.

    0 after a clean stop, 2 for configuration problems (a bad resource name, a
    socket path that is too long, a refusal by the kubelet), 3 when the kubelet
    restarted and ``on_kubelet_restart="exit"``, 1 for anything else.
    """
    log = structlog.get_logger("plugvisor.plugin").bind(resource=config.resource)
    fallback = metrics.reserve_multiprocess_files()
    if fallback is not None:
        log.warning("metrics_kept_local", reason=fallback, note="serving devices as ever")

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        runtime = DevicePluginRuntime(config, source, hooks=hooks)
        if on_ready is not None:
            on_ready(runtime)
        # Once serving, start-up is over: what it made lives as long as the process (settle_collector).
        started = asyncio.create_task(runtime.serving.wait())
        started.add_done_callback(lambda task: None if task.cancelled() else settle_collector())
        try:
            await runtime.run(stop)
        finally:
            started.cancel()

    try:
        with asyncio.Runner(loop_factory=plugin_event_loop) as runner:
            runner.run(main())
    except (ConfigurationError, RegistrationRejectedError) as exc:
        log.error("cannot_run", error=str(exc))
        return EXIT_CONFIGURATION
    except SocketInUseError as exc:
        log.error("cannot_run", error=str(exc))
        return EXIT_FAILURE
    except KubeletRestartedError as exc:
        log.info("exiting_for_restart", reason=str(exc))
        return EXIT_KUBELET_RESTARTED
    return EXIT_OK
