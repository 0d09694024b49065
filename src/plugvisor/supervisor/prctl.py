"""The Linux process controls the supervisor relies on, through libc.

``PR_SET_PDEATHSIG`` makes the kernel signal a child when its parent dies, so
children never outlive a supervisor that was SIGKILLed (systemd would otherwise
find them still holding the sockets). ``PR_SET_CHILD_SUBREAPER`` makes the
supervisor the parent of every plugin, even those the fork server forks. libc is loaded when this module is
imported, never between fork and exec, where loading a library is not safe.
"""

from __future__ import annotations

import ctypes
import os
import signal
from typing import Final

CHILD_DEATH_SIGNAL: Final = signal.SIGTERM
"""Children get SIGTERM when their parent dies: they stop cleanly and remove their socket."""

PR_SET_PDEATHSIG: Final = 1
PR_SET_CHILD_SUBREAPER: Final = 36

_libc = ctypes.CDLL(None, use_errno=True)
_prctl = _libc.prctl
_prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_prctl.restype = ctypes.c_int


def set_parent_death_signal(sig: int) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent (thread) exits."""
    if _prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")


def become_subreaper() -> None:
    """Adopt orphaned descendants: a process whose parent exits is re-parented to us, not to init.

    The fork server forks each plugin through a short-lived intermediate, so the
    plugin is re-parented to the supervisor at once: the supervisor, not the fork
    server, is then the parent that reaps it and whose death it follows.
    """
    if _prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(errno)}")


def die_with_parent(sig: int, expected_parent: int) -> None:
    """Set the parent-death signal, then exit at once if the parent is already gone.

    The parent may die between fork and prctl; the kernel then never sends the
    signal, so the child checks that its parent is still the one that forked it.
    """
    set_parent_death_signal(sig)
    if os.getppid() != expected_parent:
        os._exit(1)
