"""Per-device monitoring: what each device is, how it is doing, and who holds it, as Prometheus families.

Three parts meet here, and none of them needs gRPC or the framework, so the
supervisor (which must load neither) can render the same metrics a standalone
plugin serves:

- A source may describe its devices (``plugvisor.deviceplugin.device_monitor.DeviceDescriber``): PCI address,
  kind-specific identity (GPU UUID, a VF's PF, an FPGA's interface ID), the
  cause of an unhealthy state, and telemetry :class:`Reading` values (AER
  counters, PCIe link speed and width, hwmon sensors, network link state). The
  plugin process turns its device set plus these descriptions into one
  :class:`ResourceReport` per resource.
- :class:`Owners`: which container holds which device, from the kubelet's
  PodResources ``List`` (polled by one process per agent, see
  :mod:`plugvisor.deviceplugin.owners`).
- :mod:`plugvisor.common.device_metrics` joins both at scrape time. Nothing is kept between
  scrapes, so a pod that ended or a device that vanished simply has no series
  in the next scrape: cardinality is bounded by devices x current holders, never
  by allocation history.

Under the supervisor the reports and owners travel through files in
``<runtimeDir>/monitor`` (:func:`write_report`, :func:`write_owners`, written
atomically by rename); a standalone plugin keeps them in memory. Telemetry
values are sampled by the plugin processes, so a scrape only reads those files.
A report is JSON Lines, a header then one line per device: a node of thousands
of devices is megabytes, and the agent parses it a slice at a time, between
which its event loop goes on supervising (:func:`report_header`, :func:`parse_device`).
"""

from __future__ import annotations

import contextlib
import json
import re
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

from plugvisor.common.atomicfile import write_atomically

REPORTS_DIR: Final = "devices"
OWNERS_FILE: Final = "owners.json"
LEADER_LOCK: Final = "pod-resources.lock"

DEVICE_LABELS: Final = ("resource", "device", "numa_node", "pci_address", "pod", "namespace", "container")
"""Labels every per-device series carries (owner labels empty while the device is free)."""
IDENTITY_LABELS: Final = ("uuid", "pf", "interface", "interface_id", "afu_id")
"""Kind-specific identity, on ``plugvisor_device_info`` only (empty where a kind has none)."""


@dataclass(frozen=True, slots=True)
class Family:
    """One per-device metric family: name, help, type and the labels it adds to :data:`DEVICE_LABELS`."""

    name: str
    help: str
    counter: bool = False
    labels: tuple[str, ...] = ()


TELEMETRY: Final = {
    f.name: f
    for f in (
        Family(
            "plugvisor_device_aer_errors",
            "PCIe AER errors the kernel counted for the device (aer_dev_*), by severity.",
            counter=True,
            labels=("severity",),
        ),
        Family(
            "plugvisor_device_pcie_link_speed_gts",
            "PCIe link speed in GT/s, current and maximum (current_/max_link_speed).",
            labels=("link",),
        ),
        Family(
            "plugvisor_device_pcie_link_width_lanes",
            "PCIe link width in lanes, current and maximum (current_/max_link_width).",
            labels=("link",),
        ),
        Family(
            "plugvisor_device_pcie_link_degraded",
            "1 when the link trained below its maximum speed or width (a classic early failure).",
        ),
        Family(
            "plugvisor_device_temperature_celsius",
            "hwmon temperature of the device, by sensor label (edge, junction, mem...).",
            labels=("sensor",),
        ),
        Family(
            "plugvisor_device_temperature_critical_celsius",
            "hwmon critical temperature of the sensor (temp*_crit).",
            labels=("sensor",),
        ),
        Family(
            "plugvisor_device_power_watts",
            "hwmon power draw of the device (power*_input or power*_average).",
            labels=("sensor",),
        ),
        Family(
            "plugvisor_device_energy_joules",
            "hwmon energy counter of the device (energy*_input).",
            counter=True,
            labels=("sensor",),
        ),
        Family("plugvisor_device_fan_rpm", "hwmon fan speed of the device.", labels=("sensor",)),
        Family("plugvisor_gpu_utilization_ratio", "NVML: fraction of time a kernel ran on the GPU (0-1)."),
        Family(
            "plugvisor_gpu_memory_copy_utilization_ratio",
            "NVML: fraction of time the GPU's memory was read or written (0-1).",
        ),
        Family("plugvisor_gpu_memory_used_bytes", "NVML: GPU memory (framebuffer) in use."),
        Family("plugvisor_gpu_memory_total_bytes", "NVML: GPU memory (framebuffer) in all."),
        Family(
            "plugvisor_gpu_ecc_errors",
            "NVML: ECC errors since the driver loaded (volatile), single-bit (sbe) or double-bit (dbe).",
            counter=True,
            labels=("type",),
        ),
        Family(
            "plugvisor_gpu_pcie_replays", "NVML: PCIe replays (link-level retries) of the GPU.", counter=True
        ),
        Family("plugvisor_gpu_last_xid", "NVML: the last XID reported for the GPU (0 for none since start)."),
        Family("plugvisor_gpu_sm_clock_hertz", "NVML: streaming multiprocessor clock."),
        Family(
            "plugvisor_device_netdev_up",
            "1 when the network interface's link is up (operstate up and carrier 1), by role (pf or vf).",
            labels=("interface", "role"),
        ),
    )
}
"""Telemetry families a :class:`Reading` may name."""

