"""plugvisor: a Kubernetes device-plugin node agent and framework.

The public entry points live in the subpackages: :mod:`plugvisor.deviceplugin`
(the framework), :mod:`plugvisor.plugins` (built-in device kinds),
:mod:`plugvisor.emulators` (the emulated kubelet and hardware lab) and
:mod:`plugvisor.supervisor` (one process per resource).

``__version__`` is read from the installed metadata only when asked for:
:mod:`importlib.metadata` pulls in the email and zip machinery (about 5 MB in
every process, measured by bench/bench_footprint.py). plugvisor's own programs
also keep rich out of structlog (:mod:`plugvisor.common.richless`); a program
that merely imports plugvisor is left as it is.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415

        try:
            return version("plugvisor")
        except PackageNotFoundError:  # pragma: no cover - running from a bare checkout
            return "0+unknown"
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["__version__"]
