"""sd_notify's wire format, and a sender that never blocks and never fails its process.

Two conversations use the same format: the agent tells systemd about itself over
``NOTIFY_SOCKET`` (sd_notify(3): readiness, ``STATUS=``, watchdog pings), and
each plugin process tells the agent about itself over the socket named by
``PLUGVISOR_STATUS_SOCKET``. A message is one unix datagram of ``KEY=value``
lines. The plugin's fields are::

    REGISTERED=3            registrations so far (1 after start, +1 per kubelet restart)
    ENDPOINT=plugvisor-gpu-1a2b3c-9f8e7d6c.sock
    DEVICES=7/8             healthy/total
    KUBELET_RESTART=plugin socket deleted   (a restart was detected)
    SLICES=synced           a DRA driver's ResourceSlices: synced, pending, or failing: <why>

Speaking it directly keeps libsystemd out of the dependencies. Sending is best
effort in both directions: a missing or full socket only drops the message, and
every message carries the full state it is about, so the next one repairs a loss.
See https://www.freedesktop.org/software/systemd/man/latest/sd_notify.html.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Mapping
from typing import Final

STATUS_SOCKET_ENV: Final = "PLUGVISOR_STATUS_SOCKET"
"""Names the agent's datagram socket in a plugin's environment."""


def encode(fields: Mapping[str, str | int]) -> bytes:
    """Render fields as ``KEY=value`` lines (a value with a newline would forge a field: refused)."""
    lines = []
    for key, value in fields.items():
        text = str(value)
        if "\n" in text:
            raise ValueError(f"status field {key} must be one line, got {text!r}")
        lines.append(f"{key}={text}")
    return "\n".join(lines).encode()


def decode(data: bytes) -> dict[str, str]:
    """Parse a datagram back into fields (the receiving side's half); lines without ``=`` are ignored."""
    fields: dict[str, str] = {}
    for line in data.decode(errors="replace").splitlines():
        key, sep, value = line.partition("=")
        if sep:
            fields[key] = value
    return fields


def socket_address(path: str) -> str | None:
    """The address to send to for a socket path as sd_notify takes it (``@name``: abstract namespace).

    None for anything that is neither an absolute path nor an abstract name, as
    sd_notify ignores those too.
    """
    if path.startswith("@"):
        return "\0" + path[1:]
    if path.startswith("/"):
        return path
    return None


class DatagramSender:
    """One non-blocking unix datagram socket that sends :func:`encode`'d fields to one address."""

    def __init__(self, address: str | None) -> None:
        self.address = address
        self._sock: socket.socket | None = None
        if address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.setblocking(False)

    @property
    def enabled(self) -> bool:
        """Whether there is anyone to send to."""
        return self._sock is not None

    def send(self, **fields: str | int) -> bool:
        """Send one datagram; returns whether the kernel took it (never raises for a missing listener)."""
        if self._sock is None or self.address is None:
            return False
        message = encode(fields)
        try:
            self._sock.sendto(message, self.address)
        except OSError:
            return False
        return True

    def close(self) -> None:
        """Release the socket."""
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None


class StatusReporter(DatagramSender):
    """A plugin's reports to its agent: to the socket named by ``PLUGVISOR_STATUS_SOCKET``, if any."""

    def __init__(self, path: str | None = None) -> None:
        super().__init__(path if path is not None else os.environ.get(STATUS_SOCKET_ENV) or None)

    @property
    def path(self) -> str | None:
        """The agent's socket, or None when nobody listens."""
        return self.address
