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
import dataclasses
import os
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import Final

import grpc

from plugvisor.api.deviceplugin.v1beta1 import api_pb2
from plugvisor.common import constants
from plugvisor.emulators.kubelet import allocation as allocation_
from plugvisor.emulators.kubelet import checkpoint as checkpoint_
from plugvisor.emulators.kubelet import client as client_
from plugvisor.emulators.kubelet import endpoint as endpoint_
from plugvisor.emulators.kubelet import (
    errors,
    journal,
    manager,
    manifest,
    model,
    podresources,
    podsource,
    registration,
    view,
)
from plugvisor.emulators.kubelet import gates as gates_
from plugvisor.emulators.kubelet import pods as pods_

DEFAULT_GRACE_PERIOD: Final = 300.0
"""``endpointStopGracePeriod``: 5 minutes upstream."""

DEVICE_PLUGINS_DIR_NAME: Final = "device-plugins"

DEFAULT_POD_UID: Final = "pod-0"
DEFAULT_CONTAINER: Final = "container-0"

_TIMER_SLACK = 0.001
"""Fire grace timers just after expiry: the kubelet's test is strictly "older than"."""


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
        replacement: registration.Replacement = "per-name",
        gates: gates_.FeatureGates | None = None,
        node_name: str = manifest.DEFAULT_NODE_NAME,
    ) -> None:
        self.socket_dir = Path(os.path.abspath(socket_dir))  # noqa: PTH100 - no symlink resolution
        self.socket_path = self.socket_dir / constants.KUBELET_SOCKET_NAME
        _check_socket_path(self.socket_path)
        if replacement not in registration.REPLACEMENTS:
            raise ValueError(f"replacement must be one of {registration.REPLACEMENTS}, got {replacement!r}")
        self.replacement: registration.Replacement = replacement
        self.gates = gates if gates is not None else _default_gates()
        self.node_name = node_name
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
        self.view_path = view_path if view_path is not None else view.default_view_path(self.socket_dir)
        self.pods_view_path = (
            pods_view_path
            if pods_view_path is not None
            else self.socket_dir.with_name(self.socket_dir.name + ".pods.json")
        )
        self.grace_period = grace_period
        self._dial_timeout = dial_timeout
        self._pre_start_timeout = pre_start_timeout
        self._pod_resources_qps = pod_resources_qps
        self._pod_resources_burst = pod_resources_burst
        self._journal = journal.Journal(clock=clock, on_event=on_event)
        self._manager = manager.DeviceManager(grace_period=grace_period)
        self._allocation_lock = asyncio.Lock()
        self._pods_lock = asyncio.Lock()
        self._pods = pods_.Pods(
            host=self,
            journal=self._journal,
            health_status=self.gates.resource_health_status,
            on_container_stopped=self._container_stopped,
        )
        self._allocator = self._new_allocator()
        self._adhoc_pods: set[str] = set()
        self._sources_ready = False
        self._node_capacity: dict[str, int] = {}
        self._node_allocatable: dict[str, int] = {}
        self._removed: set[str] = set()
        self._server: registration.RegistrationServer | None = None
        self._pod_resources_server: podresources.PodResourcesServer | None = None
        self._pod_watcher: podsource.DirectoryWatcher | None = None
        self._reported_invalid: set[str] = set()
        self._grace_timer: asyncio.TimerHandle | None = None
        self._background: set[asyncio.Task[None]] = set()
        self.started_at: float | None = None
        """Wall-clock time of the latest start (for humans; the view shows it)."""
        self._view: view.ViewWriter | None = None
        self._pods_view: view.ViewWriter | None = None
        if write_view:
            self._view = view.ViewWriter(self.view_path, self.view_document)
            self._journal.add_listener(self._view.mark_dirty)
            self._pods_view = view.ViewWriter(self.pods_view_path, self.pods_document)
            self._journal.add_listener(self._pods_view.mark_dirty)

    def _default_pod_resources_socket(self) -> Path:
        if self.root is not None:
            return self.root / constants.POD_RESOURCES_DIR_NAME / podresources.SOCKET_NAME
        if self.socket_dir.name == DEVICE_PLUGINS_DIR_NAME:
            return self.socket_dir.parent / constants.POD_RESOURCES_DIR_NAME / podresources.SOCKET_NAME
        return self.socket_dir.with_name(f"{self.socket_dir.name}.{constants.POD_RESOURCES_DIR_NAME}") / (
            podresources.SOCKET_NAME
        )

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
        return self._server is not None

    @property
    def registration_counts(self) -> Mapping[str, int]:
        """Register attempts per resource name in the current run (the kubelet's metric)."""
        return (
            MappingProxyType(dict(self._server.registration_counts)) if self._server else MappingProxyType({})
        )

    @property
    def device_manager(self) -> manager.DeviceManager:
        """The device manager's books (replaced at every start; read-only by convention)."""
        return self._manager

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
        if self._server is not None:
            raise RuntimeError("the emulated kubelet is already running")
        self._journal.generation += 1
        self._sources_ready = False
        if reboot:
            self._pods.node_rebooted()
        self._manager = self._read_checkpoint()
        self._allocator = self._new_allocator()
        server = registration.RegistrationServer(
            socket_dir=self.socket_dir,
            handler=self,
            journal=self._journal,
            dial_timeout=self._dial_timeout,
            replacement=self.replacement,
        )
        removed = await server.start()
        self._server = server
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
        self._sync_node_status()
        for writer in (self._view, self._pods_view):
            if writer is not None:
                writer.start()
        if self.pods_dir is not None:
            # Watch before the first read: a file written meanwhile is never missed.
            self._pod_watcher = podsource.DirectoryWatcher(self.pods_dir, self.sync_pods_dir)
            self._pod_watcher.start()
        await self._initial_pod_sync()
        self._journal.event(
            model.EventKind.STARTED,
            f"kubelet listening on {self.socket_path}",
            socket=os.fspath(self.socket_path),
            pod_resources=os.fspath(self.pod_resources_socket) if self.pod_resources_socket else None,
        )

    async def _initial_pod_sync(self) -> None:
        async with self._pods_lock:
            if self.pods_dir is not None:
                await self._apply_pods_dir()
            for pod in self._pods.active():
                await self._pods.sync(pod)
        self._sources_ready = True
        self._journal.changed()

    def _read_checkpoint(self) -> manager.DeviceManager:
        try:
            data = checkpoint_.read(self.checkpoint_path)
        except checkpoint_.CheckpointNotFoundError:
            return manager.DeviceManager(grace_period=self.grace_period)
        except checkpoint_.CheckpointError as error:
            self._journal.event(
                model.EventKind.CHECKPOINT_IGNORED,
                "Continue after failing to read checkpoint file. Device allocation info may NOT be "
                f"up-to-date: {error}",
                path=os.fspath(self.checkpoint_path),
                error=str(error),
            )
            return manager.DeviceManager(grace_period=self.grace_period)
        restored = manager.DeviceManager.restored(
            data, grace_period=self.grace_period, now=self._journal.clock(), journal=self._journal
        )
        self._journal.event(
            model.EventKind.CHECKPOINT_RESTORED,
            f"checkpoint read: {len(restored.healthy)} resource(s) at capacity 0 until their plugins "
            f"register, allocations of {len(restored.pod_devices.pods())} pod(s) kept",
            path=os.fspath(self.checkpoint_path),
        )
        return restored

    def write_checkpoint(self) -> None:
        """Write ``kubelet_internal_checkpoint`` now (the kubelet's ``writeCheckpoint``)."""
        try:
            checkpoint_.write(self.checkpoint_path, self._manager.checkpoint())
        except OSError as error:
            self._journal.event(
                model.EventKind.CHECKPOINT_WRITE_FAILED,
                f"failed to write checkpoint file {constants.CHECKPOINT_NAME!r}: {error}",
                path=os.fspath(self.checkpoint_path),
            )

    async def stop(self) -> None:
        """Stop serving and cut every plugin connection, leaving the state readable.

        Pods stay as they are (their containers keep "running"): what a kubelet
        restart finds is decided by :meth:`start`.
        """
        server, self._server = self._server, None
        if server is None:
            return
        if self._grace_timer is not None:
            self._grace_timer.cancel()
            self._grace_timer = None
        if self._pod_watcher is not None:
            await self._pod_watcher.stop()
            self._pod_watcher = None
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self._pod_resources_server is not None:
            await self._pod_resources_server.stop()
            self._pod_resources_server = None
        await server.stop()
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
        if name not in self._node_capacity:
            return None
        devices = self._manager
        healthy = frozenset(devices.healthy.get(name, set()))
        unhealthy = frozenset(devices.unhealthy.get(name, set()))
        records = devices.all_devices.get(name, {})
        device_views: dict[str, model.DeviceView] = {}
        for device_id in sorted(healthy | unhealthy):
            record = records.get(device_id)
            device_views[device_id] = model.DeviceView(
                id=device_id,
                health=constants.HEALTHY if device_id in healthy else constants.UNHEALTHY,
                reported_health=record.health if record is not None else None,
                numa_nodes=record.numa_nodes if record is not None else (),
            )
        info = devices.endpoints.get(name)
        endpoint = info.endpoint if info is not None else None
        return model.ResourceView(
            name=name,
            capacity=self._node_capacity[name],
            allocatable=self._node_allocatable.get(name, 0),
            devices=MappingProxyType(device_views),
            healthy_ids=healthy,
            unhealthy_ids=unhealthy,
            endpoint=endpoint.socket_path if endpoint is not None else None,
            registered=endpoint is not None and not endpoint.is_stopped(),
            options=info.options if info is not None else None,
            stopped_at=endpoint.stop_time if endpoint is not None else None,
            removed=name in self._removed,
            topology_aware=devices.has_topology_alignment(name),
        )

    @property
    def resources(self) -> Mapping[str, model.ResourceView]:
        """Every resource the node reports, by name."""
        views = {name: self.resource(name) for name in sorted(self._node_capacity)}
        return MappingProxyType({name: view_ for name, view_ in views.items() if view_ is not None})

    def allocated(self, resource: str, *, pod_uid: str, container: str) -> tuple[str, ...] | None:
        """Return the device IDs a container holds of ``resource``, or ``None``."""
        held = self._manager.pod_devices.container_devices(pod_uid, container, resource)
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
        async with self._allocation_lock:
            self._adhoc_pods.add(pod_uid)
            result = await self._allocator.allocate(
                pod_uid=pod_uid,
                container=container,
                resource=resource,
                count=count,
                numa_affinity=numa_affinity,
                kind=kind,
                start=False,
            )
            self.write_checkpoint()
            if not start or count == 0:
                return result
            try:
                called = await self._allocator.start_container(
                    pod_uid=pod_uid, container=container, resource=resource
                )
            except errors.PreStartError as error:
                error.allocation = result
                raise
            return dataclasses.replace(result, pre_start_called=called)

    async def start_container(
        self, resource: str, *, pod_uid: str = DEFAULT_POD_UID, container: str = DEFAULT_CONTAINER
    ) -> bool:
        """Run the container-start step again (a container restart); return whether PreStart was called."""
        async with self._allocation_lock:
            return await self._allocator.start_container(
                pod_uid=pod_uid, container=container, resource=resource
            )

    def remove_pod(self, pod_uid: str) -> None:
        """Forget a pod's allocations, freeing its devices (``UpdateAllocatedDevices``)."""
        devices = self._manager
        self._adhoc_pods.discard(pod_uid)
        freed = devices.pod_devices.devices()
        devices.pod_devices.remove_pods([pod_uid])
        devices.allocated_devices = devices.pod_devices.devices()
        devices.devices_to_reuse.pop(pod_uid, None)
        self._deallocate(freed, devices.allocated_devices)
        self._journal.event(model.EventKind.POD_REMOVED, f"pod {pod_uid} removed", pod_uid=pod_uid)

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
            spec = manifest.parse_manifest(pod, source=source, node_name=self.node_name)
        elif isinstance(pod, manifest.PodSpec):
            spec = pod
        else:
            spec = manifest.parse_document(dict(pod), source=source, node_name=self.node_name)
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
        found = podsource.scan(self.pods_dir, node_name=self.node_name)
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

    async def allocate_for_pod(
        self, *, pod_uid: str, container: manifest.ContainerSpec, resource: str
    ) -> model.Allocation:
        """Admit one container's share of one resource (serialised with every other allocation)."""
        async with self._allocation_lock:
            return await self._allocator.allocate(
                pod_uid=pod_uid,
                container=container.name,
                resource=resource,
                count=container.limits[resource],
                numa_affinity=None,
                kind=container.kind,
                start=False,
            )

    async def pre_start(self, *, pod_uid: str, container: str, resource: str) -> bool:
        """Run the container-start step for one resource (serialised with allocations)."""
        async with self._allocation_lock:
            return await self._allocator.start_container(
                pod_uid=pod_uid, container=container, resource=resource
            )

    def update_allocated_devices(self) -> None:
        """Free devices of pods that are no longer active (``UpdateAllocatedDevices``).

        Does nothing until sources are ready: a restarting kubelet must not
        drop allocations of pods it has not seen again yet.
        """
        if not self._sources_ready:
            return
        devices = self._manager
        active = self._pods.active_uids() | self._adhoc_pods
        gone = devices.pod_devices.pods() - active
        if not gone:
            return
        before = devices.pod_devices.devices()
        devices.pod_devices.remove_pods(gone)
        devices.allocated_devices = devices.pod_devices.devices()
        self._deallocate(before, devices.allocated_devices)
        self._journal.changed()

    def active_pods(self) -> Sequence[podresources.PodView]:
        """Active pods: what ``GetActivePods`` returns (ad-hoc :meth:`allocate` pods are not pods)."""
        return self._pods.active()

    def pod_by_name(self, namespace: str, name: str) -> podresources.PodView | None:
        """Any pod the node knows by this name."""
        return self._pods.get(namespace, name)

    def _container_stopped(self, pod: pods_.PodRecord, container: pods_.ContainerRecord) -> None:
        """Call the proposed PostStopContainer for the container's devices (``DeviceManagerDeallocate``)."""
        if not self.gates.device_manager_deallocate:
            return
        held = self._manager.pod_devices.container_resources(pod.uid, container.spec.name)
        for resource in sorted(held):
            self._spawn(
                self._proposed_call(
                    model.PluginMethod.POST_STOP_CONTAINER, resource, held[resource].device_ids()
                )
            )

    def _deallocate(self, before: Mapping[str, set[str]], after: Mapping[str, set[str]]) -> None:
        """Call the proposed Deallocate for devices no longer in use (gate ``DeviceManagerDeallocate``)."""
        if not self.gates.device_manager_deallocate:
            return
        for resource in sorted(before):
            freed = before[resource] - after.get(resource, set())
            if freed:
                self._spawn(self._proposed_call(model.PluginMethod.DEALLOCATE, resource, freed))

    async def _proposed_call(self, method: model.PluginMethod, resource: str, device_ids: set[str]) -> None:
        info = self._manager.endpoints.get(resource)
        if info is None:
            return
        try:
            await info.endpoint.proposed_call(method, sorted(device_ids), timeout=self._pre_start_timeout)
        except endpoint_.EndpointCallError as error:
            self._journal.event(
                model.EventKind.PLUGIN_CALL_FAILED,
                f"{resource}: {method} failed: {error}",
                resource=resource,
                method=str(method),
                error=str(error),
            )

    def _spawn(self, coroutine: Coroutine[object, object, None]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- client handler (called by the registration server's clients) ----------------

    async def plugin_connected(self, resource: str, client: client_.PluginClient) -> None:
        """Fetch the plugin's options (its reply decides later calls) and install the endpoint."""
        try:
            options = await client.get_device_plugin_options()
        except grpc.aio.AioRpcError as error:
            raise client_.ConnectError(
                f"failed to get device plugin options: {errors.go_rpc_error(error)}"
            ) from None
        client.options = model.PluginOptions.from_proto(options)
        self._install_endpoint(resource, client)
        self._sync_node_status()

    def _install_endpoint(self, resource: str, client: client_.PluginClient) -> None:
        endpoint = endpoint_.Endpoint(
            resource=resource,
            socket_path=client.socket_path,
            stub=client.stub,
            journal=self._journal,
            channel=client.channel,
        )
        self._manager.plugin_connected(resource, endpoint, client.options or model.PluginOptions())

    def plugin_resumed(self, resource: str, client: client_.PluginClient) -> None:
        """An older live instance takes over again (per-socket): its endpoint and its last list."""
        self._install_endpoint(resource, client)
        if client.last_response is not None:
            self._manager.list_and_watch_update(
                resource, map(manager.DeviceRecord.from_proto, client.last_response.devices)
            )
            self.write_checkpoint()
        self._sync_node_status()
        self._journal.event(
            model.EventKind.PLUGIN_RESUMED,
            f"{resource}: the instance at {client.socket_path} serves the resource again "
            f"(capacity {self._node_capacity.get(resource, 0)}, "
            f"allocatable {self._node_allocatable.get(resource, 0)})",
            resource=resource,
            endpoint=client.socket_path,
        )

    def plugin_list_and_watch_receiver(self, resource: str, response: api_pb2.ListAndWatchResponse) -> None:
        """Apply one full device list and report the new counts."""
        self._manager.list_and_watch_update(resource, map(manager.DeviceRecord.from_proto, response.devices))
        self.write_checkpoint()
        self._sync_node_status()
        self._journal.event(
            model.EventKind.DEVICES_UPDATED,
            f"{resource}: capacity {self._node_capacity.get(resource, 0)}, "
            f"allocatable {self._node_allocatable.get(resource, 0)}",
            resource=resource,
            capacity=self._node_capacity.get(resource, 0),
            allocatable=self._node_allocatable.get(resource, 0),
            devices=len(response.devices),
        )

    def plugin_disconnected(self, resource: str) -> None:
        """Mark every device unhealthy and stop the endpoint; the grace period starts."""
        if not self._manager.plugin_disconnected(resource, now=self._journal.clock()):
            return
        self._sync_node_status()
        capacity, allocatable = self._node_capacity.get(resource, 0), self._node_allocatable.get(resource, 0)
        self._journal.event(
            model.EventKind.ENDPOINT_STOPPED,
            f"{resource}: endpoint stopped, all devices unhealthy "
            f"(capacity {capacity}, allocatable {allocatable})",
            resource=resource,
            capacity=capacity,
            allocatable=allocatable,
        )

    # -- node status -----------------------------------------------------------------

    def _sync_node_status(self) -> None:
        """Poll capacity as a node-status sync does, and re-arm the grace timer."""
        polled = self._manager.get_capacity(now=self._journal.clock())
        if polled.deleted:
            self.write_checkpoint()
        for name, value in polled.capacity.items():
            self._node_capacity[name] = value
            self._node_allocatable[name] = polled.allocatable.get(name, 0)
            self._removed.discard(name)
        for name in sorted(polled.deleted):
            # Zero, not absent: the node keeps marking the resource as device-plugin managed.
            self._node_capacity[name] = 0
            self._node_allocatable[name] = 0
            self._removed.add(name)
            self._journal.event(
                model.EventKind.RESOURCE_REMOVED,
                f"{name}: no plugin for {self.grace_period} s, resource removed (capacity 0)",
                resource=name,
            )
        self._journal.changed()
        self._arm_grace_timer()

    def _arm_grace_timer(self) -> None:
        if self._grace_timer is not None:
            self._grace_timer.cancel()
            self._grace_timer = None
        expiry = self._manager.next_expiry()
        if expiry is None or self._server is None:
            return
        delay = max(0.0, expiry - self._journal.clock()) + _TIMER_SLACK
        self._grace_timer = asyncio.get_running_loop().call_later(delay, self._grace_timer_fired)

    def _grace_timer_fired(self) -> None:
        self._grace_timer = None
        self._sync_node_status()

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
            for pod_uid, per_pod in sorted(self._manager.pod_devices.entries.items())
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
                "pods_view": os.fspath(self.pods_view_path) if self._pods_view else None,
                "sources_ready": self._sources_ready,
                "replacement": self.replacement,
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

    def _new_allocator(self) -> allocation_.Allocator:
        return allocation_.Allocator(
            devices=self._manager,
            journal=self._journal,
            pre_start_timeout=self._pre_start_timeout,
            sources_ready=lambda: self._sources_ready,
            container_running=self._pods.container_running,
        )


def _default_gates() -> gates_.FeatureGates:
    return gates_.FeatureGates()


def _check_socket_path(path: Path) -> None:
    if len(os.fsencode(path)) > constants.MAX_UNIX_SOCKET_PATH:
        raise ValueError(
            f"{path} is longer than {constants.MAX_UNIX_SOCKET_PATH} bytes, "
            "which unix sockets cannot be; use a shorter directory (e.g. under /tmp)"
        )


def _describe(predicate: Callable[[EmulatedKubelet], bool]) -> str:
    name = getattr(predicate, "__qualname__", repr(predicate))
    return "condition" if name == "<lambda>" else f"condition {name}"
