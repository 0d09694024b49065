"""The kubelet's plugin watcher on ``plugins_registry``, with its DevicePlugin handler.

Besides ``Register`` on ``kubelet.sock``, the kubelet accepts device plugins
through its plugin manager (``pkg/kubelet/pluginmanager``): a plugin puts a unix
socket into ``<root>/plugins_registry/`` serving ``pluginregistration.Registration``,
and the kubelet dials back. This module follows the upstream parts one by one:

* **the watcher** (``pluginwatcher/plugin_watcher.go``): creates the directory
  (0755), walks it and every subdirectory at start, and watches them: a *created*
  entry (inotify create or moved-in) whose name does not start with ``.`` and that
  is a unix socket is added to the desired state with a fresh timestamp (so a
  re-created socket is a new plugin); a new subdirectory is walked and watched; a
  *removed* entry leaves the desired state (a socket moved away is not noticed,
  as upstream: fsnotify reports it as a rename, which the watcher ignores);
* **the reconciler** (``reconciler/reconciler.go``): unregisters plugins no longer
  desired, or desired with a newer timestamp (re-created), then registers the
  desired ones not registered with their timestamp; a failed registration is
  retried with exponential back-off (0.5 s doubling to 2 min 2 s, goroutinemap's);
  each registration runs on its own, at most one per socket at a time
  (``nestedpendingoperations``), so a socket that takes the whole dial timeout
  (a dead one left by a killed plugin) holds up no other;
* **the register operation** (``operationexecutor/operation_generator.go``):
  blocking dial (10 s), ``GetInfo`` (1 s), the handler for ``PluginInfo.type``
  (``DevicePlugin``, and ``DRAPlugin`` on kubelets with DRA, see :mod:`.dra`),
  an empty endpoint meaning the registry socket itself, ``ValidatePlugin``,
  ``RegisterPlugin``, and ``NotifyRegistrationStatus`` (5 s) telling the plugin
  the outcome, with upstream's error texts, and failing the operation with the
  texts the kubelet logs (a refusal told is logged as ``failed to send error at
  socket``, as upstream's ``notifyPlugin`` returns it as an error); a plugin that
  cannot be told it was registered is deregistered again;
* **the DevicePlugin handler** (``devicemanager/plugin/v1beta1/handler.go``):
  ``ValidatePlugin`` checks the supported versions and the resource name;
  ``RegisterPlugin`` connects to ``PluginInfo.endpoint`` as a full socket path
  and continues exactly as ``Register`` (dial, GetDevicePluginOptions, endpoint,
  ListAndWatch); ``DeRegisterPlugin`` disconnects the client (all devices
  unhealthy, grace period started).

Upstream reconciles once a second; here a reconciliation also runs at every
watcher event, so a test does not wait for the next tick (``reconcile_period``
keeps the periodic pass, which drives the retries).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final, NoReturn, Protocol

import grpc
from asyncinotify import Inotify, Mask

from plugvisor.api.pluginregistration.v1 import api_pb2 as reg_pb2
from plugvisor.api.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from plugvisor.emulators.kubelet import client as client_
from plugvisor.emulators.kubelet import errors, journal, model

DIAL_TIMEOUT: Final = 10.0
"""``dialTimeoutDuration``."""
GET_INFO_TIMEOUT: Final = 1.0
"""GetInfo's own deadline in the register operation."""
NOTIFY_TIMEOUT: Final = 5.0
"""``notifyTimeoutDuration``."""
RECONCILE_PERIOD: Final = 1.0
"""The reconciler's ``loopSleepDuration``."""
INITIAL_BACKOFF: Final = 0.5
MAX_BACKOFF: Final = 122.0
"""goroutinemap's exponential back-off for a failing operation: 500 ms doubling to 2 min 2 s."""
DIRECTORY_MODE: Final = 0o755

_MASK: Final = Mask.CREATE | Mask.MOVED_TO | Mask.DELETE | Mask.DELETE_SELF


class PluginHandler(Protocol):
    """**Protocol:** ``cache.PluginHandler``: the device manager's server, the DRA manager."""

    def validate_plugin(self, name: str, endpoint: str, versions: list[str]) -> str | None:
        """Return the validation error text, or ``None`` when the plugin is acceptable."""

    async def register_plugin(self, name: str, endpoint: str, versions: list[str]) -> None:
        """Connect the plugin; raise :class:`~plugvisor.emulators.kubelet.client.ConnectError` on failure."""

    async def deregister_plugin(self, name: str, endpoint: str) -> None:
        """Disconnect the plugin registered under ``name`` at ``endpoint``."""


