"""Receiving the children's status datagrams, each attributed to the process that sent it.

Children send sd_notify-format datagrams (:mod:`plugvisor.common.notify`) to
one socket in the runtime directory, named in their environment. Like systemd
with ``NOTIFY_SOCKET``, the supervisor tells senders apart by the kernel's
credentials (``SO_PASSCRED``): the sender's PID cannot be forged by a child and
needs no per-child socket or field.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Callable
from pathlib import Path

from plugvisor.common import notify
from plugvisor.common.sockets import owner_only

Report = Callable[[int, dict[str, str]], None]
"""Called with the sender's PID and the decoded fields."""

_UCRED = struct.Struct("iII")


class ReportListener:
    """A unix datagram socket that children report to; calls back per datagram."""

    def __init__(self, path: Path, on_report: Report) -> None:
        self.path = path
        self._on_report = on_report
        self._sock: socket.socket | None = None

    def open(self) -> None:
        """Bind (replacing a stale file) and start reading on the running loop."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        with owner_only():
            sock.bind(str(self.path))
        self._sock = sock
        asyncio.get_running_loop().add_reader(sock.fileno(), self.drain)

    def drain(self) -> None:
        """Deliver every datagram waiting now (also called before exits are handled, see the agent)."""
        sock = self._sock
        if sock is None:
            return
        while True:
            try:
                data, ancdata, _, _ = sock.recvmsg(4096, socket.CMSG_SPACE(_UCRED.size))
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            pid = 0
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    pid = _UCRED.unpack(payload[: _UCRED.size])[0]
            if pid:
                self._on_report(pid, notify.decode(data))

    def close(self) -> None:
        """Stop reading and remove the socket file."""
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(RuntimeError, ValueError):
                asyncio.get_running_loop().remove_reader(sock.fileno())
            sock.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
