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
    UNREGISTERED=its socket ... was deleted (the registration was lost otherwise; registering again)
    WAITING=a kubelet: /var/lib/kubelet/device-plugins/kubelet.sock does not exist
                            (what registration waits for; cleared by the next REGISTERED)
    TAKEN_OVER=plugvisor-gpu-1a2b3c-0badc0de.sock   (another plugin of the resource took it over)
    WATCH=polling: cannot watch files: too many inotify instances ...   (no inotify left: it polls)

The agent's only word back is a signal: SIGTERM stops a plugin, and
:data:`STOP_FOR_GOOD_SIGNAL` stops a DRA driver whose resource left the
configuration, which then also withdraws its ResourceSlices (a driver stopped
by SIGTERM is expected back, and keeps them).

Speaking it directly keeps libsystemd out of the dependencies. Sending never
blocks and never fails the sender: a missing socket drops the message, a full
one (a busy reader) delays it (:class:`DatagramSender`), and every message
carries the full state it is about.
See https://www.freedesktop.org/software/systemd/man/latest/sd_notify.html.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import signal
import socket
from collections.abc import Mapping
from typing import Final

STATUS_SOCKET_ENV: Final = "PLUGVISOR_STATUS_SOCKET"
"""Names the agent's datagram socket in a plugin's environment."""
STOP_FOR_GOOD_SIGNAL: Final = signal.SIGUSR1
"""Sent by the agent instead of SIGTERM to a DRA driver it will not start again (removed by a reload)."""


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
    """One non-blocking unix datagram socket that sends :func:`encode`'d fields to one address.

    A unix datagram socket queues at most ``net.unix.max_dgram_qlen`` datagrams
    (10 by default) for its reader: a busy reader, or many senders at once (256
    plugins starting), fill it, and a non-blocking send then fails with EAGAIN.
    Such a message is kept, in order behind any other kept one, and sent again
    from the running event loop, sooner first (10 ms, doubling up to 0.5 s),
    until the reader takes it: a report that a plugin registered must not be
    lost, or the agent restarts the plugin for not registering. A missing reader
    (nobody bound the address) still only drops the message. At most
    :data:`BACKLOG` messages are kept (the oldest go first: each carries the
    full state it is about).
    """

    BACKLOG: Final = 256
    _FIRST_RETRY: Final = 0.01
    _LAST_RETRY: Final = 0.5

    def __init__(self, address: str | None) -> None:
        self.address = address
        self._sock: socket.socket | None = None
        self._backlog: collections.deque[bytes] = collections.deque(maxlen=self.BACKLOG)
        self._retry: asyncio.TimerHandle | None = None
        self._delay = self._FIRST_RETRY
        if address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.setblocking(False)

    @property
    def enabled(self) -> bool:
        """Whether there is anyone to send to."""
        return self._sock is not None

    def send(self, **fields: str | int) -> bool:
        """Send one datagram; returns whether the kernel took it now (never raises for a missing listener).

        False with a listener that is only busy: the message is sent later.
        """
        if self._sock is None or self.address is None:
            return False
        self._backlog.append(encode(fields))
        return self._flush()

    def _flush(self) -> bool:
        """Send what is kept, oldest first; True when nothing is left."""
        while self._backlog and self._sock is not None and self.address is not None:
            try:
                self._sock.sendto(self._backlog[0], self.address)
            except BlockingIOError:
                self._retry_later()
                return False
            except OSError:  # nobody listens (yet, or any more): this one is lost, as documented
                self._backlog.popleft()
                if not self._backlog:
                    return False
                continue
            self._backlog.popleft()
        self._delay = self._FIRST_RETRY
        return not self._backlog

    def _retry_later(self) -> None:
        if self._retry is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop here: the next send tries again
            return
        self._retry = loop.call_later(self._delay, self._retried)
        self._delay = min(self._LAST_RETRY, self._delay * 2)

    def _retried(self) -> None:
        self._retry = None
        self._flush()

    def close(self) -> None:
        """Release the socket (what is still kept is dropped)."""
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        self._backlog.clear()
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
