"""Device kinds: the one :class:`PluginKind` class, and the registry that ``kind: gpu`` resolves through.

Third-party kinds are loaded from the ``plugvisor.plugins`` entry-point group, and
a missing or broken one is reported by name. plugvisor's own kinds are registered
there too (pyproject.toml), but resolved from :data:`BUILTIN_KINDS` without
reading any package metadata: finding an entry point means importing
:mod:`importlib.metadata` (and the email parser behind it) and reading the
metadata of every installed distribution, which every plugin process and the
agent paid at start-up for a name known in advance.

The agent imports this module to validate its configuration with each kind's
options model, and the agent's import graph must not reach the framework (an
import-linter contract): so this module imports the framework for type checking
only, and a kind's module must not import gRPC when it is loaded
(docs/writing-a-kind.md).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final, Generic, Protocol, TypeVar

import pydantic

from plugvisor.common.hostpaths import HostPaths
from plugvisor.common.validation import shorten

if TYPE_CHECKING:
    from plugvisor.deviceplugin.hooks import DeviceSource

ENTRY_POINT_GROUP = "plugvisor.plugins"

BUILTIN_KINDS: Final[Mapping[str, str]] = MappingProxyType(
    {
        "generic": "plugvisor.plugins.generic:KIND",
        "gpu": "plugvisor.plugins.gpu:KIND",
        "fpga": "plugvisor.plugins.fpga:KIND",
        "nic": "plugvisor.plugins.nic:KIND",
    }
)
"""plugvisor's own kinds, ``name -> module:attribute``, exactly as pyproject.toml registers them.

A test keeps the two equal. These names are reserved: a third-party entry point
registered under one of them is never loaded (before, which of two entry points
with one name was used depended on the order of sys.path).
"""

OptionsT = TypeVar("OptionsT", bound=pydantic.BaseModel)
OptionsT_contra = TypeVar("OptionsT_contra", bound=pydantic.BaseModel, contravariant=True)


class SourceFactory(Protocol[OptionsT_contra]):
    """What builds a kind's device source: usually the source class itself."""

    def __call__(self, options: OptionsT_contra, paths: HostPaths, *, resource: str) -> DeviceSource:
        """Create the source for one resource from validated options."""
        ...


@dataclass(frozen=True, slots=True)
class PluginKind(Generic[OptionsT]):
    """A device kind: its name, the pydantic model of its configuration keys, and its source factory.

    Register an instance under the ``plugvisor.plugins`` entry-point group::

        KIND = PluginKind("widget", WidgetOptions, WidgetSource)

    ``options_model`` validates the kind's keys of one ``resources`` entry (make
    unknown keys errors with ``extra="forbid"``); ``factory(options, paths,
    resource=...)`` creates the device source, which may also implement any of
    the hook Protocols of :mod:`plugvisor.deviceplugin.hooks`.
    """

    name: str
    options_model: type[OptionsT]
    factory: SourceFactory[OptionsT]
    reads_pci: bool = False
    """Its devices are found on the PCI bus: a host root without ``sys/bus/pci/devices`` is then worth a
    warning (``no_pci_bus``, usually a wrong ``--host-root``); a kind of USB or platform devices sets none."""

    def build(self, options: OptionsT | Any, paths: HostPaths, *, resource: str) -> DeviceSource:
        """Create the device source for one resource (``options``: validated, or raw keys to validate)."""
        if not isinstance(options, self.options_model):
            options = self.options_model.model_validate(options)
        return self.factory(options, paths, resource=resource)


class UnknownKindError(LookupError):
    """No installed kind has the requested name."""


class KindLoadError(UnknownKindError):
    """A kind is registered, but its entry point cannot be loaded (a broken or partial install)."""


def _load(name: str, value: str, load: Callable[[], object]) -> PluginKind[Any]:
    try:
        kind = load()
    except Exception as exc:  # any import-time failure of a plugin package, reported by name
        raise KindLoadError(
            f"plugin kind {name!r} is registered as {value} but cannot be loaded: {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(kind, PluginKind):
        raise KindLoadError(
            f"plugin kind {name!r} ({value}) is a {type(kind).__name__}, not a plugvisor PluginKind"
        )
    return kind


def _import_attribute(value: str) -> object:
    module, _, attribute = value.partition(":")
    return getattr(importlib.import_module(module), attribute)


def get_kind(name: str) -> PluginKind[Any]:
    """The kind called ``name``; the error lists the installed ones."""
    builtin = BUILTIN_KINDS.get(name)
    if builtin is not None:
        return _load(name, builtin, lambda: _import_attribute(builtin))
    # Third-party kinds only: the metadata machinery is imported when one is asked for.
    from importlib.metadata import entry_points  # noqa: PLC0415

    for ep in entry_points(group=ENTRY_POINT_GROUP, name=name):
        return _load(ep.name, ep.value, ep.load)
    known = sorted({*BUILTIN_KINDS, *(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))})
    shown = shorten(name)
    raise UnknownKindError(f"unknown plugin kind {shown!r}: installed kinds are {', '.join(known)}")
