"""The kind registry: what ``kind: generic`` in a configuration file resolves to.

Kinds are loaded from the ``plugvisor.plugins`` entry-point group (plugvisor's own
are registered there too, in pyproject.toml), so built-in and third-party kinds
are found the same way and a missing or broken one is reported by name.
"""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import pydantic

from plugvisor.common.hostpaths import HostPaths
from plugvisor.common.validation import shorten

if TYPE_CHECKING:
    # For the annotation only: the agent imports this registry to validate its configuration,
    # and its import graph must not reach the framework (see docs/architecture.md).
    from plugvisor.deviceplugin.hooks import DeviceSource

ENTRY_POINT_GROUP = "plugvisor.plugins"


class UnknownKindError(LookupError):
    """No installed kind has the requested name."""


class KindLoadError(UnknownKindError):
    """A kind is registered, but its entry point cannot be loaded (a broken or partial install)."""


def _load(ep: EntryPoint) -> PluginKind:
    try:
        kind = ep.load()
    except Exception as exc:  # any import-time failure of a plugin package, reported by name
        raise KindLoadError(
            f"plugin kind {ep.name!r} is registered as {ep.value} but cannot be loaded: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(kind, PluginKind):
        raise KindLoadError(f"plugin kind {ep.name!r} ({ep.value}) is not a plugvisor PluginKind")
    return kind


@runtime_checkable
class PluginKind(Protocol):
    """**Protocol:** a device kind: its name, its options model and its source factory.

    ``options_model`` validates the kind-specific keys of one ``resources`` entry
    (unknown keys must be errors: use ``extra="forbid"``). ``build`` turns
    validated options into a device source reading the host through ``paths``;
    the source may also implement any of the hook Protocols.
    """

    name: str
    options_model: type[pydantic.BaseModel]

    def build(self, options: Any, paths: HostPaths, *, resource: str) -> DeviceSource:
        """Create the device source for one resource."""
        ...


def get_kind(name: str) -> PluginKind:
    """The kind called ``name``; the error lists the installed ones."""
    for ep in entry_points(group=ENTRY_POINT_GROUP, name=name):
        return _load(ep)
    known = sorted(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))
    shown = shorten(name)
    raise UnknownKindError(f"unknown plugin kind {shown!r}: installed kinds are {', '.join(known) or 'none'}")
