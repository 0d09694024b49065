"""CDI spec files for GPUs (Container Device Interface, the ``cdi_devices`` Allocate field).

The spec is plain JSON per the CDI specification (``cdiVersion``, ``kind`` =
``vendor/class``, ``devices[].name`` + ``containerEdits.deviceNodes``, shared
``containerEdits``). It is rendered deterministically (sorted, no timestamps), so
the same devices always give the same bytes: a plugin restart rewrites nothing,
and the file on disk only changes when the devices do. Writes are atomic (a
temporary file in the same directory, renamed over the old one) because the
container runtime may read the directory at any moment.

NVIDIA GPUs need the driver's user-space files too (:mod:`.driverfiles`): the
spec's shared edits carry their read-only mounts and the toolkit's
``update-ldcache`` hook, unless the node's own NVIDIA container toolkit spec
names every GPU, in which case containers get its devices instead
(:func:`with_driver`, :func:`driver_edits`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from plugvisor.common.atomicfile import write_atomically
from plugvisor.deviceplugin.devices import Mount as AllocateMount
from plugvisor.deviceplugin.hooks import ContainerAllocation
from plugvisor.plugins.gpu.driverfiles import DriverFiles, Hook, Mount, toolkit_ids

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


def render(
    kind: str,
    devices: Mapping[str, Sequence[Node]],
    shared: Sequence[Node],
    driver: tuple[Sequence[Mount], Sequence[Hook]] = ((), ()),
) -> bytes:
    """The spec's bytes: devices sorted by name; the shared nodes, driver mounts and hooks as top-level edits.

    Top-level edits apply to a container whenever any device of the spec is
    injected: the driver's files are the same for every GPU of a node.
    """
    document: dict[str, Any] = {
        "cdiVersion": CDI_VERSION,
        "kind": kind,
        "devices": [
            {"name": name, "containerEdits": {"deviceNodes": [node.render() for node in devices[name]]}}
            for name in sorted(devices)
        ],
    }
    mounts, hooks = driver
    edits: dict[str, Any] = {}
    if shared:
        edits["deviceNodes"] = [node.render() for node in shared]
    if mounts:
        edits["mounts"] = [mount.render() for mount in mounts]
    if hooks:
        edits["hooks"] = [hook.render() for hook in hooks]
    if edits:
        document["containerEdits"] = edits
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


GpuIdentity = tuple[str | None, int | None]
"""An NVIDIA GPU as the toolkit names it: UUID, minor number."""


def driver_edits(
    files: DriverFiles | None, gpus: Iterable[GpuIdentity]
) -> tuple[tuple[Mount, ...], tuple[Hook, ...]]:
    """The driver mounts and hooks a spec for these NVIDIA GPUs carries.

    None when there are no NVIDIA GPUs, or when the toolkit's own spec names each
    of them (containers then get its devices, :func:`with_driver`).
    """
    listed = list(gpus)
    if files is None or not listed or toolkit_ids(files, listed) is not None:
        return (), ()
    return files.mounts, files.hooks


def with_driver(
    allocation: ContainerAllocation,
    files: DriverFiles | None,
    gpus: Iterable[GpuIdentity],
    *,
    in_spec: bool,
) -> ContainerAllocation:
    """A container's allocation with NVIDIA's user-space driver.

    The toolkit's CDI devices for its GPUs when the node's toolkit spec names them
    all; else, unless the resource's own spec carries them (``in_spec``), the
    driver's files as read-only Allocate mounts (which a DRA claim's spec carries
    as CDI mounts).
    """
    listed = list(dict.fromkeys(gpus))
    if files is None or not listed:
        return allocation
    ids = toolkit_ids(files, listed)
    if ids is not None:
        added = [i for i in ids if i not in allocation.cdi_devices]
        return dataclasses.replace(allocation, cdi_devices=[*allocation.cdi_devices, *added])
    if in_spec or not files.mounts:
        return allocation
    taken = {m.container_path for m in allocation.mounts}
    extra = [
        AllocateMount(container_path=m.container_path, host_path=m.host_path, read_only=True)
        for m in files.mounts
        if m.container_path not in taken
    ]
    return dataclasses.replace(allocation, mounts=[*allocation.mounts, *extra])