BASE_FAMILIES: Final = (
    Family(
        "plugvisor_device_info",
        "One series per device: identity labels (kind, GPU UUID, VF's PF, FPGA interface ID).",
        labels=("kind", *IDENTITY_LABELS),
    ),
    Family(
        "plugvisor_device_healthy",
        "1 when the device is Healthy; when not, cause says why (no-driver, aer-fatal, link-down...).",
        labels=("cause",),
    ),
    Family("plugvisor_device_allocated", "1 when a container holds the device (pod/namespace/container)."),
)

AGENT_FAMILIES: Final = (
    Family("plugvisor_device_report_timestamp_seconds", "When the resource last described its devices."),
    Family("plugvisor_pod_resources_up", "1 when the latest PodResources List succeeded."),
    Family(
        "plugvisor_pod_resources_last_success_timestamp_seconds", "When PodResources List last succeeded."
    ),
    Family("plugvisor_pod_resources_calls", "PodResources List calls by result.", counter=True),
)


def exported_metric_names() -> frozenset[str]:
    """Every sample name the device collector emits (counters with ``_total``): for dashboards, rules."""
    names: set[str] = set()
    for family in (*BASE_FAMILIES, *TELEMETRY.values(), *AGENT_FAMILIES):
        names.add(f"{family.name}_total" if family.counter else family.name)
    return frozenset(names)


CAUSE_CODE: Final = re.compile(r"[a-z][a-z0-9]*(-[a-z0-9]+)*")
"""The shape of a ``cause`` label value: lower-case words joined by ``-`` (``aer-fatal``, ``ecc-error``)."""
CAUSE_CODE_MAX: Final = 40


class InvalidReadingError(ValueError):
    """A source built a reading the catalogue does not know (a programming error, named)."""


@dataclass(frozen=True, slots=True)
class Reading:
    """One telemetry value of a device: a :data:`TELEMETRY` family, its extra labels, the value."""

    family: str
    value: float
    labels: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        known = TELEMETRY.get(self.family)
        if known is None:
            raise InvalidReadingError(f"unknown telemetry family {self.family!r}; known: {sorted(TELEMETRY)}")
        if set(self.labels) != set(known.labels):
            raise InvalidReadingError(
                f"{self.family} takes labels {list(known.labels)}, got {sorted(self.labels)}"
            )
        object.__setattr__(self, "labels", MappingProxyType(dict(self.labels)))

    @classmethod
    def trusted(cls, family: str, value: float, labels: Mapping[str, str]) -> Reading:
        """A reading parsed from a report file: checked only that its family is known.

        A scrape of 10,000 devices parses ~140,000 readings; the full check (and the
        read-only copy of the labels) is for the plugins that build them.
        """
        known = TELEMETRY.get(family)
        if known is None or len(labels) != len(known.labels):
            raise ValueError(f"reading of unknown family or labels: {family} {labels}")
        reading = object.__new__(cls)
        object.__setattr__(reading, "family", family)
        object.__setattr__(reading, "value", value)
        object.__setattr__(reading, "labels", labels)
        return reading


