"""Device names from the host's ``pci.ids``, as ``lspci`` shows them (``GH100 [H100 SXM5 80GB]``).

A DRA driver publishes a ``model`` attribute users select on; where the driver
itself names the product (NVIDIA's procfs ``information``), that name is used,
elsewhere the PCI ID database the host ships is the one name every tool
agrees on. It is read under the host root (a container sees the host's at
``/host/usr/share/hwdata/pci.ids``; the emulated lab writes one), parsed for the
vendors asked about only, and kept until the file changes.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Final

from plugvisor.common.hostpaths import HostPaths

LOCATIONS: Final = ("usr/share/hwdata/pci.ids", "usr/share/misc/pci.ids", "usr/share/pci.ids")
"""Where distributions install the database (Fedora/Debian hwdata, older Debian, others)."""
_MAX_BYTES: Final = 16 << 20

_cache: dict[tuple[str, int], tuple[tuple[int, int], dict[int, str]]] = {}
"""(file, vendor) -> (the file's mtime and size when read, its device names of the vendor)."""
_lock = threading.Lock()


def _read_vendor(path: Path, vendor: int) -> dict[int, str]:
    """The device names of one vendor in the file at ``path`` (empty if the vendor is not listed)."""
    wanted = f"{vendor:04x}"
    names: dict[int, str] = {}
    inside = False
    with path.open("rb") as handle:
        data = handle.read(_MAX_BYTES)
    for raw in data.decode("utf-8", errors="replace").splitlines():
        if not raw or raw.startswith("#"):
            continue
        if not raw.startswith("\t"):
            if inside:
                break
            inside = raw[:4].lower() == wanted and raw[4:6] == "  "
            continue
        if inside and not raw.startswith("\t\t"):
            code, _, name = raw[1:].partition("  ")
            try:
                names[int(code, 16)] = name.strip()
            except ValueError:
                continue
    return names


def device_name(paths: HostPaths, vendor: int, device: int) -> str | None:
    """The database's name of a PCI device under the host root, or None (no database, unknown ID)."""
    for location in LOCATIONS:
        path = paths.host("/" + location)
        try:
            info = path.stat()
        except OSError:
            continue
        key, stamp = (str(path), vendor), (info.st_mtime_ns, info.st_size)
        with _lock:
            cached = _cache.get(key)
        if cached is None or cached[0] != stamp:
            try:
                cached = (stamp, _read_vendor(path, vendor))
            except OSError:
                continue
            with _lock:
                _cache[key] = cached
        return cached[1].get(device)
    return None
