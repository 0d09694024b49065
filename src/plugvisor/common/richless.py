"""structlog without rich, in plugvisor's own processes.

structlog's package imports its development renderer, which imports rich's
traceback machinery whenever rich is installed (it is, for the demo): about
5 MB and most of structlog's import time in every process, for a renderer
plugvisor never uses (records are rendered on one line by
:mod:`plugvisor.common.logs`). :func:`install` is called on the first lines of
plugvisor's program (:mod:`plugvisor.cli`; the agent's fork server and every
plugin child are forked from it) and nowhere else: a program that uses plugvisor as a library keeps
structlog exactly as it would be. The demo imports rich itself, later, as usual.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from importlib.abc import Loader


def install() -> None:
    """Hide rich from structlog's first import in this process (nothing to do if structlog is loaded)."""
    if "structlog" in sys.modules or any(isinstance(f, _StructlogWithoutRich) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _StructlogWithoutRich())


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
