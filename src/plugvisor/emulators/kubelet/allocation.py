"""Pod admission for one container: the kubelet's ``devicesToAllocate``, Allocate and PreStart.

The order of checks and the error texts are the kubelet's (docs/kubelet-contract.md,
sections 5 and 6), because plugin authors debug by them:

1. a container that already holds devices must ask for the same count
   (``changed request``); 2. while the kubelet is re-initialising (pod sources
   not all ready yet) a container the runtime reports running needs nothing;
   3. the resource must be registered; 4. it must have a healthy device; 5. what
   the container already holds must still be healthy; 6. then devices are taken
   from the pod's reusable pool, and the rest from ``healthy - in use``
   (``requested number of devices unavailable``).

Checks 2-5 depend on the kubelet release played (:mod:`.versions`): before
kubernetes#116376 a container already holding its devices skipped 3-5, and
before kubernetes#118635 check 2 did not exist.

The plugin is asked for a preference only when its *options reply* advertised
GetPreferredAllocation and only under the two conditions the kubelet uses; its
answer is intersected with what is allowed and any shortfall is filled by the
kubelet. Then exactly one Allocate with one container request; only
``container_responses[0]`` is kept. PreStartContainer follows at container start
when the plugin asked for it, with every device of the container and a deadline.

Where Go iterates a map (random order), this module takes devices in sorted ID
order, so the emulator is deterministic.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import MappingProxyType

from google.protobuf import text_format

from plugvisor.api.deviceplugin.v1beta1 import api_pb2
from plugvisor.emulators.kubelet import endpoint as endpoint_
from plugvisor.emulators.kubelet import errors, journal, manager, model, names, versions


class ContainerKind(enum.StrEnum):
    """How a container takes part in the pod's device reuse pool (``devicesToReuse``)."""

    APP = "app"
    """Allocates (reusable devices first), then removes its devices from the pool."""
    INIT = "init"
    """A regular init container: allocates, then *adds* its devices to the pool."""
    SIDECAR = "sidecar"
    """A restartable init container: allocates, then removes its devices (held for the pod's life)."""


class _AdmissionError(Exception):
    """The device manager's error text for a failed admission (wrapped by the caller)."""


@dataclass(slots=True)
class _Picked:
    devices: set[str] | None
    preferred_called: bool = False


def _go_proto(message: api_pb2.AllocateResponse) -> str:
    """Render a message like Go's ``%v`` of a protoc-gen-go message (compact text format)."""
    return text_format.MessageToString(message, as_one_line=True)