@dataclass(frozen=True, slots=True)
class DeviceDescription:
    """What a source knows about one device beyond the kubelet's view.

    ``cause`` is the human text (for logs and ``plugvisor status``); ``cause_code``
    a short stable word for the metric label (``aer-fatal``, ``link-down``...), so
    that a counter in the text never creates a new series. A kind may use its own
    words (``ecc-error``): any :data:`CAUSE_CODE` shape is accepted, and anything
    else is refused at construction, naming it.
    """

    kind: str = ""
    pci_address: str = ""
    identity: Mapping[str, str] = field(default_factory=dict)
    cause: str | None = None
    cause_code: str | None = None
    readings: Sequence[Reading] = ()

    def __post_init__(self) -> None:
        unknown = set(self.identity) - set(IDENTITY_LABELS)
        if unknown:
            raise InvalidReadingError(f"unknown identity labels {sorted(unknown)}; known: {IDENTITY_LABELS}")
        code = self.cause_code
        if code is not None and (len(code) > CAUSE_CODE_MAX or not CAUSE_CODE.fullmatch(code)):
            raise InvalidReadingError(
                f"cause_code {code[:80]!r}: expected lower-case words joined by '-' (like 'ecc-error'), "
                f"at most {CAUSE_CODE_MAX} characters"
            )
        # Immutable and comparable whatever the caller passed (a report equals its parsed file).
        object.__setattr__(self, "identity", MappingProxyType(dict(self.identity)))
        object.__setattr__(self, "readings", tuple(self.readings))


