"""CDI spec files for GPUs (Container Device Interface, the ``cdi_devices`` Allocate field).

The spec is plain JSON per the CDI specification (``cdiVersion``, ``kind`` =
``vendor/class``, ``devices[].name`` + ``containerEdits.deviceNodes``, shared
``containerEdits``). It is rendered deterministically (sorted, no timestamps), so
the same devices always give the same bytes: a plugin restart rewrites nothing,
and the file on disk only changes when the devices do. Writes are atomic (a
temporary file in the same directory, renamed over the old one) because the
container runtime may read the directory at any moment.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from plugvisor.common.atomicfile import write_atomically

CDI_VERSION: Final = "0.6.0"
_NAME_UNSAFE: Final = re.compile(r"[^A-Za-z0-9_.:-]")


@dataclass(frozen=True, slots=True)
class Node:
    """A device node in a CDI spec: where the container sees it and where it is on the host."""

    path: str
    host_path: str
    permissions: str = "rw"

    def render(self) -> dict[str, str]:
        """The spec's ``deviceNodes`` entry."""
        return {"path": self.path, "hostPath": self.host_path, "permissions": self.permissions}


def device_name(raw: str) -> str:
    """A CDI device name (letters, digits, ``_ . : -``; starting with a letter or digit)."""
    name = _NAME_UNSAFE.sub("_", raw)
    return name if name[:1].isalnum() else f"d{name}"


def qualified(kind: str, name: str) -> str:
    """The fully qualified name the runtime resolves (``vendor.example/gpu=GPU-1234``)."""
    return f"{kind}={name}"


def spec_file_name(kind: str) -> str:
    """The spec's file name: the kind with ``/`` replaced (Intel's convention), ``.json``."""
    return kind.replace("/", "-") + ".json"


def render(kind: str, devices: Mapping[str, Sequence[Node]], shared: Sequence[Node]) -> bytes:
    """The spec's bytes: devices sorted by name, the shared nodes as top-level edits."""
    document: dict[str, Any] = {
        "cdiVersion": CDI_VERSION,
        "kind": kind,
        "devices": [
            {"name": name, "containerEdits": {"deviceNodes": [node.render() for node in devices[name]]}}
            for name in sorted(devices)
        ],
    }
    if shared:
        document["containerEdits"] = {"deviceNodes": [node.render() for node in shared]}
    return (json.dumps(document, indent=2, sort_keys=False) + "\n").encode()


def write_if_changed(directory: Path, kind: str, content: bytes) -> bool:
    """Atomically write the spec unless the file already holds exactly ``content``; True when written.

    ``directory`` must already be resolved inside the host root
    (:meth:`~plugvisor.common.hostpaths.HostPaths.host`); the rename then
    replaces whatever is at the file's name, a link included, without following it.
    The temporary file's name does not end in ``.json``: CDI reads every
    ``*.json`` of the directory, hidden ones too, and a copy of the spec beside
    it would make each of its devices a conflict the runtime cannot resolve.
    """
    path = directory / spec_file_name(kind)
    with contextlib.suppress(OSError):
        # O_NOFOLLOW: a link put where the spec belongs must not make us read another file.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as current:
            if current.read(len(content) + 1) == content:
                return False
    write_atomically(path, content, mode=0o644)
    return True