class RegistrationFailedError(Exception):
    """A register operation failed; the text is upstream's (``RegisterPlugin error -- ...``)."""


@dataclass(frozen=True, slots=True)
class RegisteredPlugin:
    """The actual state of one registered plugin (``cache.PluginInfo``)."""

    socket_path: str
    timestamp: int
    name: str
    endpoint: str
    handler: PluginHandler


@dataclass(slots=True)
class _Backoff:
    not_before: float
    delay: float


class PluginWatcher:
    """Watches a ``plugins_registry`` directory and registers the device plugins found there."""

    def __init__(
        self,
        directory: Path,
        *,
        handlers: Callable[[], Mapping[str, PluginHandler]],
        journal: journal.Journal,
        dial_timeout: float = DIAL_TIMEOUT,
        reconcile_period: float = RECONCILE_PERIOD,
    ) -> None:
        self.directory = directory
        self._handlers = handlers
        self._journal = journal
        self._dial_timeout = dial_timeout
        self._reconcile_period = reconcile_period
        self.desired: dict[str, int] = {}
        """Socket path -> timestamp of its latest creation (the desired state of the world)."""
        self.actual: dict[str, RegisteredPlugin] = {}
        """Socket path -> what was registered (the actual state of the world)."""
        self._ticks = itertools.count(1)
        self._backoff: dict[str, _Backoff] = {}
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._pending: dict[str, asyncio.Task[None]] = {}
        """Socket path -> its registration in flight (one per socket, as upstream's operation executor)."""
        self._stopping = False
        """Set by :meth:`stop`: the reconciler ends even if gRPC turned its cancellation into a call error."""
        self._inotify: Inotify | None = None
        self._watches: dict[str, object] = {}

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Create the directory, walk it, watch it, and start reconciling."""
        self.directory.mkdir(mode=DIRECTORY_MODE, parents=True, exist_ok=True)
        self._stopping = False
        self._inotify = Inotify()
        self._traverse(self.directory)
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._watch(self._inotify), name=f"plugin watcher {self.directory}"),
            loop.create_task(self._reconcile_loop(), name="plugin reconciler"),
        ]

    def stopping(self) -> bool:
        """Whether :meth:`stop` was called (read again after every await)."""
        return self._stopping

    async def stop(self) -> None:
        """Stop watching and reconciling; registered plugins are left to the device manager's stop."""
        self._stopping = True
        tasks, self._tasks = [*self._tasks, *self._pending.values()], []
        self._pending.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._inotify is not None:
            self._inotify.close()
            self._inotify = None

    # -- the watcher -----------------------------------------------------------------

    def _traverse(self, directory: Path) -> None:
        """Watch ``directory`` and its subdirectories; every socket found counts as created."""
        assert self._inotify is not None
        try:
            self._watches[os.fspath(directory)] = self._inotify.add_watch(directory, _MASK)
        except OSError as error:
            self._journal.event(
                model.EventKind.REGISTRATION_FAILED,
                f"failed to watch {directory}, err: {error.strerror}",
                path=os.fspath(directory),
            )
            return
        for root, dirs, files in os.walk(directory):
            for name in dirs:
                path = Path(root) / name
                with contextlib.suppress(OSError):
                    self._watches[os.fspath(path)] = self._inotify.add_watch(path, _MASK)
            for name in files:
                path = Path(root) / name
                if _is_socket(path):
                    self._created(path)

    def _created(self, path: Path) -> None:
        """``handleCreateEvent``: hidden names ignored, directories walked, sockets desired anew."""
        if path.name.startswith("."):
            return
        try:
            mode = path.stat().st_mode
        except OSError:
            return
        if stat.S_ISDIR(mode):
            self._traverse(path)
            return
        if not stat.S_ISSOCK(mode):
            return
        socket_path = os.fspath(path)
        self.desired[socket_path] = next(self._ticks)
        self._backoff.pop(socket_path, None)
        self._journal.event(
            model.EventKind.PLUGIN_SOCKET_FOUND, f"plugin socket {socket_path} found", path=socket_path
        )
        self._wake.set()

    def _removed(self, path: Path) -> None:
        """``handleDeleteEvent``: the socket leaves the desired state."""
        socket_path = os.fspath(path)
        if self.desired.pop(socket_path, None) is not None:
            self._journal.event(
                model.EventKind.PLUGIN_SOCKET_REMOVED,
                f"plugin socket {socket_path} removed",
                path=socket_path,
            )
        self._backoff.pop(socket_path, None)
        self._wake.set()

    async def _watch(self, inotify: Inotify) -> None:
        while True:
            event = await inotify.get()
            if event.path is None:
                continue
            path = Path(os.fsdecode(event.path))
            if event.mask & (Mask.CREATE | Mask.MOVED_TO):
                self._created(path)
            elif event.mask & (Mask.DELETE | Mask.DELETE_SELF):
                self._removed(path)

    # -- the reconciler ----------------------------------------------------------------

    async def _reconcile_loop(self) -> None:
        while not self.stopping():
            self._wake.clear()
            await self.reconcile()
            if self.stopping():
                return
            # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow a cancellation.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._reconcile_period):
                    await self._wake.wait()

    async def reconcile(self) -> None:
        """One pass: unregistrations first, then registrations (``reconciler.reconcile``)."""
        handlers = self._handlers()
        if not handlers:
            return
        for socket_path, registered in list(self.actual.items()):
            wanted = self.desired.get(socket_path)
            if wanted is None or wanted != registered.timestamp:
                del self.actual[socket_path]
                await registered.handler.deregister_plugin(registered.name, registered.endpoint)
                self._journal.event(
                    model.EventKind.PLUGIN_DEREGISTERED,
                    f"{registered.name}: plugin at {socket_path} deregistered",
                    resource=registered.name,
                    path=socket_path,
                )
        loop = asyncio.get_running_loop()
        now = loop.time()
        for socket_path, timestamp in list(self.desired.items()):
            current = self.actual.get(socket_path)
            if current is not None and current.timestamp == timestamp:
                continue
            if socket_path in self._pending:
                continue  # upstream: "operation already exists", the next pass looks again
            backoff = self._backoff.get(socket_path)
            if backoff is not None and now < backoff.not_before:
                continue
            self._pending[socket_path] = loop.create_task(
                self._operation(handlers, socket_path, timestamp, backoff),
                name=f"register {socket_path}",
            )

    async def _operation(
        self,
        handlers: Mapping[str, PluginHandler],
        socket_path: str,
        timestamp: int,
        backoff: _Backoff | None,
    ) -> None:
        """One register operation, on its own; a failure sets the socket's next try (exponential back-off)."""
        try:
            await self._register(handlers, socket_path, timestamp)
        except RegistrationFailedError as failure:
            if self.stopping():
                return
            delay = INITIAL_BACKOFF if backoff is None else min(backoff.delay * 2, MAX_BACKOFF)
            self._backoff[socket_path] = _Backoff(
                not_before=asyncio.get_running_loop().time() + delay, delay=delay
            )
            self._journal.event(
                model.EventKind.REGISTRATION_FAILED,
                str(failure),
                path=socket_path,
                retry_in=delay,
            )
        else:
            self._backoff.pop(socket_path, None)
        finally:
            if self._pending.get(socket_path) is asyncio.current_task():
                del self._pending[socket_path]

    # -- the register operation ----------------------------------------------------------

    async def _register(
        self, handlers: Mapping[str, PluginHandler], socket_path: str, timestamp: int
    ) -> None:
        received_at = self._journal.clock()
        async with grpc.aio.insecure_channel(
            "unix:" + socket_path, options=[("grpc.use_local_subchannel_pool", 1)]
        ) as channel:
            try:
                async with asyncio.timeout(self._dial_timeout):
                    await channel.channel_ready()
            except TimeoutError:
                raise RegistrationFailedError(
                    f"RegisterPlugin error -- dial failed at socket {socket_path}, "
                    f"err: failed to dial socket {socket_path}, err: {errors.GO_DEADLINE_EXCEEDED}"
                ) from None
            plugin = reg_grpc.RegistrationStub(channel)
            try:
                info = await plugin.GetInfo(reg_pb2.InfoRequest(), timeout=GET_INFO_TIMEOUT)
            except grpc.aio.AioRpcError as error:
                raise RegistrationFailedError(
                    "RegisterPlugin error -- failed to get plugin info using RPC GetInfo at socket "
                    f"{socket_path}, err: {errors.go_rpc_error(error)}"
                ) from None
            handler = handlers.get(info.type)
            if handler is None:
                await self._refuse(
                    plugin,
                    socket_path,
                    f"RegisterPlugin error -- no handler registered for plugin type: {info.type} "
                    f"at socket {socket_path}",
                )
            endpoint = info.endpoint or socket_path
            versions = list(info.supported_versions)
            record = _Record(self._journal, info.name, endpoint, versions, received_at)
            problem = handler.validate_plugin(info.name, endpoint, versions)
            if problem is not None:
                record.done(problem)
                await self._refuse(
                    plugin,
                    socket_path,
                    f"RegisterPlugin error -- plugin validation failed with err: {problem}",
                )
            # Recorded before the handler runs, so that a removal meanwhile becomes a deregistration.
            self.actual[socket_path] = RegisteredPlugin(socket_path, timestamp, info.name, endpoint, handler)
            try:
                await handler.register_plugin(info.name, endpoint, versions)
            except client_.ConnectError as error:
                self.actual.pop(socket_path, None)
                record.done(str(error))
                message = f"RegisterPlugin error -- plugin registration failed with err: {error}"
                raise RegistrationFailedError(
                    await self._notify(plugin, registered=False, error=message)
                ) from None
            record.done(None)
            failure = await self._notify(plugin, registered=True, error="")
            if failure is not None:
                self.actual.pop(socket_path, None)
                await handler.deregister_plugin(info.name, endpoint)
                raise RegistrationFailedError(
                    f"RegisterPlugin error -- failed to send registration status at socket {socket_path}, "
                    f"err: {failure}"
                )

    async def _refuse(
        self, plugin: reg_grpc.RegistrationAsyncStub, socket_path: str, message: str
    ) -> NoReturn:
        """Tell the plugin why it is refused; the operation fails with upstream's words.

        Upstream's ``notifyPlugin`` returns the refusal as an error even when it was
        sent, so the kubelet logs every refusal as ``failed to send error at socket``.
        """
        failure = await self._notify(plugin, registered=False, error=message)
        raise RegistrationFailedError(
            f"RegisterPlugin error -- failed to send error at socket {socket_path}, err: {failure}"
        )

    async def _notify(
        self, plugin: reg_grpc.RegistrationAsyncStub, *, registered: bool, error: str
    ) -> str | None:
        """``notifyPlugin``: tell the plugin the outcome, and return upstream's error for it.

        That is ``error`` itself when there is one, with the RPC's failure after it
        when telling failed; None for a registration told.
        """
        try:
            await plugin.NotifyRegistrationStatus(
                reg_pb2.RegistrationStatus(plugin_registered=registered, error=error), timeout=NOTIFY_TIMEOUT
            )
        except grpc.aio.AioRpcError as failure:
            return f"{error}: {errors.go_rpc_error(failure)}"
        return error or None


