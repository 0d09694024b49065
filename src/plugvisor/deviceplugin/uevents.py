"""Kernel uevents: hot-plug on real nodes, where sysfs sends no inotify events.

A device appearing or vanishing on a real node changes sysfs without any inotify
event; the kernel announces it on a netlink socket instead (what udev listens
to). A source that names the subsystems it cares about (``pci``, ``drm``,
``net``...) gets a rescan on each matching uevent, so hot-plug reaches the
kubelet at once rather than at the next periodic rescan.

Kernel messages are ``ACTION@DEVPATH`` followed by NUL-separated ``KEY=VALUE``
fields. Messages re-broadcast by udev (they start with ``libudev``) belong to
another multicast group and are ignored if they arrive anyway.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Final

import structlog

NETLINK_KOBJECT_UEVENT: Final = 15
KERNEL_GROUP: Final = 1
_RECV_SIZE: Final = 64 * 1024


@dataclass(frozen=True, slots=True)
class Uevent:
    """One kernel uevent."""

    action: str
    devpath: str
    subsystem: str | None
    fields: dict[str, str] = field(default_factory=dict)


def parse(data: bytes) -> Uevent | None:
    """Decode a kernel uevent datagram; None for anything else (udev's own messages, garbage)."""
    if data.startswith(b"libudev"):
        return None
    parts = data.split(b"\0")
    header = parts[0].decode(errors="replace")
    action, sep, devpath = header.partition("@")
    if not sep or not action or not devpath:
        return None
    fields: dict[str, str] = {}
    for raw in parts[1:]:
        key, eq, value = raw.decode(errors="replace").partition("=")
        if eq:
            fields[key] = value
    return Uevent(action=action, devpath=devpath, subsystem=fields.get("SUBSYSTEM"), fields=fields)


def open_kernel_socket() -> socket.socket:
    """A non-blocking socket subscribed to the kernel's uevent multicast group."""
    sock = socket.socket(
        socket.AF_NETLINK,
        socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC,
        NETLINK_KOBJECT_UEVENT,
    )
    try:
        sock.bind((0, KERNEL_GROUP))
    except OSError:
        sock.close()
        raise
    return sock


class UeventListener:
    """Calls ``on_match`` (on the event loop) whenever a uevent of one of ``subsystems`` arrives.

    ``sock`` defaults to the kernel's uevent socket; tests pass one end of a
    socket pair instead. Without permission to open the kernel socket the
    listener logs once and stays inert: the periodic rescan still covers hot-plug.
    """

    def __init__(
        self,
        subsystems: Collection[str],
        on_match: Callable[[Uevent], None],
        *,
        sock: socket.socket | None = None,
    ) -> None:
        self.subsystems = frozenset(subsystems)
        self._on_match = on_match
        self._sock = sock
        self._log = structlog.get_logger("plugvisor.uevents")
        self.matched = 0

    def open(self) -> bool:
        """Open the socket if needed; returns whether uevents will be seen."""
        if self._sock is None:
            try:
                self._sock = open_kernel_socket()
            except OSError as exc:
                self._log.warning("uevents_unavailable", error=str(exc), fallback="periodic rescan")
                return False
        self._sock.setblocking(False)
        return True

    def fileno(self) -> int:
        """The socket's descriptor, for ``loop.add_reader``."""
        if self._sock is None:
            raise RuntimeError("UeventListener.open() must succeed first")
        return self._sock.fileno()

    def read_ready(self) -> None:
        """Drain every pending datagram; call ``on_match`` for each uevent of a watched subsystem."""
        if self._sock is None:
            return
        while True:
            try:
                data = self._sock.recv(_RECV_SIZE)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # ENOBUFS: the kernel dropped some; a rescan catches up anyway
                self._log.warning("uevent_read_failed", error=str(exc))
                return
            event = parse(data)
            if event is not None and event.subsystem in self.subsystems:
                self.matched += 1
                self._on_match(event)

    def close(self) -> None:
        """Release the socket."""
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None
