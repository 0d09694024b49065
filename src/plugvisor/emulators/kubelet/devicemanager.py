"""The device manager, shaped like upstream's ``ManagerImpl`` (``pkg/kubelet/cm/devicemanager/manager.go``).

Upstream one object owns the device plugin side of a kubelet: the Registration
server and its plugin clients, the books (healthy/unhealthy sets, pod
allocations, the in-use set), the checkpoint it reads at start and writes after
every change, admission (``Allocate``), the container-start step
(``GetDeviceRunContainerOptions``) and ``UpdateAllocatedDevices``. The pod side
calls it directly, and the node status polls its ``GetCapacity``. This class is
that object, so a rule of the device manager has one obvious home:

* the books themselves and their pure rules are in :mod:`.manager`
  (``DeviceManager``, unit-tested without sockets);
* the allocation algorithm (``devicesToAllocate`` and its error texts) is in
  :mod:`.allocation`;
* talking to one plugin is :mod:`.endpoint`, the Registration server and the
  plugin clients :mod:`.registration` and :mod:`.client`;
* the checkpoint's file format is :mod:`.checkpoint`; reading it at start and
  writing it when the kubelet writes it happen here, as upstream.

Everything the kubelet around it knows (which pods are active, which
containers the runtime still runs, whether pod sources are ready) comes in
through callables, so this module knows nothing about pods.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Protocol

import grpc

from plugvisor.api.deviceplugin.v1beta1 import api_pb2
from plugvisor.common import constants
from plugvisor.emulators.kubelet import allocation as allocation_
from plugvisor.emulators.kubelet import checkpoint as checkpoint_
from plugvisor.emulators.kubelet import client as client_
from plugvisor.emulators.kubelet import endpoint as endpoint_
from plugvisor.emulators.kubelet import errors, journal, manager, manifest, model, registration, versions
from plugvisor.emulators.kubelet import gates as gates_


class NodeStatusSink(Protocol):
    """**Protocol:** the node status the device manager reports through (see :mod:`.nodestatus`)."""

    def sync(self, resource: str | None = None) -> None:
        """Poll capacity now, as a node-status sync would (``resource``: only that one changed)."""

    def counts(self, resource: str) -> tuple[int, int]:
        """Return ``(capacity, allocatable)`` as the node reports them now."""


class ManagerImpl:
    """The device manager of one kubelet process: server, books, checkpoint, admission, container start.

    One instance lives as long as the :class:`~plugvisor.emulators.kubelet.EmulatedKubelet`;
    :meth:`start` plays a new kubelet process (fresh books from the checkpoint,
    a fresh Registration server) and :meth:`stop` its death.
    """

    def __init__(
        self,
        *,
        socket_dir: Path,
        journal: journal.Journal,
        grace_period: float,
        dial_timeout: float,
        pre_start_timeout: float,
        replacement: registration.Replacement,
        gates: gates_.FeatureGates,
        node_status: NodeStatusSink,
        sources_ready: Callable[[], bool],
        container_running: Callable[[str, str], bool],
        active_pod_uids: Callable[[], set[str]],
        rules: versions.KubeletRules,
    ) -> None:
        self.socket_dir = socket_dir
        self.checkpoint_path = socket_dir / constants.CHECKPOINT_NAME
        self.grace_period = grace_period
        self.replacement = replacement
        self.gates = gates
        self._journal = journal
        self._dial_timeout = dial_timeout
        self._pre_start_timeout = pre_start_timeout
        self._node_status = node_status
        self._sources_ready = sources_ready
        self._container_running = container_running
        self._active_pod_uids = active_pod_uids
        self.rules = rules
        self.books = manager.DeviceManager(grace_period=grace_period)
        """The books (replaced at every start, as a new kubelet process starts empty)."""
        self.server: registration.RegistrationServer | None = None
        self._allocation_lock = asyncio.Lock()
        self._allocator = self._new_allocator()
        self._adhoc_pods: set[str] = set()
        self._pending_admission_pod: str | None = None
        """The pod that last went through admission (``pendingAdmissionPod``, releases 1.22-1.31)."""
        self._background: set[asyncio.Task[None]] = set()

    # -- lifecycle (``Start``/``Stop``) ------------------------------------------------

    async def start(self) -> list[Path]:
        """Read the checkpoint, then clean the directory and serve Register; return the removed sockets."""
        self._pending_admission_pod = None
        self.books = self.read_checkpoint()
        self._allocator = self._new_allocator()
        server = registration.RegistrationServer(
            socket_dir=self.socket_dir,
            handler=self,
            journal=self._journal,
            dial_timeout=self._dial_timeout,
            replacement=self.replacement,
        )
        removed = await server.start()
        self.server = server
        return removed

    async def stop(self) -> None:
        """Die as a kubelet process does: background calls cancelled, every plugin stream cut."""
        server, self.server = self.server, None
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if server is not None:
            await server.stop()

    # -- the checkpoint (``readCheckpoint``/``writeCheckpoint``) -----------------------

    def read_checkpoint(self) -> manager.DeviceManager:
        """Build the books of a freshly started kubelet from ``kubelet_internal_checkpoint``.

        Missing: empty books. Corrupt or undecodable: reported, then empty books
        (the kubelet logs and continues).
        """
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
        """Write ``kubelet_internal_checkpoint`` now; a failure is reported, never raised."""
        try:
            checkpoint_.write(self.checkpoint_path, self.books.checkpoint())
        except OSError as error:
            self._journal.event(
                model.EventKind.CHECKPOINT_WRITE_FAILED,
                f"failed to write checkpoint file {constants.CHECKPOINT_NAME!r}: {error}",
                path=os.fspath(self.checkpoint_path),
            )

    # -- capacity (``GetCapacity``, polled by the node status) ---------------------------

    def get_capacity(self) -> manager.Capacity:
        """Poll capacity, dropping expired resources (the checkpoint is rewritten when one goes)."""
        polled = self.books.get_capacity(now=self._journal.clock())
        if polled.deleted:
            self.write_checkpoint()
        return polled

    # -- admission (``Allocate``) and container start ---------------------------------

    async def allocate(
        self,
        *,
        pod_uid: str,
        container: str,
        resource: str,
        count: int,
        numa_affinity: frozenset[int] | None,
        kind: allocation_.ContainerKind,
        start: bool,
        adhoc: bool = False,
    ) -> model.Allocation:
        """Admit one container's share of one resource, then optionally start it (serialised).

        ``adhoc`` marks a pod that exists only through this call (the Python
        API's :meth:`~plugvisor.emulators.kubelet.EmulatedKubelet.allocate`), so
        ``UpdateAllocatedDevices`` keeps it until :meth:`remove_pod`.
        """
        async with self._allocation_lock:
            if adhoc:
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
            if adhoc:
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

    async def allocate_container(self, *, pod_uid: str, container: manifest.ContainerSpec) -> None:
        """Admit one container of a pod (``Allocate(pod, container)``) for every device resource it limits.

        As upstream: the pod becomes the pending-admission pod, devices of
        inactive pods are freed once (before the first device resource), one
        allocation runs per resource, then the checkpoint is written.
        """
        self._pending_admission_pod = pod_uid
        updated = False
        for resource in sorted(container.limits):
            if not self.is_device_plugin_resource(resource):
                continue
            if not updated:
                self.update_allocated_devices()
                updated = True
            await self.allocate(
                pod_uid=pod_uid,
                container=container.name,
                resource=resource,
                count=container.limits[resource],
                numa_affinity=None,
                kind=container.kind,
                start=False,
            )
        self.write_checkpoint()

    async def pre_start(self, *, pod_uid: str, container: str, resource: str) -> bool:
        """Run ``callPreStartContainerIfNeeded`` for one resource; tell whether it called the plugin."""
        async with self._allocation_lock:
            return await self._allocator.start_container(
                pod_uid=pod_uid, container=container, resource=resource
            )

    def is_device_plugin_resource(self, resource: str) -> bool:
        """Tell whether admission must go through the device manager for ``resource``."""
        return self.books.is_device_plugin_resource(resource)

    def update_allocated_devices(self) -> None:
        """Free devices of pods that are no longer active (``UpdateAllocatedDevices``).

        Does nothing until sources are ready: a restarting kubelet must not
        drop allocations of pods it has not seen again yet.
        """
        if not self._sources_ready():
            return
        books = self.books
        active = self._active_pod_uids() | self._adhoc_pods
        if self.rules.pending_admission_pod_is_active and self._pending_admission_pod is not None:
            active.add(self._pending_admission_pod)
        gone = books.pod_devices.pods() - active
        if not gone:
            return
        before = books.pod_devices.devices()
        books.pod_devices.remove_pods(gone)
        books.allocated_devices = books.pod_devices.devices()
        self._deallocate(before, books.allocated_devices)
        self._journal.changed()

    def remove_pod(self, pod_uid: str) -> None:
        """Forget an ad-hoc pod's allocations at once, freeing its devices."""
        books = self.books
        self._adhoc_pods.discard(pod_uid)
        freed = books.pod_devices.devices()
        books.pod_devices.remove_pods([pod_uid])
        books.allocated_devices = books.pod_devices.devices()
        books.devices_to_reuse.pop(pod_uid, None)
        self._deallocate(freed, books.allocated_devices)
        self._journal.event(model.EventKind.POD_REMOVED, f"pod {pod_uid} removed", pod_uid=pod_uid)

    # -- the proposed KEP-20210712 calls (gate ``DeviceManagerDeallocate``) -------------

    def container_stopped(self, pod_uid: str, container: str) -> None:
        """Call the proposed PostStopContainer for the devices of a container that stopped."""
        if not self.gates.device_manager_deallocate:
            return
        held = self.books.pod_devices.container_resources(pod_uid, container)
        for resource in sorted(held):
            self._spawn(
                self._proposed_call(
                    model.PluginMethod.POST_STOP_CONTAINER, resource, held[resource].device_ids()
                )
            )

    def _deallocate(self, before: Mapping[str, set[str]], after: Mapping[str, set[str]]) -> None:
        if not self.gates.device_manager_deallocate:
            return
        for resource in sorted(before):
            freed = before[resource] - after.get(resource, set())
            if freed:
                self._spawn(self._proposed_call(model.PluginMethod.DEALLOCATE, resource, freed))

    async def _proposed_call(self, method: model.PluginMethod, resource: str, device_ids: set[str]) -> None:
        info = self.books.endpoints.get(resource)
        if info is None:
            return
        try:
            offered = await info.endpoint.proposed_call(
                method, sorted(device_ids), timeout=self._pre_start_timeout
            )
        except endpoint_.EndpointCallError as error:
            self._journal.event(
                model.EventKind.PLUGIN_CALL_FAILED,
                f"{resource}: {method} failed: {error}",
                resource=resource,
                method=str(method),
                error=str(error),
            )
            return
        # Journaled, as a failure is: whoever waits for the outcome of a call sent in the
        # background (a test, before it stops the plugin) has something to wait for.
        self._journal.event(
            model.EventKind.PLUGIN_CALL_ANSWERED,
            f"{resource}: {method} " + ("answered" if offered else "not offered (UNIMPLEMENTED)"),
            resource=resource,
            method=str(method),
            offered=offered,
        )

    def _spawn(self, coroutine: Coroutine[object, object, None]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- plugin callbacks (``PluginConnected``, ``PluginListAndWatchReceiver``, ...) ----

    async def plugin_connected(self, resource: str, client: client_.PluginClient) -> None:
        """Fetch the plugin's options (its reply decides later calls) and install the endpoint.

        From 1.37 an instance whose socket path is connected already is refused
        here, after the dial and the options call, as upstream refuses it.
        """
        try:
            options = await client.get_device_plugin_options()
        except grpc.aio.AioRpcError as error:
            raise client_.ConnectError(
                f"failed to get device plugin options: {errors.go_rpc_error(error)}"
            ) from None
        client.options = model.PluginOptions.from_proto(options)
        endpoint = endpoint_.Endpoint(
            resource=resource,
            socket_path=client.socket_path,
            stub=client.stub,
            journal=self._journal,
            channel=client.channel,
        )
        if self.replacement == "per-name":
            self.books.plugin_connected(resource, endpoint, client.options)
        elif not self.books.instance_connected(resource, endpoint, client.options):
            raise client_.ConnectError(f"device plugin already connected: {client.socket_path}")
        self._node_status.sync(resource)

    def plugin_list_and_watch_receiver(self, resource: str, response: api_pb2.ListAndWatchResponse) -> None:
        """Apply one full device list (``genericDeviceUpdateCallback``) and report the new counts."""
        self.books.list_and_watch_update(resource, map(manager.DeviceRecord.from_proto, response.devices))
        self.write_checkpoint()
        self._node_status.sync(resource)
        capacity, allocatable = self._node_status.counts(resource)
        self._journal.event(
            model.EventKind.DEVICES_UPDATED,
            f"{resource}: capacity {capacity}, allocatable {allocatable}",
            resource=resource,
            capacity=capacity,
            allocatable=allocatable,
            devices=len(response.devices),
        )

    def plugin_disconnected(self, resource: str, socket_path: str) -> None:
        """The plugin at ``socket_path`` is gone.

        Up to 1.35 the resource's endpoint stops and every device turns
        unhealthy, whichever instance it was; from 1.37 only the last instance
        does that, and another one's end leaves the resource as it is.
        """
        now = self._journal.clock()
        if self.replacement == "per-name":
            last: bool | None = True if self.books.plugin_disconnected(resource, now=now) else None
        else:
            last = self.books.instance_disconnected(resource, socket_path, now=now)
        if last is None:
            return
        self._node_status.sync(resource)
        capacity, allocatable = self._node_status.counts(resource)
        if not last:
            current = self.books.endpoints[resource].endpoint.socket_path
            self._journal.event(
                model.EventKind.PLUGIN_INSTANCE_ENDED,
                f"{resource}: the instance at {socket_path} ended; the one at {current} serves the resource "
                f"(capacity {capacity}, allocatable {allocatable})",
                resource=resource,
                endpoint=socket_path,
            )
            return
        self._journal.event(
            model.EventKind.ENDPOINT_STOPPED,
            f"{resource}: endpoint stopped, all devices unhealthy "
            f"(capacity {capacity}, allocatable {allocatable})",
            resource=resource,
            capacity=capacity,
            allocatable=allocatable,
        )

    def _new_allocator(self) -> allocation_.Allocator:
        return allocation_.Allocator(
            devices=self.books,
            journal=self._journal,
            pre_start_timeout=self._pre_start_timeout,
            sources_ready=self._sources_ready,
            container_running=self._container_running,
            rules=self.rules,
        )