@dataclass(frozen=True, slots=True)
class DeviceReport:
    """One device as reported: the kubelet's view plus its description (JSON-serialisable)."""

    id: str
    healthy: bool
    numa_nodes: tuple[int, ...]
    description: DeviceDescription

    def to_json(self) -> dict[str, Any]:
        """The record written to the report file."""
        d = self.description
        return {
            "id": self.id,
            "healthy": self.healthy,
            "numa_nodes": list(self.numa_nodes),
            "kind": d.kind,
            "pci_address": d.pci_address,
            "identity": dict(d.identity),
            "cause": d.cause,
            "cause_code": d.cause_code,
            "readings": [[r.family, r.value, dict(r.labels)] for r in d.readings],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DeviceReport:
        """Parse a record; raises ``ValueError``/``KeyError``/``TypeError`` on a malformed one."""
        readings = tuple(
            Reading.trusted(str(f), float(v), labels) for f, v, labels in data.get("readings", [])
        )
        description = DeviceDescription(
            kind=str(data.get("kind", "")),
            pci_address=str(data.get("pci_address", "")),
            identity={str(k): str(v) for k, v in data.get("identity", {}).items()},
            cause=data.get("cause"),
            cause_code=data.get("cause_code"),
            readings=readings,
        )
        return cls(
            str(data["id"]), bool(data["healthy"]), tuple(int(n) for n in data["numa_nodes"]), description
        )


@dataclass(frozen=True, slots=True)
class ResourceReport:
    """Every device of one resource at one moment, from the plugin process serving it."""

    resource: str
    pid: int
    written_at: float
    devices: tuple[DeviceReport, ...]

    def to_lines(self) -> Iterator[str]:
        """The report file's lines (JSON Lines): the header, then one record per device."""
        yield json.dumps({"resource": self.resource, "pid": self.pid, "written_at": self.written_at})
        for device in self.devices:
            yield json.dumps(device.to_json(), separators=(",", ":"))

    @classmethod
    def from_lines(cls, lines: Iterable[bytes | str]) -> ResourceReport:
        """Parse a report file's lines (raises ``ValueError``, ``KeyError`` or ``TypeError`` if malformed)."""
        records = iter(lines)
        resource, pid, written_at = report_header(next(records, b""))
        return cls(resource, pid, written_at, tuple(parse_device(line) for line in records if line.strip()))


def report_header(line: bytes | str) -> tuple[str, int, float]:
    """``(resource, pid, written_at)`` from a report's first line (raises on a malformed one)."""
    data = json.loads(line)
    return str(data["resource"]), int(data["pid"]), float(data["written_at"])


def parse_device(line: bytes | str) -> DeviceReport:
    """One device record of a report (raises on a malformed one)."""
    return DeviceReport.from_json(json.loads(line))


@dataclass(frozen=True, slots=True)
class Holder:
    """A container holding a device."""

    namespace: str
    pod: str
    container: str


@dataclass(frozen=True, slots=True)
class Owners:
    """Who holds which device, from the latest PodResources ``List``, and how polling goes.

    ``holders`` maps ``(resource, device ID)`` to the containers listing it (more
    than one when init and app containers of a pod reuse a device).
    """

    holders: Mapping[tuple[str, str], tuple[Holder, ...]] = field(default_factory=dict)
    up: bool = False
    last_success: float | None = None
    error: str | None = None
    calls_ok: int = 0
    calls_failed: int = 0
    pid: int = 0

    def to_json(self) -> dict[str, Any]:
        """The owners file's document."""
        return {
            "up": self.up,
            "last_success": self.last_success,
            "error": self.error,
            "calls_ok": self.calls_ok,
            "calls_failed": self.calls_failed,
            "pid": self.pid,
            "holders": [
                [resource, device, [[h.namespace, h.pod, h.container] for h in holders]]
                for (resource, device), holders in sorted(self.holders.items())
            ],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Owners:
        """Parse an owners document (raises on a malformed one)."""
        holders = {
            (str(resource), str(device)): tuple(Holder(str(n), str(p), str(c)) for n, p, c in entries)
            for resource, device, entries in data["holders"]
        }
        last = data.get("last_success")
        return cls(
            holders=holders,
            up=bool(data["up"]),
            last_success=None if last is None else float(last),
            error=data.get("error"),
            calls_ok=int(data.get("calls_ok", 0)),
            calls_failed=int(data.get("calls_failed", 0)),
            pid=int(data.get("pid", 0)),
        )


# -- files ---------------------------------------------------------------------------


def report_path(monitor_dir: Path, resource: str) -> Path:
    """The report file of one resource (the name is URL-quoted: resource names contain ``/``)."""
    return monitor_dir / REPORTS_DIR / f"{urllib.parse.quote(resource, safe='')}.jsonl"


def _write_atomically(path: Path, text: str) -> None:
    # Readers never see half a file; the temporary name is unpredictable and never followed.
    write_atomically(path, text.encode(), durable=False)


def write_report(monitor_dir: Path, report: ResourceReport) -> None:
    """Replace the resource's report file (readers never see half a file); raises ``OSError``."""
    _write_atomically(report_path(monitor_dir, report.resource), "\n".join(report.to_lines()) + "\n")


def remove_report(monitor_dir: Path, resource: str) -> None:
    """Remove the resource's report (its plugin stops)."""
    with contextlib.suppress(FileNotFoundError):
        report_path(monitor_dir, resource).unlink()


def write_owners(monitor_dir: Path, owners: Owners) -> None:
    """Replace the owners file; raises ``OSError``."""
    _write_atomically(monitor_dir / OWNERS_FILE, json.dumps(owners.to_json(), separators=(",", ":")))


def read_report(monitor_dir: Path, resource: str) -> ResourceReport | None:
    """The resource's latest report; ``None`` when absent or unreadable (a half-dead writer, a full disk)."""
    try:
        return ResourceReport.from_lines(report_path(monitor_dir, resource).read_bytes().splitlines())
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_owners(monitor_dir: Path) -> Owners | None:
    """The latest owners document; ``None`` when no process has polled PodResources yet."""
    try:
        return Owners.from_json(json.loads((monitor_dir / OWNERS_FILE).read_bytes()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


# -- views ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class View:
    """What one scrape sees: every live resource's report and the owners (if anyone polled)."""

    reports: Sequence[ResourceReport]
    owners: Owners | None


ViewProvider = Callable[[], View]


def holder_labels(holders: Iterable[Holder]) -> tuple[str, str, str]:
    """``(pod, namespace, container)`` label values; several holders are joined with commas, sorted."""
    entries = list(holders)
    if not entries:
        return "", "", ""

    def joined(values: Iterable[str]) -> str:
        return ",".join(sorted(set(values)))

    return (
        joined(h.pod for h in entries),
        joined(h.namespace for h in entries),
        joined(h.container for h in entries),
    )


def directory_view(monitor_dir: Path, live: Mapping[str, int | None]) -> View:
    """The view from the monitor directory, for the resources in ``live`` (resource -> current child PID).

    A report is used only while the process that wrote it is the resource's
    current child: a crashed child's last words are not shown as the present,
    and a resource removed by a reload is gone at once.
    """
    reports = []
    for resource, pid in live.items():
        if not pid:
            continue
        report = read_report(monitor_dir, resource)
        if report is not None and report.pid == pid:
            reports.append(report)
    return View(reports, read_owners(monitor_dir))
