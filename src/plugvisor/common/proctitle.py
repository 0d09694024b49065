"""Process titles: what ``ps`` and ``top`` show for each of plugvisor's processes.

Every plugin of an agent used to show the command line of the process it was
forked from (``python3 -m plugvisor run ...``), and a forked process still has its
parent's environment block in ``/proc/PID/environ``. This module writes both the
way ``setproctitle`` does, without the dependency: :func:`set_name` sets ``comm``
(what ``top`` and ``pgrep`` show, 15 bytes), :func:`set_title` writes the command
line's own memory (what ``ps`` shows, never longer than the command line the
process started with), and :func:`forget_environment_changes` makes the
environment block show only what is still true. Linux only; best effort: a
failure leaves the old title, never an error.
"""

from __future__ import annotations

import ctypes
import os
from typing import Final

PR_SET_NAME: Final = 15

_prctl = ctypes.CDLL(None, use_errno=True).prctl
_prctl.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_prctl.restype = ctypes.c_int


def set_name(name: str) -> None:
    """Set this process's name as ``top`` shows it (``comm``, at most 15 bytes; best effort)."""
    _prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def _memory_layout() -> tuple[int, int, int, int]:
    """Where the kernel keeps this process's command line and environment: (arg start/end, env start/end).

    Fields 48 to 51 of ``/proc/self/stat`` (Linux 3.5+). Both areas are ordinary
    memory at the top of the stack, written by ``execve`` and read by ``ps``
    through ``/proc/PID/cmdline`` and ``/proc/PID/environ``; a forked process has
    its own copy of them.
    """
    with open("/proc/self/stat", "rb") as stat:  # noqa: PTH123 - read once, no pathlib needed
        fields = stat.read().rsplit(b")", 1)[1].split()
    arg_start, arg_end, env_start, env_end = (int(value) for value in fields[45:49])
    return arg_start, arg_end, env_start, env_end


def set_title(title: str) -> None:
    """Make ``ps`` show ``title`` as this process's command line (best effort).

    Written over the command line's own memory (as ``setproctitle`` does), NUL
    padded, and cut to fit it: a title can never be longer than the command line
    the process was started with. Nothing reads that memory but the kernel for
    ``/proc/PID/cmdline`` (Python keeps its own copies of the arguments).
    """
    try:
        start, end, _, _ = _memory_layout()
    except (OSError, ValueError, IndexError):
        return
    size = end - start
    if size <= 1:
        return
    data = title.encode()[: size - 1]
    ctypes.memmove(start, data + bytes(size - len(data)), size)


def forget_environment_changes() -> None:
    """Blank the entries of ``/proc/self/environ`` that this process no longer has as they were.

    A forked process inherits its parent's environment block, which the kernel
    shows as its environment whatever ``os.environ`` has become. The fork server
    and the plugins run with a changed environment (without the agent's systemd
    variables, with the status socket): each entry whose variable is now unset or
    different is overwritten with NULs where it is, so that what ``ps e`` or a
    look at ``/proc`` shows is true, if incomplete (variables set after the fork
    are not in it). Entries are blanked in place, not moved: libc may still point
    at the ones that are kept. Call it after ``os.environ`` is what it should be.
    """
    try:
        _, _, start, end = _memory_layout()
    except (OSError, ValueError, IndexError):
        return
    offset = start
    for entry in ctypes.string_at(start, end - start).split(b"\0"):
        name, sep, value = entry.partition(b"=")
        if entry and (not sep or os.environb.get(name) != value):
            ctypes.memset(offset, 0, len(entry))
        offset += len(entry) + 1
