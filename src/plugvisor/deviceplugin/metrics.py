"""Prometheus metrics of one plugin process: RPC latency and errors, allocations, open streams.

Under the supervisor, ``PROMETHEUS_MULTIPROC_DIR`` is set in the child's
environment and prometheus-client writes these values to files there, which the
supervisor's ``/metrics`` endpoint aggregates across children (and forgets when
a child dies). A standalone ``plugvisor plugin`` can serve them itself with
``--metrics-listen``. Device counts and registrations are exported by the
supervisor from the status datagrams, so they are not repeated here.

Label cardinality is bounded: resource names and the five RPC names, status codes.

The metrics are created, and prometheus-client imported, at the first use of
one of them: a process whose metrics nobody can read (a standalone plugin
without ``--metrics-listen``) calls :func:`disable` first and gets recorders
that do nothing, sparing it prometheus-client's import (its exposition code
brings an HTTP server, the email package and compression modules: about 3 MB
and tens of milliseconds of every plugin start). Once created, each metric is
a plain module attribute, so the per-call path pays no lookup hook.
"""

from __future__ import annotations

import contextlib
import os
from bisect import bisect_left
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from prometheus_client import Counter, Gauge, Histogram

    RPC_SECONDS: Histogram
    RPC_ERRORS: Counter
    ALLOCATED_DEVICES: Counter
    STREAMS: Gauge
    PLUGIN_REGISTRATIONS: Counter

RPC_BUCKETS: Final = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 1.0, 10.0, 30.0)
METRICS: Final = ("RPC_SECONDS", "RPC_ERRORS", "ALLOCATED_DEVICES", "STREAMS", "PLUGIN_REGISTRATIONS")
"""The module attributes that are metrics, created together at the first use of one."""

_enabled = True


def _create() -> dict[str, Any]:
    from prometheus_client import Counter, Gauge, Histogram  # noqa: PLC0415

    return {
        "RPC_SECONDS": Histogram(
            "plugvisor_plugin_rpc_duration_seconds",
            "Time to answer a DevicePlugin RPC, by resource and method (ListAndWatch: not observed).",
            ["resource", "method"],
            buckets=RPC_BUCKETS,
        ),
        "RPC_ERRORS": Counter(
            "plugvisor_plugin_rpc_errors_total",
            "DevicePlugin RPCs answered with an error status, by resource, method and gRPC code.",
            ["resource", "method", "code"],
        ),
        "ALLOCATED_DEVICES": Counter(
            "plugvisor_plugin_allocated_devices_total",
            "Devices handed out by successful Allocate calls.",
            ["resource"],
        ),
        "STREAMS": Gauge(
            "plugvisor_plugin_list_and_watch_streams",
            "ListAndWatch streams open now.",
            ["resource"],
            multiprocess_mode="livesum",
        ),
        "PLUGIN_REGISTRATIONS": Counter(
            "plugvisor_plugin_registrations_total",
            "Successful Register calls made by this plugin process (1 + one per kubelet restart).",
            ["resource"],
        ),
    }


class _Unread:
    """What a metric is in a process whose metrics nobody reads: every recording call does nothing."""

    def labels(self, *_values: str, **_named: str) -> _Unread:
        return self

    def inc(self, amount: float = 1) -> None:
        """Record nothing."""

    def dec(self, amount: float = 1) -> None:
        """Record nothing."""

    def set(self, value: float) -> None:
        """Record nothing."""

    def observe(self, amount: float) -> None:
        """Record nothing."""


def disable() -> None:
    """Nobody can read this process's metrics: make every one a recorder that does nothing.

    Call it before the first metric is used (it raises otherwise: some code
    would keep recording into the real ones).
    """
    global _enabled  # noqa: PLW0603 - one switch per process, set once before any metric exists
    if METRICS[0] in globals():
        raise RuntimeError("the plugin metrics are in use already")
    _enabled = False


def __getattr__(name: str) -> Any:
    if name not in METRICS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    created = _create() if _enabled else dict.fromkeys(METRICS, _Unread())
    globals().update(created)
    return created[name]


def observer(child: Histogram) -> Callable[[float], None]:
    """``child.observe`` for the per-call path, with prometheus-client's per-call checks done once here.

    ``Histogram.observe`` checks that the metric is a labelled child and walks the
    buckets in a Python loop on every call; for a child (this function's argument)
    the check always passes, and the bucket is one binary search away. The values
    written are the very value objects ``observe`` writes (the sum, then one
    bucket), so multiprocess mode and its fork handling work unchanged;
    tests/unit/deviceplugin/test_metrics.py holds both paths to the same
    exposition. Should a prometheus-client release lay its children out
    differently (or the metric is one that :func:`disable` made a recorder that
    does nothing), this falls back to ``child.observe``.
    """
    parts: Any = child
    try:
        bounds = tuple(float(b) for b in parts._upper_bounds)
        add_sum = parts._sum.inc
        add_bucket = [bucket.inc for bucket in parts._buckets]
    except (AttributeError, TypeError):
        return child.observe
    if len(add_bucket) != len(bounds) or bounds[-1] != float("inf"):
        return child.observe

    def observe(amount: float) -> None:
        add_sum(amount)
        add_bucket[bisect_left(bounds, amount)](1)

    return observe


def incrementer(child: Counter) -> Callable[[float], None]:
    """``child.inc`` for the per-call path, for amounts known to be non-negative (checked by the caller).

    Like :func:`observer`: the same value object is written, without the
    per-call checks; falls back to ``child.inc``.
    """
    parts: Any = child
    inc = getattr(getattr(parts, "_value", None), "inc", None)
    return inc if callable(inc) else child.inc


MULTIPROCESS_FILE_BYTES: Final = 128 * 1024
"""Reserved per value file: far more than this process's label sets ever fill (about 16 KiB)."""
_MULTIPROCESS_PREFIXES: Final = ("counter", "histogram", "gauge_livesum")


def reserve_multiprocess_files(pid: int | None = None) -> str | None:
    """Allocate this process's metric files now, or fall back to process-local metrics.

    prometheus-client writes multiprocess values through ``mmap`` into sparse
    files; on a full file system the first write to a page that has no block
    yet kills the process with SIGBUS. Allocating the files' blocks up front
    (``posix_fallocate``) turns that into an ``ENOSPC`` here, at start, where it
    is handled: this process then keeps its metrics to itself (the agent's
    ``/metrics`` lacks them until it restarts) and serves its devices as ever.
    Returns the reason when it fell back, None otherwise.
    """
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not directory:
        return None
    pid = os.getpid() if pid is None else pid
    created: list[Path] = []
    try:
        for prefix in _MULTIPROCESS_PREFIXES:
            path = Path(directory) / f"{prefix}_{pid}.db"
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            created.append(path)
            try:
                if os.fstat(fd).st_size < MULTIPROCESS_FILE_BYTES:
                    os.posix_fallocate(fd, 0, MULTIPROCESS_FILE_BYTES)
            finally:
                os.close(fd)
    except OSError as exc:
        for path in created:
            with contextlib.suppress(OSError):
                path.unlink()
        from prometheus_client import values  # noqa: PLC0415

        values.ValueClass = values.MutexValue
        return f"{exc.strerror or exc} in {directory}"
    return None
