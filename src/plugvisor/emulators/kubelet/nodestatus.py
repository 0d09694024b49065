"""The node status: what the Node object reports for each device-plugin resource.

Upstream, ``pkg/kubelet/nodestatus/setters.go`` polls the device manager's
``GetCapacity`` at every node-status sync (every 10 s) and writes capacity and
allocatable into the Node; a resource the device manager dropped after its grace
period is written with capacity 0 (not removed), so the node keeps marking it as
device-plugin managed. Here a sync happens on every change instead, plus a timer
at the next grace-period expiry, so a view never lags a ListAndWatch message.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Final

from plugvisor.common import constants
from plugvisor.emulators.kubelet import journal, model

if TYPE_CHECKING:
    from plugvisor.emulators.kubelet import devicemanager

_TIMER_SLACK: Final = 0.001
"""Fire grace timers just after expiry: the kubelet's test is strictly "older than"."""


class NodeStatus:
    """Capacity and allocatable per resource as the node reports them, and the grace timer."""

    def __init__(
        self,
        *,
        journal: journal.Journal,
        devices: Callable[[], devicemanager.ManagerImpl],
        grace_period: float,
    ) -> None:
        self._journal = journal
        self._devices = devices
        self.grace_period = grace_period
        self.capacity: dict[str, int] = {}
        self.allocatable: dict[str, int] = {}
        self.removed: set[str] = set()
        """Resources dropped after the grace period (reported at capacity 0)."""
        self._grace_timer: asyncio.TimerHandle | None = None
        self.armed = False
        """Whether the grace timer may be armed (only while the kubelet runs)."""

    def counts(self, resource: str) -> tuple[int, int]:
        """Return ``(capacity, allocatable)`` as the node reports them now."""
        return self.capacity.get(resource, 0), self.allocatable.get(resource, 0)

    def sync(self, resource: str | None = None) -> None:
        """Poll capacity as a node-status sync does, and re-arm the grace timer.

        ``resource``: only that one changed (a device list, a plugin connected or
        gone), so only its figures are read again, unless a grace period has run
        out meanwhile, which only the full poll applies. A full poll per change
        read every resource: at a kubelet restart of N resources, N² reads (a
        second of the emulated kubelet's CPU at 256, taken from the plugins it emulates for).
        """
        devices = self._devices()
        if resource is not None and resource in devices.books.endpoints:  # none: the full poll drops it
            expiry = devices.books.next_expiry()
            if expiry is None or expiry > self._journal.clock():
                self._sync_one(resource, devices.books.counts(resource))
                self._journal.changed()
                self._arm_grace_timer(expiry)
                return
        polled = devices.get_capacity()
        for name, value in polled.capacity.items():
            self.capacity[name] = value
            self.allocatable[name] = polled.allocatable.get(name, 0)
            self.removed.discard(name)
        for name in sorted(polled.deleted):
            # Zero, not absent: the node keeps marking the resource as device-plugin managed.
            self.capacity[name] = 0
            self.allocatable[name] = 0
            self.removed.add(name)
            self._journal.event(
                model.EventKind.RESOURCE_REMOVED,
                f"{name}: no plugin for {self.grace_period} s, resource removed (capacity 0)",
                resource=name,
            )
        self._journal.changed()
        self._arm_grace_timer()

    def _sync_one(self, resource: str, counts: tuple[int, int] | None) -> None:
        """Set one resource's figures (None: the device manager has none for it: left as it is)."""
        if counts is None:
            return
        self.capacity[resource], self.allocatable[resource] = counts
        self.removed.discard(resource)

    def stop(self) -> None:
        """Stop the grace timer (the kubelet stops; nothing syncs until it starts again)."""
        self.armed = False
        if self._grace_timer is not None:
            self._grace_timer.cancel()
            self._grace_timer = None

    def _arm_grace_timer(self, expiry: float | None = None) -> None:
        """Fire at the next grace-period expiry (``expiry`` when the caller has just read it)."""
        if self._grace_timer is not None:
            self._grace_timer.cancel()
            self._grace_timer = None
        if expiry is None:
            expiry = self._devices().books.next_expiry()
        if expiry is None or not self.armed:
            return
        delay = max(0.0, expiry - self._journal.clock()) + _TIMER_SLACK
        self._grace_timer = asyncio.get_running_loop().call_later(delay, self._grace_timer_fired)

    def _grace_timer_fired(self) -> None:
        self._grace_timer = None
        self.sync()

    # -- views -----------------------------------------------------------------------

    def resource(self, name: str) -> model.ResourceView | None:
        """Return ``name`` as the node reports it, or ``None`` while the node does not report it."""
        if name not in self.capacity:
            return None
        books = self._devices().books
        healthy = frozenset(books.healthy.get(name, set()))
        unhealthy = frozenset(books.unhealthy.get(name, set()))
        records = books.all_devices.get(name, {})
        device_views: dict[str, model.DeviceView] = {}
        for device_id in sorted(healthy | unhealthy):
            record = records.get(device_id)
            device_views[device_id] = model.DeviceView(
                id=device_id,
                health=constants.HEALTHY if device_id in healthy else constants.UNHEALTHY,
                reported_health=record.health if record is not None else None,
                numa_nodes=record.numa_nodes if record is not None else (),
            )
        info = books.endpoints.get(name)
        endpoint = info.endpoint if info is not None else None
        return model.ResourceView(
            name=name,
            capacity=self.capacity[name],
            allocatable=self.allocatable.get(name, 0),
            devices=MappingProxyType(device_views),
            healthy_ids=healthy,
            unhealthy_ids=unhealthy,
            endpoint=endpoint.socket_path if endpoint is not None else None,
            registered=endpoint is not None and not endpoint.is_stopped(),
            options=info.options if info is not None else None,
            stopped_at=endpoint.stop_time if endpoint is not None else None,
            removed=name in self.removed,
            topology_aware=books.has_topology_alignment(name),
        )

    def resources(self) -> Mapping[str, model.ResourceView]:
        """Every resource the node reports, by name."""
        views = {name: self.resource(name) for name in sorted(self.capacity)}
        return MappingProxyType({name: view for name, view in views.items() if view is not None})
