"""Prometheus metrics of the whole process tree, plus ``/healthz`` and ``/readyz``.

Two sources, one endpoint:

- The supervisor's own view, computed at scrape time from its children
  (state, restarts by cause, registrations and devices from the status
  datagrams, kubelet restarts seen). A collector rather than long-lived metric
  objects, so a resource removed by a reload simply disappears.
- Per-device families (health and cause, owner pod/namespace/container,
  identity, sysfs telemetry), rendered at scrape time from the reports the
  children write to ``<runtimeDir>/monitor`` and the owners file the elected
  child keeps (see :mod:`plugvisor.common.monitoring`): plain JSON files,
  so the supervisor needs no gRPC for them, and series of a departed pod vanish
  with it.
- The children's own metrics (allocations, RPC latencies), in
  prometheus-client's multiprocess mode: the supervisor creates a fresh
  ``PROMETHEUS_MULTIPROC_DIR`` per run, hands it to every child, aggregates the
  files with ``MultiProcessCollector`` on each scrape and marks each exited child
  dead (``mark_process_dead``) so its live gauges stop counting.

The server is a few lines of asyncio on the supervisor's own loop: no thread
(the exec spawner forks with ``preexec_fn``, which must not happen in a
threaded process), and it answers only while the loop is alive, which is what
``/healthz`` is meant to tell. It binds to loopback unless configured otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import prometheus_client
import structlog
from prometheus_client import multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from plugvisor.common import device_metrics, monitoring
from plugvisor.supervisor import states
from plugvisor.supervisor.child import CAUSES
from plugvisor.supervisor.config import ConfigError

MULTIPROC_ENV: Final = "PROMETHEUS_MULTIPROC_DIR"
SLICE_SECONDS: Final = 0.005
"""The longest a rendering works before it lets the loop run (supervision, /healthz, other scrapes)."""
START_PRIORITY: Final = 1.0
"""Seconds after a child's start during which scrapes give way to it (:class:`ScrapeGate`)."""
REUSE_FOR: Final = 1.0
"""Seconds a rendering answers later scrapes too (concurrent scrapers, a storm)."""
MAX_CONNECTIONS: Final = 256
"""Connections served at once; more are closed at once (each holds a file descriptor)."""
MAX_SCRAPES: Final = 64
"""Scrapes sent at once; more wait for their turn (each holds a socket buffer meanwhile)."""
CHUNK: Final = 64 * 1024
"""Bytes of a body written before waiting for the client to take them."""
SEND_DEADLINE: Final = 30.0
"""Seconds a client has to take a whole response (a reader that stalls holds a rendering alive)."""
STALLED_AFTER: Final = 2.0
"""Seconds a scrape's client may take nothing of its body while another scrape waits for a send slot;
then it gives way (its connection is closed), so clients that ask and never read cannot hold /metrics.
More than :data:`START_PRIORITY`: a body paused for a child's start is not the client's stall."""
REQUEST_DEADLINE: Final = 5.0
"""Seconds a client has to send its request line and headers."""
MAX_REQUEST_LINE: Final = 16 * 1024
"""The longest request line or header line read (asyncio's stream limit)."""
Snapshot = Callable[[], Mapping[str, Any]]


