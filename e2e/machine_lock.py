"""One cluster at a time on this machine: the lock every cluster's owner holds for its whole life.

The local cluster (e2e/local) and a kind run whose dockerd the suite started (e2e/kind) both change the
host: a local cluster its bridge, kube-proxy's tables and the kubelet's sysctls; dockerd the iptables
FORWARD policy (DROP), its nftables tables and IPv4 forwarding. Run side by side, one breaks the other's pod
network and each records the other's changes as the host it must restore. So both take an exclusive
``flock`` on LOCK before they change anything and keep it until the host is as they found it; a second
owner waits (saying whose it is), and gives up after the timeout it was given.

The lock file holds the owner's PID and command line, for the person (or the waiting run) asking whose it
is. ``flock`` goes with the descriptor: an owner that is killed releases it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

LOCK = Path("/run/lock/plugvisor-e2e.lock")


class LockBusyError(RuntimeError):
    """Another owner held the lock for longer than the caller would wait; the message names it."""


def owner(path: Path = LOCK) -> str:
    """Who holds (or last held) the lock, as its file says: ``owner: pid <pid> <command>``."""
    with contextlib.suppress(OSError):
        text = path.read_text().strip()
        if text:
            return f"owner: pid {text}"
    return "owner unknown"


def acquire(
    timeout: float, *, progress: Callable[[str], None] = print, what: str = "a cluster", path: Path = LOCK
) -> int:
    """Take the machine's lock, waiting up to ``timeout`` seconds; the descriptor that holds it.

    ``what`` says what the waiting caller is (for its one "waiting" line). Raises LockBusyError when the other
    owner keeps it past the timeout.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    deadline = time.monotonic() + timeout
    said = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise LockBusyError(
                    f"another cluster holds {path} ({owner(path)}) for more than {timeout:.0f} s"
                ) from None
            if not said:
                progress(f"{what} waits for the other cluster on this machine to finish ({owner(path)})")
                said = True
            time.sleep(2)
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()} {' '.join(sys.argv)[:200]}\n".encode())
    return fd


def release(fd: int) -> None:
    """Give the lock up (closing its descriptor releases the flock)."""
    os.close(fd)
