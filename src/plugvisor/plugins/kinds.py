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

import hashlib
import importlib
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
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
    preload: tuple[str, ...] = ()
    """Modules the agent's fork server imports for this kind's children (pure Python that starts nothing:
    no library loaded, no thread), so that each child inherits them instead of importing them again;
    the kind's own module must not import them, since the agent loads it to validate configuration."""
    names_logs: bool = False
    """Its factory takes ``log_as=``: the name its log lines give the process when that is not
    ``resource``. A DRA driver builds a kind with ``resource=<driver>/<kind>`` (what names its CDI kind,
    its environment variables), but the process is known by the driver's name, which every other line of
    it (and its agent's) carries as ``resource=``; a kind without it logs under ``resource``."""

    def build(
        self, options: OptionsT | Any, paths: HostPaths, *, resource: str, log_as: str | None = None
    ) -> DeviceSource:
        """Create the device source for one resource (``options``: validated, or raw keys to validate).

        ``log_as``: the name the process is known by, when not ``resource`` (a DRA driver's name); handed
        to a kind that takes it (:attr:`names_logs`).
        """
        if not isinstance(options, self.options_model):
            options = self.options_model.model_validate(options)
        if self.names_logs and log_as is not None:
            factory: Any = self.factory  # the keyword is beyond SourceFactory, which outside kinds implement
            source: DeviceSource = factory(options, paths, resource=resource, log_as=log_as)
            return source
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
        kind = _load(ep.name, ep.value, ep.load)
        if name not in _installed:
            _installed[name] = _Installed.loaded(ep.module.partition(".")[0])
        return kind
    known = sorted({*BUILTIN_KINDS, *(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))})
    shown = shorten(name)
    raise UnknownKindError(f"unknown plugin kind {shown!r}: installed kinds are {', '.join(known)}")


@dataclass(frozen=True, slots=True)
class _Installed:
    """An outside kind as loaded in this process: its top-level package, its module files, their revision."""

    package: str
    files: tuple[str, ...]
    revision: str

    @classmethod
    def loaded(cls, package: str) -> _Installed:
        files = tuple(
            sorted(
                path
                for name, module in list(sys.modules.items())
                if name.partition(".")[0] == package and (path := getattr(module, "__file__", None))
            )
        )
        return cls(package, files, _revision(files))


_installed: dict[str, _Installed] = {}
"""Outside kinds loaded in this process, by name (plugvisor's own are part of plugvisor: never reloaded)."""


def _revision(files: tuple[str, ...]) -> str:
    """A digest of ``files``' sizes and modification times.

    A reinstall (pip writes every file anew) or an edit of an editable install changes it.
    """
    digest = hashlib.sha256()
    for path in files:
        try:
            stat = Path(path).stat()
        except OSError:
            digest.update(f"{path}\0gone\n".encode())
        else:
            digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def kind_revision(name: str) -> str:
    """The revision of an outside kind's code as loaded here ("" for plugvisor's own or one not loaded)."""
    installed = _installed.get(name)
    return "" if installed is None else installed.revision


def forget_changed_kinds() -> list[str]:
    """Unload every outside kind whose installed code changed since it was loaded; returns their names.

    The modules of its package leave ``sys.modules`` (with every kind of that
    package), so that the next :func:`get_kind` imports what is installed now:
    on the agent's SIGHUP the file is then validated with the new options model,
    and a fork server forked afterwards has the new code. A kind packaged inside
    plugvisor itself is never unloaded: that is an upgrade of plugvisor, which
    needs a restart of the agent.
    """
    packages = {
        installed.package
        for installed in _installed.values()
        if installed.package != "plugvisor" and _revision(installed.files) != installed.revision
    }
    changed = sorted(name for name, installed in _installed.items() if installed.package in packages)
    for name in changed:
        del _installed[name]
    for module in [name for name in sys.modules if name.partition(".")[0] in packages]:
        del sys.modules[module]
    if packages:
        importlib.invalidate_caches()
    return changed