class _Record:
    """Journal one plugin-watcher registration like a Register call (``via="plugins_registry"``)."""

    def __init__(
        self, journal_: journal.Journal, name: str, endpoint: str, versions: list[str], received_at: float
    ) -> None:
        self._journal = journal_
        self._name, self._endpoint, self._versions = name, endpoint, versions
        self._received_at = received_at

    def done(self, error: str | None) -> None:
        self._journal.registration(
            model.RegistrationRecord(
                resource=self._name,
                endpoint=self._endpoint,
                version=",".join(self._versions),
                requested_options=None,
                accepted=error is None,
                error=error,
                received_at=self._received_at,
                finished_at=self._journal.clock(),
                generation=self._journal.generation,
                via="plugins_registry",
            )
        )
        if error is None:
            self._journal.event(
                model.EventKind.REGISTERED,
                f"{self._name} registered at {self._endpoint} (plugin watcher)",
                resource=self._name,
                endpoint=self._endpoint,
                via="plugins_registry",
            )
        else:
            self._journal.event(
                model.EventKind.REGISTRATION_FAILED,
                error,
                resource=self._name,
                endpoint=self._endpoint,
                via="plugins_registry",
            )


def _is_socket(path: Path) -> bool:
    try:
        return stat.S_ISSOCK(path.stat().st_mode)
    except OSError:
        return False
