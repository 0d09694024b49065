"""Lab device kinds: one module per kind of hardware, registered here, looked up everywhere else.

Placement, numbering, rendering, faults, records and the node-wide entries a kind
needs (driver directories, shared nodes, ``proc/devices`` majors) all used to be
``if kind is GPU ... elif NIC ... else FPGA`` chains spread over seven files, and
anything unknown fell through to the FPGA renderer. Now a kind's module (``gpu``,
``fpga``, ``nic``) defines a :class:`LabKind` and calls :func:`register` at import;
the generic steps (:mod:`.layout`, :mod:`.render`, :mod:`.faults`, :mod:`.platform`,
:mod:`.lab`) ask :func:`get` and never name a kind. A kind nobody registered is a
:class:`~.errors.LabError` naming it, never somebody else's renderer.

Adding hardware of a new *kind* therefore means: a module with its ``LabKind`` (and
its entry in :data:`BUILTIN` so that it is imported), its :class:`~.state.DeviceKind`
member and its profile section. New *models* of an existing kind stay one entry in
:mod:`.catalog`.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from plugvisor.emulators.lab import errors
from plugvisor.emulators.lab.pci import Bdf, Identity
from plugvisor.emulators.lab.profiles import Profile
from plugvisor.emulators.lab.spec import Spec
from plugvisor.emulators.lab.state import DeviceKind, DeviceState, FunctionState, LabState

BUILTIN = ("gpu", "fpga", "nic")
"""Modules of the lab package that define kinds; importing one registers its kinds."""


class Placer(Protocol):
    """What :mod:`.layout` offers a kind while placing its devices on the bus."""

    @property
    def profile_name(self) -> str:
        """The profile's name (stable seeds for UUIDs and MACs)."""
        ...

    def function(self, parent: str, bdf: Bdf, role: str, driver: str | None) -> FunctionState:
        """A PCI function under ``parent`` with the next IOMMU group."""
        ...

    def group_id(self, count: int = 1) -> int:
        """Reserve ``count`` consecutive IOMMU groups; return the first."""
        ...

    def next_ifindex(self) -> int:
        """The next network interface index."""
        ...

    def add(self, dev: DeviceState) -> None:
        """Record a placed device."""
        ...


@dataclass
class Shared:
    """What a kind needs node-wide: entries, ``proc/devices`` majors, PCI driver directories."""

    spec: Spec = field(default_factory=dict)
    majors: set[int] = field(default_factory=set)
    drivers: set[str] = field(default_factory=set)


class LabKind(Protocol):
    """One kind of lab hardware: how it is placed, numbered, drawn, broken and described."""

    owns: tuple[DeviceKind, ...]
    """The state kinds this module owns (the NIC module owns PFs and VFs)."""
    section: str | None
    """The profile section whose groups it places (``gpus``), or None if only derived (VFs)."""
    prefix: str
    """Device name prefix (``gpu`` -> ``gpu0``)."""

    def ports(self, group: Any) -> int:
        """Devices per slot-sized unit (ports per NIC card; 1 otherwise)."""
        ...

    def buses(self, group: Any) -> int:
        """Bus numbers one unit needs below its port (SR-IOV VFs can need more than one)."""
        ...

    def place(
        self,
        placer: Placer,
        names: list[str],
        group: Any,
        *,
        node: int,
        parent: str,
        bus: int,
        switch: str | None,
    ) -> None:
        """Create the state of one unit's devices on ``bus`` below ``parent``."""
        ...

    def number(self, state: LabState, dev: DeviceState, counters: dict[str, int]) -> None:
        """Assign numbers drivers hand out in probe (bus) order; ``counters`` is shared by all kinds."""
        ...

    def finish(self, state: LabState, dev: DeviceState) -> None:
        """Complete a device once everything is numbered (a PF creates its starting VFs)."""
        ...

    def render(self, state: LabState, dev: DeviceState) -> Spec:
        """The device's entries as they are now (it is present)."""
        ...

    def family(self, state: LabState, dev: DeviceState) -> list[str]:
        """The device and those whose tree depends on it (a PF's VFs)."""
        ...

    def identity(self, dev: DeviceState) -> Identity:
        """What the device's primary function says it is."""
        ...

    def faults(self, dev: DeviceState) -> tuple[str, ...]:
        """Fault kinds that apply to this device beyond the AER ones every PCI device has."""
        ...

    def shared(self, state: LabState, devices: list[DeviceState]) -> Shared:
        """Node-wide entries for ``devices`` (all of this kind, present or not)."""
        ...


_REGISTRY: dict[DeviceKind, LabKind] = {}
_loaded = False


def register(kind: LabKind) -> LabKind:
    """Register a kind module's :class:`LabKind` for each state kind it owns; return it."""
    for k in kind.owns:
        owner = _REGISTRY.get(k)
        if owner is not None and owner is not kind:
            raise errors.LabError(f"lab device kind {k.value!r} is registered twice")
        _REGISTRY[k] = kind
    return kind


def _load() -> None:
    global _loaded  # noqa: PLW0603 - the built-in modules are imported once, on first use
    if not _loaded:
        for name in BUILTIN:
            importlib.import_module(f"{__package__}.{name}")
        _loaded = True


def get(kind: DeviceKind | str) -> LabKind:
    """Return the module that owns ``kind``, or raise :class:`~.errors.LabError` naming it."""
    _load()
    try:
        return _REGISTRY[DeviceKind(kind)]
    except (KeyError, ValueError):
        known = ", ".join(sorted(k.value for k in _REGISTRY))
        raise errors.LabError(
            f"no lab device kind {getattr(kind, 'value', kind)!r} is registered; expected one of: {known}"
        ) from None


def placing() -> list[LabKind]:
    """The registered kinds that place profile groups, in profile section order."""
    _load()
    sections = list(Profile.model_fields)
    unique: Iterable[LabKind] = dict.fromkeys(_REGISTRY.values())
    return sorted((k for k in unique if k.section is not None), key=lambda k: sections.index(k.section or ""))
