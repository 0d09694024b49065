"""Per-device Prometheus families, computed at scrape time from a monitoring view.

The supervisor (from the report files of its children) and a standalone plugin
(from its own memory) render the same families through :class:`DeviceCollector`.
Nothing is kept between scrapes: a departed pod or a vanished device has no
series in the next scrape, so cardinality follows the node's devices and
current holders, never allocation history. gRPC-free, like
:mod:`plugvisor.common.monitoring`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from plugvisor.common import monitoring as m


def _numa_label(nodes: Sequence[int]) -> str:
    return ",".join(str(n) for n in nodes)


def _family(family: m.Family) -> GaugeMetricFamily | CounterMetricFamily:
    labels = [*m.DEVICE_LABELS, *family.labels]
    if family.counter:
        return CounterMetricFamily(family.name, family.help, labels=labels)
    return GaugeMetricFamily(family.name, family.help, labels=labels)


def collect(view: m.View) -> Iterator[Metric]:
    """The per-device families of one view (see :data:`BASE_FAMILIES` and :data:`TELEMETRY`)."""
    info, healthy, allocated = (_family(f) for f in m.BASE_FAMILIES)
    telemetry = {name: _family(f) for name, f in m.TELEMETRY.items()}
    stamp = GaugeMetricFamily(m.AGENT_FAMILIES[0].name, m.AGENT_FAMILIES[0].help, labels=["resource"])
    holders = view.owners.holders if view.owners is not None else {}
    for report in view.reports:
        stamp.add_metric([report.resource], report.written_at)
        for device in report.devices:
            d = device.description
            owner = m.holder_labels(holders.get((report.resource, device.id), ()))
            base = [report.resource, device.id, _numa_label(device.numa_nodes), d.pci_address, *owner]
            info.add_metric([*base, d.kind, *(d.identity.get(k, "") for k in m.IDENTITY_LABELS)], 1.0)
            cause = "" if device.healthy else (d.cause_code or "unknown")
            healthy.add_metric([*base, cause], 1.0 if device.healthy else 0.0)
            allocated.add_metric(base, 1.0 if owner[0] else 0.0)
            for reading in d.readings:
                family = m.TELEMETRY[reading.family]
                telemetry[reading.family].add_metric(
                    [*base, *(reading.labels[k] for k in family.labels)], reading.value
                )
    yield from (info, healthy, allocated, *telemetry.values(), stamp)
    owners = view.owners
    if owners is not None:
        yield GaugeMetricFamily(
            m.AGENT_FAMILIES[1].name, m.AGENT_FAMILIES[1].help, value=1.0 if owners.up else 0.0
        )
        if owners.last_success is not None:
            yield GaugeMetricFamily(
                m.AGENT_FAMILIES[2].name, m.AGENT_FAMILIES[2].help, value=owners.last_success
            )
        calls = CounterMetricFamily(m.AGENT_FAMILIES[3].name, m.AGENT_FAMILIES[3].help, labels=["result"])
        calls.add_metric(["ok"], float(owners.calls_ok))
        calls.add_metric(["error"], float(owners.calls_failed))
        yield calls


class DeviceCollector(Collector):
    """A prometheus-client collector over a :data:`ViewProvider` (files or memory)."""

    def __init__(self, provider: m.ViewProvider) -> None:
        self._provider = provider

    def collect(self) -> Iterator[Metric]:
        """Render the current view."""
        yield from collect(self._provider())
