"""Lab device kinds from other packages: the contract a PCI device kind fulfils, and its adapter.

A package that brings a plugin kind for hardware plugvisor does not know (an
``acme.com/npu`` accelerator) can bring the lab's side of that hardware too, so
that its tests, ``plugvisor lab`` and its users get a faithful tree with faults,
hot-plug and ``lab check`` instead of a fake ``sys/`` written by hand. It
subclasses :class:`PciDeviceKind` and names an instance in the ``plugvisor.lab``
entry-point group (docs/lab.md, "Lab device kinds from other packages")::

    [project.entry-points."plugvisor.lab"]
    acme-npu = "plugvisor_npu.lab:LAB_KIND"

The division of work: the lab places each device on the PCI bus like its own
(a root port or a PCIe switch port, a NUMA node, an IOMMU group, BARs), writes
its PCI function with every attribute and link a real one has, binds the
driver, numbers the devices in bus order, keeps the state, and does the
faults every PCI device shares (``aer-fatal``, ``aer-nonfatal``,
``aer-correctable``, ``link-degraded``, ``fallen-off-bus``: the driver goes and
the kind's entries with it), hot-plug (``lab unplug``/``plug``: everything the
device rendered goes and comes back) and ``lab show``. The kind says what the
hardware is (:class:`PciModel`: IDs, driver, names for ``pci.ids``) and what its
driver adds below the function (:meth:`PciDeviceKind.render`: a class device,
its attributes, its device node), as a pure function of a :class:`PciDevice`
view: its faults are just names the kind's renderer looks at.

Like the rest of the lab, this is plain files: nothing here may import gRPC or
the framework (an import-linter contract).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

import pydantic

from plugvisor.emulators.lab import errors, kinds, majors, pci
from plugvisor.emulators.lab.catalog import GiB, MiB
from plugvisor.emulators.lab.faults import FaultKind
from plugvisor.emulators.lab.gpu import FALLEN_OFF_BUS
from plugvisor.emulators.lab.pci import Bdf, Identity
from plugvisor.emulators.lab.profiles import BUILTIN_PROFILES, Placement, Profile
from plugvisor.emulators.lab.spec import Dir, File, Link, Node, Spec, add_link, add_node, text
from plugvisor.emulators.lab.state import DeviceKind, DeviceState, LabState

__all__ = [
    "Dir",
    "File",
    "GiB",
    "Identity",
    "Link",
    "MiB",
    "Node",
    "PciDevice",
    "PciDeviceKind",
    "PciGroup",
    "PciModel",
    "Spec",
    "add_link",
    "add_node",
    "class_device",
    "installed",
    "text",
]

PCI_FAULTS = (FALLEN_OFF_BUS, pci.LINK_DEGRADED)
"""Faults every outside PCI kind gets besides the three AER ones."""

_NAME = re.compile(r"^[a-z][a-z0-9-]{0,30}[a-z0-9]$")
_SECTION = re.compile(r"^[a-z][A-Za-z0-9]{0,30}$")
_PREFIX = re.compile(r"^[a-z]{1,16}$")
_FAULT = re.compile(r"^[a-z][a-z0-9-]{0,40}$")


class PciGroup(Placement):
    """One profile group of an outside kind: ``model``, ``count``, ``numaNodes``, ``perSwitch``.

    A kind's own group model subclasses it to add keys (in camelCase in the
    YAML, like every profile key); unknown keys are errors naming the field.
    """

    model: str


@dataclass(frozen=True, slots=True)
class PciModel:
    """One model of an outside kind: what its PCI function says it is and which driver binds it."""

    key: str
    """What a profile's ``model:`` names (``acme-n1``)."""
    name: str
    """The device's name in ``pci.ids``."""
    vendor_name: str
    """The vendor's name in ``pci.ids``."""
    identity: Identity
    driver: str | None
    """The PCI driver bound to it (``sys/bus/pci/drivers/<driver>``); None: no driver."""
    module: str | None = None
    """The driver's kernel module (``sys/module/<module>``), when it is not built in."""
    link_speed: str = "16.0 GT/s PCIe"
    link_width: int = 16
    bars: tuple[tuple[int, int, bool], ...] = ((0, 16 * MiB, False), (2, 1 * GiB, True))
    """``(BAR index, size in bytes, prefetchable)``; the lab assigns the addresses."""


