"""The emulated kubelet: the device manager's side of the protocol, as a Python object.

:class:`EmulatedKubelet` wires the parts together - the Registration server, one
client per registered plugin, the device manager's books, the allocator and the
JSON view - and is the API tests, benchmarks and the demo use::

    async with EmulatedKubelet(Path(tempfile.mkdtemp(prefix="/tmp/pvk-"))) as kubelet:
        ...  # start a plugin that registers with kubelet.socket_path
        gpu = "vendor.example/gpu"
        await kubelet.wait_for(lambda k: (r := k.resource(gpu)) is not None and r.allocatable == 4)
        allocation = await kubelet.allocate("vendor.example/gpu", 2)

Node status is synchronised on every state change (the real kubelet polls
every 10 s), so a view reflects a ListAndWatch message as soon as it is applied;
the grace-period drop of a resource happens when its timer fires. A restart
behaves like a kubelet process restart: every connection is cut without
ceremony, state is rebuilt from the checkpoint *file* (``kubelet_internal_checkpoint``,
written when the kubelet writes it), every socket in the directory is deleted
and ``kubelet.sock`` is created again; pods keep running, and are admitted again
with the kubelet's restart rules before new pods are.

Around the device manager sit the parts a node adds: pods (from a manifest
directory or :meth:`EmulatedKubelet.add_pod`, see :mod:`.pods`), the PodResources
v1 server (:mod:`.podresources`) and the pod status file ``<DIR>.pods.json``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import Final

from plugvisor.common import constants
from plugvisor.common.hostpaths import beside_kubelet_dir
from plugvisor.emulators.kubelet import allocation as allocation_
from plugvisor.emulators.kubelet import (
    devicemanager,
    dra,
    journal,
    manager,
    manifest,
    model,
    nodestatus,
    pluginwatcher,
    podresources,
    podsource,
    registration,
    versions,
    view,
)
from plugvisor.emulators.kubelet import gates as gates_
from plugvisor.emulators.kubelet import pods as pods_

DEFAULT_GRACE_PERIOD: Final = 300.0
"""``endpointStopGracePeriod``: 5 minutes upstream."""

DEFAULT_POD_UID: Final = "pod-0"
DEFAULT_CONTAINER: Final = "container-0"

POD_SOURCES_DELAY: Final = 0.1
"""Seconds between serving Register and delivering the node's pods again at a start.

A real kubelet starts its device manager (and serves Register) once the
container runtime reports ready, and its sync loop only handles pods after its
first runtime check, backing off 100 ms while the runtime is not yet up
(``syncLoop`` in kubelet.go). A plugin that re-registers at once is therefore in
time for the pods of a restarted node; this delay reproduces that order.
"""


def default_node_name() -> str:
    """The kubelet's default node name: the host name, lower-cased (``nodeutil.GetHostname``)."""
    return socket.gethostname().strip().lower() or manifest.DEFAULT_NODE_NAME


