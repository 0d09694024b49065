"""One DRA driver's kubelet plugin, start to finish: discover, publish, serve, register, keep its sockets.

The order follows what the kubelet and the scheduler need: the first scan and
the pool it gives come first (a claim prepared before them would find no
device); the DRA socket serves before the registration socket exists (the
kubelet connects as soon as it has registered the driver); prepared claims are
read back from the checkpoint before either, so that a restarted driver
answers for the claims it prepared before. The slices come last: published
only once the kubelet has registered the driver, since the scheduler allocates
from them at once, and a pod whose claim the kubelet cannot prepare yet backs
off for about a minute. From then on every change is published, by a task of
its own (a slow or absent API server must not hold the node side back), and
again at every registration (a restarted kubelet deletes the node's slices);
a registration the driver knows is lost (its registration socket gone or taken
over) holds publishing until the next one, leaving the slices to the kubelet's
rule for a driver that went away.

Device discovery and health come from the same machinery as the device-plugin
side (:class:`~plugvisor.deviceplugin.watch.DeviceWatcher`, the kind's
``scan()``), and so does monitoring (:class:`~plugvisor.deviceplugin.device_monitor.DeviceMonitor`);
what differs is only how the devices reach the kubelet.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import uvloop

from plugvisor.common import constants
from plugvisor.common import inotify as inotify_
from plugvisor.common.exitcodes import EXIT_CONFIGURATION, EXIT_FAILURE, EXIT_OK
from plugvisor.common.hostpaths import HostPaths, beside_kubelet_dir
from plugvisor.common.names import dra_driver_name_problem, node_name_problem
from plugvisor.common.notify import STOP_FOR_GOOD_SIGNAL, StatusReporter
from plugvisor.common.validation import printable
from plugvisor.deviceplugin.cell import CellClosedError, SnapshotCell
from plugvisor.deviceplugin.device_monitor import DeviceDescriber, DeviceMonitor
from plugvisor.deviceplugin.errors import ConfigurationError, SocketInUseError
from plugvisor.deviceplugin.hooks import DeviceSource, Hooks, resolve_hooks
from plugvisor.deviceplugin.lifetime import Work, kind_lifecycle, run_until_stopped
from plugvisor.deviceplugin.monitorconfig import MonitorConfig
from plugvisor.deviceplugin.pluginwatcher import RegistrationService
from plugvisor.deviceplugin.release import default_pod_resources_socket
from plugvisor.deviceplugin.snapshot import Snapshot
from plugvisor.deviceplugin.watch import DeviceWatcher
from plugvisor.dra import cdi, sockets
from plugvisor.dra.checkpoint import FILE_NAME, Checkpoint, CheckpointError, PreparedClaim
from plugvisor.dra.cluster import ClaimReader, PublishState, SlicePublisher
from plugvisor.dra.hooks import DraDescriber
from plugvisor.dra.pool import Pool, build_pool
from plugvisor.dra.preparer import ClaimPreparer
from plugvisor.dra.server import DraServer


@dataclass(frozen=True, slots=True)
class DriverConfig:
    """Everything one DRA driver process needs besides its device source and the API server.

    The kubelet root is the parent of ``paths.kubelet_dir`` (the device-plugins
    directory): the registration socket goes to ``<root>/plugins_registry``, the
    DRA socket and the checkpoint to ``<root>/plugins/<driver>/``. ``cdi_dir`` is
    host-absolute (resolved inside the host root). ``withdraw_on_stop`` removes
    the node's slices at a clean stop: for a driver that stops for good, not one
    that is restarted (the kubelet keeps the slices of a driver that is back
    within its grace).
    """

    driver: str
    node_name: str
    paths: HostPaths = field(default_factory=HostPaths)
    cdi_dir: str = constants.DEFAULT_CDI_DIR
    rescan_interval: float = 30.0
    monitoring: MonitorConfig = field(default_factory=MonitorConfig)
    plugins_registry: Path | None = None
    replace: bool = False
    withdraw_on_stop: bool = False

    def __post_init__(self) -> None:
        problem = dra_driver_name_problem(self.driver)
        if problem is not None:
            raise ConfigurationError(problem)
        if not self.node_name:
            raise ConfigurationError("the node name is empty: set NODE_NAME or --node-name")
        problem = node_name_problem(self.node_name)  # the pool's name, and a file name without an API server
        if problem is not None:
            raise ConfigurationError(f"node name {problem}")
        if self.rescan_interval <= 0:
            raise ConfigurationError(f"rescan interval must be positive, got {self.rescan_interval}")
        if not self.cdi_dir.startswith("/"):
            raise ConfigurationError(f"the CDI directory {self.cdi_dir!r} must be an absolute path")

    @property
    def registry_dir(self) -> Path:
        """Where the kubelet's plugin watcher looks for registration sockets."""
        if self.plugins_registry is not None:
            return self.plugins_registry
        return beside_kubelet_dir(self.paths.kubelet_dir, constants.PLUGINS_REGISTRY_DIR_NAME)

    @property
    def driver_dir(self) -> Path:
        """The driver's own directory: its DRA socket and its checkpoint.

        ``/var/lib/kubelet/plugins/<driver>`` for the kubelet's ``device-plugins``
        directory; ``D.plugins/<driver>`` beside an emulated kubelet's ``D``, so
        that emulated nodes side by side never share a driver's checkpoint.
        """
        return beside_kubelet_dir(self.paths.kubelet_dir, constants.DRA_PLUGINS_DIR_NAME) / self.driver

    @property
    def dra_socket(self) -> Path:
        """The endpoint the registration names."""
        return self.driver_dir / constants.DRA_SOCKET_NAME

    @property
    def registration_socket(self) -> Path:
        """The socket the kubelet's plugin watcher finds."""
        return self.registry_dir / f"{self.driver}{constants.DRA_REGISTRATION_SOCKET_SUFFIX}"