@dataclass(frozen=True, slots=True)
class PciDevice:
    """What a kind's renderer gets for one present device: decided at creation, changed by faults."""

    name: str
    """The lab's name for it (``npu0``): the kind's prefix and its number."""
    model: PciModel
    index: int
    """Its number among the devices of its kind, in bus order (as a driver numbers them at probe)."""
    bdf: str
    path: str
    """Its PCI function's directory, relative to the lab root (below ``sys/devices``)."""
    numa_node: int
    cpulist: str
    faults: frozenset[str]
    """The faults injected now: the kind's own and the shared ones (``aer-fatal``, ``link-degraded``)."""
    attributes: Mapping[str, str | int]
    """What :meth:`PciDeviceKind.attributes` decided for it when the lab was created."""


GroupT = TypeVar("GroupT", bound=PciGroup)


class PciDeviceKind(Generic[GroupT]):
    """A kind of PCI hardware the lab learns from another package.

    Set the class attributes and implement :meth:`render`; the other methods
    have working defaults. One instance is registered, under the
    ``plugvisor.lab`` entry-point group with the kind's :attr:`name`.
    """

    name: ClassVar[str]
    """The kind (``acme-npu``): ``lab show``'s kind column and the entry point's name."""
    section: ClassVar[str]
    """The profile key of its groups (``npus``)."""
    prefix: ClassVar[str]
    """Device names are the prefix and a number (``npu`` -> ``npu0``, ``npu1``)."""
    group_model: ClassVar[type[PciGroup]] = PciGroup
    """The pydantic model of one profile group; a subclass of :class:`PciGroup`."""
    models: ClassVar[Mapping[str, PciModel]]
    """Its models by key."""
    faults: ClassVar[tuple[str, ...]] = ()
    """Its own fault names, beyond those every PCI device has (:data:`PCI_FAULTS` and AER)."""
    majors: ClassVar[Mapping[int, str]] = {}
    """Character majors its device nodes use -> their ``proc/devices`` name (a dynamic one, 240-254)."""

    def attributes(self, group: GroupT, name: str) -> Mapping[str, str | int]:
        """Per-device values decided once when the lab is created (a serial number); kept in the state."""
        return {}

    def render(self, device: PciDevice, spec: Spec) -> None:
        """Add what the driver shows for ``device`` below its PCI function (class device, attributes, nodes).

        Called while the device is present and bound (not fallen off the bus);
        every entry must be relative to the lab root, and links must resolve
        inside it (``lab check`` says where not). Its faults are in
        ``device.faults``: render what the kernel would show with them.
        """
        raise NotImplementedError(f"{type(self).__name__}.render")

    def shared(self, devices: Sequence[PciDevice], spec: Spec) -> None:
        """Add node-wide entries for the kind's devices (``sys/class/<class>``), written at creation."""
        return

    def check(self, root: str) -> list[str]:
        """``lab check``'s questions about the kind's own entries, as a reader asks them; [] when right."""
        return []

    def profiles(self) -> Mapping[str, str]:
        """Named profiles (YAML text) this package brings: ``plugvisor lab create --profile NAME``."""
        return {}

    def parse_groups(self, raw: object) -> list[GroupT]:
        """The profile's groups of this kind, validated (raises :class:`pydantic.ValidationError`)."""
        adapter: pydantic.TypeAdapter[list[GroupT]] = pydantic.TypeAdapter(list[self.group_model])  # type: ignore[name-defined]
        return adapter.validate_python(raw)

    def lab_kind(self) -> PciAdapter:
        """The kind as the lab's registry runs it (raises :class:`~.errors.LabError` naming what is wrong).

        The registry (:mod:`.kinds`) sits below this module and never imports it;
        it asks an entry point's object for its lab kind through this method.
        """
        return PciAdapter(self)


