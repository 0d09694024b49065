"""plugvisor: a Kubernetes device-plugin node agent and framework.

The public entry points live in the subpackages: :mod:`plugvisor.deviceplugin`
(the framework), :mod:`plugvisor.plugins` (built-in device kinds),
:mod:`plugvisor.emulators` (the emulated kubelet and hardware lab) and
:mod:`plugvisor.supervisor` (one process per resource).

Every plugvisor process imports this module first (the command, the agent's fork
server and so its children), so it is where two imports that would otherwise
cost each process about 5 MB are kept out (measured by bench/bench_footprint.py):

- ``__version__`` is read from the installed metadata only when asked for:
  :mod:`importlib.metadata` pulls in the email and zip machinery.
- structlog is imported with rich hidden (whenever it is first imported). Its
  development renderer imports rich's traceback machinery whenever rich is
  installed (it is, for the demo), although plugvisor never uses that renderer:
  our records are rendered on one line by :mod:`plugvisor.common.logs`. The
  demo imports rich itself, later, as usual. The one visible effect: in a
  program that imports plugvisor before structlog, structlog's own console
  renderer formats exceptions without rich; import structlog (or rich) first to
  keep them.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from importlib.abc import Loader


class _StructlogWithoutRich:
    """A one-shot import hook: while structlog's own modules execute, ``import rich`` fails.

    Installed first in :data:`sys.meta_path`. At the first ``import structlog``
    it removes itself and asks the remaining finders for structlog's spec (so
    structlog is found exactly as it would have been), then wraps the loader
    for the one call that executes the package: rich is hidden for that call
    only, and the module gets its own loader back afterwards. Nothing is hidden
    when rich is imported already (there is nothing left to spare). No plugvisor
    process pays for structlog before it logs: ``plugvisor --help`` never
    imports it.
    """

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        """The spec the other finders give for structlog, with rich hidden while it executes."""
        if fullname != "structlog":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        # The import system is iterating sys.meta_path, so answer for every other finder at
        # once (the one after this would be skipped): structlog's spec, or None everywhere.
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None and "rich" not in sys.modules:
            spec.loader = _HidingRich(spec.loader)  # type: ignore[assignment] # a loader by its two methods
        return spec


class _HidingRich:
    def __init__(self, loader: Loader) -> None:
        self._loader = loader

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        sys.modules["rich"] = None  # type: ignore[assignment] # makes `import rich` raise ImportError
        try:
            self._loader.exec_module(module)
        finally:
            del sys.modules["rich"]


if "structlog" not in sys.modules:
    sys.meta_path.insert(0, _StructlogWithoutRich())


def __getattr__(name: str) -> Any:
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415

        try:
            return version("plugvisor")
        except PackageNotFoundError:  # pragma: no cover - running from a bare checkout
            return "0+unknown"
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["__version__"]
