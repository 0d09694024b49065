"""Device telemetry from sysfs, as monitoring readings: AER, PCIe link, hwmon sensors, network links.

Everything an exporter would need a vendor library for, read from what the kernel
already exposes (see docs/monitoring.md for the attributes and their units):

- ``aer_dev_{fatal,nonfatal,correctable}``: the ``TOTAL_ERR_*`` line of each;
- ``{current,max}_link_{speed,width}``: ``16.0 GT/s PCIe`` and lane counts; a
  link trained below its maximum is *degraded*, a classic early sign of a bad
  riser, slot or card;
- ``hwmon/hwmon*/``: ``temp*_input``/``_crit`` (millidegrees Celsius, named by
  ``temp*_label``), ``power*_input`` or ``power*_average`` (microwatts),
  ``energy*_input`` (microjoules), ``fan*_input`` (RPM), as amdgpu, i915 and xe
  write them;
- ``net/<if>/operstate`` and ``carrier``: a PF's or VF's link.

An attribute that does not exist is simply not a reading (many devices have no
AER capability or no hwmon). One that exists but cannot be read or holds
garbage is left out too, with one log line per device and attribute
(:class:`TelemetryLog`) until it reads right again. Nothing here raises.

:func:`cause_code` turns the kinds' health problem texts into the short stable
words of the ``cause`` label.
"""

# os.* rather than pathlib on purpose, as in sysfs.py: thousands of devices per describe.
# ruff: noqa: PTH118

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Final

import structlog

from plugvisor.common.monitoring import Reading
from plugvisor.plugins import sysfs

AER_SEVERITIES: Final = ("fatal", "nonfatal", "correctable")
_SENSOR_FILE: Final = re.compile(r"^(temp|power|energy|fan)(\d+)_(input|average|crit)$")
_SPEED: Final = re.compile(r"^(\d+(?:\.\d+)?)\s*GT/s")

_CAUSES: Final = tuple(
    (re.compile(pattern), code)
    for pattern, code in (
        (r"unreadable|garbage", "unreadable"),
        (r"gpu lost", "gpu-lost"),
        (r"double-bit ecc", "ecc-dbe"),
        (r"fallen off the bus", "fallen-off-bus"),
        (r"aer fatal", "aer-fatal"),
        (r"aer nonfatal", "aer-nonfatal"),
        (r"aer correctable", "aer-correctable"),
        (r"\bpf\b.*link down", "pf-link-down"),
        (r"\bvf\b.*link down", "vf-link-down"),
        (r"link down", "link-down"),
        (r"no driver", "no-driver"),
        (r"(device|render) node", "device-node-missing"),
        (r"iommu group", "no-iommu-group"),
        (r"port errors", "port-errors"),
        (r"missing|not found", "missing"),
    )
)


_XID: Final = re.compile(r"^xid (\d{1,5})\b")


def cause_code(problems: Sequence[str]) -> str | None:
    """The label word for a device's first problem (``None`` when it has none; ``other`` if unknown).

    An NVML XID is the one number kept in the word (``xid-79``): XIDs are a
    short fixed list of NVIDIA's, and which one it was is what an alert routes on.
    """
    if not problems:
        return None
    text = problems[0].lower()
    xid = _XID.match(text)
    if xid:
        return f"xid-{int(xid.group(1))}"
    for pattern, code in _CAUSES:
        if pattern.search(text):
            return code
    return "other"


class TelemetryLog:
    """One log line per device and attribute that turns unreadable, and one when it reads again."""

    def __init__(self, logger: structlog.typing.FilteringBoundLogger) -> None:
        self._log = logger
        self._bad: set[str] = set()
        self._lock = threading.Lock()

    def bad(self, device: str, problem: sysfs.Unreadable) -> None:
        """``device``'s attribute could not be used: log it the first time."""
        key = f"{device}:{problem.path}"
        with self._lock:
            if key in self._bad:
                return
            self._bad.add(key)
        self._log.warning(
            "telemetry_unreadable", device=device, problem=str(problem), effect="reading absent"
        )

    def good(self, device: str, path: Path) -> None:
        """``device``'s attribute read right: log the recovery if it was bad."""
        key = f"{device}:{path}"
        with self._lock:
            if key not in self._bad:
                return
            self._bad.discard(key)
        self._log.info("telemetry_readable", device=device, path=str(path))