def installed(name: str) -> PciDeviceKind[Any]:
    """The lab kind of another package registered as ``name`` (a :class:`~.errors.LabError` says why not)."""
    adapter = kinds.get(name)
    if not isinstance(adapter, PciAdapter):
        raise errors.LabError(f"{name!r} is one of the lab's own kinds, not another package's")
    return adapter.kind


def class_device(
    spec: Spec,
    device: PciDevice,
    *,
    cls: str,
    name: str,
    major: int,
    minor: int,
    node: str | None = None,
    mode: int = 0o666,
) -> str:
    """Add a class device below ``device``'s function, as a driver's ``device_create`` makes it.

    ``<function>/<cls>/<name>/`` with ``dev``, ``uevent``, ``device`` and
    ``subsystem`` links, ``sys/class/<cls>/<name>`` pointing at it, and the node
    ``dev/<node>`` (default: ``name``) with its ``sys/dev/char`` and ``dev/char``
    links. Returns the directory, for the class device's own attributes.
    """
    where = f"{device.path}/{cls}/{name}"
    devname = node or name
    spec[where] = Dir()
    spec[f"{where}/dev"] = text(f"{major}:{minor}")
    spec[f"{where}/uevent"] = text(f"MAJOR={major}\nMINOR={minor}\nDEVNAME={devname}")
    add_link(spec, f"{where}/device", device.path)
    add_link(spec, f"{where}/subsystem", f"sys/class/{cls}")
    add_link(spec, f"sys/class/{cls}/{name}", where)
    add_node(spec, at=f"dev/{devname}", major=major, minor=minor, sys_target=where, mode=mode)
    return where


def _problems(kind: PciDeviceKind[Any]) -> list[str]:
    """Why ``kind`` cannot be registered (empty: it can)."""
    cls = type(kind).__name__
    problems = []
    for attribute in ("name", "section", "prefix", "models"):
        if not hasattr(kind, attribute):
            problems.append(f"{cls}.{attribute} is not set")
    if problems:
        return problems
    taken_sections = {info.alias or field for field, info in Profile.model_fields.items()} | set(
        Profile.model_fields
    )
    checks = (
        (
            _NAME.match(kind.name) and kind.name not in set(DeviceKind),
            "name",
            "lower-case letters, digits, - (not a built-in kind)",
        ),
        (_SECTION.match(kind.section) and kind.section not in taken_sections, "section", "a new profile key"),
        (_PREFIX.match(kind.prefix), "prefix", "1-16 lower-case letters"),
    )
    problems += [
        f"{cls}.{what} {getattr(kind, what)!r}: expected {hint}" for ok, what, hint in checks if not ok
    ]
    if not kind.models or any(key != model.key for key, model in kind.models.items()):
        problems.append(f"{cls}.models: expected at least one PciModel, each under its own key")
    group_model: Any = kind.group_model  # whatever another package set, checked rather than trusted
    if not (isinstance(group_model, type) and issubclass(group_model, PciGroup)):
        problems.append(f"{cls}.group_model: expected a subclass of PciGroup")
    shared = {f.value for f in FaultKind}
    for fault in kind.faults:
        if not _FAULT.match(fault) or fault in shared:
            problems.append(
                f"{cls}.faults: {fault!r} is not a new fault name (lower-case letters, digits, -)"
            )
    for major in kind.majors:
        if major in majors.NAMES or not 1 <= major <= 511:
            problems.append(f"{cls}.majors: {major} is the lab's own or not a character major")
    return problems


