"""What a plugin author writes: a device source, plus any of a few optional hooks.

**Protocol:** each optional capability is its own one-method Protocol. The
framework checks which ones a plugin object implements *once*, when the server is
built (:func:`resolve_hooks`), and derives the kubelet-facing
``DevicePluginOptions`` from that result, so what a plugin advertises can never
drift from what it does (Intel's device-plugin framework works the same way).

Hooks take and return domain values (:class:`~plugvisor.deviceplugin.snapshot.Snapshot`,
:class:`ContainerAllocation`), never protobuf messages: the wire format is the
server's business. Every hook receives the snapshot its answer is about (narrowed
to the devices concerned), so a source keeps no state between ``scan()`` and
its hooks.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

from plugvisor.deviceplugin.devices import DeviceSpec, Mount
from plugvisor.deviceplugin.snapshot import Snapshot


@runtime_checkable
class DeviceSource(Protocol):
    """**Protocol:** discovers a resource's devices, one full snapshot per call.

    ``scan`` is one-shot and side-effect free: it reads the host and returns what
    it found, health included, as a :class:`Snapshot`. It does not loop, sleep or
    notify; the framework owns the loop, its triggers and its clock. It runs in a
    worker thread, so blocking file reads are fine. Raising means "this scan
    failed": the framework logs it and keeps the previous snapshot.

    The snapshot's ``watch`` names the directories whose changes should trigger a
    rescan (inotify: an entry created, deleted or renamed in; in-place writes are
    left to the periodic rescan). A path that does not exist yet is watched
    through its nearest existing parent; each scan's list replaces the previous one.
    """

    def scan(self) -> Snapshot[Any]:
        """Return every device of the resource as it is now, what to watch, and the hooks' data."""
        ...


@dataclass(frozen=True, slots=True)
class ContainerAllocation:
    """What one container receives for its devices: the domain form of ContainerAllocateResponse."""

    specs: Sequence[DeviceSpec] = ()
    mounts: Sequence[Mount] = ()
    envs: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    annotations: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    cdi_devices: Sequence[str] = ()


@runtime_checkable
class PreferredAllocator(Protocol):
    """**Protocol:** chooses which devices a container should get (topology, packing...).

    Called with IDs the framework has already validated: ``available`` are known,
    healthy and distinct, ``must_include`` is a subset of them and
    ``len(must_include) <= size <= len(available)``. Return exactly ``size`` IDs
    from ``available`` that include every ``must_include`` ID; an answer that
    breaks this is logged and replaced by the framework's default choice.
    """

    def preferred_allocation(
        self, available: Sequence[str], must_include: Sequence[str], size: int, snapshot: Snapshot[Any]
    ) -> Sequence[str]:
        """Return the preferred ``size`` device IDs (``snapshot``: what the request was checked against)."""
        ...


@runtime_checkable
class ContainerPreStarter(Protocol):
    """**Protocol:** prepares devices before every container start (reset, re-initialise).

    Runs in a worker thread; the kubelet gives the whole call 30 seconds. Raise to
    fail the container start (the kubelet reports the message).
    """

    def pre_start_container(self, snapshot: Snapshot[Any]) -> None:
        """Make ``snapshot.devices`` ready for a container that is about to start."""
        ...


@runtime_checkable
class PostAllocator(Protocol):
    """**Protocol:** edits the default allocation of one container (extra env, renumbering...)."""

    def post_allocate(self, allocation: ContainerAllocation, snapshot: Snapshot[Any]) -> ContainerAllocation:
        """Return the allocation the container should really get (``snapshot.devices``: its devices)."""
        ...


@runtime_checkable
class UeventSubscriber(Protocol):
    """**Protocol:** a source that wants a rescan when the kernel announces a device change.

    On real nodes sysfs sends no inotify events; hot-plug arrives as kernel
    uevents. Return the subsystems that matter (``pci``, ``drm``, ``net``...).
    """

    def uevent_subsystems(self) -> Collection[str]:
        """Return the uevent subsystems whose events should trigger a rescan."""
        ...


@runtime_checkable
class RescanRequester(Protocol):
    """**Protocol:** a source that learns of changes by itself and wants a rescan when it does.

    For health that arrives as events of a vendor library (NVML's XID events,
    waited on by the source's own thread) rather than as files or uevents. The
    framework calls ``request_rescans`` once discovery runs, with a callable
    that any thread may call, any number of times: each call asks for a scan
    as soon as possible (calls while one is pending make one scan). The scan
    itself stays one-shot and side-effect free, and reads what the event left.
    """

    def request_rescans(self, rescan: Callable[[], None]) -> None:
        """Keep ``rescan`` and call it (from any thread) whenever the devices should be scanned again."""
        ...


