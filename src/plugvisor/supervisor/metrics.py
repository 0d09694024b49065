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
from collections.abc import Callable, Iterator, Mapping
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
        for child in children:
            resource = child["resource"]
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


class Metrics:
    """The registries behind ``/metrics``: the supervisor's and the children's (multiprocess)."""

    def __init__(
        self, snapshot: Snapshot, *, multiproc_dir: Path | None, monitor_dir: Path | None = None
    ) -> None:
        self.own = prometheus_client.CollectorRegistry(auto_describe=False)
        self.own.register(SupervisorCollector(snapshot))
        self._snapshot = snapshot
        self.monitor_dir = monitor_dir
        self.multiproc_dir = multiproc_dir
        self.children: prometheus_client.CollectorRegistry | None = None
        if multiproc_dir is not None:
            self.children = prometheus_client.CollectorRegistry(auto_describe=False)
            multiprocess.MultiProcessCollector(self.children, path=str(multiproc_dir))  # type: ignore[no-untyped-call]

    def render(self) -> bytes:
        """The exposition text of both registries."""
        text = prometheus_client.generate_latest(self.own)
        if self.monitor_dir is not None:
            text += device_metrics.render(_device_view(self._snapshot, self.monitor_dir))
        if self.children is not None:
            text += prometheus_client.generate_latest(self.children)
        return text

    def process_dead(self, pid: int) -> None:
        """A child exited: drop its live gauges from the aggregate (prometheus-client's rule)."""
        if self.multiproc_dir is not None:
            with contextlib.suppress(OSError):
                multiprocess.mark_process_dead(pid, str(self.multiproc_dir))  # type: ignore[no-untyped-call]


def _device_view(snapshot: Snapshot, monitor_dir: Path) -> monitoring.View:
    """The children's device reports (only those written by each resource's current process) and owners."""
    live = {child["resource"]: child["pid"] for child in snapshot()["children"]}
    return monitoring.directory_view(monitor_dir, live)


Readiness = Callable[[], tuple[bool, str]]


class HttpServer:
    """``GET /metrics``, ``/healthz``, ``/readyz`` on the supervisor's loop (HTTP/1.0, one request each)."""

    def __init__(self, metrics: Metrics, readiness: Readiness, *, host: str, port: int) -> None:
        self._metrics = metrics
        self._readiness = readiness
        self._host = host
        self._port = port
        self._server: asyncio.Server | None = None
        self._log = structlog.get_logger("plugvisor.supervisor.metrics")

    @property
    def address(self) -> tuple[str, int]:
        """The bound host and port (the port is chosen by the kernel when configured as 0)."""
        assert self._server is not None
        host, port = self._server.sockets[0].getsockname()[:2]
        return str(host), int(port)

    async def start(self) -> None:
        """Bind and serve; a port in use or an address not on this host is a :class:`ConfigError`."""
        try:
            self._server = await asyncio.start_server(self._handle, self._host, self._port)
        except OSError as exc:
            raise ConfigError(
                f"metrics.listen: cannot listen on {self._host}:{self._port}: {exc.strerror or exc}"
            ) from None
        host, port = self.address
        self._log.info("metrics_listening", url=f"http://{host}:{port}/metrics")

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readline(), 5.0)
            while (await asyncio.wait_for(reader.readline(), 5.0)).strip():
                pass
            parts = request.decode("latin-1").split()
            method, target = (parts[0], parts[1]) if len(parts) >= 2 else ("", "")
            status, content_type, body = self._respond(method, target.split("?", 1)[0])
            head = (
                f"HTTP/1.0 {status}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            )
            writer.write(head.encode() + (b"" if method == "HEAD" else body))
            await writer.drain()
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    def _respond(self, method: str, path: str) -> tuple[str, str, bytes]:
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", "text/plain", b"only GET\n"
        if path == "/metrics":
            return "200 OK", prometheus_client.CONTENT_TYPE_LATEST, self._metrics.render()
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
