"""Talking to systemd: readiness, status lines and watchdog pings over ``NOTIFY_SOCKET``.

With ``Type=notify`` systemd considers the agent started only when it sends
``READY=1``; we send it once every resource is registered with the kubelet, so
that units ordered after plugvisor (and ``systemctl start`` itself) see a node
that actually advertises its devices. The protocol is a datagram of
``KEY=value`` lines (:mod:`plugvisor.common.notify`, shared with the plugins'
reports to us). Everything here is a no-op when the variables are absent, so
the same code runs outside systemd.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Final

from plugvisor.common.notify import DatagramSender, socket_address

NOTIFY_SOCKET_ENV: Final = "NOTIFY_SOCKET"
WATCHDOG_USEC_ENV: Final = "WATCHDOG_USEC"
WATCHDOG_PID_ENV: Final = "WATCHDOG_PID"
SYSTEMD_ENV: Final = (NOTIFY_SOCKET_ENV, WATCHDOG_USEC_ENV, WATCHDOG_PID_ENV)
"""Variables that are meant for the main process only (children must not inherit them)."""


class Notifier:
    """sd_notify for this process, from the environment it was started with."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        self._sender = DatagramSender(socket_address(env.get(NOTIFY_SOCKET_ENV, "")))
        self.watchdog_interval: float | None = None
        usec = env.get(WATCHDOG_USEC_ENV, "")
        watchdog_pid = env.get(WATCHDOG_PID_ENV, "")
        for_us = not watchdog_pid or (watchdog_pid.isdigit() and int(watchdog_pid) == os.getpid())
        if usec.isdigit() and int(usec) > 0 and for_us:
            # Ping at half the timeout, as sd_watchdog_enabled(3) recommends.
            self.watchdog_interval = int(usec) / 1e6 / 2
        self._last_status: str | None = None

    @property
    def enabled(self) -> bool:
        """Whether systemd listens."""
        return self._sender.enabled

    @property
    def address(self) -> str | None:
        """Where the datagrams go (a leading NUL: the abstract namespace), or None outside systemd."""
        return self._sender.address

    def notify(self, **fields: str | int) -> bool:
        """Send one datagram of ``KEY=value`` lines; a missing listener only drops it."""
        return self._sender.send(**fields)

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
        self._sender.close()
