"""Lab device kinds: one module per kind of hardware, registered here, looked up everywhere else.

Placement, numbering, rendering, faults, records and the node-wide entries a kind
needs (driver directories, shared nodes, ``proc/devices`` majors) all used to be
``if kind is GPU ... elif NIC ... else FPGA`` chains spread over seven files, and
anything unknown fell through to the FPGA renderer. Now a kind's module (``gpu``,
``fpga``, ``nic``) defines a :class:`LabKind`, which :data:`BUILTIN` names;
the generic steps (:mod:`.layout`, :mod:`.render`, :mod:`.faults`, :mod:`.platform`,
:mod:`.lab`) ask :func:`get` and never name a kind. A kind nobody registered is a
:class:`~.errors.LabError` naming it, never somebody else's renderer.

Adding hardware of a new *kind* therefore means: a module with its ``LabKind`` (and
its entry in :data:`BUILTIN` so that it is imported), its :class:`~.state.DeviceKind`
member and its profile section. New *models* of an existing kind stay one entry in
:mod:`.catalog`.

Other packages add kinds the same way plugin kinds are added: an entry point in
the ``plugvisor.lab`` group naming a
:class:`~plugvisor.emulators.lab.extension.PciDeviceKind` (docs/lab.md, "Lab
device kinds from other packages"). The built-in three are registered there
too (pyproject.toml) but imported by name, as :data:`BUILTIN` says, and their
names are reserved. An outside kind that cannot be loaded is remembered with its
error, which is reported when a profile or a lab needs it, so one broken package
does not take the lab away from everyone else.

The registry sits low in the lab's imports: it knows no kind and imports none of
the modules it describes (their types only for the checker). Kind modules import
it and are found by name when first asked for, like entry points; profiles,
state checks, faults, layout and rendering look kinds up here. So the arrows
point one way (tests/unit/lab/test_import_graph.py holds them to it).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final, Protocol, runtime_checkable

from plugvisor.emulators.lab import errors

if TYPE_CHECKING:  # types only: the registry sits below everything it describes (docs/lab.md)
    from pydantic import BaseModel

    from plugvisor.emulators.lab.pci import Bdf, Identity
    from plugvisor.emulators.lab.spec import Spec
    from plugvisor.emulators.lab.state import DeviceKind, DeviceState, FunctionState, LabState

ENTRY_POINT_GROUP = "plugvisor.lab"

BUILTIN: Final[Mapping[str, str]] = MappingProxyType(
    {
        "gpu": "plugvisor.emulators.lab.gpu:KIND",
        "fpga": "plugvisor.emulators.lab.fpga:KIND",
        "nic": "plugvisor.emulators.lab.nic:KIND",
    }
)
"""The lab's own kinds, ``name -> module:attribute``, exactly as pyproject.toml registers them
(a test keeps the two equal), registered on first use like the kinds of other packages."""


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
    names: dict[int, str] = field(default_factory=dict)
    """``proc/devices`` names of majors the lab's own table (:mod:`.majors`) does not know."""
    modules: dict[str, str] = field(default_factory=dict)
    """Kernel modules of PCI drivers :data:`.platform.MODULES` does not know: driver -> module."""
    pci_ids: dict[tuple[int, int], tuple[str, str]] = field(default_factory=dict)
    """``pci.ids`` lines for identities :mod:`.catalog` does not know: (vendor, device) -> names."""


class LabKind(Protocol):
    """One kind of lab hardware: how it is placed, numbered, drawn, broken and described."""

    owns: tuple[str, ...]
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


class OutsideSource(Protocol):
    """What the registry needs of another package's kind (:class:`~.extension.PciDeviceKind`)."""

    @property
    def name(self) -> str:
        """The kind's name, the entry point's name."""
        ...

    @property
    def models(self) -> Mapping[str, Any]:
        """Its models by key."""
        ...

    @property
    def group_model(self) -> type[BaseModel]:
        """The pydantic model of one profile group."""
        ...

    def parse_groups(self, raw: object) -> list[Any]:
        """The profile's groups of this kind, validated."""
        ...

    def check(self, root: str) -> list[str]:
        """``lab check``'s questions about the kind's own entries."""
        ...


@runtime_checkable
class OutsideKind(LabKind, Protocol):
    """A registered kind of another package (:class:`~.extension.PciAdapter`): its source and profiles."""

    @property
    def kind(self) -> OutsideSource:
        """The package's own kind object."""
        ...

    @property
    def profiles(self) -> Mapping[str, str]:
        """Named profiles (YAML text) the package brings."""
        ...


@runtime_checkable
class Adaptable(Protocol):
    """An entry point's object that can become a :class:`LabKind` (a :class:`~.extension.PciDeviceKind`)."""

    def lab_kind(self) -> LabKind:
        """The object the registry runs (raises :class:`~.errors.LabError` naming what is wrong)."""
        ...


_REGISTRY: dict[str, LabKind] = {}
_BROKEN: dict[str, str] = {}
"""Outside kinds that failed to load: entry point name -> why."""
_loaded = False
_SECTIONS: list[str] = []
"""The built-in kinds' profile sections in :data:`BUILTIN` order, which is the profile's field order."""


