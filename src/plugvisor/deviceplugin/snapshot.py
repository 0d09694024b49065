"""One scan's result: the devices, the directories to watch, and whatever the hooks need from that scan.

A source returns a :class:`Snapshot` from ``scan()`` and keeps nothing itself:
the framework publishes the snapshot and hands each hook the snapshot its
answer is about. A preferred allocation is then computed from the very device
set the kubelet was sent, never from a newer scan that raced it, and a source
needs no lock shared between its scan (a worker thread) and its hooks.

``data`` is the kind's own per-scan value (the gpu kind keeps each device's PCI
placement and CDI nodes there). It must be immutable and comparable: a rescan
whose snapshot equals the previous one wakes nobody.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, Generic, TypeVar, overload

from plugvisor.deviceplugin.devices import Device, DeviceSet

DataT = TypeVar("DataT")


class Snapshot(Generic[DataT]):
    """Immutable: devices (a :class:`DeviceSet`), directories to watch, and the kind's per-scan data."""

    __slots__ = ("data", "devices", "watch")

    devices: DeviceSet
    watch: tuple[Path, ...]
    data: DataT

    @overload
    def __init__(
        self: Snapshot[None], devices: DeviceSet | Iterable[Device] = (), *, watch: Iterable[Path] = ()
    ) -> None: ...
    @overload
    def __init__(
        self, devices: DeviceSet | Iterable[Device] = (), *, watch: Iterable[Path] = (), data: DataT
    ) -> None: ...
    def __init__(
        self, devices: DeviceSet | Iterable[Device] = (), *, watch: Iterable[Path] = (), data: Any = None
    ) -> None:
        object.__setattr__(self, "devices", devices if isinstance(devices, DeviceSet) else DeviceSet(devices))
        object.__setattr__(self, "watch", tuple(Path(p) for p in watch))
        object.__setattr__(self, "data", data)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Snapshot is immutable: cannot set {name}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Snapshot):
            return NotImplemented
        return (self.devices, self.watch, self.data) == (other.devices, other.watch, other.data)

    def __hash__(self) -> int:
        return hash((self.devices, self.watch))

    def __repr__(self) -> str:
        return f"Snapshot({self.devices!r}, watch={len(self.watch)} paths, data={type(self.data).__name__})"

    def only(self, ids: Iterable[str]) -> Snapshot[DataT]:
        """The same snapshot narrowed to the devices with these IDs (those still in it), in that order.

        What a hook receives when it is about some devices: a container's, or the released ones.
        """
        narrowed: Snapshot[DataT] = Snapshot(
            self.devices.subset(ids, strict=False), watch=self.watch, data=self.data
        )
        return narrowed