@runtime_checkable
class ContainerPostStopper(Protocol):
    """**Protocol:** cleans up after a container that held devices has stopped.

    A *proposed* call (the KEP-20210712 addendum), never merged upstream: real
    kubelets never make it; the emulated kubelet does behind its
    ``DeviceManagerDeallocate`` gate. Runs in a worker thread.
    """

    def post_stop_container(self, snapshot: Snapshot[Any]) -> None:
        """Undo what the container's start did to ``snapshot.devices``."""
        ...


@runtime_checkable
class Deallocator(Protocol):
    """**Protocol:** scrubs devices that are no longer allocated to any container.

    The same proposal as :class:`ContainerPostStopper`; on real kubelets use
    :class:`ReleaseHandler`, which the framework calls for both signs of a release.
    Devices that have vanished since are left out of ``snapshot.devices``.
    """

    def deallocate(self, snapshot: Snapshot[Any]) -> None:
        """Make ``snapshot.devices`` clean for their next user (de-program, scrub)."""
        ...


@dataclass(frozen=True, slots=True)
class ReleaseWatch:
    """How the framework watches the kubelet's PodResources API for released devices.

    ``socket`` defaults to the PodResources socket beside the kubelet's
    device-plugins directory; ``interval`` is the seconds between two ``List`` calls.
    """

    interval: float = 5.0
    socket: Path | None = None


@runtime_checkable
class ReleaseHandler(Protocol):
    """**Protocol:** acts on devices that no container holds any more (scrub, reset, de-program).

    Real kubelets never tell a plugin that a device was released; the framework
    finds out by polling the PodResources API (as :meth:`release_watch` asks) and,
    where a kubelet makes the proposed ``Deallocate`` call, from that too.
    :meth:`released` runs once per use of a device, in a worker thread, however
    many of those signs arrive: a device handed out again (Allocate or
    PreStartContainer) becomes eligible again. A device released while the plugin
    was not running is not seen.
    """

    def release_watch(self) -> ReleaseWatch | None:
        """How to watch PodResources; None turns the watch off (Deallocate calls still count)."""
        ...

    def released(self, snapshot: Snapshot[Any]) -> None:
        """Clean ``snapshot.devices`` for their next user; raising logs the failure and allows a retry."""
        ...


@runtime_checkable
class PluginLifecycle(Protocol):
    """**Protocol:** a source with something to set up before its first scan and to tear down after the last.

    ``start`` runs once, before discovery starts; ``close`` runs once when the
    plugin stops, after the server has stopped, also when the plugin fails. A
    failing ``start`` ends the plugin, and ``close`` is then not called. Both run
    in a worker thread.
    """

    def start(self) -> None:
        """Acquire what the source needs (open a device, start a helper)."""
        ...

    def close(self) -> None:
        """Release it."""
        ...


@dataclass(frozen=True, slots=True)
class Hooks:
    """The optional capabilities a plugin object turned out to have, resolved once."""

    preferred: PreferredAllocator | None = None
    pre_start: ContainerPreStarter | None = None
    post_allocate: PostAllocator | None = None
    post_stop: ContainerPostStopper | None = None
    deallocate: Deallocator | None = None
    release: ReleaseHandler | None = None
    lifecycle: PluginLifecycle | None = None


def resolve_hooks(plugin: object) -> Hooks:
    """Find which optional hook Protocols ``plugin`` implements.

    ``runtime_checkable`` only checks that the method exists; mypy checks its
    signature where the plugin is written. This is the only isinstance check the
    framework makes on hooks: never per request.
    """
    return Hooks(
        preferred=plugin if isinstance(plugin, PreferredAllocator) else None,
        pre_start=plugin if isinstance(plugin, ContainerPreStarter) else None,
        post_allocate=plugin if isinstance(plugin, PostAllocator) else None,
        post_stop=plugin if isinstance(plugin, ContainerPostStopper) else None,
        deallocate=plugin if isinstance(plugin, Deallocator) else None,
        release=plugin if isinstance(plugin, ReleaseHandler) else None,
        lifecycle=plugin if isinstance(plugin, PluginLifecycle) else None,
    )