@dataclass(frozen=True, slots=True)
class DriverRegistration:
    """One successful registration with the kubelet, as the driver saw it."""

    number: int
    seconds: float


class DraDriverRuntime:
    """Runs one driver until told to stop, and owns everything that runs for it.

    ``pools`` holds the latest published pool; ``registrations`` the latest
    successful registration (tests, benchmarks and the agent's readiness await
    it); ``preparer`` the prepared claims.
    """

    def __init__(
        self,
        config: DriverConfig,
        source: DeviceSource,
        *,
        claims: ClaimReader,
        slices: SlicePublisher,
        hooks: Hooks | None = None,
        status: StatusReporter | None = None,
    ) -> None:
        self.config = config
        self.slices = slices
        self.hooks = hooks if hooks is not None else resolve_hooks(source)
        self.status = status if status is not None else StatusReporter()
        self.snapshot: SnapshotCell[Snapshot[Any]] = SnapshotCell(Snapshot())
        self.pools: SnapshotCell[Pool] = SnapshotCell(Pool())
        self.registrations: SnapshotCell[DriverRegistration | None] = SnapshotCell(None)
        self.pool_ready = asyncio.Event()
        """Set once the first scan's pool is built: the driver serves and registers only then."""
        self._registered = 0
        """The number of the registration in force; 0 before the first and after one is lost."""
        self._to_publish = asyncio.Event()
        """A new pool or a new registration: the publishing task looks again."""
        self._describer = source if isinstance(source, DraDescriber) else None
        self._log = structlog.get_logger("plugvisor.dra").bind(driver=config.driver)
        self.checkpoint = Checkpoint(config.driver_dir / FILE_NAME, driver=config.driver)
        self.cdi_dir = config.paths.host(config.cdi_dir)
        self.preparer = ClaimPreparer(
            driver=config.driver,
            pool_name=config.node_name,
            pools=self.pools,
            hooks=self.hooks,
            claims=claims,
            checkpoint=self.checkpoint,
            cdi_dir=self.cdi_dir,
        )
        self.watcher = DeviceWatcher(
            source, self.snapshot, rescan_interval=config.rescan_interval, resource=config.driver
        )
        self.pooled: SnapshotCell[Snapshot[Any]] = SnapshotCell(Snapshot())
        """The snapshot of each pool, published after it: monitoring reports the pool's devices by name."""
        self.monitor: DeviceMonitor | None = None
        if config.monitoring.enabled:
            # Reported as PodResources' dynamic_resources name them: resource = the driver, device =
            # the name in the pool (what the owner labels are keyed by).
            self.monitor = DeviceMonitor(
                config.driver,
                self.pooled,
                source if isinstance(source, DeviceDescriber) else None,
                config.monitoring,
                pod_resources_socket=config.monitoring.pod_resources_socket
                or default_pod_resources_socket(config.paths.kubelet_dir),
                names=lambda _: self.pools.value.names,
            )
        self.server = DraServer(self.preparer, self.pools, causes=self._causes)
        self.registration = RegistrationService(
            plugin_type=constants.DRA_PLUGIN_TYPE,
            name=config.driver,
            endpoint=str(config.dra_socket),
            versions=(*constants.DRA_SERVICES, *constants.DRA_HEALTH_SERVICES),
        )
        self.dra_socket = sockets.KeptSocket(
            config.dra_socket, self.server.handlers(), role="dra", replace=config.replace
        )
        self.registration_socket = sockets.KeptSocket(
            config.registration_socket,
            (self.registration.handler(),),
            role="registration",
            replace=config.replace,
            directory_mode=0o755,
        )

    def _causes(self) -> Mapping[str, str]:
        """Why each unhealthy device is unhealthy, by name, as the monitor last described it (or empty)."""
        report = self.monitor.report.value if self.monitor is not None else None
        if report is None:
            return {}
        return {device.id: device.description.cause for device in report.devices if device.description.cause}

    def load_prepared(self) -> dict[str, PreparedClaim]:
        """The claims earlier runs prepared: the checkpoint, or what the CDI specs record if it is unusable.

        An unusable checkpoint is kept aside (``.damaged-<time>``) for people to
        look at, never overwritten silently.
        """
        try:
            return self.checkpoint.load()
        except CheckpointError as exc:
            kept = self.checkpoint.path.with_name(f"{self.checkpoint.path.name}.damaged-{int(time.time())}")
            with contextlib.suppress(OSError):
                self.checkpoint.path.rename(kept)
            recovered, problems = cdi.recover(self.cdi_dir, self.config.driver)
            self._log.error(
                "checkpoint_unusable",
                error=str(exc),
                kept_as=str(kept),
                recovered_from_cdi_specs=sorted(recovered),
                unreadable_specs=problems,
            )
            return recovered

    async def run(self, stop: asyncio.Event, *, for_good: asyncio.Event | None = None) -> None:
        """Discover, publish, serve, register; keep it so until ``stop`` is set.

        At the stop the slices are withdrawn when the configuration says
        ``withdraw_on_stop`` or ``for_good`` is set by then (the driver is not
        coming back); otherwise they stay for the driver's next process.
        """
        # Before any watch is opened, so that the agent hears of a fallback from the first one.
        # The line names the driver as ``resource=``, as the agent and the device plugins' lines do.
        stop_hearing = inotify_.on_polling(
            self._watching_by_polling, log=self._log.bind(resource=self.config.driver)
        )
        try:
            async with kind_lifecycle(self.hooks.lifecycle, self._log):
                await self._run(stop, for_good)
        finally:
            stop_hearing()

    def _watching_by_polling(self, reason: str) -> None:
        """Tell the agent that this driver polls (no inotify budget left): its status shows it."""
        self.status.send(WATCH=f"polling: {printable(reason)}")

    async def _run(self, stop: asyncio.Event, for_good: asyncio.Event | None) -> None:
        self.preparer.prepared = await asyncio.to_thread(self.load_prepared)
        if self.preparer.prepared:
            self._log.info("prepared_claims_restored", claims=sorted(self.preparer.prepared))
        work: list[Work] = [
            ("discovery", self.watcher.run()),
            ("pool", self._build_pools()),
        ]
        if self.monitor is not None:
            work.append(("monitor", self.monitor.run()))
        work.append(("serve-and-register", self._serve_and_register()))
        work.append(("publish", self._publish()))
        try:
            await run_until_stopped(stop, work)
        finally:
            # The registration first: the kubelet deregisters the driver and stops calling it.
            await self.registration_socket.stop(grace=0)
            self.pools.close()
            self.pooled.close()
            self.snapshot.close()
            await self.dra_socket.stop(grace=1.0)
            withdraw = self.config.withdraw_on_stop or (for_good is not None and for_good.is_set())
            await self._end_publishing(withdraw=withdraw)
            self.status.close()
            self._log.info("stopped", slices="withdrawn" if withdraw else "kept")

    async def _end_publishing(self, *, withdraw: bool) -> None:
        try:
            await (self.slices.withdraw() if withdraw else self.slices.close())
        except Exception as exc:  # the publisher logs API errors itself; a bug must not hide the stop
            self._log.error("slices_not_released", error=f"{type(exc).__name__}: {exc}")

    async def _build_pools(self) -> None:
        """Turn every new snapshot into the pool (published by :meth:`_publish`).

        The first pool is built once the first scan is done, even a failed one
        (the driver then registers with no devices, as a plugin does).
        """
        await self.watcher.first_scan_done.wait()
        seen = self.snapshot.version
        snapshot = self.snapshot.value
        while True:
            pool = await asyncio.to_thread(self._pool_of, snapshot, self.preparer.device_names())
            if self.pools.closed:
                return
            self.pools.publish(pool)
            self.pooled.publish(snapshot)
            self.pool_ready.set()
            self._to_publish.set()
            self.status.send(DEVICES=f"{len(pool.healthy())}/{len(pool.devices)}")
            try:
                seen, snapshot = await self.snapshot.wait_newer(seen)
            except CellClosedError:
                return

    async def _publish(self) -> None:
        """Publish the pool's listed devices while the kubelet has the driver registered (module docstring).

        Each registration publishes once even when the devices did not change:
        the publisher then puts back what was removed meanwhile.
        """
        published: tuple[list[Any], int] | None = None
        while True:
            await self._to_publish.wait()
            self._to_publish.clear()
            if not self._registered:
                continue
            wanted = (self.pools.value.listed(), self._registered)
            if wanted == published:
                continue
            published = wanted
            try:
                await self.slices.publish(wanted[0])
            except Exception as exc:  # the publisher never raises for API errors; a bug is logged
                self._log.error("slices_not_published", error=f"{type(exc).__name__}: {exc}")

    def _registration_lost(self, kept: sockets.KeptSocket) -> None:
        """Our registration socket is gone or taken over: the kubelet deregisters us; hold publishing."""
        if kept is self.registration_socket and self._registered:
            self._registered = 0
            self.slices.hold()
            self._log.info("registration_lost", slices="held until registered again")

    def _pool_of(self, snapshot: Snapshot[Any], pinned: Mapping[str, str]) -> Pool:
        try:
            return build_pool(snapshot, self._describer, driver=self.config.driver, pinned=pinned)
        except Exception as exc:  # a describer bug keeps the previous names for the devices still there
            self._log.error("dra_devices_failed", error=f"{type(exc).__name__}: {exc}")
            previous = self.pools.value
            kept = {name: d for name, d in previous.devices.items() if previous.ids[name] in snapshot.devices}
            return Pool(snapshot, kept, {name: previous.ids[name] for name in kept})

    async def _taken_over_or_back(self, kept: sockets.KeptSocket) -> None:
        """Another process of this driver took a socket over, or it is gone and the socket is ours again.

        Back, the claims are read from the checkpoint again: the other process
        prepared and unprepared claims in it meanwhile. The kubelet registers
        the driver again then, which clears ``TAKEN_OVER=`` in the agent.
        """
        if kept.standing_by:
            self.status.send(TAKEN_OVER=f"another live process serving {kept.path.name}")
        else:
            await self.preparer.reload(self.load_prepared)
            self._log.info(
                "serving_again_after_takeover", socket=kept.path.name, claims=len(self.preparer.prepared)
            )

    async def _serve_and_register(self) -> None:
        await self.pool_ready.wait()
        await self.dra_socket.start()
        await self.registration_socket.start()
        self.status.send(ENDPOINT=self.registration_socket.path.name)
        keeper = asyncio.create_task(
            sockets.keep(
                [self.dra_socket, self.registration_socket],
                on_change=self._taken_over_or_back,
                on_gone=self._registration_lost,
            ),
            name="sockets",
        )
        try:
            number = 0
            while True:
                verdict = await self.registration.wait_registered()
                number += 1
                self._registered = number
                self._to_publish.set()
                self.registrations.publish(DriverRegistration(number, verdict.seconds))
                pool = self.pools.value
                self.status.send(
                    REGISTERED=number,
                    ENDPOINT=self.registration_socket.path.name,
                    DEVICES=f"{len(pool.healthy())}/{len(pool.devices)}",
                )
                self._log.info("registered", number=number, seconds=verdict.seconds)
        finally:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper


