"""Replacing a file so that no reader, and no crash, ever sees half of it.

A CDI spec is read by the container runtime at any moment, and a checkpoint is
read by the next run of a process that may be SIGKILLed at any instruction:
both are written to a temporary file in the same directory, flushed to disk,
and renamed over the old name. rename(2) within one filesystem is atomic, so
the name always holds either the whole old content or the whole new one; a
crash before the rename leaves only a hidden temporary file, which the next
write of the same name removes.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Final

TEMPORARY_PREFIX: Final = ".tmp-"


def write_atomically(path: Path, content: bytes, *, mode: int = 0o644, durable: bool = True) -> None:
    """Replace ``path`` with ``content`` in one step; raises :class:`OSError` and leaves nothing half-written.

    ``durable`` also syncs the data before the rename and the directory after
    it, so that the new content survives a power loss, not only a crash of this
    process. The rename replaces whatever is at ``path`` (a link included)
    without following it. Leftover temporary files of earlier crashed writes of
    the same name are removed.
    """
    directory = path.parent
    directory.mkdir(parents=True, exist_ok=True)
    prefix = f"{TEMPORARY_PREFIX}{path.name}."
    _remove_leftovers(directory, prefix)
    fd, name = tempfile.mkstemp(prefix=prefix, dir=directory)
    temporary = Path(name)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(content)
            handle.flush()
            if durable:
                os.fsync(handle.fileno())
        temporary.chmod(mode)
        temporary.replace(path)
    except BaseException:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise
    if durable:
        sync_directory(directory)


def sync_directory(directory: Path) -> None:
    """Flush a directory's entries (a rename or an unlink in it) to disk; errors are ignored.

    Some filesystems refuse fsync on a directory; the data itself is safe by then.
    """
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _remove_leftovers(directory: Path, prefix: str) -> None:
    """Remove temporary files an earlier, interrupted write of the same name left behind."""
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for entry in entries:
            if entry.name.startswith(prefix) and entry.is_file(follow_symlinks=False):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)  # noqa: PTH108 - a DirEntry's path