def _value(
    read: int | str | sysfs.Unreadable, device: str, log: TelemetryLog, path: Path
) -> int | str | None:
    if isinstance(read, sysfs.Unreadable):
        if read.problem is not sysfs.Problem.MISSING:
            log.bad(device, read)
        return None
    log.good(device, path)
    return read


def link_speed(text: str) -> float | None:
    """GT/s from ``current_link_speed`` text (``16.0 GT/s PCIe``, ``2.5 GT/s``); ``None`` for ``Unknown``."""
    match = _SPEED.match(text.strip())
    return float(match.group(1)) if match else None


def aer_readings(device: str, path: Path, log: TelemetryLog) -> list[Reading]:
    """The AER totals of one PCI function, by severity."""
    readings: list[Reading] = []
    for severity in AER_SEVERITIES:
        total = sysfs.aer_total(path, severity)
        value = _value(total, device, log, path / f"aer_dev_{severity}")
        if isinstance(value, int):
            readings.append(Reading("plugvisor_device_aer_errors", float(value), {"severity": severity}))
    return readings


def pcie_readings(device: str, path: Path, log: TelemetryLog) -> list[Reading]:
    """AER totals, link speed and width (current and max) and whether the link is degraded."""
    return aer_readings(device, path, log) + link_readings(device, path, log)


def link_readings(device: str, path: Path, log: TelemetryLog) -> list[Reading]:
    """Link speed and width (current and max) of a PCI function and whether the link is degraded."""
    readings: list[Reading] = []
    speeds: dict[str, float] = {}
    widths: dict[str, int] = {}
    for link in ("current", "max"):
        speed_path = path / f"{link}_link_speed"
        text = _value(sysfs.read_text(speed_path), device, log, speed_path)
        if isinstance(text, str):
            speed = link_speed(text)
            if speed is None and not text.lower().startswith("unknown"):
                log.bad(device, sysfs.Unreadable(speed_path, sysfs.Problem.GARBAGE, repr(text[:32])))
            elif speed is not None:
                speeds[link] = speed
                readings.append(Reading("plugvisor_device_pcie_link_speed_gts", speed, {"link": link}))
        width_path = path / f"{link}_link_width"
        width = _value(sysfs.read_int(width_path), device, log, width_path)
        if isinstance(width, int):
            widths[link] = width
            readings.append(Reading("plugvisor_device_pcie_link_width_lanes", float(width), {"link": link}))
    if "max" in speeds or "max" in widths:
        degraded = ("max" in speeds and speeds.get("current", 0.0) < speeds["max"]) or (
            "max" in widths and widths.get("current", 0) < widths["max"]
        )
        readings.append(Reading("plugvisor_device_pcie_link_degraded", 1.0 if degraded else 0.0))
    return readings


def hwmon_dirs(path: Path) -> list[str]:
    """The ``hwmon/hwmonN`` directories under a device (absolute paths, sorted)."""
    base = os.path.join(path, "hwmon")
    names = sysfs.list_dir(Path(base))
    if isinstance(names, sysfs.Unreadable):
        return []
    return [os.path.join(base, n) for n in names if n.startswith("hwmon")]


