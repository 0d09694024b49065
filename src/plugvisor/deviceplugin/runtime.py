"""One device plugin, start to finish: discover, serve, register, and re-register after kubelet restarts.

Order matters and follows what the kubelet requires: discovery's first scan
finishes before the server starts (so the first ListAndWatch message is the real
list, not an empty one that would zero the resource), and the server serves
before Register is called (the kubelet dials back inside Register since 1.25).

Until the supervisor takes over the restarts, this runtime re-registers in
process: on a kubelet restart it starts a fresh server on a fresh socket and
registers again, while discovery keeps running untouched.

Every Register goes out from a socket that was never registered: a 1.37 kubelet
refuses a second Register from a socket it holds a stream on, and then never
notices that plugin's end (docs/architecture.md, "Two plugins for one
resource"). And an older socket keeps serving for as long as the kubelet holds
a stream on it: up to 1.36 the end of *any* stream of a resource disconnects
the plugin the kubelet follows (kubernetes#121994).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

import grpc
import structlog
import uvloop

from plugvisor.common import constants
from plugvisor.common import inotify as inotify_
from plugvisor.common.exitcodes import EXIT_CONFIGURATION, EXIT_FAILURE, EXIT_KUBELET_RESTARTED, EXIT_OK
from plugvisor.common.hostpaths import HostPaths, beside_kubelet_dir
from plugvisor.common.names import extended_resource_name_problem
from plugvisor.common.notify import StatusReporter
from plugvisor.common.sockets import socket_answers, socket_prefix
from plugvisor.common.validation import printable
from plugvisor.deviceplugin import metrics
from plugvisor.deviceplugin.cell import SnapshotCell
from plugvisor.deviceplugin.endpoint import PluginEndpoint, remove_dead_instances
from plugvisor.deviceplugin.errors import ConfigurationError, RegistrationRejectedError, SocketInUseError
from plugvisor.deviceplugin.hooks import DeviceSource, Hooks, resolve_hooks
from plugvisor.deviceplugin.lifetime import Work, cancel_all, kind_lifecycle, run_until_stopped
from plugvisor.deviceplugin.monitorconfig import MonitorConfig
from plugvisor.deviceplugin.registration import (
    SIBLING_CUT_WAIT,
    SIBLING_STARTED,
    SIBLING_STOPPED,
    EndpointLostError,
    KubeletDirState,
    Registrar,
    SocketIdentity,
)
from plugvisor.deviceplugin.release import PodResourcesWatch, Releases, default_pod_resources_socket
from plugvisor.deviceplugin.server import PluginServer
from plugvisor.deviceplugin.snapshot import Snapshot
from plugvisor.deviceplugin.watch import DeviceWatcher
from plugvisor.deviceplugin.watcherregistration import (
    RegistrySocketWatch,
    WatcherRegistrar,
    wait_until_answers,
)

if TYPE_CHECKING:
    from plugvisor.common.monitoring import Owners
    from plugvisor.deviceplugin.device_monitor import DeviceMonitor

WATCHER_SILENCE: Final = 5.0
"""Seconds without a plugin-watcher registration after which the plugin says what it waits for."""
CUT_PAUSE_MAX: Final = 30.0
"""Seconds, at most, between registrations whose streams the kubelet cut at once (:class:`CutPacing`)."""
TAKER_CHECK_INTERVAL: Final = 1.0
"""Seconds between two looks at the plugin that took our resource over (one killed leaves its socket)."""
STREAM_OPEN_TIMEOUT: Final = 10.0
"""Seconds the kubelet has, after a registration, to open ListAndWatch before the plugin registers again."""
STREAM_CUT: Final = "the kubelet ended this plugin's ListAndWatch stream"
"""Why a plugin registers again when the kubelet, still running, closed the stream it held on our socket."""

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
    directory, :func:`~plugvisor.common.hostpaths.beside_kubelet_dir`) and lets the kubelet dial
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
        return beside_kubelet_dir(self.paths.kubelet_dir, constants.PLUGINS_REGISTRY_DIR_NAME)

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


class CutPacing:
    """Paces registering again after the kubelet cut our stream: at once, then backing off if it goes on.

    One cut is the kubelet dropping us for another plugin's end (up to 1.36).
    Cut after cut is the kubelet refusing what we send (a device list over its
    4 MiB message limit, say): registering again at once would loop as fast as
    the round trip. So from the second cut in a row the pause doubles from 0.5 s
    up to :data:`CUT_PAUSE_MAX`; a registration that lasted longer than that
    starts the count again.
    """

    def __init__(self, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self._sleep = sleep
        self.in_a_row = 0

    async def pause(self, lasted: float) -> float:
        """Wait before registering again after a cut registration that ``lasted`` seconds; return the wait."""
        self.in_a_row = self.in_a_row + 1 if lasted < CUT_PAUSE_MAX else 1
        if self.in_a_row == 1:
            return 0.0
        delay: float = min(0.5 * 2.0 ** (self.in_a_row - 2), CUT_PAUSE_MAX)
        await self._sleep(delay)
        return delay


@dataclass(slots=True)
class _Siblings:
    """What one registration has seen of the other plugins of its resource, and what it waits for."""

    started: bool = False
    """One started since we registered: the kubelet follows it once it registers."""
    taken_over_by: str | None = None
    """The one that started and answers: we stand by and look at it now and then."""
    settle_until: float | None = None
    """Only older ones (taken over by us) stopped: their cut is awaited until then (SIBLING_CUT_WAIT)."""

    def timeout(self, now: float) -> float | None:
        """How long the next wait may last before :meth:`timed_out` has something to look at."""
        if self.settle_until is not None:
            return max(0.0, self.settle_until - now)
        return TAKER_CHECK_INTERVAL if self.taken_over_by is not None else None

    def stopped(self, now: float) -> bool:
        """One stopped: whether to look for live ones now, or first give its cut time to come."""
        if self.started:
            return True
        if self.settle_until is None:
            self.settle_until = now + SIBLING_CUT_WAIT
        return False

    def timed_out(self, now: float) -> bool:
        """A wait ran out: whether to look for live ones now."""
        if self.settle_until is not None:
            if now < self.settle_until:
                return False
            self.settle_until = None
            return True
        return self.taken_over_by is not None


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
            # Imported only by a plugin that monitors: the report model and the PodResources poller
            # are no part of a standalone plugin's start without metrics.
            from plugvisor.deviceplugin.device_monitor import DeviceDescriber, DeviceMonitor  # noqa: PLC0415

            self.monitor = DeviceMonitor(
                config.resource,
                self.snapshot,
                source if isinstance(source, DeviceDescriber) else None,
                watch,
                pod_resources_socket=watch.pod_resources_socket
                or default_pod_resources_socket(config.paths.kubelet_dir),
            )
        self.endpoint: PluginEndpoint | None = None
        """The socket registered last."""
        self.serving = asyncio.Event()
        """Set once the first endpoint serves: the first scan is done and the server has started."""
        self.retained: dict[PluginEndpoint, asyncio.Task[None]] = {}
        """Older sockets the kubelet still holds a stream on, each with the task that stops it at the end."""
        self._sweep: asyncio.Task[None] | None = None
        """Removing dead sockets beside ``kubelet.sock`` (see :meth:`_remove_dead_sockets`)."""
        self._log = structlog.get_logger("plugvisor.plugin").bind(resource=config.resource)

    async def run(self, stop: asyncio.Event) -> None:
        """Discover, serve, register; re-register after each kubelet restart; return when ``stop`` is set."""
        async with kind_lifecycle(self.hooks.lifecycle, self._log):
            await self._run(stop)

    async def _run(self, stop: asyncio.Event) -> None:
        # Before any watch is opened, so that the agent hears of a fallback from the first one.
        stop_hearing = inotify_.on_polling(self._watching_by_polling, log=self._log)
        dir_watch = KubeletDirState(self.config.paths.kubelet_dir, log=self._log)
        try:
            dir_watch.open()
        except OSError as exc:  # the check before start cannot foresee all (mkdir in /proc as root)
            where = exc.filename or self.config.paths.kubelet_dir
            raise ConfigurationError(f"kubelet dir {where}: {exc.strerror or exc}") from None
        registrar = Registrar(
            dir_watch,
            resource=self.config.resource,
            register_timeout=self.config.register_timeout,
            on_waiting=self._waiting,
        )
        work: list[Work] = [
            ("discovery", self.watcher.run()),
            ("kubelet-dir-watch", dir_watch.run()),
        ]
        if self.status.enabled:
            work.append(("status", self._report_devices()))
        release_watch = self._release_watch()
        if release_watch is not None:
            shared = self._shared_owners(release_watch)
            work.append(
                ("release-watch", release_watch.run() if shared is None else release_watch.follow(shared))
            )
        if self.monitor is not None:
            work.append(("monitor", self.monitor.run()))
        work.append(("serve-and-register", self._serve_and_register(registrar)))
        try:
            await run_until_stopped(stop, work)
        finally:
            # End the ListAndWatch streams first, so they finish as a normal end of stream
            # (what the kubelet expects of a plugin going away), then stop the server.
            self.snapshot.close()
            for endpoint in [*self.retained, *([self.endpoint] if self.endpoint is not None else [])]:
                await endpoint.stop(grace=0.5)
            await asyncio.gather(*self.retained.values(), return_exceptions=True)
            if self._sweep is not None:
                await cancel_all([self._sweep])
            dir_watch.close()
            stop_hearing()
            self.status.close()
            self._log.info("stopped")

    def _watching_by_polling(self, reason: str) -> None:
        """Tell the agent that this process polls (no inotify budget left): its status shows it."""
        self.status.send(WATCH=f"polling: {printable(reason)}")

    async def _serve_and_register(self, registrar: Registrar) -> None:
        sweep = self._remove_dead_sockets()
        if self.config.registration == "plugin-watcher":
            await sweep
        else:  # dead files beside kubelet.sock are clutter only: removed meanwhile, never a delay
            self._sweep = asyncio.create_task(sweep, name="dead-sockets")
        await self.watcher.first_scan_done.wait()
        if self.config.registration == "plugin-watcher":
            await self._serve_for_plugin_watcher()
            return
        reason = "start"
        number = 0
        endpoint: PluginEndpoint | None = None
        cuts = CutPacing()
        while True:
            detected = time.monotonic()
            if endpoint is None:
                endpoint = await self._serve(self.config.paths.kubelet_dir)
            try:
                await registrar.register(endpoint.name, self.server.options)
            except EndpointLostError as exc:
                reason = "plugin socket deleted before registration"
                self._log.info("kubelet_restart_detected", reason=reason, detail=str(exc))
                endpoint = None
                continue
            number += 1
            self._registered(
                Registration(number, endpoint.name, round(time.monotonic() - detected, 6), reason)
            )
            registered_at = time.monotonic()
            reason = await self._until_registration_lost(registrar, endpoint)
            endpoint = None  # never a second Register from a socket (1.37 refuses it, then loses track)
            if reason == STREAM_CUT:
                await self._pace(cuts, time.monotonic() - registered_at)
            if reason in (SIBLING_STOPPED, STREAM_CUT):
                continue  # the same kubelet, whatever the restart policy: nobody else need know
            self._log.info("kubelet_restart_detected", reason=reason)
            self.status.send(KUBELET_RESTART=reason)
            if self.config.on_kubelet_restart == "exit":
                raise KubeletRestartedError(reason)

    async def _remove_dead_sockets(self, *, before_fresh_socket: bool = False) -> None:
        """Remove the sockets killed plugins of this resource left where this one serves.

        In ``plugins_registry`` the kubelet tries to register each for ever, and
        they go before the first socket of ours is served: a kubelet up to 1.36
        disconnects the plugin it follows when a registered socket of the
        resource disappears (see :meth:`_serve`). Beside ``kubelet.sock`` the
        kubelet dials nothing by itself: they are only clutter there.

        ``before_fresh_socket``: called again before each later registry socket
        (:meth:`_serve`), for the same reason. A killed plugin never removes its
        socket, and one that stops may stop listening a while before its socket
        goes; up to 1.36 its stream's end has cut ours already. Were the fresh
        socket registered before that removal reached the kubelet, the removal
        would disconnect the fresh one in turn, or, while the kubelet still
        connects it, fail its registration or leave it a client the kubelet
        forgot.
        """
        watcher = self.config.registration == "plugin-watcher"
        directory = self.config.registry_dir if watcher else self.config.paths.kubelet_dir
        removed = await remove_dead_instances(directory, self.config.resource)
        if not removed:
            return
        if before_fresh_socket:
            why = (
                "no process answers on them: a plugin of this resource that stopped or was killed; removed "
                "before the fresh socket appears, as a kubelet up to 1.36 disconnects whatever plugin it "
                "follows for the resource when one of its sockets goes"
            )
        else:
            why = "no process answers on them: left by an earlier plugin of this resource that was killed" + (
                "; the kubelet's plugin watcher would retry them for ever" if watcher else ""
            )
        self._log.info("dead_sockets_removed", directory=str(directory), sockets=removed, why=why)

    async def _serve(
        self,
        directory: Path,
        extra_handlers: tuple[grpc.GenericRpcHandler, ...] = (),
        *,
        idle_previous_first: bool = False,
    ) -> PluginEndpoint:
        """A new server on a fresh socket in ``directory``; the previous one goes once this one serves.

        The previous one goes when the kubelet holds no stream on it, at once or
        later (:meth:`_retire`). ``idle_previous_first``: an idle previous socket
        is removed before the new one appears, and so are the dead sockets of
        other plugins of the resource (the plugin watcher's way: a kubelet up to
        1.36 disconnects whatever plugin it follows for a removed socket of the
        resource, so the removals must come before the new socket is
        registered; see :meth:`_remove_dead_sockets`).
        """
        previous = self.endpoint
        if previous is not None and idle_previous_first:
            await self._remove_dead_sockets(before_fresh_socket=True)
            if not previous.streams.value:
                await previous.stop(grace=0)
                previous = self.endpoint = None
        proposed = self.server.proposed_handler()
        endpoint = PluginEndpoint(
            self.server,
            directory,
            self.config.resource,
            extra_handlers=(*extra_handlers, *((proposed,) if proposed is not None else ())),
        )
        try:
            await endpoint.start()
        except asyncio.CancelledError:  # stopped while starting: the new server goes too
            await endpoint.stop(grace=0)
            raise
        self.serving.set()
        # Said before registering, so that whoever reaps this process knows which socket
        # it leaves behind should it be killed before it could register.
        self.status.send(ENDPOINT=endpoint.name)
        self.endpoint = endpoint
        if previous is not None:
            await self._retire(previous)
        return endpoint

    async def _retire(self, endpoint: PluginEndpoint) -> None:
        """Stop an older socket now if the kubelet holds no stream on it, else once it holds none.

        Ending a stream the kubelet holds would, up to 1.36, disconnect the plugin
        it follows: the newer socket of this very process (kubernetes#121994).
        """
        if not endpoint.streams.value:
            await endpoint.stop(grace=0)
            return
        self._log.info(
            "socket_kept",
            socket=endpoint.name,
            until="the kubelet ends the stream it holds on it",
            why="ending it would make a kubelet up to 1.36 drop this plugin's newer socket",
        )

        async def stop_when_idle() -> None:
            await endpoint.until_idle()
            await endpoint.stop(grace=0)
            self.retained.pop(endpoint, None)

        self.retained[endpoint] = asyncio.create_task(stop_when_idle(), name=f"retire {endpoint.name}")

    async def _pace(self, cuts: CutPacing, lasted: float) -> None:
        waited = await cuts.pause(lasted)
        if waited:
            self._log.warning(
                "stream_cut_again",
                times_in_a_row=cuts.in_a_row,
                waited=waited,
                check="does the kubelet log why it ended the stream (a device list over 4 MiB)?",
            )

    def _registered(self, registration: Registration) -> None:
        metrics.PLUGIN_REGISTRATIONS.labels(self.config.resource).inc()
        self.registrations.publish(registration)
        devices = self.snapshot.value.devices
        self.status.send(
            REGISTERED=registration.number,
            ENDPOINT=registration.endpoint,
            DEVICES=f"{len(devices.healthy_ids)}/{len(devices)}",
        )

    def _waiting(self, what: str, **details: str) -> None:
        """Say once what registration waits for.

        To the agent, which says it once for all its children and shows it in
        ``plugvisor status``; or in the log of a plugin of its own.
        """
        if self.status.enabled:
            self.status.send(WAITING=printable(what))
            self._log.debug("waiting", waiting_for=what, **details)
        else:
            self._log.warning("waiting", waiting_for=what, **details)

    def _taken_over(self, by: str) -> None:
        self._log.warning(
            "taken_over",
            by=by,
            meaning="another plugin of this resource registered; the kubelet now uses it. This one stands "
            "by and registers again when that one stops",
        )
        self.status.send(TAKEN_OVER=by)

    async def _until_registration_lost(self, registrar: Registrar, endpoint: PluginEndpoint) -> str:
        """Wait until the registration of ``endpoint`` is lost, and say why.

        A kubelet restart returns its reason. Two reasons mean the same kubelet
        should get a Register again: :data:`STREAM_CUT`, the kubelet closed our
        stream while it runs on (up to 1.36 it does so to the plugin it follows
        when another plugin of the resource ends), or never opened one
        (:meth:`_until_stream_opened`); and :data:`SIBLING_STOPPED`, another
        plugin of this resource (one started by hand with ``--replace``, a second
        agent on the node) stopped and none is left: if it had taken the resource
        over, the kubelet up to 1.36 marked every device unhealthy. One that was
        there before we registered, and so was taken over by us, is given
        :data:`SIBLING_CUT_WAIT` seconds first, for the cut its end brings.

        When another plugin starts and answers, we say so and stand by:
        registering back would take the resource from it, and two agents would
        take it from each other for ever. While standing by we look at it every
        :data:`TAKER_CHECK_INTERVAL` seconds, since a killed one leaves its socket.
        """
        loop = asyncio.get_running_loop()
        siblings = _Siblings()
        checks: set[asyncio.Task[None]] = set()

        async def check(sibling: str) -> None:
            # Apart from the wait below: a socket that never answers must not delay a restart.
            if await wait_until_answers(endpoint.path.parent / sibling) and siblings.taken_over_by is None:
                siblings.taken_over_by = sibling
                self._taken_over(sibling)

        restart: asyncio.Future[str] | None = None
        cut = asyncio.ensure_future(self._until_stream_cut(endpoint, registrar.registered_kubelet))
        unopened = asyncio.ensure_future(self._until_stream_opened(endpoint))
        try:
            while True:
                if restart is None:
                    restart = asyncio.ensure_future(registrar.wait_for_restart())
                done, _ = await asyncio.wait(
                    {restart, cut, unopened},
                    timeout=siblings.timeout(loop.time()),
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if cut in done or unopened in done:
                    self._log.info("registering_again", reason=STREAM_CUT, endpoint=endpoint.name)
                    return STREAM_CUT
                if restart in done:
                    reason, restart = restart.result(), None
                    if reason == SIBLING_STARTED:
                        siblings.started = True
                        sibling = registrar.dir_state.last_sibling
                        if sibling and siblings.taken_over_by is None:
                            task = asyncio.create_task(check(sibling))
                            checks.add(task)
                            task.add_done_callback(checks.discard)
                        continue
                    if reason != SIBLING_STOPPED:
                        return reason
                    look = siblings.stopped(loop.time())
                else:
                    look = siblings.timed_out(loop.time())
                if look and not await asyncio.to_thread(registrar.dir_state.live_siblings):
                    self._log.info("registering_again", reason=SIBLING_STOPPED, endpoint=endpoint.name)
                    return SIBLING_STOPPED
        finally:
            for task in (*checks, cut, unopened, *((restart,) if restart is not None else ())):
                task.cancel()

    async def _until_stream_opened(self, endpoint: PluginEndpoint) -> str:
        """:data:`STREAM_CUT` if the running kubelet opens no stream on ``endpoint`` in time, else nothing.

        Called once ``endpoint`` is registered: the kubelet dials back and opens
        ListAndWatch at once. When it dropped the connection first (up to 1.36,
        another plugin's end arriving just after our registration), no stream is
        ever opened and none can be seen to end: only this timeout notices that
        the kubelet no longer follows us. A kubelet that went away is a restart,
        which the registration's own watch reports.
        """
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(STREAM_OPEN_TIMEOUT):
                await endpoint.streamed.wait()
        if not endpoint.streamed.is_set() and await asyncio.to_thread(self._kubelet_runs):
            self._log.warning(
                "no_stream_after_registration",
                endpoint=endpoint.name,
                waited=STREAM_OPEN_TIMEOUT,
                meaning="the kubelet accepted the registration but never opened ListAndWatch on this "
                "socket; registering again from a fresh one",
            )
            return STREAM_CUT
        never: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        return await never  # the other waits decide

    async def _until_stream_cut(self, endpoint: PluginEndpoint, kubelet: SocketIdentity | None) -> str:
        """Return :data:`STREAM_CUT` once the kubelet closed every stream it held on ``endpoint`` and runs on.

        A kubelet going away closes them too: that is a restart, seen in its
        directory (or, with the plugin watcher, the new kubelet dials back). So
        is a ``kubelet.sock`` that is another file than ``kubelet``, the one the
        registration went through: a quick restart has the new kubelet
        answering by the time we look. (The file is noted again whenever a
        stream opens: the kubelet that holds it.)

        Streams are counted over the socket's whole life (a socket is registered
        once, so every stream on it is this registration's), not from this call
        on: the kubelet opens the stream on our socket while Register returns,
        and up to 1.36 another plugin's end can cut it at once, so the cut can
        be read before Register's answer. Counting from the answer on missed
        such a cut: the plugin stood registered on a stream that was gone, with
        the resource at zero (a killed first plugin leaves its socket, so
        nothing else told).
        """
        drops, changes = 0, 0
        kubelet_socket = self.config.paths.kubelet_dir / constants.KUBELET_SOCKET_NAME
        while True:
            changes, open_now = await endpoint.streams.wait_newer(changes)
            if endpoint.drops.version == drops:
                if open_now:
                    kubelet = SocketIdentity.of(kubelet_socket)
                continue
            drops = endpoint.drops.version
            now = SocketIdentity.of(kubelet_socket)
            # The same kubelet.sock before and after the probe: whoever answered is the kubelet we
            # registered with. A kubelet that restarts the instant it answered Register (a crash
            # loop) ends the stream first and listens anew during the probe: the new one answers.
            if (
                now == kubelet
                and await asyncio.to_thread(self._kubelet_runs)
                and SocketIdentity.of(kubelet_socket) == kubelet
            ):
                return STREAM_CUT
            kubelet = SocketIdentity.of(kubelet_socket)
            self._log.info("stream_ended_by_a_stopping_kubelet", endpoint=endpoint.name)

    def _kubelet_runs(self) -> bool:
        """Whether the kubelet answers on its ``kubelet.sock`` (blocking probe).

        A plugin-watcher plugin may not see the device-plugins directory at all
        (only ``plugins_registry`` mounted): it takes the kubelet for running.
        """
        kubelet_dir = self.config.paths.kubelet_dir
        if self.config.registration == "plugin-watcher" and not kubelet_dir.is_dir():
            return True
        return socket_answers(kubelet_dir / constants.KUBELET_SOCKET_NAME)

    async def _serve_for_plugin_watcher(self) -> None:
        """Serve in ``plugins_registry`` and count every time the kubelet dials back (restarts included).

        A socket that is no longer ours (deleted, replaced) is served afresh at once:
        the kubelet deregistered the old one and registers only a new one. So is one
        whose stream the kubelet ended while it runs on, or that another plugin of
        the resource had taken over when that one stops: the kubelet's plugin
        watcher registers a socket once, so only a new one is registered again.
        """
        registry = self.config.registry_dir
        reason = "start"
        number = 0
        served: set[str] = set()
        cuts = CutPacing()
        with inotify_.open_watches(poll_interval=inotify_.POLL_INTERVAL) as watches:
            socket_watch = RegistrySocketWatch(
                watches,
                prefix=socket_prefix(self.config.resource),
                served=served,
                on_taken_over=self._taken_over,
            )
            while True:
                registrar = WatcherRegistrar(self.config.resource)
                try:
                    registry.mkdir(parents=True, exist_ok=True)
                except OSError as exc:
                    raise ConfigurationError(f"cannot create {registry}: {exc.strerror or exc}") from None
                endpoint = await self._serve(registry, (registrar.handler(),), idle_previous_first=True)
                served.add(endpoint.name)
                served_at = time.monotonic()
                lost = asyncio.create_task(self._until_watcher_registration_lost(socket_watch, endpoint))
                unopened: asyncio.Task[str] | None = None  # from the first registration on
                said = False
                try:
                    while True:
                        verdict = asyncio.ensure_future(registrar.wait_registered())
                        done, _ = await asyncio.wait(
                            {verdict, lost, *((unopened,) if unopened is not None else ())},
                            timeout=None if said else WATCHER_SILENCE,
                            return_when=asyncio.FIRST_COMPLETED,
                        )
                        if not done:  # the kubelet has not dialled: say once what we wait for
                            verdict.cancel()
                            said = True
                            what = f"the kubelet's plugin watcher to dial {endpoint.path}"
                            self._waiting(what, check="is that the kubelet's plugins_registry?")
                            continue
                        if not verdict.done():
                            verdict.cancel()
                            break
                        if unopened is None:
                            unopened = asyncio.create_task(self._until_stream_opened(endpoint))
                        said = True
                        number += 1
                        self._registered(
                            Registration(number, endpoint.name, verdict.result().seconds, reason)
                        )
                        self._log.info(
                            "registered",
                            via="plugin-watcher",
                            number=number,
                            seconds=verdict.result().seconds,
                        )
                        reason = "kubelet dialled back"
                finally:
                    lost.cancel()
                    if unopened is not None:
                        unopened.cancel()
                reason = lost.result() if lost.done() and not lost.cancelled() else STREAM_CUT
                self._log.warning("registration_lost", reason=reason, action="serving a fresh socket")
                self.status.send(UNREGISTERED=printable(reason))
                if reason == STREAM_CUT:
                    await self._pace(cuts, time.monotonic() - served_at)

    async def _until_watcher_registration_lost(
        self, socket_watch: RegistrySocketWatch, endpoint: PluginEndpoint
    ) -> str:
        """Why the plugin-watcher socket no longer brings registrations: its watch says, or a cut stream."""
        kubelet = SocketIdentity.of(self.config.paths.kubelet_dir / constants.KUBELET_SOCKET_NAME)
        waits = {
            asyncio.ensure_future(socket_watch.lost(endpoint.path)),
            asyncio.ensure_future(self._until_stream_cut(endpoint, kubelet)),
        }
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in waits:
                waiting.cancel()
        return done.pop().result()

    async def _report_devices(self) -> None:
        """Tell the agent every new device count, from the first scan on.

        The cell's value before that scan is an empty placeholder: reported, it
        read as "this resource matches no device" and the agent warned of it for
        resources whose devices the scan found milliseconds later.
        """
        await self.watcher.first_scan_done.wait()
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
