"""The emulated kubelet's memory of what happened, and the signal that something did.

Every part (registration server, plugin clients, allocator) writes here and
nowhere else, so tests can assert on one ordered history ("exactly two calls:
GetDevicePluginOptions, ListAndWatch") and wait on one signal. Waiting is
event-driven: each state change wakes every waiter, which then re-evaluates its
own predicate - no polling interval to tune, no sleep in tests.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from types import MappingProxyType

from plugvisor.emulators.kubelet import model

EventSink = Callable[[model.Event], None]
"""Receives each event as it is recorded (the CLI logs them, one line each)."""


class Journal:
    """Ordered records of registrations, plugin calls and events, plus change notification."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_event: EventSink | None = None,
    ) -> None:
        self.clock = clock
        self.registrations: list[model.RegistrationRecord] = []
        self.calls: list[model.PluginCall] = []
        self.events: list[model.Event] = []
        self.generation = 0
        """How many times the kubelet has started (1 after the first start)."""
        self._on_event = on_event
        self._listeners: list[Callable[[], None]] = []
        self._changed = asyncio.Event()

    def add_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` (synchronously, cheaply) after every state change."""
        self._listeners.append(listener)

    def changed(self) -> None:
        """Announce a state change: wake all waiters and listeners."""
        event, self._changed = self._changed, asyncio.Event()
        event.set()
        for listener in self._listeners:
            listener()

    def event(
        self,
        kind: model.EventKind,
        message: str,
        *,
        resource: str | None = None,
        **fields: model.FieldValue,
    ) -> model.Event:
        """Record an event and announce the change it describes."""
        record = model.Event(
            kind=kind,
            message=message,
            resource=resource,
            at=self.clock(),
            wall=time.time(),
            generation=self.generation,
            fields=MappingProxyType(dict(fields)),
        )
        self.events.append(record)
        if self._on_event is not None:
            self._on_event(record)
        self.changed()
        return record

    def call(self, resource: str, endpoint: str, method: model.PluginMethod) -> None:
        """Record an RPC the kubelet is about to issue to a plugin."""
        self.calls.append(
            model.PluginCall(
                resource=resource,
                endpoint=endpoint,
                method=method,
                at=self.clock(),
                generation=self.generation,
            )
        )
        self.changed()

    def registration(self, record: model.RegistrationRecord) -> None:
        """Record a finished Register call."""
        self.registrations.append(record)
        self.changed()

    async def wait_changed(self, timeout: float) -> None:
        """Return at the next state change, or raise :class:`TimeoutError` after ``timeout`` s."""
        await asyncio.wait_for(self._changed.wait(), timeout)
