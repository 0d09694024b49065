"""Reporting a plugin's state to whoever runs it, in sd_notify's wire format.

The supervisor needs to know when each child has registered (for systemd
readiness and ``plugvisor status``) without speaking gRPC. A child sends one
datagram per change to a unix datagram socket named in its environment, each a
few ``KEY=value`` lines, exactly like systemd's ``NOTIFY_SOCKET`` protocol:

    REGISTERED=3            registrations so far (1 after start, +1 per kubelet restart)
    ENDPOINT=plugvisor-gpu-1a2b3c-9f8e7d6c.sock
    DEVICES=7/8             healthy/total
    KUBELET_RESTART=plugin socket deleted   (a restart was detected)

Sending never blocks and never fails the plugin: a missing or full socket only
drops the message (the next one carries the full state again).
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Mapping
from typing import Final

STATUS_SOCKET_ENV: Final = "PLUGVISOR_STATUS_SOCKET"


def encode(fields: Mapping[str, str | int]) -> bytes:
    """Render fields as sd_notify lines (values must not contain newlines)."""
    lines = []
    for key, value in fields.items():
        text = str(value)
        if "\n" in text:
            raise ValueError(f"status field {key} must be one line, got {text!r}")
        lines.append(f"{key}={text}")
    return ("\n".join(lines) + "\n").encode()


def decode(data: bytes) -> dict[str, str]:
    """Parse a datagram back into fields (the receiving side's half)."""
    fields: dict[str, str] = {}
    for line in data.decode(errors="replace").splitlines():
        key, sep, value = line.partition("=")
        if sep:
            fields[key] = value
    return fields


class StatusReporter:
    """Sends status datagrams to the socket named by ``PLUGVISOR_STATUS_SOCKET`` (if any)."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path if path is not None else os.environ.get(STATUS_SOCKET_ENV) or None
        self._sock: socket.socket | None = None
        if self.path:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.setblocking(False)

    @property
    def enabled(self) -> bool:
        """Whether anyone listens for our status."""
        return self._sock is not None

    def send(self, **fields: str | int) -> bool:
        """Send one datagram; returns whether it was handed to the kernel."""
        if self._sock is None or self.path is None:
            return False
        try:
            self._sock.sendto(encode(fields), self.path)
        except OSError:
            return False
        return True

    def close(self) -> None:
        """Release the socket."""
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None
