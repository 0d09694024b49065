"""``/metrics`` of a standalone plugin (``plugvisor plugin --metrics-listen``), with bounded threads.

prometheus-client's own server (``start_http_server``) starts one thread per
connection and keeps it for as long as the client keeps the connection open
without sending a request, or stops reading the answer: a careless or hostile
scraper that opens many connections grows the plugin's threads without bound
(300 idle connections were 300 more threads). The agent's endpoint is asyncio
and got its limits earlier (:mod:`plugvisor.supervisor.metrics`); this is the
same protection for the threaded server a plugin without an agent runs:

- at most :data:`MAX_CONNECTIONS` connections (each one thread) at once; a new
  one beyond that makes the connection that has been silent the longest (no
  whole request yet) give way, and is closed at once when every one is being
  answered;
- a client that sends nothing, or takes nothing of the answer, for
  :data:`IDLE_TIMEOUT` seconds is dropped (the socket's timeout, on every read
  and write), so every thread ends.

The answer is prometheus-client's WSGI application, as before (same body, same
paths). Threads rather than an event loop: the plugin's loop serves the
kubelet's gRPC calls, and a scrape's rendering must not hold it.
"""

from __future__ import annotations

import contextlib
import socket
import socketserver
import sys
import threading
from typing import IO, TYPE_CHECKING, Any, Final, cast
from wsgiref.simple_server import ServerHandler, WSGIRequestHandler, WSGIServer

import structlog

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry

MAX_CONNECTIONS: Final = 64
"""Connections (and so handler threads) a standalone plugin's ``/metrics`` holds at once."""
IDLE_TIMEOUT: Final = 5.0
"""Seconds a client may send nothing (its request) or take nothing (the answer) before it is dropped."""
GIVE_WAY_WAIT: Final = 1.0
"""Seconds a new connection waits for the silent one it displaced to let go of its thread."""

_log = structlog.get_logger("plugvisor.metrics")


class _ServerHandler(ServerHandler):
    """wsgiref's, with its errors in the log: a client that went or stopped reading is no traceback."""

    def log_exception(self, exc_info: Any) -> None:
        """A timeout or a closed connection is the client's doing (debug); anything else is ours (error)."""
        error = exc_info[1]
        if isinstance(error, OSError):
            _log.debug("metrics_client_gone", error=f"{type(error).__name__}: {error}")
        else:
            _log.error("metrics_request_failed", exc_info=exc_info)


class _Handler(WSGIRequestHandler):
    """prometheus-client's handler: no access log; the socket times out; the server hears of the request."""

    timeout = IDLE_TIMEOUT
    server: BoundedMetricsServer

    def handle(self) -> None:
        """The base class's ``handle``, with :class:`_ServerHandler` (wsgiref's names its own)."""
        self.raw_requestline = self.rfile.readline(65537)
        if len(self.raw_requestline) > 65536:
            self.requestline = self.request_version = self.command = ""
            self.send_error(414)
            return
        if not self.parse_request():  # an error answer was sent, or there was no request at all
            return
        app = self.server.get_app()
        assert app is not None, "serve() sets the application before it serves"
        wfile = cast("IO[bytes]", self.wfile)  # typeshed's BufferedIOBase: a socket writer, as wsgiref passes
        handler = _ServerHandler(self.rfile, wfile, self.get_stderr(), self.get_environ(), multithread=False)
        handler.request_handler = self  # type: ignore[attr-defined]  # wsgiref's back-pointer
        handler.run(app)

    def parse_request(self) -> bool:
        """Once the request line and headers are in, the connection is no longer a silent one."""
        parsed = super().parse_request()
        self.server.heard(self.connection)
        return parsed

    def log_message(self, format: str, *args: Any) -> None:
        """Log no request (prometheus-client's handler does not either)."""


class BoundedMetricsServer(socketserver.ThreadingMixIn, WSGIServer):
    """A thread per connection, at most :data:`MAX_CONNECTIONS` of them; see the module."""

    daemon_threads = True
    block_on_close = False
    request_queue_size = 128
    """The listen backlog (socketserver's is 5: a burst of connections then waits on SYN retries)."""

    def __init__(self, address: tuple[str, int], family: socket.AddressFamily, *, limit: int) -> None:
        self.address_family = family
        self.limit = limit
        self._lock = threading.Condition()
        self._open: dict[socket.socket, bool] = {}
        """Every connection being served, oldest first, with whether it is still silent (no request)."""
        super().__init__(address, _Handler)

    def heard(self, connection: socket.socket) -> None:
        """``connection`` sent its whole request: it is being answered, no longer one that can give way."""
        with self._lock:
            if connection in self._open:
                self._open[connection] = False

    def process_request(self, request: Any, client_address: Any) -> None:
        """Serve ``request`` in a thread of its own when there is room; make room, or close it."""
        with self._lock:
            if len(self._open) >= self.limit:
                silent = next((c for c, quiet in self._open.items() if quiet), None)
                if silent is not None:
                    self._open[silent] = False  # chosen once
                    with contextlib.suppress(OSError):
                        silent.shutdown(socket.SHUT_RDWR)  # its thread's read returns: it ends
                    self._lock.wait_for(lambda: len(self._open) < self.limit, timeout=GIVE_WAY_WAIT)
            if len(self._open) >= self.limit:
                self.shutdown_request(request)
                return
            self._open[request] = True
        try:
            super().process_request(request, client_address)
        except Exception:  # no thread could be started: the connection goes, the server stays
            self._forget(request)
            self.shutdown_request(request)
            _log.exception("metrics_connection_not_served")

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        """The base class's thread body, then the connection's room given back."""
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._forget(request)

    def _forget(self, request: socket.socket) -> None:
        with self._lock:
            self._open.pop(request, None)
            self._lock.notify_all()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client gone or silent is no error; anything else costs its connection and one log line.

        (socketserver's own prints a traceback to standard error.)
        """
        error = sys.exc_info()[1]
        if isinstance(error, OSError):  # TimeoutError after IDLE_TIMEOUT, a reset, a connection given way
            _log.debug("metrics_client_gone", error=f"{type(error).__name__}: {error}")
        else:
            _log.error("metrics_request_failed", exc_info=True)

    @property
    def connections(self) -> int:
        """Connections being served now."""
        with self._lock:
            return len(self._open)


def serve(host: str, port: int, registry: CollectorRegistry | None = None) -> BoundedMetricsServer:
    """Listen on ``host:port``; answer ``/metrics`` from ``registry`` (default: the process's) in a thread.

    An address that cannot be bound raises :class:`OSError`.
    """
    from prometheus_client import REGISTRY, make_wsgi_app  # noqa: PLC0415 (only a plugin that serves)

    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, sockaddr = infos[0]
    server = BoundedMetricsServer((str(sockaddr[0]), port), family, limit=MAX_CONNECTIONS)
    server.set_app(make_wsgi_app(REGISTRY if registry is None else registry))
    thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    bound_host, bound_port = server.server_address[:2]
    _log.info("metrics_listening", url=f"http://{bound_host!s}:{bound_port}/metrics")
    return server