class EmulatedKubelet:
    """The kubelet's device-plugin side on a socket directory, with a readable state.

    ``grace_period``, ``dial_timeout`` and ``pre_start_timeout`` default to the
    kubelet's values (300 s, 10 s, 30 s); tests shorten them. ``view_path``
    defaults to ``<DIR>.kubelet.json`` and ``pods_view_path`` to ``<DIR>.pods.json``;
    ``write_view=False`` disables both files. ``on_event`` receives every event
    as it happens (the CLI logs them).

    ``root`` is the kubelet root directory: by default ``DIR``'s parent when DIR
    is called ``device-plugins`` (the kubelet's own layout); PodResources is then
    served on ``<root>/pod-resources/kubelet.sock``. For any other DIR the socket
    goes beside DIR, ``<DIR>.pod-resources/kubelet.sock``, like the view files, so
    that two emulated kubelets never share one. ``pod_resources_socket`` sets it
    explicitly; ``pod_resources=False`` serves none.

    ``pods_dir`` is watched for Pod manifests (static-pod style). ``replacement``
    selects the kubelet generation for a second plugin of the same resource
    (``"per-name"``: v1.31-v1.35; ``"per-socket"``: the fix of PR #135437).
    ``gates`` holds the feature gates (defaults as upstream).

    ``kubelet_version`` selects the release whose rules are played (see
    :mod:`.versions`; default the newest): admission checks, manifest schema,
    known feature gates. ``node_name`` (default: the host name) names static
    pods ``<name>-<node name>`` as a real node does. ``pod_sources_delay`` is the
    time between serving Register and re-admitting pods at a start
    (:data:`POD_SOURCES_DELAY`).

    On releases with DRA (1.34 and later) the plugin watcher also registers DRA
    drivers' kubelet plugins, and :attr:`dra` prepares claims a test states
    (:mod:`.dra`); ``objects_dir`` is where it writes them for drivers run with
    ``--objects-dir`` (the API server's part, as files).
    """

    def __init__(
        self,
        socket_dir: Path,
        *,
        view_path: Path | None = None,
        grace_period: float = DEFAULT_GRACE_PERIOD,
        dial_timeout: float = constants.KUBELET_DIAL_TIMEOUT_SECONDS,
        pre_start_timeout: float = constants.PRE_START_CONTAINER_TIMEOUT_SECONDS,
        write_view: bool = True,
        on_event: journal.EventSink | None = None,
        clock: Callable[[], float] = time.monotonic,
        root: Path | None = None,
        pods_dir: Path | None = None,
        pods_view_path: Path | None = None,
        pod_resources: bool = True,
        pod_resources_socket: Path | None = None,
        pod_resources_qps: float = podresources.DEFAULT_QPS,
        pod_resources_burst: int = podresources.DEFAULT_BURST,
        replacement: registration.Replacement | None = None,
        gates: gates_.FeatureGates | None = None,
        node_name: str | None = None,
        kubelet_version: str = versions.DEFAULT_VERSION,
        pod_sources_delay: float = POD_SOURCES_DELAY,
        plugin_watcher: bool = True,
        plugins_registry: Path | None = None,
        plugin_watcher_period: float = pluginwatcher.RECONCILE_PERIOD,
        objects_dir: Path | None = None,
    ) -> None:
        self.socket_dir = Path(os.path.abspath(socket_dir))  # noqa: PTH100 - no symlink resolution
        self.socket_path = self.socket_dir / constants.KUBELET_SOCKET_NAME
        _check_socket_path(self.socket_path)
        self.rules = versions.rules_for(kubelet_version)
        self.replacement: registration.Replacement = _checked_replacement(replacement, self.rules)
        self.gates = self.rules.with_locks(gates if gates is not None else self.rules.default_gates)
        self.rules.check_gates(self.gates)
        self.node_name = node_name if node_name is not None else default_node_name()
        self.pod_sources_delay = pod_sources_delay
        self.checkpoint_path = self.socket_dir / constants.CHECKPOINT_NAME
        self.root = Path(os.path.abspath(root)) if root is not None else None  # noqa: PTH100
        self.pod_resources_socket: Path | None = None
        if pod_resources:
            self.pod_resources_socket = (
                pod_resources_socket
                if pod_resources_socket is not None
                else self._default_pod_resources_socket()
            )
            _check_socket_path(self.pod_resources_socket)
        self.pods_dir = pods_dir
        self.plugins_registry: Path | None = None
        if plugin_watcher:
            self.plugins_registry = (
                Path(os.path.abspath(plugins_registry))  # noqa: PTH100
                if plugins_registry is not None
                else self._default_plugins_registry()
            )
        self._plugin_watcher_period = plugin_watcher_period
        self._plugin_watcher: pluginwatcher.PluginWatcher | None = None
        self.view_path = view_path if view_path is not None else view.default_view_path(self.socket_dir)
        self.pods_view_path = (
            pods_view_path
            if pods_view_path is not None
            else self.socket_dir.with_name(self.socket_dir.name + ".pods.json")
        )
        self.grace_period = grace_period
        self._pod_resources_qps = pod_resources_qps
        self._pod_resources_burst = pod_resources_burst
        self._journal = journal.Journal(clock=clock, on_event=on_event)
        self._pods_lock = asyncio.Lock()
        self._sources_ready = False
        self._running = False
        self._node_status = nodestatus.NodeStatus(
            journal=self._journal, devices=lambda: self._devices, grace_period=grace_period
        )
        self._devices = devicemanager.ManagerImpl(
            socket_dir=self.socket_dir,
            journal=self._journal,
            grace_period=grace_period,
            dial_timeout=dial_timeout,
            pre_start_timeout=pre_start_timeout,
            replacement=self.replacement,
            gates=self.gates,
            node_status=self._node_status,
            sources_ready=lambda: self._sources_ready,
            # Late-bound: the pods are created below, with this device manager.
            container_running=lambda pod_uid, container: self._pods.container_running(pod_uid, container),  # noqa: PLW0108
            active_pod_uids=lambda: self._pods.active_uids(),  # noqa: PLW0108
            rules=self.rules,
        )
        self._pods = pods_.Pods(
            devices=self._devices, journal=self._journal, health_status=self.gates.resource_health_status
        )
        self.dra: dra.DraManager | None = (
            dra.DraManager(
                journal=self._journal,
                health_status=self.gates.resource_health_status,
                objects_dir=Path(os.path.abspath(objects_dir)) if objects_dir is not None else None,  # noqa: PTH100
            )
            if dra.dra_available(self.rules.version)
            else None
        )
        """The DRA side (kubelets 1.34 and later): drivers registered by the plugin watcher, claims."""
        self._pod_resources_server: podresources.PodResourcesServer | None = None
        self._pod_watcher: podsource.DirectoryWatcher | None = None
        self._reported_invalid: set[str] = set()
        self.started_at: float | None = None
        """Wall-clock time of the latest start (for humans; the view shows it)."""
        self._view: view.ViewWriter | None = None
        self._pods_view: view.ViewWriter | None = None
        if write_view:
            failed = self._view_write_failed
            self._view = view.ViewWriter(self.view_path, self.view_document, failed)
            self._journal.add_listener(self._view.mark_dirty)
            self._pods_view = view.ViewWriter(self.pods_view_path, self.pods_document, failed)
            self._journal.add_listener(self._pods_view.mark_dirty)

    def _view_write_failed(self, path: Path, error: OSError) -> None:
        """A view that cannot be written is said once; the kubelet goes on serving (views are for people)."""
        self._journal.event(
            model.EventKind.VIEW_WRITE_FAILED,
            f"cannot write view file {path}: {error.strerror or error}",
            path=os.fspath(path),
        )

    def _plugin_handlers(self) -> dict[str, pluginwatcher.PluginHandler]:
        """The plugin manager's handlers by plugin type: the device manager's, and DRA's where it exists."""
        handlers: dict[str, pluginwatcher.PluginHandler] = {}
        if self._devices.server is not None:
            handlers[constants.DEVICE_PLUGIN_TYPE] = self._devices.server
        if self.dra is not None:
            handlers[constants.DRA_PLUGIN_TYPE] = self.dra
        return handlers

    def _default_plugins_registry(self) -> Path:
        """``<root>/plugins_registry``; beside DIR (``<DIR>.plugins_registry``) when there is no root."""
        if self.root is not None:
            return self.root / constants.PLUGINS_REGISTRY_DIR_NAME
        return beside_kubelet_dir(self.socket_dir, constants.PLUGINS_REGISTRY_DIR_NAME)

    def _default_pod_resources_socket(self) -> Path:
        if self.root is not None:
            return self.root / constants.POD_RESOURCES_DIR_NAME / podresources.SOCKET_NAME
        directory = beside_kubelet_dir(self.socket_dir, constants.POD_RESOURCES_DIR_NAME)
        return directory / podresources.SOCKET_NAME

    # -- records ---------------------------------------------------------------------

    @property
    def registrations(self) -> Sequence[model.RegistrationRecord]:
        """Every Register call, in arrival order, across restarts."""
        return self._journal.registrations

    @property
    def calls(self) -> Sequence[model.PluginCall]:
        """Every RPC the kubelet issued to a plugin, in order, across restarts."""
        return self._journal.calls

    @property
    def events(self) -> Sequence[model.Event]:
        """Every event, in order, across restarts."""
        return self._journal.events

    @property
    def generation(self) -> int:
        """How many times this kubelet has started (1 while the first run lasts)."""
        return self._journal.generation

    @property
    def running(self) -> bool:
        """Tell whether the Registration server is listening."""
        return self._running

    @property
    def registration_counts(self) -> Mapping[str, int]:
        """Register attempts per resource name in the current run (the kubelet's metric)."""
        server = self._devices.server
        return MappingProxyType(dict(server.registration_counts)) if server else MappingProxyType({})

    @property
    def device_manager(self) -> manager.DeviceManager:
        """The device manager's books (replaced at every start; read-only by convention)."""
        return self._devices.books

    @property
    def devices(self) -> devicemanager.ManagerImpl:
        """The device manager itself (upstream's ``ManagerImpl``): server, books, checkpoint, admission."""
        return self._devices

    @property
    def sources_ready(self) -> bool:
        """Whether the kubelet has seen all its pods since the latest start (``sourcesReady.AllReady``)."""
        return self._sources_ready

    def calls_for(self, resource: str) -> list[model.PluginMethod]:
        """Return the methods called on ``resource``'s plugins, in order (for terse assertions)."""
        return [call.method for call in self._journal.calls if call.resource == resource]

    # -- lifecycle -------------------------------------------------------------------

    async def start(self, *, reboot: bool = False) -> None:
        """Read the checkpoint, delete the directory's sockets, listen, then bring pods back.

        The checkpoint is read at every start, as the kubelet does: a corrupt or
        unreadable one is reported and ignored. Pods the node already had are
        admitted again first - a container the runtime still runs needs nothing,
        see :meth:`restart` - and only then are sources "ready".
        """
        if self._running:
            raise RuntimeError("the emulated kubelet is already running")
        self._journal.generation += 1
        self._sources_ready = False
        if reboot:
            self._pods.node_rebooted()
        removed = await self._devices.start()
        self._running = True
        self._node_status.armed = True
        self.started_at = time.time()
        for path in removed:
            self._journal.event(
                model.EventKind.SOCKET_REMOVED, f"removed socket {path}", path=os.fspath(path)
            )
        if self.pod_resources_socket is not None:
            pod_resources_server = podresources.PodResourcesServer(
                socket_path=self.pod_resources_socket,
                provider=self,
                get_enabled=self.gates.kubelet_pod_resources_get,
                qps=self._pod_resources_qps,
                burst=self._pod_resources_burst,
            )
            await pod_resources_server.start()
            self._pod_resources_server = pod_resources_server
        self._node_status.sync()
        if self.plugins_registry is not None:
            # The plugin manager starts with the device manager's handler registered.
            watcher = pluginwatcher.PluginWatcher(
                self.plugins_registry,
                handlers=self._plugin_handlers,
                journal=self._journal,
                reconcile_period=self._plugin_watcher_period,
            )
            await watcher.start()
            self._plugin_watcher = watcher
        for writer in (self._view, self._pods_view):
            if writer is not None:
                writer.start()
        if self.pods_dir is not None:
            # Watch before the first read: a file written meanwhile is never missed.
            self._pod_watcher = podsource.DirectoryWatcher(self.pods_dir, self._pods_dir_changed)
            self._pod_watcher.start()
        await self._initial_pod_sync()
        self._journal.event(
            model.EventKind.STARTED,
            f"kubelet listening on {self.socket_path}",
            socket=os.fspath(self.socket_path),
            pod_resources=os.fspath(self.pod_resources_socket) if self.pod_resources_socket else None,
        )

    async def _initial_pod_sync(self) -> None:
        if self.pod_sources_delay > 0 and (self.pods_dir is not None or self._pods.active()):
            # Register is served already: plugins that re-register at once are in time for the
            # pods. (A node with no pod source and no pods has nothing to deliver: no wait.)
            await asyncio.sleep(self.pod_sources_delay)
        async with self._pods_lock:
            if self.pods_dir is not None:
                await self._apply_pods_dir()
            for pod in self._pods.active():
                await self._pods.sync(pod)
        self._sources_ready = True
        self._journal.changed()
        if self.pods_dir is not None:
            # Changes seen while the pods were being delivered were held back (see below).
            await self.sync_pods_dir()

    async def _pods_dir_changed(self) -> None:
        """Apply the pods directory after a change; never let a failure stop the watcher.

        Until the initial delivery is done the change is left to it: pods reach
        admission only after Register has been served for a while.
        """
        if not self._sources_ready:
            return
        try:
            await self.sync_pods_dir()
        except Exception as error:  # a running kubelet never dies of a pod
            self._journal.event(
                model.EventKind.POD_INVALID,
                f"failed to apply the pods directory {self.pods_dir}: {type(error).__name__}: {error}",
                path=os.fspath(self.pods_dir) if self.pods_dir else None,
            )

    def write_checkpoint(self) -> None:
        """Write ``kubelet_internal_checkpoint`` now (the kubelet's ``writeCheckpoint``)."""
        self._devices.write_checkpoint()

    async def stop(self) -> None:
        """Stop serving and cut every plugin connection, leaving the state readable.

        Pods stay as they are (their containers keep "running"): what a kubelet
        restart finds is decided by :meth:`start`.
        """
        if not self._running:
            return
        self._running = False
        self._node_status.stop()
        if self._plugin_watcher is not None:
            await self._plugin_watcher.stop()
            self._plugin_watcher = None
        if self._pod_watcher is not None:
            await self._pod_watcher.stop()
            self._pod_watcher = None
        if self._pod_resources_server is not None:
            await self._pod_resources_server.stop()
            self._pod_resources_server = None
        if self.dra is not None:
            await self.dra.stop()
        await self._devices.stop()
        self._journal.event(model.EventKind.STOPPED, "kubelet stopped")
        for writer in (self._view, self._pods_view):
            if writer is not None:
                await writer.stop()

    async def restart(self, *, reboot: bool = False) -> None:
        """Restart exactly as a kubelet does: stop, then start (sockets wiped, kubelet.sock anew).

        With ``reboot=True`` the node rebooted meanwhile: no container is running
        any more, so every active pod goes through admission from scratch - and
        fails with ``UnexpectedAdmissionError`` while its plugin is not back.
        """
        await self.stop()
        await self.start(reboot=reboot)

    async def __aenter__(self) -> EmulatedKubelet:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.stop()

    # -- views -----------------------------------------------------------------------

    def resource(self, name: str) -> model.ResourceView | None:
        """Return ``name`` as the node reports it, or ``None`` while the node does not report it.

        A resource appears with its plugin's first ListAndWatch message (or its
        stream's end), and stays, at capacity 0, once dropped after the grace period.
        """
        return self._node_status.resource(name)

    @property
    def resources(self) -> Mapping[str, model.ResourceView]:
        """Every resource the node reports, by name."""
        return self._node_status.resources()

    def allocated(self, resource: str, *, pod_uid: str, container: str) -> tuple[str, ...] | None:
        """Return the device IDs a container holds of ``resource``, or ``None``."""
        held = self._devices.books.pod_devices.container_devices(pod_uid, container, resource)
        return None if held is None else tuple(sorted(held))

    async def wait_for(
        self,
        predicate: Callable[[EmulatedKubelet], bool],
        *,
        timeout: float = 10.0,
        what: str | None = None,
    ) -> None:
        """Wait until ``predicate(self)`` holds, re-checking at every state change.

        Raises :class:`TimeoutError` naming ``what`` (or the predicate) and
        summarising resources and recent events, so a failing test says why.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not predicate(self):
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError(self._timeout_message(what or _describe(predicate), timeout))
            with contextlib.suppress(TimeoutError):
                await self._journal.wait_changed(remaining)

    def _timeout_message(self, what: str, timeout: float) -> str:
        resources = (
            ", ".join(
                f"{name} (capacity {view_.capacity}, allocatable {view_.allocatable}, "
                f"{'registered' if view_.registered else 'not registered'})"
                for name, view_ in self.resources.items()
            )
            or "none"
        )
        recent = "; ".join(f"{event.kind}: {event.message}" for event in self._journal.events[-5:]) or "none"
        return f"{what} did not hold within {timeout} s; resources: {resources}; last events: {recent}"

    # -- allocation ------------------------------------------------------------------

    async def allocate(
        self,
        resource: str,
        count: int,
        *,
        pod_uid: str = DEFAULT_POD_UID,
        container: str = DEFAULT_CONTAINER,
        numa_affinity: frozenset[int] | None = None,
        kind: allocation_.ContainerKind = allocation_.ContainerKind.APP,
        start: bool = True,
    ) -> model.Allocation:
        """Admit one container asking for ``count`` devices of ``resource``, then start it.

        Follows the kubelet: GetPreferredAllocation only when the plugin's
        options allow and the conditions hold, one Allocate, and PreStartContainer
        when the plugin asked for it (``start=False`` stops after admission).
        A second call for the same container reuses its devices.

        Raises :class:`~plugvisor.emulators.kubelet.errors.AllocationError` (pod
        rejected, ``UnexpectedAdmissionError``),
        :class:`~plugvisor.emulators.kubelet.errors.PreStartError` (container
        start failed) or
        :class:`~plugvisor.emulators.kubelet.errors.NotDevicePluginResourceError`.
        """
        return await self._devices.allocate(
            pod_uid=pod_uid,
            container=container,
            resource=resource,
            count=count,
            numa_affinity=numa_affinity,
            kind=kind,
            start=start,
            adhoc=True,
        )

    async def start_container(
        self, resource: str, *, pod_uid: str = DEFAULT_POD_UID, container: str = DEFAULT_CONTAINER
    ) -> bool:
        """Run the container-start step again (a container restart); return whether PreStart was called."""
        return await self._devices.pre_start(pod_uid=pod_uid, container=container, resource=resource)

    def remove_pod(self, pod_uid: str) -> None:
        """Forget a pod's allocations, freeing its devices (``UpdateAllocatedDevices``)."""
        self._devices.remove_pod(pod_uid)

    # -- pods ------------------------------------------------------------------------

    async def add_pod(
        self, pod: str | Mapping[str, object] | manifest.PodSpec, *, source: str | None = None
    ) -> pods_.PodStatusView:
        """Add a pod (a manifest's YAML text, its decoded document, or a parsed spec), admit and start it.

        Returns the pod's status afterwards: ``Running``, ``Pending`` (a start
        failed) or ``Failed`` (admission rejected it). Raises
        :class:`~plugvisor.emulators.kubelet.manifest.ManifestError` for a bad manifest.
        """
        if isinstance(pod, str):
            spec = manifest.parse_manifest(
                pod, source=source, node_name=self.node_name, kubelet_version=self.rules.version
            )
        elif isinstance(pod, manifest.PodSpec):
            spec = pod
        else:
            spec = manifest.parse_document(
                dict(pod), source=source, node_name=self.node_name, kubelet_version=self.rules.version
            )
        async with self._pods_lock:
            record = await self._pods.add(spec)
        return self._pods.view(record)

    def delete_pod(self, name: str, namespace: str = manifest.DEFAULT_NAMESPACE) -> bool:
        """Delete a pod; tell whether there was one.

        Its devices are freed lazily, at the next ``UpdateAllocatedDevices``
        (an admission or a PodResources List), as in the kubelet.
        """
        return self._pods.delete(namespace, name) is not None

    def pod(self, name: str, namespace: str = manifest.DEFAULT_NAMESPACE) -> pods_.PodStatusView | None:
        """Return a pod's status now, or ``None`` when the node does not know it."""
        record = self._pods.get(namespace, name)
        return None if record is None else self._pods.view(record)

    @property
    def pods(self) -> Sequence[pods_.PodStatusView]:
        """Every pod the node knows, in arrival order."""
        return [self._pods.view(record) for record in self._pods]

    async def restart_container(
        self, name: str, container: str, *, namespace: str = manifest.DEFAULT_NAMESPACE
    ) -> pods_.ContainerStatusView:
        """Restart one container of a pod: the start step (PreStartContainer included) runs again."""
        async with self._pods_lock:
            await self._pods.restart_container(namespace, name, container)
        return self._require_pod(name, namespace).container(container)

    async def exit_container(
        self, name: str, container: str, *, exit_code: int = 0, namespace: str = manifest.DEFAULT_NAMESPACE
    ) -> pods_.PodStatusView:
        """Let a container exit with ``exit_code``; the restart policy decides what happens next."""
        async with self._pods_lock:
            await self._pods.exit_container(namespace, name, container, exit_code=exit_code)
        return self._require_pod(name, namespace)

    async def sync_pods_dir(self) -> None:
        """Read the pods directory now and apply what changed (the watcher does this by itself)."""
        async with self._pods_lock:
            await self._apply_pods_dir()

    async def _apply_pods_dir(self) -> None:
        if self.pods_dir is None:
            return
        found = podsource.scan(self.pods_dir, node_name=self.node_name, kubelet_version=self.rules.version)
        for key, message in found.invalid.items():
            if key not in self._reported_invalid:
                self._reported_invalid.add(key)
                self._journal.event(model.EventKind.POD_INVALID, message, path=key.partition("#")[0])
        wanted = {spec.key: spec for spec in found.pods.values()}
        for record in list(self._pods):
            source = record.spec.source
            if source is None or not source.startswith(os.fspath(self.pods_dir) + os.sep):
                continue
            if wanted.get(record.spec.key) is None or wanted[record.spec.key].uid != record.uid:
                self._pods.delete(record.namespace, record.name)
        for spec in found.pods.values():
            await self._pods.add(spec)

    def _require_pod(self, name: str, namespace: str) -> pods_.PodStatusView:
        view_ = self.pod(name, namespace)
        if view_ is None:
            raise KeyError(f"no pod {namespace}/{name} on this node")
        return view_

    # -- pod host and PodResources provider (called by pods and podresources) ---------

    def update_allocated_devices(self) -> None:
        """Free devices of pods that are no longer active (``UpdateAllocatedDevices``)."""
        self._devices.update_allocated_devices()

    def active_pods(self) -> Sequence[podresources.PodView]:
        """Active pods: what ``GetActivePods`` returns (ad-hoc :meth:`allocate` pods are not pods)."""
        return self._pods.active()

    def pod_by_name(self, namespace: str, name: str) -> podresources.PodView | None:
        """Any pod the node knows by this name."""
        return self._pods.get(namespace, name)

    # -- the JSON view ---------------------------------------------------------------

    def view_document(self) -> view.JsonObject:
        """Return the view file's document for the current state."""
        allocations: list[view.JsonObject] = [
            {
                "pod_uid": pod_uid,
                "container": container,
                "resource": resource,
                "device_ids": sorted(entry.device_ids()),
            }
            for pod_uid, per_pod in sorted(self._devices.books.pod_devices.entries.items())
            for container, per_container in sorted(per_pod.items())
            for resource, entry in sorted(per_container.items())
        ]
        return view.render(
            kubelet={
                "socket_dir": os.fspath(self.socket_dir),
                "socket": os.fspath(self.socket_path),
                "pid": os.getpid(),
                "running": self.running,
                "generation": self._journal.generation,
                "started_at": self.started_at,
                "grace_period": self.grace_period,
                "registrations": len(self._journal.registrations),
                "checkpoint": os.fspath(self.checkpoint_path),
                "pod_resources_socket": os.fspath(self.pod_resources_socket)
                if self.pod_resources_socket
                else None,
                "pods_dir": os.fspath(self.pods_dir) if self.pods_dir else None,
                "plugins_registry": os.fspath(self.plugins_registry) if self.plugins_registry else None,
                "pods_view": os.fspath(self.pods_view_path) if self._pods_view else None,
                "sources_ready": self._sources_ready,
                "replacement": self.replacement,
                "kubelet_version": self.rules.version,
                "node_name": self.node_name,
                "feature_gates": self.gates.enabled(),
            },
            resources=self.resources,
            allocations=allocations,
            events=self._journal.events[-view.RECENT_EVENTS :],
        )

    def pods_document(self) -> view.JsonObject:
        """Return the pod status file's document: every pod, as ``kubectl get pods -o yaml`` would show it."""
        return pods_.render(self.pods)

    async def flush_view(self) -> None:
        """Write the view files now (tests and scripts that need them on disk at this point)."""
        for writer in (self._view, self._pods_view):
            if writer is not None:
                await writer.flush()

    async def view_settled(self) -> None:
        """Wait until the background writers have put every change so far on disk."""
        for writer in (self._view, self._pods_view):
            if writer is not None and self.running:
                await writer.settled()


def _checked_replacement(
    replacement: registration.Replacement | None, rules: versions.KubeletRules
) -> registration.Replacement:
    """The replacement generation asked for, or the release's own; an unknown one is a ValueError."""
    if replacement is None:
        return rules.replacement
    if replacement not in registration.REPLACEMENTS:
        raise ValueError(f"replacement must be one of {registration.REPLACEMENTS}, got {replacement!r}")
    return replacement


def _check_socket_path(path: Path) -> None:
    if len(os.fsencode(path)) > constants.MAX_UNIX_SOCKET_PATH:
        raise ValueError(
            f"{path} is longer than {constants.MAX_UNIX_SOCKET_PATH} bytes, "
            "which unix sockets cannot be; use a shorter directory (e.g. under /tmp)"
        )


def _describe(predicate: Callable[[EmulatedKubelet], bool]) -> str:
    name = getattr(predicate, "__qualname__", repr(predicate))
    return "condition" if name == "<lambda>" else f"condition {name}"