ExitCode = int


Connect = Callable[[Callable[[PublishState], None]], Awaitable[tuple[ClaimReader, SlicePublisher]]]
"""Makes the driver's claim reader and slice publisher, in the driver's event loop (clients bind to it).

Its argument hears every change of where the slices stand (the driver reports it to its agent).
"""


def run_driver(
    config: DriverConfig,
    source: DeviceSource,
    *,
    connect: Connect,
    on_ready: Callable[[DraDriverRuntime], None] | None = None,
) -> ExitCode:
    """Run a driver in this process until SIGTERM or SIGINT; returns the process exit code.

    :data:`~plugvisor.common.notify.STOP_FOR_GOOD_SIGNAL` stops it too, and
    withdraws its slices (the agent's way of saying the driver is not coming
    back). 0 after a clean stop, 2 for configuration problems (a bad driver
    name, no API server configured, a socket path that is too long, a live
    driver of the same name already serving its sockets), 1 for anything else.
    """
    log = structlog.get_logger("plugvisor.dra").bind(driver=config.driver)

    async def main() -> None:
        stop, for_good = asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)

        def stop_for_good() -> None:
            for_good.set()
            stop.set()

        def report(state: PublishState) -> None:
            status.send(SLICES=state.summary)

        loop.add_signal_handler(STOP_FOR_GOOD_SIGNAL, stop_for_good)
        status = StatusReporter()
        claims, slices = await connect(report)
        runtime = DraDriverRuntime(config, source, claims=claims, slices=slices, status=status)
        if on_ready is not None:
            on_ready(runtime)
        await runtime.run(stop, for_good=for_good)

    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(main())
    except (ConfigurationError, SocketInUseError) as exc:
        log.error("cannot_run", error=str(exc))
        return EXIT_CONFIGURATION
    except OSError as exc:
        log.error("cannot_run", error=str(exc))
        return EXIT_FAILURE
    return EXIT_OK
