"""Per-device Prometheus families, computed at scrape time from a monitoring view.

The supervisor (from the report files of its children) and a standalone plugin
(from its own memory) render the same families through :class:`DeviceCollector`.
Nothing is kept between scrapes: a departed pod or a vanished device has no
series in the next scrape, so cardinality follows the node's devices and
current holders, never allocation history. gRPC-free, like
:mod:`plugvisor.common.monitoring`.
"""

from __future__ import annotations

import math
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


def _number(value: float) -> str:
    """A sample value as the text format spells it (``+Inf``, ``-Inf``, ``NaN``, else Python's repr)."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _escape(value: str) -> str:
    """A label value in the text format (backslash, double quote and newline escaped)."""
    if "\\" in value or '"' in value or "\n" in value:
        return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
    return value


def _labels(names: Sequence[str], values: Sequence[str]) -> str:
    return ",".join(f'{name}="{_escape(value)}"' for name, value in zip(names, values, strict=True))


def render(view: m.View) -> bytes:
    """The same families as :func:`collect`, in the Prometheus text format, written directly.

    The agent's scrape path. prometheus-client's generic writer validates and
    escapes every label name of every sample (about 8 per series here), which
    made a 10,000-device scrape take seconds; these label names are constants,
    so only values are escaped. ``tests/unit/deviceplugin/test_monitoring.py``
    checks that both writers give the same samples.
    """
    out: dict[str, list[str]] = {f.name: [] for f in (*m.BASE_FAMILIES, *m.TELEMETRY.values())}
    info, healthy, allocated = (out[f.name] for f in m.BASE_FAMILIES)
    extra = {name: family.labels for name, family in m.TELEMETRY.items()}
    holders = view.owners.holders if view.owners is not None else {}
    stamps = []
    for report in view.reports:
        stamps.append(f'{{resource="{_escape(report.resource)}"}} {_number(report.written_at)}')
        for device in report.devices:
            d = device.description
            owner = m.holder_labels(holders.get((report.resource, device.id), ()))
            base = _labels(
                m.DEVICE_LABELS,
                (report.resource, device.id, _numa_label(device.numa_nodes), d.pci_address, *owner),
            )
            identity = _labels(
                ("kind", *m.IDENTITY_LABELS), (d.kind, *(d.identity.get(k, "") for k in m.IDENTITY_LABELS))
            )
            info.append(f"{{{base},{identity}}} 1.0")
            cause = "" if device.healthy else (d.cause_code or "unknown")
            healthy.append(f'{{{base},cause="{_escape(cause)}"}} {"1.0" if device.healthy else "0.0"}')
            allocated.append(f"{{{base}}} {'1.0' if owner[0] else '0.0'}")
            for reading in d.readings:
                names = extra[reading.family]
                labels = f"{base},{_labels(names, [reading.labels[k] for k in names])}" if names else base
                out[reading.family].append(f"{{{labels}}} {_number(reading.value)}")
    text: list[str] = []
    for family in (*m.BASE_FAMILIES, *m.TELEMETRY.values()):
        kind = "counter" if family.counter else "gauge"
        sample = f"{family.name}_total" if family.counter else family.name
        text.append(f"# HELP {family.name} {family.help}\n# TYPE {family.name} {kind}\n")
        text.extend(f"{sample}{line}\n" for line in out[family.name])
    stamp = m.AGENT_FAMILIES[0]
    text.append(f"# HELP {stamp.name} {stamp.help}\n# TYPE {stamp.name} gauge\n")
    text.extend(f"{stamp.name}{line}\n" for line in stamps)
    owners = view.owners
    if owners is not None:
        up, last, calls = m.AGENT_FAMILIES[1:]
        text.append(
            f"# HELP {up.name} {up.help}\n# TYPE {up.name} gauge\n{up.name} {'1.0' if owners.up else '0.0'}\n"
        )
        if owners.last_success is not None:
            text.append(
                f"# HELP {last.name} {last.help}\n# TYPE {last.name} gauge\n"
                f"{last.name} {_number(owners.last_success)}\n"
            )
        text.append(
            f"# HELP {calls.name} {calls.help}\n# TYPE {calls.name} counter\n"
            f'{calls.name}_total{{result="ok"}} {_number(owners.calls_ok)}\n'
            f'{calls.name}_total{{result="error"}} {_number(owners.calls_failed)}\n'
        )
    return "".join(text).encode()