class SupervisorCollector(Collector):
    """Turns the supervisor's snapshot (``Supervisor.snapshot``) into metric families."""

    def __init__(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        """One family per figure, labelled by resource."""
        document = self._snapshot()
        children = document["children"]
        up = GaugeMetricFamily(
            "plugvisor_child_up", "Whether the resource's child process exists.", labels=["resource"]
        )
        state = GaugeMetricFamily(
            "plugvisor_child_state",
            "The child's state (1 for the current one).",
            labels=["resource", "state"],
        )
        registered = GaugeMetricFamily(
            "plugvisor_resource_registered",
            "Whether the resource is registered with the current kubelet.",
            labels=["resource"],
        )
        registrations = CounterMetricFamily(
            "plugvisor_resource_registrations",
            "Successful registrations with the kubelet, over all processes of the resource.",
            labels=["resource"],
        )
        devices = GaugeMetricFamily(
            "plugvisor_resource_devices",
            "Devices the resource advertises, by health.",
            labels=["resource", "health"],
        )
        restarts = CounterMetricFamily(
            "plugvisor_child_restarts", "Child restarts, by cause.", labels=["resource", "cause"]
        )
        looping = GaugeMetricFamily(
            "plugvisor_child_crash_looping", "Whether the child is failing repeatedly.", labels=["resource"]
        )
        backoff = GaugeMetricFamily(
            "plugvisor_child_backoff_seconds",
            "The current restart delay (0 unless backing off).",
            labels=["resource"],
        )
        info = GaugeMetricFamily(
            "plugvisor_child_info",
            "The resource's kind and mode (device-plugin, or dra: a DRA driver named by the resource).",
            labels=["resource", "kind", "mode"],
        )
        slices = GaugeMetricFamily(
            "plugvisor_dra_slices_synced",
            "Whether a DRA driver's ResourceSlices hold its devices as they are now (0: pending or failing).",
            labels=["resource"],
        )
        polling = GaugeMetricFamily(
            "plugvisor_watch_polling",
            "Whether the child watches files by polling (1: no inotify budget was left) or with inotify (0).",
            labels=["resource"],
        )
        for child in children:
            resource = child["resource"]
            if child.get("watch"):
                polling.add_metric([resource], 1.0 if child["watch"] == "polling" else 0.0)
            info.add_metric([resource, child.get("kind", ""), child.get("mode", "device-plugin")], 1.0)
            if child.get("slices"):
                slices.add_metric([resource], 1.0 if child["slices"] == "synced" else 0.0)
            up.add_metric([resource], 1.0 if child["pid"] else 0.0)
            for name in states.BY_NAME:
                state.add_metric([resource, name], 1.0 if child["state"] == name else 0.0)
            registered.add_metric([resource], 1.0 if child["registered"] else 0.0)
            registrations.add_metric([resource], float(child["registrations"]))
            counts = child["devices"]
            if counts is not None:
                devices.add_metric([resource, "healthy"], float(counts["healthy"]))
                devices.add_metric([resource, "unhealthy"], float(counts["total"] - counts["healthy"]))
            by_cause = child["restarts_by_cause"]
            for cause in CAUSES:
                restarts.add_metric([resource, cause], float(by_cause.get(cause, 0)))
            looping.add_metric([resource], 1.0 if child["crash_looping"] else 0.0)
            backoff.add_metric([resource], float(child["backoff_delay"] or 0.0))
        supervisor = document["supervisor"]
        yield from (info, up, state, registered, registrations, devices, restarts, looping, backoff, slices)
        yield polling
        yield CounterMetricFamily(
            "plugvisor_kubelet_restarts",
            "Kubelet restarts the supervisor noticed.",
            value=supervisor["kubelet_restarts"],
        )
        yield GaugeMetricFamily(
            "plugvisor_ready",
            "Whether every configured resource is registered.",
            value=1.0 if supervisor["ready"] else 0.0,
        )
        yield GaugeMetricFamily(
            "plugvisor_spawner_fallback",
            "1 while children are started by exec because the fork server is unavailable (see the log's "
            "forkserver_unavailable; a restart of the agent brings it back).",
            value=1.0 if supervisor.get("spawner_fallback") else 0.0,
        )


class ScrapeGate:
    """Where scrapes give way to supervision: while a child (re)starts, its start has the CPU.

    A storm of scrapes keeps two cores busy (the agent sending, the scrapers reading);
    a child forked meanwhile then took seconds to register, where it takes tens of
    milliseconds. The agent sets :attr:`hold_until` (monotonic) while a child that
    started less than :data:`START_PRIORITY` seconds ago has not registered yet;
    renderings and bodies being sent wait until then, each for at most
    :data:`START_PRIORITY` seconds in all (:meth:`pacer`), so that children that keep
    restarting, or 256 of them starting at once, cannot stop ``/metrics``.
    ``/healthz`` and ``/readyz`` never wait.
    """

    def __init__(self) -> None:
        self.hold_until = 0.0

    def follow(self, starting_until: Callable[[float], float]) -> None:
        """Take the supervisor's word (``Supervisor.starting_until``) after each of its ticks."""
        self.hold_until = starting_until(START_PRIORITY)

    def pacer(self) -> Callable[[], Awaitable[None]]:
        """The pause of one rendering or one response.

        Each call lets the loop run, and gives way to starts for at most
        :data:`START_PRIORITY` seconds over all the calls together.
        """
        allowance = START_PRIORITY

        async def pause() -> None:
            nonlocal allowance
            delay = min(max(self.hold_until - time.monotonic(), 0.0), allowance)
            allowance -= delay
            await asyncio.sleep(delay)

        return pause


@dataclass(eq=False, slots=True)
class Body:
    """One rendering of ``/metrics``, shared by every scrape it answers."""

    data: bytes
    rendered_at: float
    readers: int = 0


@dataclass(frozen=True, slots=True)
class _ResourceText:
    """One resource's per-device lines, family by family, and the files they were rendered from."""

    key: tuple[int, int, int, int, object]
    """(report inode, mtime, size, writer PID, owners key): unchanged, the text is reused."""
    written_at: float
    texts: Mapping[str, str]


class Metrics:
    """Everything behind ``/metrics``: the supervisor's and the children's registries, the device families.

    The per-device families are rendered from the monitor directory. A scrape must
    never starve supervision, nor memory. On a node with thousands of devices one
    rendering is megabytes and, done in one go, a noticeable stall of the agent's
    loop (which also answers ``/healthz``, restarts children and pings systemd's
    watchdog); a hundred concurrent scrapes each rendering and holding their own
    copy stalled it for half a minute and took gigabytes. So:

    - one rendering answers every scrape that arrives while it runs, and those of
      the next :data:`REUSE_FOR` seconds (:meth:`acquire`);
    - a resource's per-device text is kept until its report file or the owners
      file changes (every ``telemetryInterval`` at most), so most scrapes only
      join texts;
    - what must be parsed and rendered again is done a slice at a time
      (:data:`SLICE_SECONDS`), yielding to the loop in between;
    - at most two renderings exist at once: a new one is made only when no older
      one than the latest is still being sent to a slow client.
    """

    def __init__(
        self,
        snapshot: Snapshot,
        *,
        multiproc_dir: Path | None,
        monitor_dir: Path | None = None,
        gate: ScrapeGate | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.gate = gate if gate is not None else ScrapeGate()
        self._clock = clock
        self.own = prometheus_client.CollectorRegistry(auto_describe=False)
        self.own.register(SupervisorCollector(snapshot))
        self._snapshot = snapshot
        self.monitor_dir = monitor_dir
        self.multiproc_dir = multiproc_dir
        self.children: prometheus_client.CollectorRegistry | None = None
        if multiproc_dir is not None:
            self.children = prometheus_client.CollectorRegistry(auto_describe=False)
            multiprocess.MultiProcessCollector(self.children, path=str(multiproc_dir))  # type: ignore[no-untyped-call]
        self._texts: dict[str, _ResourceText] = {}
        self._owners: tuple[object, monitoring.Owners | None] = (None, None)
        self._rendering: asyncio.Future[Body] | None = None
        self._latest: Body | None = None
        self._previous: Body | None = None
        self.renderings = 0
        """How many renderings were made (scrapes beyond that shared one)."""

    async def acquire(self) -> Body:
        """A rendering for one scrape (shared); give it back with :meth:`release` once sent."""
        latest, previous = self._latest, self._previous
        reusable = latest is not None and (
            self._clock() - latest.rendered_at < REUSE_FOR or (previous is not None and previous.readers > 0)
        )
        if self._rendering is None and not reusable:
            self._rendering = asyncio.ensure_future(self._new_body())
        body = await asyncio.shield(self._rendering) if self._rendering is not None else latest
        assert body is not None
        body.readers += 1
        return body

    def release(self, body: Body) -> None:
        """A scrape is done with ``body``."""
        body.readers -= 1
        if body is self._previous and body.readers <= 0:
            self._previous = None

    async def _new_body(self) -> Body:
        try:
            data = await self.render()
        finally:
            self._rendering = None
        body = Body(data, self._clock())
        latest = self._latest
        self._previous = latest if latest is not None and latest.readers > 0 else None
        self._latest = body
        self.renderings += 1
        return body

    async def render(self) -> bytes:
        """The exposition text of every source, made in slices (see the class)."""
        parts = [prometheus_client.generate_latest(self.own)]
        if self.monitor_dir is not None:
            parts.append((await self._device_text(self.monitor_dir)).encode())
        if self.children is not None:
            parts.append(prometheus_client.generate_latest(self.children))
        return b"".join(parts)

    async def _device_text(self, monitor_dir: Path) -> str:
        """The per-device families of every resource whose current child wrote a report."""
        owners_key, owners = self._read_owners(monitor_dir)
        holders = owners.holders if owners is not None else {}
        texts: dict[str, _ResourceText] = {}
        for child in self._snapshot()["children"]:
            resource, pid = child["resource"], child["pid"]
            if not pid:
                continue
            text = await self._resource_text(monitor_dir, resource, pid, holders, owners_key)
            if text is not None:
                texts[resource] = text
        self._texts = texts  # a resource removed (or whose report went) is forgotten
        pieces = device_metrics.assemble(
            [text.texts for text in texts.values()],
            [(resource, text.written_at) for resource, text in texts.items()],
            owners,
        )
        return "".join(pieces)

    def _read_owners(self, monitor_dir: Path) -> tuple[object, monitoring.Owners | None]:
        key = _file_key(monitor_dir / monitoring.OWNERS_FILE)
        if key is None or key != self._owners[0]:
            self._owners = (key, monitoring.read_owners(monitor_dir) if key is not None else None)
        return self._owners

    async def _resource_text(
        self,
        monitor_dir: Path,
        resource: str,
        pid: int,
        holders: device_metrics.Holders,
        owners_key: object,
    ) -> _ResourceText | None:
        """``resource``'s text: kept while its files are unchanged, else rendered a slice at a time."""
        path = monitoring.report_path(monitor_dir, resource)
        file_key = _file_key(path)
        if file_key is None:
            return None
        key = (*file_key, pid, owners_key)
        cached = self._texts.get(resource)
        if cached is not None and cached.key == key:
            return cached
        try:
            lines = path.read_bytes().split(b"\n")
            _, writer, written_at = monitoring.report_header(lines[0])
            if writer != pid:  # a previous process's last report is not the present
                return None
            out = device_metrics.device_lines()
            pause = self.gate.pacer()
            budget = time.monotonic() + SLICE_SECONDS
            for line in lines[1:]:
                if line:
                    device_metrics.add_device(out, resource, monitoring.parse_device(line), holders)
                if time.monotonic() >= budget:
                    await pause()
                    budget = time.monotonic() + SLICE_SECONDS
        except (OSError, ValueError, KeyError, TypeError):  # a half-dead writer, a full disk: no report
            return None
        return _ResourceText(key, written_at, {name: "".join(lines) for name, lines in out.items()})

    def process_dead(self, pid: int) -> None:
        """A child exited: drop its live gauges from the aggregate (prometheus-client's rule)."""
        if self.multiproc_dir is not None:
            with contextlib.suppress(OSError):
                multiprocess.mark_process_dead(pid, str(self.multiproc_dir))  # type: ignore[no-untyped-call]


def _file_key(path: Path) -> tuple[int, int, int] | None:
    """What tells one version of a file from the next (it is replaced by rename), or None if absent."""
    try:
        info = path.stat()
    except OSError:
        return None
    return info.st_ino, info.st_mtime_ns, info.st_size


Readiness = Callable[[], tuple[bool, str]]


class HttpServer:
    """``GET /metrics``, ``/healthz``, ``/readyz`` on the supervisor's loop (HTTP/1.0, one request each).

    ``/healthz`` and ``/readyz`` are answered at once, whatever scrapes are doing:
    a scrape renders in slices and streams its body :data:`CHUNK` bytes at a time
    (so a slow reader costs a socket buffer, not a copy of the body), at most
    :data:`MAX_SCRAPES` at once (others wait for their turn, and a client that has
    taken nothing for :data:`STALLED_AFTER` seconds gives its turn away), each within
    :data:`SEND_DEADLINE`; beyond :data:`MAX_CONNECTIONS` open connections, the one
    that has been silent the longest is closed for a new one (a new one is closed at
    once when none is silent). A request whose line or headers exceed
    :data:`MAX_REQUEST_LINE` gets a 414 (the line) or a 431 (a header), not a traceback;
    a request target in absolute form (``http://host/metrics``) is served by its path.
    """

    def __init__(
        self, metrics: Metrics, readiness: Readiness, *, host: str, port: int, source: str | None = None
    ) -> None:
        self._metrics = metrics
        self._source = source
        self._readiness = readiness
        self._host = host
        self._port = port
        self._server: asyncio.Server | None = None
        self._scrapes = asyncio.Semaphore(MAX_SCRAPES)
        self._sending: dict[asyncio.StreamWriter, float] = {}
        """Scrapes holding a send slot, with when their client last took a piece of the body."""
        self._connections = 0
        self._silent: dict[asyncio.StreamWriter, None] = {}
        """Connections that have not sent their whole request yet, oldest first."""
        self._log = structlog.get_logger("plugvisor.supervisor.metrics")

    @property
    def address(self) -> tuple[str, int]:
        """The bound host and port (the port is chosen by the kernel when configured as 0)."""
        assert self._server is not None
        host, port = self._server.sockets[0].getsockname()[:2]
        return str(host), int(port)

    async def start(self) -> None:
        """Bind and serve; a port in use or an address not on this host is a :class:`ConfigError`.

        Its message names ``source`` (the configuration file) first, as every other configuration error does.
        """
        try:
            self._server = await asyncio.start_server(
                self._handle, self._host, self._port, limit=MAX_REQUEST_LINE
            )
        except OSError as exc:
            where = f"{self._source}: " if self._source else ""
            raise ConfigError(
                f"{where}metrics.listen: cannot listen on {self._host}:{self._port}: {exc.strerror or exc}"
            ) from None
        host, port = self.address
        self._log.info("metrics_listening", url=f"http://{host}:{port}/metrics")

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._connections >= MAX_CONNECTIONS:
            # Each connection is a descriptor: thousands held open would leave the agent none
            # to restart a child with. The one silent the longest gives way, so that connections
            # that never ask cannot keep the kubelet's probe out (a liveness failure restarts the
            # agent); when every one is being answered, the new one is closed.
            if not self._silent:
                writer.transport.abort()
                return
            oldest = next(iter(self._silent))
            del self._silent[oldest]
            oldest.transport.abort()
        self._connections += 1
        self._silent[writer] = None
        try:
            await self._serve_one(reader, writer)
        except asyncio.CancelledError:
            # The agent stopping: the connection just ends. (Python 3.11's stream server logs
            # "Exception in callback" for a connection task that ends cancelled.)
            writer.transport.abort()
        finally:
            self._connections -= 1
            self._silent.pop(writer, None)

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            method, path = await self._read_request(reader)
            self._silent.pop(writer, None)
            if method in {"GET", "HEAD"}:
                if path == "/metrics":
                    await self._scrape(writer, head_only=method == "HEAD")
                    return
                status, content_type, body = self._respond(path)
            elif method:
                status, content_type, body = "405 Method Not Allowed", "text/plain", b"only GET\n"
            else:
                status, content_type, body = "400 Bad Request", "text/plain", b"expected an HTTP request\n"
            writer.write(_head(status, content_type, len(body)) + (b"" if method == "HEAD" else body))
            await writer.drain()
        except _RequestTooLongError as too_long:
            what, status = (
                ("request line", "414 URI Too Long")
                if too_long.in_request_line
                else ("header", "431 Request Header Fields Too Large")
            )
            message = f"{what} longer than {MAX_REQUEST_LINE} bytes\n".encode()
            with contextlib.suppress(ConnectionError, TimeoutError):
                writer.write(_head(status, "text/plain", len(message)) + message)
                await writer.drain()
                # The rest of the request is still coming: closing with it unread makes the kernel
                # reset the connection, and the client may lose the answer. Say we are done, and
                # read what it still sends, for a moment.
                writer.write_eof()
                async with asyncio.timeout(1.0):
                    while await reader.read(65536):
                        pass
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError):
            pass
        except Exception:  # a bug of ours must cost one request and one log line, not the endpoint
            self._log.exception("metrics_request_failed")
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    @staticmethod
    async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str]:
        """``(method, path)`` of the request (empty when there is none), its headers read and dropped."""
        request = b""
        try:
            async with asyncio.timeout(REQUEST_DEADLINE):
                request = await reader.readline()
                while (await reader.readline()).strip():
                    pass
        except ValueError:  # the stream's limit: a line longer than MAX_REQUEST_LINE
            raise _RequestTooLongError(in_request_line=not request) from None
        parts = request.decode("latin-1").split()
        if len(parts) < 2:
            return "", ""
        target = parts[1]
        if "://" in target and not target.startswith("/"):  # absolute-form, as a proxy would send it
            target = urllib.parse.urlsplit(target).path or "/"
        return parts[0], target.split("?", 1)[0]

    async def _take_slot(self) -> None:
        """Wait for a send slot; every :data:`STALLED_AFTER` seconds of waiting, a stalled holder gives way.

        A holder is stalled when its client has taken nothing for that long (its
        socket buffer full, the rest of the body waiting): the one stalled the
        longest is closed. Clients that read, however slowly, keep their slot.
        """
        while True:
            try:
                async with asyncio.timeout(STALLED_AFTER):
                    await self._scrapes.acquire()
            except TimeoutError:
                self._evict_stalled()
            else:
                return

    def _evict_stalled(self) -> None:
        now = time.monotonic()
        stalled = [(since, writer) for writer, since in self._sending.items() if now - since >= STALLED_AFTER]
        if not stalled:
            return
        since, writer = min(stalled, key=lambda item: item[0])
        del self._sending[writer]
        self._log.info("metrics_stalled_client_closed", stalled_for=round(now - since, 3))
        writer.transport.abort()

    async def _scrape(self, writer: asyncio.StreamWriter, *, head_only: bool) -> None:
        await self._take_slot()
        self._sending[writer] = time.monotonic()
        try:
            await self._send_scrape(writer, head_only=head_only)
        finally:
            self._sending.pop(writer, None)
            self._scrapes.release()

    def _progressed(self, writer: asyncio.StreamWriter) -> None:
        if writer in self._sending:
            self._sending[writer] = time.monotonic()

    async def _send_scrape(self, writer: asyncio.StreamWriter, *, head_only: bool) -> None:
        """Render (or reuse) the body and send it in pieces, each piece noted as progress."""
        try:
            body = await self._metrics.acquire()
        except Exception:
            self._log.exception("metrics_render_failed")
            message = b"rendering the metrics failed; the agent's log says why\n"
            writer.write(_head("500 Internal Server Error", "text/plain", len(message)) + message)
            await writer.drain()
            return
        try:
            async with asyncio.timeout(SEND_DEADLINE):
                writer.write(_head("200 OK", prometheus_client.CONTENT_TYPE_LATEST, len(body.data)))
                if not head_only:
                    view = memoryview(body.data)
                    pause = self._metrics.gate.pacer()
                    for offset in range(0, len(view), CHUNK):
                        writer.write(view[offset : offset + CHUNK])
                        await writer.drain()
                        self._progressed(writer)
                        # drain() returns without yielding while the client keeps up: a fast
                        # client would otherwise have the loop for its whole body.
                        await pause()
                        self._progressed(writer)
                await writer.drain()
        finally:
            self._metrics.release(body)

    def _respond(self, path: str) -> tuple[str, str, bytes]:
        if path == "/healthz":
            return "200 OK", "text/plain", b"ok\n"
        if path == "/readyz":
            ready, detail = self._readiness()
            return ("200 OK" if ready else "503 Service Unavailable"), "text/plain", detail.encode() + b"\n"
        return "404 Not Found", "text/plain", b"try /metrics, /healthz or /readyz\n"

    async def close(self) -> None:
        """Stop listening."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
            await server.wait_closed()


class _RequestTooLongError(Exception):
    """The request line or a header is longer than :data:`MAX_REQUEST_LINE` (a 414 or a 431)."""

    def __init__(self, *, in_request_line: bool) -> None:
        super().__init__()
        self.in_request_line = in_request_line


def _head(status: str, content_type: str, length: int) -> bytes:
    return (
        f"HTTP/1.0 {status}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {length}\r\nConnection: close\r\n\r\n"
    ).encode()
