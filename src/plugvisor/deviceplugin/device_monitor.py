"""The plugin process's side of monitoring: describe the devices, sample telemetry, share the owners.

A :class:`DeviceMonitor` runs beside discovery in every plugin process that
asks for it (``plugvisor plugin --metrics-listen``, or any child of the agent):

- after every change of the device set, and every ``telemetry_interval``
  seconds in between (hwmon and link attributes change without any inotify
  event), it asks the source's :class:`DeviceDescriber`
  hook (in a worker thread: sysfs reads block) and publishes a
  :class:`~plugvisor.common.monitoring.ResourceReport`, also written to
  the agent's monitor directory when there is one;
- it runs the agent-wide :class:`~plugvisor.deviceplugin.owners.OwnerWatch`
  (only the elected process actually calls PodResources).

A failing describer or an unwritable directory costs one log line, never the
plugin: the kubelet-facing work does not depend on monitoring at all.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import structlog

from plugvisor.common import monitoring
from plugvisor.common.monitoring import DeviceDescription, DeviceReport, ResourceReport
from plugvisor.deviceplugin.cell import CellClosedError, SnapshotCell
from plugvisor.deviceplugin.devices import DeviceSet
from plugvisor.deviceplugin.lifetime import cancel_all
from plugvisor.deviceplugin.monitorconfig import MonitorConfig
from plugvisor.deviceplugin.owners import OwnerWatch
from plugvisor.deviceplugin.snapshot import Snapshot


@runtime_checkable
class DeviceDescriber(Protocol):
    """**Protocol:** describes devices for monitoring (identity, health cause, sysfs telemetry).

    Called from a worker thread after every new snapshot and every telemetry
    interval, with the latest snapshot (the kind's per-scan data included).
    Must not raise for an unreadable value: leave the reading out (and log it
    once).
    """

    def describe(self, snapshot: Snapshot[Any]) -> Mapping[str, DeviceDescription]:
        """Descriptions of the snapshot's devices by ID (devices left out get an empty description)."""
        ...


def build_report(
    resource: str,
    devices: DeviceSet,
    descriptions: Mapping[str, DeviceDescription],
    *,
    names: Mapping[str, str] | None = None,
    now: float | None = None,
) -> ResourceReport:
    """A report for ``devices``; devices without a description get an empty one.

    ``names`` renames devices by ID (a DRA driver reports the names of its
    pool); with it, devices it does not name are left out.
    """
    empty = DeviceDescription()
    return ResourceReport(
        resource,
        os.getpid(),
        time.time() if now is None else now,
        tuple(
            DeviceReport(
                device_id if names is None else names[device_id],
                device.healthy,
                tuple(device.numa_nodes),
                descriptions.get(device_id, empty),
            )
            for device_id, device in devices.items()
            if names is None or device_id in names
        ),
    )


class DeviceMonitor:
    """Keeps one resource's :class:`~plugvisor.common.monitoring.ResourceReport` current.

    The report names devices by their IDs, or by what ``names`` gives for a
    snapshot (device ID -> name): a DRA driver reports each device under its
    name in the pool, which is how PodResources names DRA-prepared devices.
    """

    def __init__(
        self,
        resource: str,
        snapshots: SnapshotCell[Snapshot[Any]],
        describer: DeviceDescriber | None,
        config: MonitorConfig,
        *,
        pod_resources_socket: Path,
        names: Callable[[Snapshot[Any]], Mapping[str, str]] | None = None,
    ) -> None:
        self.resource = resource
        self.config = config
        self._snapshots = snapshots
        self._describer = describer
        self._names = names
        self.report: SnapshotCell[monitoring.ResourceReport | None] = SnapshotCell(None)
        self.owner_watch = (
            OwnerWatch(
                socket=pod_resources_socket,
                interval=config.pod_resources_interval,
                monitor_dir=config.monitor_dir,
            )
            if config.owners
            else None
        )
        self._describe_failed = False
        self._write_failed = False
        self._log = structlog.get_logger("plugvisor.monitor").bind(resource=resource)

    def view(self) -> monitoring.View:
        """This process's view, for an in-process collector (a standalone plugin's ``/metrics``)."""
        report = self.report.value
        owners = self.owner_watch.owners.value if self.owner_watch is not None else None
        return monitoring.View([] if report is None else [report], owners)

    async def run(self) -> None:
        """Report after each device change and each telemetry interval; poll owners; until cancelled."""
        tasks = [asyncio.create_task(self._guarded(self._report_loop()), name="device-report")]
        if self.owner_watch is not None:
            tasks.append(asyncio.create_task(self._guarded(self.owner_watch.run()), name="pod-resources"))
        try:
            await asyncio.gather(*tasks)
            await asyncio.Event().wait()  # monitoring ended (closed or broken): the plugin goes on
        finally:
            await cancel_all(tasks)
            if self.config.monitor_dir is not None:
                monitoring.remove_report(self.config.monitor_dir, self.resource)

    async def _guarded(self, loop: Coroutine[Any, Any, None]) -> None:
        try:
            await loop
        except Exception as exc:  # monitoring is never worth the plugin: log and stop monitoring only
            self._log.error("monitoring_failed", error=f"{type(exc).__name__}: {exc}")

    async def _report_loop(self) -> None:
        seen = -1
        while True:
            try:
                seen, snapshot = await asyncio.wait_for(
                    self._snapshots.wait_newer(seen), self.config.telemetry_interval
                )
            except TimeoutError:
                snapshot = self._snapshots.value
            except CellClosedError:
                return
            descriptions = await asyncio.to_thread(self._describe, snapshot)
            names = None if self._names is None else self._names(snapshot)
            report = build_report(self.resource, snapshot.devices, descriptions, names=names)
            self.report.publish(report)
            if self.config.monitor_dir is not None:
                await asyncio.to_thread(self._write, self.config.monitor_dir, report)

    def _describe(self, snapshot: Snapshot[Any]) -> Mapping[str, monitoring.DeviceDescription]:
        # No devices, nothing to describe; and before the first scan the snapshot carries no scan data, which
        # a kind's describe() may rightly expect (the gpu kind logged describe_failed at every start).
        if self._describer is None or not snapshot.devices:
            return {}
        try:
            descriptions = self._describer.describe(snapshot)
        except Exception as exc:  # a broken describer must not take the plugin down
            if not self._describe_failed:
                self._log.error("describe_failed", error=f"{type(exc).__name__}: {exc}")
                self._describe_failed = True
            return {}
        if self._describe_failed:
            self._log.info("describe_recovered")
            self._describe_failed = False
        return descriptions

    def _write(self, monitor_dir: Path, report: monitoring.ResourceReport) -> None:
        try:
            monitoring.write_report(monitor_dir, report)
        except OSError as exc:
            if not self._write_failed:
                self._log.warning("device_report_unwritable", dir=str(monitor_dir), error=str(exc))
                self._write_failed = True
            return
        if self._write_failed:
            self._log.info("device_report_writable", dir=str(monitor_dir))
            self._write_failed = False