class Allocator:
    """Runs admission and container start for one container and one resource at a time."""

    def __init__(
        self,
        *,
        devices: manager.DeviceManager,
        journal: journal.Journal,
        pre_start_timeout: float,
        sources_ready: Callable[[], bool] = lambda: True,
        container_running: Callable[[str, str], bool] = lambda pod_uid, container: False,
        rules: versions.KubeletRules | None = None,
    ) -> None:
        self._rules = rules if rules is not None else versions.rules_for()
        self._manager = devices
        self._journal = journal
        self._pre_start_timeout = pre_start_timeout
        self._sources_ready = sources_ready
        self._container_running = container_running

    async def allocate(
        self,
        *,
        pod_uid: str,
        container: str,
        resource: str,
        count: int,
        numa_affinity: frozenset[int] | None,
        kind: ContainerKind,
        start: bool,
    ) -> model.Allocation:
        """Admit ``container`` with ``count`` devices of ``resource``, then start it if asked.

        Raises :class:`~plugvisor.emulators.kubelet.errors.AllocationError` when
        admission fails and :class:`~plugvisor.emulators.kubelet.errors.PreStartError`
        when the start fails (the allocation then stands, as in the kubelet).
        """
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        devices = self._manager
        if not devices.is_device_plugin_resource(resource):
            raise errors.NotDevicePluginResourceError(
                f"resource {names.go_quote(resource)} was never registered nor allocated: "
                "the kubelet's device manager would not handle it"
            )
        # Manager.Allocate: one reuse pool per pod; entries of other pods are dropped.
        pool = devices.devices_to_reuse.setdefault(pod_uid, {})
        for other in [uid for uid in devices.devices_to_reuse if uid != pod_uid]:
            del devices.devices_to_reuse[other]
        try:
            picked, allocate_called = await self._allocate_container_resources(
                pod_uid=pod_uid,
                container=container,
                resource=resource,
                count=count,
                numa_affinity=numa_affinity,
                reusable=set(pool.get(resource, set())),
            )
        except _AdmissionError as failure:
            error = errors.AllocationError(str(failure))
            self._journal.event(
                model.EventKind.ALLOCATION_FAILED,
                f"{pod_uid}/{container}: {error.status_message}",
                resource=resource,
                pod_uid=pod_uid,
                container=container,
                count=count,
                error=error.message,
            )
            raise error from None
        if kind is ContainerKind.INIT:
            devices.pod_devices.add_container_allocated_resources(pod_uid, container, pool)
        else:
            devices.pod_devices.remove_container_allocated_resources(pod_uid, container, pool)

        stored = devices.pod_devices.get(pod_uid, container, resource)
        by_numa = stored.devices_by_numa if stored is not None else {}
        allocation = model.Allocation(
            pod_uid=pod_uid,
            container=container,
            resource=resource,
            device_ids=tuple(sorted(stored.device_ids())) if stored is not None else (),
            devices_by_numa=MappingProxyType(dict(by_numa)),
            response=stored.response if stored is not None else None,
            preferred_called=picked.preferred_called,
            allocate_called=allocate_called,
            pre_start_called=False,
            reused=picked.devices is None and stored is not None,
        )
        self._journal.event(
            model.EventKind.ALLOCATED,
            f"{pod_uid}/{container}: {resource} -> {','.join(allocation.device_ids) or '(none)'}",
            resource=resource,
            pod_uid=pod_uid,
            container=container,
            devices=",".join(allocation.device_ids),
            reused=allocation.reused,
        )
        if not start or count == 0:
            return allocation
        try:
            called = await self.start_container(pod_uid=pod_uid, container=container, resource=resource)
        except errors.PreStartError as error:
            error.allocation = allocation
            raise
        return dataclasses.replace(allocation, pre_start_called=called)

    async def start_container(self, *, pod_uid: str, container: str, resource: str) -> bool:
        """Run the container-start step (``callPreStartContainerIfNeeded``); return whether it called.

        This runs at every container (re)start in the kubelet, so callers may
        repeat it for a container that restarts.
        """
        try:
            return await self._pre_start_if_needed(pod_uid=pod_uid, container=container, resource=resource)
        except errors.PreStartError as error:
            self._journal.event(
                model.EventKind.PRE_START_FAILED,
                f"{pod_uid}/{container}: {error.message}",
                resource=resource,
                pod_uid=pod_uid,
                container=container,
                error=error.message,
            )
            raise

    async def _pre_start_if_needed(self, *, pod_uid: str, container: str, resource: str) -> bool:
        devices = self._manager
        if not devices.is_device_plugin_resource(resource):
            return False
        info = devices.endpoints.get(resource)
        if info is None:
            raise errors.PreStartError(f"endpoint not found in cache for a registered resource: {resource}")
        if info.options is None or not info.options.pre_start_required:
            return False
        held = devices.pod_devices.container_devices(pod_uid, container, resource)
        if held is None:
            raise errors.PreStartError(
                f"no devices found allocated in local cache for pod {pod_uid}, "
                f"container {container}, resource {resource}"
            )
        try:
            await info.endpoint.pre_start_container(sorted(held), timeout=self._pre_start_timeout)
        except endpoint_.EndpointCallError as error:
            raise errors.PreStartError(
                f"device plugin PreStartContainer rpc failed with err: {error}"
            ) from None
        return True

    # -- allocateContainerResources, for one resource ----------------------------------------

    async def _allocate_container_resources(
        self,
        *,
        pod_uid: str,
        container: str,
        resource: str,
        count: int,
        numa_affinity: frozenset[int] | None,
        reusable: set[str],
    ) -> tuple[_Picked, bool]:
        devices = self._manager
        picked = await self._devices_to_allocate(
            pod_uid=pod_uid,
            container=container,
            resource=resource,
            required=count,
            reusable=reusable,
            numa_affinity=numa_affinity,
        )
        if not picked.devices:
            return picked, False
        info = devices.endpoints.get(resource)
        if info is None:
            devices.allocated_devices = devices.pod_devices.devices()
            raise _AdmissionError(f"unknown Device Plugin {resource}")
        try:
            response = await info.endpoint.allocate(sorted(picked.devices))
        except endpoint_.EndpointCallError as error:
            # Upstream restores the in-use set from pod allocations only on this path.
            devices.allocated_devices = devices.pod_devices.devices()
            raise _AdmissionError(str(error)) from None
        if not response.container_responses:
            raise _AdmissionError(f"no containers return in allocation response {_go_proto(response)}")
        by_numa: dict[int, list[str]] = {}
        for device in sorted(picked.devices):
            for node in devices.numa_nodes_of(resource, device):
                by_numa.setdefault(node, []).append(device)
        devices.pod_devices.insert(
            pod_uid,
            container,
            resource,
            manager.ContainerAllocation(
                devices_by_numa=MappingProxyType({node: tuple(ids) for node, ids in sorted(by_numa.items())}),
                response=response.container_responses[0],
            ),
        )
        return picked, True

    async def _devices_to_allocate(  # noqa: PLR0911, PLR0912 - mirrors devicesToAllocate check by check
        self,
        *,
        pod_uid: str,
        container: str,
        resource: str,
        required: int,
        reusable: set[str],
        numa_affinity: frozenset[int] | None,
    ) -> _Picked:
        devices = self._manager
        needed = required
        held = devices.pod_devices.container_devices(pod_uid, container, resource)
        if held is not None:
            needed -= len(held)
            if needed != 0:
                raise _AdmissionError(
                    f"pod {names.go_quote(pod_uid)} container {names.go_quote(container)} changed request "
                    f"for resource {names.go_quote(resource)} from {len(held)} to {required}"
                )
        rules = self._rules
        if (
            rules.skip_running_containers_while_sources_not_ready
            and not self._sources_ready()
            and self._container_running(pod_uid, container)
        ):
            # A kubelet restart: the running container already has its devices.
            return _Picked(devices=None)
        if not rules.health_checks_before_reuse and needed == 0:
            # Before kubernetes#116376 a container holding its devices needed nothing, healthy or not.
            return _Picked(devices=None)
        healthy = devices.healthy.get(resource)
        if healthy is None:
            raise _AdmissionError(rules.unregistered_device_error.format(resource=resource))
        if rules.health_checks_before_reuse:
            if not healthy:
                raise _AdmissionError(
                    f"no healthy devices present; cannot allocate unhealthy devices {resource}"
                )
            if held is not None and not held <= healthy:
                raise _AdmissionError(
                    "previously allocated devices are no longer healthy; "
                    f"cannot allocate unhealthy devices {resource}"
                )
        if needed == 0:
            return _Picked(devices=None)

        allocated: set[str] = set()
        picked = _Picked(devices=allocated)

        def take_from(candidates: Iterable[str]) -> bool:
            """Take devices until none is needed; tell whether that point was reached."""
            nonlocal needed
            in_use = devices.allocated_devices.setdefault(resource, set())
            for device in sorted(set(candidates) - allocated):
                in_use.add(device)
                allocated.add(device)
                needed -= 1
                if needed == 0:
                    return True
            return False

        if take_from(reusable):
            return picked
        available = devices.healthy[resource] - devices.allocated_devices.get(resource, set())
        if len(available) < needed:
            raise _AdmissionError(
                f"requested number of devices unavailable for {resource}. "
                f"Requested: {needed}, Available: {len(available)}"
            )
        aligned, unaligned, no_affinity = self._filter_by_affinity(resource, available, numa_affinity)
        if needed < len(aligned):
            preferred = await self._preferred(
                picked, resource, available=aligned | allocated, must_include=set(allocated), size=required
            )
            if take_from(preferred & aligned) or take_from(aligned):
                return picked
            raise _AdmissionError(
                "unexpectedly allocated less resources than required. "
                f"Requested: {required}, Got: {required - needed}"
            )
        if take_from(aligned):
            return picked
        preferred = await self._preferred(
            picked, resource, available=available | allocated, must_include=set(allocated), size=required
        )
        if take_from(preferred & available) or take_from(unaligned) or take_from(no_affinity):
            return picked
        raise _AdmissionError(
            "unexpectedly allocated less resources than required. "
            f"Requested: {required}, Got: {required - needed}"
        )

    async def _preferred(
        self, picked: _Picked, resource: str, *, available: set[str], must_include: set[str], size: int
    ) -> set[str]:
        """Run ``callGetPreferredAllocationIfAvailable``: empty when the plugin has no preference."""
        info = self._manager.endpoints.get(resource)
        if info is None:
            raise _AdmissionError(f"endpoint not found in cache for a registered resource: {resource}")
        if info.options is None or not info.options.get_preferred_allocation_available:
            return set()
        picked.preferred_called = True
        try:
            response = await info.endpoint.get_preferred_allocation(
                available=sorted(available), must_include=sorted(must_include), size=size
            )
        except endpoint_.EndpointCallError as error:
            raise _AdmissionError(
                f"device plugin GetPreferredAllocation rpc failed with err: {error}"
            ) from None
        if response.container_responses:
            return set(response.container_responses[0].deviceIDs)
        return set()

    def _filter_by_affinity(
        self, resource: str, available: set[str], numa_affinity: frozenset[int] | None
    ) -> tuple[set[str], set[str], set[str]]:
        """Split into (aligned, unaligned, no-topology) by the hint, as ``filterByAffinity``.

        Without a hint, or for a resource without topology, everything is
        "no-topology". A device on several NUMA nodes goes to the list of its
        first node in the order: hinted nodes, other nodes, then the pseudo node -1.
        """
        devices = self._manager
        if numa_affinity is None or not devices.has_topology_alignment(resource):
            return set(), set(), set(available)
        per_node: dict[int, set[str]] = {}
        for device in available:
            for node in devices.numa_nodes_of(resource, device):
                per_node.setdefault(node, set()).add(device)

        def order(node: int) -> tuple[int, int]:
            if node in numa_affinity:
                return (0, node)
            if node == manager.NODE_WITHOUT_TOPOLOGY:
                return (2, node)
            return (1, node)

        nodes = sorted(per_node, key=order)
        aligned: set[str] = set()
        unaligned: set[str] = set()
        without: set[str] = set()
        for device in available:
            for node in nodes:
                if device in per_node[node]:
                    if node == manager.NODE_WITHOUT_TOPOLOGY:
                        without.add(device)
                    elif node in numa_affinity:
                        aligned.add(device)
                    else:
                        unaligned.add(device)
                    break
        return aligned, unaligned, without
