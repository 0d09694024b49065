"""Device kinds: the one :class:`PluginKind` class, and the registry that ``kind: gpu`` resolves through.

Kinds are loaded from the ``plugvisor.plugins`` entry-point group (plugvisor's own
are registered there too, in pyproject.toml), so built-in and third-party kinds
are found the same way and a missing or broken one is reported by name.

The agent imports this module to validate its configuration with each kind's
options model, and the agent's import graph must not reach the framework (an
import-linter contract): so this module imports the framework for type checking
only, and a kind's module must not import gRPC when it is loaded
(docs/writing-a-kind.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import pydantic

from plugvisor.common.hostpaths import HostPaths
from plugvisor.common.validation import shorten

if TYPE_CHECKING:
    from plugvisor.deviceplugin.hooks import DeviceSource

ENTRY_POINT_GROUP = "plugvisor.plugins"

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

    def build(self, options: OptionsT | Any, paths: HostPaths, *, resource: str) -> DeviceSource:
        """Create the device source for one resource (``options``: validated, or raw keys to validate)."""
        if not isinstance(options, self.options_model):
            options = self.options_model.model_validate(options)
        return self.factory(options, paths, resource=resource)


class UnknownKindError(LookupError):
    """No installed kind has the requested name."""


class KindLoadError(UnknownKindError):
    """A kind is registered, but its entry point cannot be loaded (a broken or partial install)."""


def _load(ep: EntryPoint) -> PluginKind[Any]:
    try:
        kind = ep.load()
    except Exception as exc:  # any import-time failure of a plugin package, reported by name
        raise KindLoadError(
            f"plugin kind {ep.name!r} is registered as {ep.value} but cannot be loaded: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(kind, PluginKind):
        raise KindLoadError(
            f"plugin kind {ep.name!r} ({ep.value}) is a {type(kind).__name__}, not a plugvisor PluginKind"
        )
    return kind


def get_kind(name: str) -> PluginKind[Any]:
    """The kind called ``name``; the error lists the installed ones."""
    for ep in entry_points(group=ENTRY_POINT_GROUP, name=name):
        return _load(ep)
    known = sorted(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))
    shown = shorten(name)
    raise UnknownKindError(f"unknown plugin kind {shown!r}: installed kinds are {', '.join(known) or 'none'}")
