"""Prometheus metrics of one plugin process: RPC latency and errors, allocations, open streams.

Under the supervisor, ``PROMETHEUS_MULTIPROC_DIR`` is set in the child's
environment and prometheus-client writes these values to files there, which the
supervisor's ``/metrics`` endpoint aggregates across children (and forgets when
a child dies). A standalone ``plugvisor plugin`` can serve them itself with
``--metrics-listen``. Device counts and registrations are exported by the
supervisor from the status datagrams, so they are not repeated here.

Label cardinality is bounded: resource names and the five RPC names, status codes.
"""

from __future__ import annotations

from typing import Final

from prometheus_client import Counter, Gauge, Histogram

RPC_BUCKETS: Final = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 1.0, 10.0, 30.0)

RPC_SECONDS: Final = Histogram(
    "plugvisor_plugin_rpc_duration_seconds",
    "Time to answer a DevicePlugin RPC, by resource and method (ListAndWatch: not observed).",
    ["resource", "method"],
    buckets=RPC_BUCKETS,
)
RPC_ERRORS: Final = Counter(
    "plugvisor_plugin_rpc_errors_total",
    "DevicePlugin RPCs answered with an error status, by resource, method and gRPC code.",
    ["resource", "method", "code"],
)
ALLOCATED_DEVICES: Final = Counter(
    "plugvisor_plugin_allocated_devices_total",
    "Devices handed out by successful Allocate calls.",
    ["resource"],
)
STREAMS: Final = Gauge(
    "plugvisor_plugin_list_and_watch_streams",
    "ListAndWatch streams open now.",
    ["resource"],
    multiprocess_mode="livesum",
)
PLUGIN_REGISTRATIONS: Final = Counter(
    "plugvisor_plugin_registrations_total",
    "Successful Register calls made by this plugin process (1 + one per kubelet restart).",
    ["resource"],
)
