"""Talking to systemd: readiness, status lines and watchdog pings over ``NOTIFY_SOCKET``.

With ``Type=notify`` systemd considers the agent started only when it sends
``READY=1``; we send it once every resource is registered with the kubelet, so
that units ordered after plugvisor (and ``systemctl start`` itself) see a node
that actually advertises its devices. The protocol is a datagram of
``KEY=value`` lines (sd_notify(3)); it is small enough to speak directly, which
keeps libsystemd out of the dependencies. Everything here is a no-op when the
variables are absent, so the same code runs outside systemd.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Mapping
from typing import Final

NOTIFY_SOCKET_ENV: Final = "NOTIFY_SOCKET"
WATCHDOG_USEC_ENV: Final = "WATCHDOG_USEC"
WATCHDOG_PID_ENV: Final = "WATCHDOG_PID"
SYSTEMD_ENV: Final = (NOTIFY_SOCKET_ENV, WATCHDOG_USEC_ENV, WATCHDOG_PID_ENV)
"""Variables that are meant for the main process only (children must not inherit them)."""


class Notifier:
    """sd_notify for this process, from the environment it was started with."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        path = env.get(NOTIFY_SOCKET_ENV) or None
        self.address: str | None = None
        if path is not None and path.startswith(("/", "@")):
            # A leading '@' names a socket in the abstract namespace.
            self.address = "\0" + path[1:] if path.startswith("@") else path
        self.watchdog_interval: float | None = None
        usec = env.get(WATCHDOG_USEC_ENV, "")
        watchdog_pid = env.get(WATCHDOG_PID_ENV, "")
        for_us = not watchdog_pid or (watchdog_pid.isdigit() and int(watchdog_pid) == os.getpid())
        if usec.isdigit() and int(usec) > 0 and for_us:
            # Ping at half the timeout, as sd_watchdog_enabled(3) recommends.
            self.watchdog_interval = int(usec) / 1e6 / 2
        self._sock: socket.socket | None = None
        if self.address is not None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._last_status: str | None = None

    @property
    def enabled(self) -> bool:
        """Whether systemd listens."""
        return self._sock is not None

    def notify(self, **fields: str | int) -> bool:
        """Send one datagram of ``KEY=value`` lines; never raises."""
        if self._sock is None or self.address is None:
            return False
        message = "\n".join(f"{key}={value}" for key, value in fields.items()).encode()
        try:
            self._sock.sendto(message, self.address)
        except OSError:
            return False
        return True

    def ready(self, status: str) -> None:
        """The service is up: every resource registered."""
        self._last_status = status
        self.notify(READY=1, STATUS=status)

    def status(self, text: str) -> None:
        """A one-line status shown by ``systemctl status`` (sent only when it changes)."""
        if text != self._last_status:
            self._last_status = text
            self.notify(STATUS=text)

    def reloading(self, monotonic_usec: int) -> None:
        """A reload started (SIGHUP); ``READY=1`` follows when it is applied."""
        self.notify(RELOADING=1, MONOTONIC_USEC=monotonic_usec)

    def stopping(self) -> None:
        """A stop started."""
        self.notify(STOPPING=1, STATUS="stopping")

    def watchdog(self) -> None:
        """Tell the watchdog the main loop is alive."""
        self.notify(WATCHDOG=1)

    def close(self) -> None:
        """Release the socket."""
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None