def hwmon_readings(device: str, path: Path, log: TelemetryLog) -> list[Reading]:
    """Temperatures (and their critical limits), power, energy and fans of every hwmon under ``path``."""
    readings: list[Reading] = []
    for directory in hwmon_dirs(path):
        names = sysfs.list_dir(Path(directory))
        if isinstance(names, sysfs.Unreadable):
            log.bad(device, names)
            continue
        present = set(names)
        for name in names:
            match = _SENSOR_FILE.match(name)
            if match is None:
                continue
            kind, number, item = match.groups()
            if kind == "power" and item == "average" and f"power{number}_input" in present:
                continue  # newer amdgpu has both; the instantaneous one wins
            if kind != "temp" and item == "crit":
                continue
            file = Path(directory, name)
            raw = _value(sysfs.read_int(file), device, log, file)
            if not isinstance(raw, int):
                continue
            sensor = _label(Path(directory, f"{kind}{number}_label")) or f"{kind}{number}"
            reading = _sensor_reading(kind, item, raw, sensor)
            if reading is not None:
                readings.append(reading)
    return readings


def _label(path: Path) -> str | None:
    text = sysfs.read_text(path)
    return text if isinstance(text, str) and text and text.isprintable() else None


def _sensor_reading(kind: str, item: str, raw: int, sensor: str) -> Reading | None:
    labels = {"sensor": sensor}
    if kind == "temp" and item == "input":
        return Reading("plugvisor_device_temperature_celsius", raw / 1000.0, labels)
    if kind == "temp" and item == "crit":
        return Reading("plugvisor_device_temperature_critical_celsius", raw / 1000.0, labels)
    if kind == "power":
        return Reading("plugvisor_device_power_watts", raw / 1_000_000.0, labels)
    if kind == "energy":
        return Reading("plugvisor_device_energy_joules", raw / 1_000_000.0, labels)
    if kind == "fan":
        return Reading("plugvisor_device_fan_rpm", float(raw), labels)
    return None


def netdev_up(netdev: Path) -> int | sysfs.Unreadable:
    """1 when an interface's link is up, 0 when down; from ``operstate``, then ``carrier`` if it is unknown.

    The kernel answers ``EINVAL`` to a ``carrier`` read on an interface that is
    administratively down, so ``carrier`` is read only when ``operstate`` cannot tell.
    """
    state = sysfs.read_text(netdev / "operstate")
    if isinstance(state, sysfs.Unreadable):
        return state
    if state == "up":
        return 1
    if state in ("down", "lowerlayerdown", "notpresent", "dormant"):
        return 0
    carrier = sysfs.read_int(netdev / "carrier")
    if isinstance(carrier, sysfs.Unreadable):
        return 0 if carrier.problem is sysfs.Problem.UNREADABLE else carrier
    return 1 if carrier == 1 else 0


def netdev_readings(device: str, function: Path, role: str, log: TelemetryLog) -> list[Reading]:
    """The link state of each interface under a PCI function's ``net/``."""
    readings: list[Reading] = []
    names = sysfs.list_dir(function / "net")
    if isinstance(names, sysfs.Unreadable):
        if names.problem is not sysfs.Problem.MISSING:
            log.bad(device, names)
        return readings
    for name in names:
        up = _value(netdev_up(function / "net" / name), device, log, function / "net" / name)
        if isinstance(up, int):
            readings.append(
                Reading("plugvisor_device_netdev_up", float(up), {"interface": name, "role": role})
            )
    return readings


def pci_readings(device: str, path: Path, log: TelemetryLog, *, hwmon: bool = True) -> list[Reading]:
    """PCIe readings plus, if asked, the hwmon sensors of a PCI function."""
    readings = pcie_readings(device, path, log)
    if hwmon:
        readings += hwmon_readings(device, path, log)
    return readings


def identity(**values: str | None) -> dict[str, str]:
    """Identity labels with the unknown ones left out."""
    return {key: value for key, value in values.items() if value}


def first_problem_text(problems: Iterable[str]) -> str | None:
    """All problems as one line for status and logs (``None`` when healthy)."""
    text = "; ".join(problems)
    return text or None
