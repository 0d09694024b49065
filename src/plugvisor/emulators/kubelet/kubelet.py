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
ceremony, state is rebuilt from what the checkpoint would hold, every socket in
the directory is deleted and ``kubelet.sock`` is created again.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import Final

import grpc

from plugvisor.api import constants
from plugvisor.api.deviceplugin.v1beta1 import api_pb2
from plugvisor.emulators.kubelet import allocation as allocation_
from plugvisor.emulators.kubelet import client as client_
from plugvisor.emulators.kubelet import endpoint as endpoint_
from plugvisor.emulators.kubelet import errors, journal, manager, model, registration, view

DEFAULT_GRACE_PERIOD: Final = 300.0
"""``endpointStopGracePeriod``: 5 minutes upstream."""

DEFAULT_POD_UID: Final = "pod-0"
DEFAULT_CONTAINER: Final = "container-0"

_TIMER_SLACK = 0.001
"""Fire grace timers just after expiry: the kubelet's test is strictly "older than"."""


class EmulatedKubelet:
    """The kubelet's device-plugin side on a socket directory, with a readable state.

    ``grace_period``, ``dial_timeout`` and ``pre_start_timeout`` default to the
    kubelet's values (300 s, 10 s, 30 s); tests shorten them. ``view_path``
    defaults to ``<DIR>.kubelet.json``; ``write_view=False`` disables the file.
    ``on_event`` receives every event as it happens (the CLI logs them).
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
    ) -> None:
        self.socket_dir = Path(os.path.abspath(socket_dir))  # noqa: PTH100 - no symlink resolution
        self.socket_path = self.socket_dir / constants.KUBELET_SOCKET_NAME
        if len(os.fsencode(self.socket_path)) > constants.MAX_UNIX_SOCKET_PATH:
            raise ValueError(
                f"{self.socket_path} is longer than {constants.MAX_UNIX_SOCKET_PATH} bytes, "
                "which unix sockets cannot be; use a shorter directory (e.g. under /tmp)"
            )
        self.view_path = view_path if view_path is not None else view.default_view_path(self.socket_dir)
        self.grace_period = grace_period
        self._dial_timeout = dial_timeout
        self._pre_start_timeout = pre_start_timeout
        self._journal = journal.Journal(clock=clock, on_event=on_event)
        self._manager = manager.DeviceManager(grace_period=grace_period)
        self._allocator = self._new_allocator()
        self._allocation_lock = asyncio.Lock()
        self._node_capacity: dict[str, int] = {}
        self._node_allocatable: dict[str, int] = {}
        self._removed: set[str] = set()
        self._server: registration.RegistrationServer | None = None
        self._grace_timer: asyncio.TimerHandle | None = None
        self.started_at: float | None = None
        """Wall-clock time of the latest start (for humans; the view shows it)."""
        self._view: view.ViewWriter | None = None
        if write_view:
            self._view = view.ViewWriter(self.view_path, self.view_document)
            self._journal.add_listener(self._view.mark_dirty)

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

    def calls_for(self, resource: str) -> list[model.PluginMethod]:
        """Return the methods called on ``resource``'s plugins, in order (for terse assertions)."""
        return [call.method for call in self._journal.calls if call.resource == resource]

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Create the directory, delete its sockets, listen on ``kubelet.sock``.

        Starting again after :meth:`stop` is a kubelet restart: state is first
        rebuilt from what the checkpoint holds.
        """
        if self._server is not None:
            raise RuntimeError("the emulated kubelet is already running")
        if self._journal.generation > 0:
            self._manager = manager.DeviceManager.restored(
                self._manager.checkpoint(),
                grace_period=self.grace_period,
                now=self._journal.clock(),
                journal=self._journal,
            )
            self._allocator = self._new_allocator()
        self._journal.generation += 1
        server = registration.RegistrationServer(
            socket_dir=self.socket_dir, handler=self, journal=self._journal, dial_timeout=self._dial_timeout
        )
        removed = await server.start()
        self._server = server
        self.started_at = time.time()
        for path in removed:
            self._journal.event(
                model.EventKind.SOCKET_REMOVED, f"removed socket {path}", path=os.fspath(path)
            )
        self._sync_node_status()
        if self._view is not None:
            self._view.start()
        self._journal.event(
            model.EventKind.STARTED,
            f"kubelet listening on {self.socket_path}",
            socket=os.fspath(self.socket_path),
        )

    async def stop(self) -> None:
        """Stop serving and cut every plugin connection, leaving the state readable."""
        server, self._server = self._server, None
        if server is None:
            return
        if self._grace_timer is not None:
            self._grace_timer.cancel()
            self._grace_timer = None
        await server.stop()
        self._journal.event(model.EventKind.STOPPED, "kubelet stopped")
        if self._view is not None:
            await self._view.stop()

    async def restart(self) -> None:
        """Restart exactly as a kubelet does: stop, then start (sockets wiped, kubelet.sock anew)."""
        await self.stop()
        await self.start()

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
            return await self._allocator.allocate(
                pod_uid=pod_uid,
                container=container,
                resource=resource,
                count=count,
                numa_affinity=numa_affinity,
                kind=kind,
                start=start,
            )

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
        devices.pod_devices.remove_pods([pod_uid])
        devices.allocated_devices = devices.pod_devices.devices()
        devices.devices_to_reuse.pop(pod_uid, None)
        self._journal.event(model.EventKind.POD_REMOVED, f"pod {pod_uid} removed", pod_uid=pod_uid)

    # -- client handler (called by the registration server's clients) ----------------

    async def plugin_connected(self, resource: str, client: client_.PluginClient) -> None:
        """Fetch the plugin's options (its reply decides later calls) and install the endpoint."""
        try:
            options = await client.get_device_plugin_options()
        except grpc.aio.AioRpcError as error:
            raise client_.ConnectError(
                f"failed to get device plugin options: {errors.go_rpc_error(error)}"
            ) from None
        endpoint = endpoint_.Endpoint(
            resource=resource, socket_path=client.socket_path, stub=client.stub, journal=self._journal
        )
        self._manager.plugin_connected(resource, endpoint, model.PluginOptions.from_proto(options))
        self._sync_node_status()

    def plugin_list_and_watch_receiver(self, resource: str, response: api_pb2.ListAndWatchResponse) -> None:
        """Apply one full device list and report the new counts."""
        self._manager.list_and_watch_update(resource, map(manager.DeviceRecord.from_proto, response.devices))
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
            },
            resources=self.resources,
            allocations=allocations,
            events=self._journal.events[-view.RECENT_EVENTS :],
        )

    async def flush_view(self) -> None:
        """Write the view file now (tests and scripts that need it on disk at this point)."""
        if self._view is not None:
            await self._view.flush()

    async def view_settled(self) -> None:
        """Wait until the background writer has put every change so far on disk."""
        if self._view is not None and self.running:
            await self._view.settled()

    def _new_allocator(self) -> allocation_.Allocator:
        return allocation_.Allocator(
            devices=self._manager, journal=self._journal, pre_start_timeout=self._pre_start_timeout
        )


def _describe(predicate: Callable[[EmulatedKubelet], bool]) -> str:
    name = getattr(predicate, "__qualname__", repr(predicate))
    return "condition" if name == "<lambda>" else f"condition {name}"
