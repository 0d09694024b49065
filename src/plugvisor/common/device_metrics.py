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
from collections.abc import Iterator, Mapping, Sequence
from typing import Final

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


DEVICE_FAMILIES: Final = (*m.BASE_FAMILIES, *m.TELEMETRY.values())
"""The per-device families, in the order the text lists them."""

Holders = Mapping[tuple[str, str], Sequence[m.Holder]]


def device_lines() -> dict[str, list[str]]:
    """An empty accumulator for :func:`add_device`: family name -> its sample lines."""
    return {family.name: [] for family in DEVICE_FAMILIES}


def add_device(out: dict[str, list[str]], resource: str, device: m.DeviceReport, holders: Holders) -> None:
    """Append ``device``'s sample lines (each whole, newline included) to ``out``, family by family.

    One device at a time, so that a caller on an event loop can render a node of
    thousands of devices in slices (the agent's scrape does).
    """
    d = device.description
    owner = m.holder_labels(holders.get((resource, device.id), ()))
    base = _labels(
        m.DEVICE_LABELS, (resource, device.id, _numa_label(device.numa_nodes), d.pci_address, *owner)
    )
    identity = _labels(
        ("kind", *m.IDENTITY_LABELS), (d.kind, *(d.identity.get(k, "") for k in m.IDENTITY_LABELS))
    )
    info, healthy, allocated = (m.BASE_FAMILIES[i].name for i in range(3))
    out[info].append(f"{info}{{{base},{identity}}} 1.0\n")
    cause = "" if device.healthy else (d.cause_code or "unknown")
    out[healthy].append(
        f'{healthy}{{{base},cause="{_escape(cause)}"}} {"1.0" if device.healthy else "0.0"}\n'
    )
    out[allocated].append(f"{allocated}{{{base}}} {'1.0' if owner[0] else '0.0'}\n")
    for reading in d.readings:
        family = m.TELEMETRY[reading.family]
        sample = f"{family.name}_total" if family.counter else family.name
        names = family.labels
        labels = f"{base},{_labels(names, [reading.labels[k] for k in names])}" if names else base
        out[family.name].append(f"{sample}{{{labels}}} {_number(reading.value)}\n")


def assemble(
    resources: Sequence[Mapping[str, str]], stamps: Sequence[tuple[str, float]], owners: m.Owners | None
) -> Iterator[str]:
    """The text of the per-device families: each family's header, then its lines from every resource.

    ``resources``: per resource, family name -> its lines joined (``"".join`` of an
    :func:`add_device` accumulator); ``stamps``: ``(resource, written_at)`` of each report.
    """
    for family in DEVICE_FAMILIES:
        kind = "counter" if family.counter else "gauge"
        yield f"# HELP {family.name} {family.help}\n# TYPE {family.name} {kind}\n"
        for texts in resources:
            yield texts.get(family.name, "")
    stamp = m.AGENT_FAMILIES[0]
    yield f"# HELP {stamp.name} {stamp.help}\n# TYPE {stamp.name} gauge\n"
    for resource, written_at in stamps:
        yield f'{stamp.name}{{resource="{_escape(resource)}"}} {_number(written_at)}\n'
    if owners is not None:
        up, last, calls = m.AGENT_FAMILIES[1:]
        yield f"# HELP {up.name} {up.help}\n# TYPE {up.name} gauge\n"
        yield f"{up.name} {'1.0' if owners.up else '0.0'}\n"
        if owners.last_success is not None:
            yield (
                f"# HELP {last.name} {last.help}\n# TYPE {last.name} gauge\n"
                f"{last.name} {_number(owners.last_success)}\n"
            )
        yield (
            f"# HELP {calls.name} {calls.help}\n# TYPE {calls.name} counter\n"
            f'{calls.name}_total{{result="ok"}} {_number(owners.calls_ok)}\n'
            f'{calls.name}_total{{result="error"}} {_number(owners.calls_failed)}\n'
        )


def render(view: m.View) -> bytes:
    """The same families as :func:`collect`, in the Prometheus text format, written directly.

    prometheus-client's generic writer validates and escapes every label name of
    every sample (about 8 per series here), which made a 10,000-device scrape take
    seconds; these label names are constants, so only values are escaped.
    ``tests/unit/deviceplugin/test_monitoring.py`` checks that both writers give
    the same samples. (The agent renders the same way, resource by resource and
    in slices: :mod:`plugvisor.supervisor.metrics`.)
    """
    holders = view.owners.holders if view.owners is not None else {}
    resources = []
    for report in view.reports:
        out = device_lines()
        for device in report.devices:
            add_device(out, report.resource, device, holders)
        resources.append({name: "".join(lines) for name, lines in out.items()})
    stamps = [(report.resource, report.written_at) for report in view.reports]
    return "".join(assemble(resources, stamps, view.owners)).encode()
