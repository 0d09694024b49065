"""plugvisor: a Kubernetes device-plugin node agent and framework.

The public entry points live in the subpackages: :mod:`plugvisor.deviceplugin`
(the framework), :mod:`plugvisor.plugins` (built-in device kinds),
:mod:`plugvisor.emulators` (the emulated kubelet and hardware lab) and
:mod:`plugvisor.supervisor` (one process per resource).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("plugvisor")
except PackageNotFoundError:  # pragma: no cover - running from a bare checkout
    __version__ = "0+unknown"

__all__ = ["__version__"]