def register(kind: LabKind) -> LabKind:
    """Register a kind module's :class:`LabKind` for each state kind it owns; return it."""
    for k in kind.owns:
        owner = _REGISTRY.get(k)
        if owner is not None and owner is not kind:
            raise errors.LabError(f"lab device kind {str(k)!r} is registered twice")
    others = [other for other in dict.fromkeys(_REGISTRY.values()) if other is not kind]
    if kind.prefix in {other.prefix for other in others}:
        raise errors.LabError(
            f"lab device kind {kind.owns[0]!r}: device name prefix {kind.prefix!r} is taken"
        )
    if kind.section is not None and kind.section in {other.section for other in others}:
        raise errors.LabError(f"lab device kind {kind.owns[0]!r}: profile section {kind.section!r} is taken")
    named = set(getattr(kind, "profiles", {}))
    for other in others:
        clash = sorted(named & set(getattr(other, "profiles", {})))
        if clash:
            raise errors.LabError(f"lab device kind {kind.owns[0]!r}: profiles {', '.join(clash)} are taken")
    for k in kind.owns:
        _REGISTRY[k] = kind
    return kind


def _load_outside() -> None:
    from importlib.metadata import entry_points  # noqa: PLC0415 - metadata is read only for outside kinds

    try:
        found = list(entry_points(group=ENTRY_POINT_GROUP))
    except Exception as exc:  # an unreadable site-packages must not take the built-in kinds away
        _BROKEN["(entry points)"] = f"{type(exc).__name__}: {exc}"
        return
    for ep in found:
        if ep.name in BUILTIN:
            if ep.value != BUILTIN[ep.name]:  # not plugvisor's own entry: the name is reserved
                _BROKEN[f"{ep.name} ({ep.value})"] = f"{ep.name!r} is the name of one of the lab's own kinds"
            continue
        try:
            kind = ep.load()
        except Exception as exc:  # any import-time failure of another package, reported by name
            _BROKEN[ep.name] = f"{type(exc).__name__}: {exc}"
            continue
        if not isinstance(kind, Adaptable):
            _BROKEN[ep.name] = f"{ep.value} is a {type(kind).__name__}, not a PciDeviceKind"
        elif getattr(kind, "name", None) != ep.name:
            _BROKEN[ep.name] = f"{ep.value} is named {getattr(kind, 'name', None)!r}, not {ep.name!r}"
        else:
            try:
                register(kind.lab_kind())
            except errors.LabError as exc:
                _BROKEN[ep.name] = str(exc)


def _load() -> None:
    global _loaded  # noqa: PLW0603 - the kinds are imported once, on first use
    if not _loaded:
        _loaded = True
        for value in BUILTIN.values():
            module, _, attribute = value.partition(":")
            kind = register(getattr(importlib.import_module(module), attribute))
            if kind.section is not None and kind.section not in _SECTIONS:
                _SECTIONS.append(kind.section)
        _load_outside()


def broken() -> dict[str, str]:
    """Outside kinds that are installed but could not be loaded, with why (for error messages)."""
    _load()
    return dict(_BROKEN)


def get(kind: DeviceKind | str) -> LabKind:
    """Return the module that owns ``kind``, or raise :class:`~.errors.LabError` naming it."""
    _load()
    name = str(kind)
    found = _REGISTRY.get(name)
    if found is not None:
        return found
    if name in _BROKEN:
        raise errors.LabError(f"lab device kind {name!r} is installed but cannot be loaded: {_BROKEN[name]}")
    known = ", ".join(sorted(_REGISTRY))
    raise errors.LabError(f"no lab device kind {name!r} is registered; expected one of: {known}")


def placing() -> list[LabKind]:
    """The registered kinds that place profile groups: the built-in sections in profile order, then others."""
    _load()
    sections = _SECTIONS
    unique: Iterable[LabKind] = dict.fromkeys(_REGISTRY.values())

    def order(kind: LabKind) -> tuple[int, str]:
        section = kind.section or ""
        return (sections.index(section), "") if section in sections else (len(sections), section)

    return sorted((k for k in unique if k.section is not None), key=order)


def by_section() -> dict[str, LabKind]:
    """Every placing kind by its profile section."""
    return {k.section: k for k in placing() if k.section is not None}


def groups(profile: BaseModel, kind: LabKind) -> list[Any]:
    """A profile's groups of ``kind``: its own field for a built-in kind, validated extras for others."""
    assert kind.section is not None
    if kind.section in type(profile).model_fields:
        built_in: list[Any] = getattr(profile, kind.section)
        return built_in
    assert isinstance(kind, OutsideKind)
    return list(kind.kind.parse_groups((profile.model_extra or {}).get(kind.section, [])))


def check(kind: LabKind, root: str) -> list[str]:
    """An outside kind's own ``lab check`` problems for the lab at ``root`` (built-in kinds: none here)."""
    return kind.kind.check(root) if isinstance(kind, OutsideKind) else []


def outside_profiles() -> dict[str, tuple[str, str]]:
    """Named profiles of outside kinds: name -> (``profile of lab kind <kind>``, YAML text)."""
    _load()
    found: dict[str, tuple[str, str]] = {}
    for kind in dict.fromkeys(_REGISTRY.values()):
        if isinstance(kind, OutsideKind):
            for name, text in kind.profiles.items():
                found[name] = (f"profile of lab kind {kind.kind.name}", text)
    return found