class PciAdapter:
    """Runs a :class:`PciDeviceKind` as one of the lab's kinds (the internal :class:`~.kinds.LabKind`)."""

    def __init__(self, kind: PciDeviceKind[Any]) -> None:
        problems = _problems(kind)
        if problems:
            raise errors.LabError("; ".join(problems))
        self.kind = kind
        self.owns: tuple[str, ...] = (kind.name,)
        self.section: str | None = kind.section
        self.prefix = kind.prefix
        self.profiles = dict(kind.profiles())
        """Its named profiles; plugvisor's own names are refused (another kind's, by the registry)."""
        taken = sorted(set(self.profiles) & set(BUILTIN_PROFILES))
        if taken:
            raise errors.LabError(
                f"{type(kind).__name__}.profiles: {', '.join(taken)} are plugvisor's own profiles"
            )

    def ports(self, group: Any) -> int:
        return 1

    def buses(self, group: Any) -> int:
        return 1

    def place(
        self,
        placer: kinds.Placer,
        names: list[str],
        group: Any,
        *,
        node: int,
        parent: str,
        bus: int,
        switch: str | None,
    ) -> None:
        model = self.kind.models[group.model]
        fn = placer.function(parent, Bdf(0, bus, 0, 0), "device", model.driver)
        placer.add(
            DeviceState(
                name=names[0],
                kind=self.kind.name,
                model=model.key,
                numa_node=node,
                switch=switch,
                functions=[fn],
                attributes=dict(self.kind.attributes(group, names[0])),
            )
        )

    def number(self, state: LabState, dev: DeviceState, counters: dict[str, int]) -> None:
        key = f"kind:{self.kind.name}"
        dev.index = counters.get(key, 0)
        counters[key] = dev.index + 1

    def finish(self, state: LabState, dev: DeviceState) -> None:
        return

    def view(self, state: LabState, dev: DeviceState) -> PciDevice:
        """The kind's view of one device."""
        fn = dev.primary
        return PciDevice(
            name=dev.name,
            model=self.kind.models[dev.model],
            index=dev.index or 0,
            bdf=fn.bdf,
            path=fn.path,
            numa_node=dev.numa_node,
            cpulist=state.cpulist(dev.numa_node),
            faults=frozenset(dev.faults),
            attributes=dict(dev.attributes),
        )

    def render(self, state: LabState, dev: DeviceState) -> Spec:
        device = self.view(state, dev)
        model = device.model
        fn = dev.primary
        fallen = FALLEN_OFF_BUS in dev.faults
        spec: Spec = {}
        pci.render_function(
            spec,
            pci.Function(
                bdf=fn.address,
                path=fn.path,
                identity=model.identity,
                driver=None if fallen else fn.driver,
                numa_node=dev.numa_node,
                cpulist=device.cpulist,
                iommu_group=fn.iommu_group,
                link_speed=model.link_speed,
                link_width=model.link_width,
                aer=dev.aer,
                config_readable=not fallen,
                link_degraded=pci.LINK_DEGRADED in dev.faults,
                bars=pci.assign_bars(fn.address, model.bars),
                nr_cpus=state.nr_cpus,
                msi_vectors=0 if fallen or not fn.driver else 2,
            ),
        )
        if not fallen:
            self.kind.render(device, spec)
        return spec

    def family(self, state: LabState, dev: DeviceState) -> list[str]:
        return [dev.name]

    def identity(self, dev: DeviceState) -> Identity:
        return self.kind.models[dev.model].identity

    def faults(self, dev: DeviceState) -> tuple[str, ...]:
        return (*PCI_FAULTS, *self.kind.faults)

    def shared(self, state: LabState, devices: list[DeviceState]) -> kinds.Shared:
        out = kinds.Shared()
        self.kind.shared([self.view(state, d) for d in devices], out.spec)
        out.majors |= set(self.kind.majors)
        out.names.update(self.kind.majors)
        for model in {self.kind.models[d.model] for d in devices}:
            if model.driver and model.module:
                out.modules[model.driver] = model.module
            ident = model.identity
            out.pci_ids[(ident.vendor, ident.device)] = (model.vendor_name, model.name)
        return out
