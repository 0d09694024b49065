"""The ``fpga`` device source and its hooks: IDs, health, Allocate contents, PreStart, release cleanup."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import structlog

from plugvisor.common.hostpaths import HostPaths
from plugvisor.common.monitoring import DeviceDescription, Reading
from plugvisor.deviceplugin.devices import Device, DeviceSpec, Health
from plugvisor.deviceplugin.hooks import ReleaseWatch
from plugvisor.deviceplugin.snapshot import Snapshot
from plugvisor.dra.devices import PublishedDevice
from plugvisor.dra.hooks import dra_device_name
from plugvisor.plugins import sysfs, telemetry
from plugvisor.plugins.draattributes import function_attributes
from plugvisor.plugins.fpga import naming
from plugvisor.plugins.fpga.discovery import FpgaDevice, FpgaScanner
from plugvisor.plugins.fpga.options import Family, FpgaOptions, PreStartAction

EVENT_ATTRIBUTES: Final = ("ap1_event", "ap2_event")
"""DFL port attributes that clear their event when ``1`` is written."""
_STDERR_TAIL: Final = 300


def intel_resource_name(device: FpgaDevice, family: Family) -> str | None:
    """The name Intel's plugin (mode ``af``/``region``) or Xilinx's would give ``device``'s resource.

    ``None`` when the IDs it needs are unknown (an AFU never read right, a shell never read).
    """
    if device.flavor == "xilinx":
        if device.shell is None or device.timestamp is None:
            return None
        return naming.xilinx_resource(device.shell, device.timestamp)
    if device.interface_id is None:
        return None
    if family is Family.REGION:
        return naming.intel_region_resource(device.interface_id)
    if device.afu_id is None:
        return None
    return naming.intel_af_resource(device.interface_id, device.afu_id)


@dataclass(frozen=True, slots=True)
class Suggestion:
    """A ``resources`` entry for one Intel- or Xilinx-style resource, and the devices it would serve now."""

    entry: Mapping[str, Any]
    devices: tuple[str, ...]


def suggest_resources(root: Path | str = "/") -> list[Suggestion]:
    """Resource entries for every FPGA under ``root``, named as Intel's and Xilinx's plugins name them.

    One entry per distinct name in each family (``af`` by AFU and interface ID,
    ``region`` by interface ID, ``xilinx`` by shell), ready to paste into a
    configuration's ``resources`` list.
    """
    paths = HostPaths(root=Path(root))
    entries: dict[str, dict[str, Any]] = {}
    served: dict[str, list[str]] = {}
    for family in Family:
        scanner = FpgaScanner(FpgaOptions(family=family), paths)
        functions, _ = scanner.candidates()
        for function in functions:
            devices = (
                [d for d in [scanner.xilinx_device(function)] if d is not None]
                if family is Family.XILINX
                else scanner.dfl_devices(function)
            )
            for device in devices:
                name = intel_resource_name(device, family)
                if name is None:
                    continue
                match: dict[str, list[str]]
                if family is Family.AF:
                    match = {"afuIds": [str(device.afu_id)], "interfaceIds": [str(device.interface_id)]}
                elif family is Family.REGION:
                    match = {"interfaceIds": [str(device.interface_id)]}
                else:
                    match = {"shells": [str(device.shell)]}
                entries.setdefault(
                    name, {"name": name, "kind": "fpga", "family": family.value, "match": match}
                )
                served.setdefault(name, []).append(device.id)
    return [Suggestion(entries[k], tuple(served[k])) for k in sorted(entries)]


FpgaScan = Mapping[str, FpgaDevice]
"""What the hooks need from one scan: each listed device as sysfs described it (by device ID)."""


class FpgaSource:
    """Device source for FPGA ports and cards (the ``fpga`` kind): PreStartContainer and release hooks.

    Stateless between scans and hooks: each hook reads the devices of the
    snapshot it is handed. The framework runs the release watch and calls
    :meth:`released` once per use of a device.
    """

    def __init__(
        self, options: FpgaOptions, paths: HostPaths, *, resource: str, log_as: str | None = None
    ) -> None:
        self.options = options
        self.paths = paths
        self.resource = resource
        self.scanner = FpgaScanner(options, paths)
        self.log_as = log_as or resource
        """The name its log lines give the process (a DRA driver's name; else ``resource``)."""
        self._log = structlog.get_logger("plugvisor.plugins.fpga").bind(resource=self.log_as)
        self._problems = sysfs.ProblemLog(self._log)
        self._telemetry = telemetry.TelemetryLog(self._log)

    # -- discovery -----------------------------------------------------------------

    def scan(self) -> Snapshot[FpgaScan]:
        """Read every selected port or card; one device each, health included."""
        functions, broken = self.scanner.candidates()
        for bdf, why in broken:
            self._problems.report(bdf, str(why), skipped=True)
        found: list[FpgaDevice] = []
        watch = {self.paths.sysfs / sysfs.PCI_DEVICES, self.paths.devfs}
        for function in functions:
            if self.options.family is Family.XILINX:
                device = self.scanner.xilinx_device(function)
                if device is not None and self.scanner.wanted_xilinx(device):
                    found.append(device)
                    watch |= {function.path, function.path / "drm", self.paths.devfs / "dri"}
            else:
                for device in self.scanner.dfl_devices(function):
                    if self.scanner.wanted_dfl(device):
                        found.append(device)
                        watch |= {function.path, function.path / "fpga_region", device.sysfs_path.parent}
                        watch.add(device.sysfs_path)
        found.sort(key=lambda d: d.id)
        devices: list[Device] = []
        for device in found:
            self._problems.report(device.id, "; ".join(device.problems) or None)
            numa = device.function.numa_node
            devices.append(
                Device(
                    device.id,
                    health=Health.UNHEALTHY if device.problems else Health.HEALTHY,
                    numa_nodes=() if numa is None else (numa,),
                    specs=[self._spec(n) for n in device.nodes],
                    envs={self.options.visible_devices_env: device.id},
                )
            )
        self._problems.forget_absent([*(d.id for d in found), *(bdf for bdf, _ in broken)])
        return Snapshot(devices, watch=sorted(watch, key=str), data={d.id: d for d in found})

    def _spec(self, local: Path) -> DeviceSpec:
        return DeviceSpec("/" + str(local.relative_to(self.paths.root)), self.paths.for_kubelet(local))

    def uevent_subsystems(self) -> tuple[str, ...]:
        """Rescan on real nodes when the kernel announces PCI, FPGA region or DFL changes."""
        return ("pci", "fpga_region", "dfl")

    def describe(self, snapshot: Snapshot[FpgaScan]) -> Mapping[str, DeviceDescription]:
        """Monitoring: PCI address, interface and AFU IDs (or shell), health cause, AER, PCIe link, hwmon."""
        known = snapshot.data
        devices = snapshot.devices
        per_function: dict[str, list[Reading]] = {}
        described: dict[str, DeviceDescription] = {}
        for device_id in devices:
            device = known.get(device_id)
            if device is None:
                continue
            bdf = device.function.bdf
            if bdf not in per_function:
                per_function[bdf] = telemetry.pci_readings(bdf, device.function.path, self._telemetry)
            described[device_id] = DeviceDescription(
                kind="fpga",
                pci_address=bdf,
                identity=telemetry.identity(
                    interface_id=device.interface_id or device.shell, afu_id=device.afu_id
                ),
                cause=telemetry.first_problem_text(device.problems),
                cause_code=telemetry.cause_code(device.problems),
                readings=per_function[bdf],
            )
        return described

    def dra_devices(self, snapshot: Snapshot[FpgaScan]) -> Mapping[str, PublishedDevice]:
        """DRA: each port (DFL) or card (Xilinx) with what a bitstream is built for, and its placement.

        Attributes: ``flavor`` (``dfl``, ``xilinx``), ``interfaceId`` (the FPGA
        interface a bitstream targets; a Xilinx card's shell), ``afuId`` (the
        accelerator loaded in a DFL port), the card's ``vendor``,
        ``pciDeviceId``, ``driver`` and ``model``, and the standard
        ``resource.kubernetes.io/pciBusID``, ``pcieRoot`` and ``numaNode``.
        """
        answer: dict[str, PublishedDevice] = {}
        for device_id in snapshot.devices:
            device = snapshot.data.get(device_id)
            if device is None:
                continue
            attributes = function_attributes(device.function, self.paths)
            attributes["flavor"] = device.flavor
            interface = device.interface_id or device.shell
            if interface:
                attributes["interfaceId"] = interface[:64]
            if device.afu_id:
                attributes["afuId"] = device.afu_id[:64]
            answer[device_id] = PublishedDevice(dra_device_name(device_id), attributes)
        return answer

    # -- PreStartContainer -----------------------------------------------------------

    def pre_start_container(self, snapshot: Snapshot[FpgaScan]) -> None:
        """Re-initialise each port before a container starts: the in-tree action, then the command.

        Everything shares one deadline (``preStartTimeout``, at most 25 s of the
        kubelet's 30); any failure fails the container start with a message
        naming the device.
        """
        deadline = time.monotonic() + self.options.pre_start_timeout

        def prepare(device: FpgaDevice) -> str | None:
            if device.flavor == "dfl" and self.options.pre_start_action is PreStartAction.CLEAR_EVENTS:
                problem = clear_port_events(device.sysfs_path)
                if problem is not None:
                    return problem
            command = self.options.pre_start_command
            if command is not None:
                problem = self._run(command, device, deadline - time.monotonic())
                if problem is not None:
                    return f"pre-start command {problem}"
            self._log.info("device_prepared", device=device.id)
            return None

        self._on_each(snapshot, prepare)

    def _on_each(self, snapshot: Snapshot[FpgaScan], act: Callable[[FpgaDevice], str | None]) -> None:
        """Run ``act`` on each device of ``snapshot``; raise naming every device it failed for, and why."""
        failures: list[str] = []
        for device_id in snapshot.devices:
            device = snapshot.data.get(device_id)
            problem = f"not a device of {self.resource}" if device is None else act(device)
            if problem is not None:
                failures.append(f"{device_id}: {problem}")
        if failures:
            raise RuntimeError("; ".join(failures))

    def _run(self, argv: Sequence[str], device: FpgaDevice, timeout: float) -> str | None:
        """Run ``argv`` with ``{device}``, ``{sysfs}``, ``{dev}``, ``{bdf}`` filled in; say what failed."""
        values = {
            "{device}": device.id,
            "{sysfs}": str(device.sysfs_path),
            "{dev}": str(device.nodes[0]) if device.nodes else "",
            "{bdf}": device.function.bdf,
        }
        args = [_fill(a, values) for a in argv]
        if timeout <= 0:
            return "not started: no time left"
        try:
            result = subprocess.run(
                args, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired:
            return f"{args[0]} timed out after {timeout:.1f} s"
        except OSError as error:
            return f"{args[0]} could not start: {error.strerror or error}"
        if result.returncode != 0:
            tail = result.stderr.decode(errors="replace").strip()[-_STDERR_TAIL:]
            return f"{args[0]} exited with {result.returncode}" + (f": {tail}" if tail else "")
        return None

    # -- release cleanup -------------------------------------------------------------

    def release_watch(self) -> ReleaseWatch | None:
        """With ``releaseCleanup``, have the framework watch PodResources for released devices."""
        cleanup = self.options.release_cleanup
        if cleanup is None:
            return None
        socket = None if cleanup.pod_resources_socket is None else Path(cleanup.pod_resources_socket)
        return ReleaseWatch(interval=cleanup.interval, socket=socket)

    def released(self, snapshot: Snapshot[FpgaScan]) -> None:
        """Run the ``releaseCleanup`` command for each device no container holds any more.

        The framework calls this once per use of a device, whether the release
        was seen in PodResources or announced by the proposed Deallocate call.
        """
        cleanup = self.options.release_cleanup
        if cleanup is None:
            self._log.info("release_without_cleanup", devices=list(snapshot.devices))
            return

        def clean(device: FpgaDevice) -> str | None:
            problem = self._run(cleanup.command, device, cleanup.timeout)
            return None if problem is None else f"cleanup command {problem}"

        self._on_each(snapshot, clean)


def _fill(arg: str, values: Mapping[str, str]) -> str:
    for key, value in values.items():
        arg = arg.replace(key, value)
    return arg


def clear_port_events(port: Path) -> str | None:
    """Clear a DFL port's AP1/AP2 events and its error register; return what went wrong, else ``None``.

    Writes ``1`` to ``ap1_event`` and ``ap2_event`` (the kernel clears the event;
    the lab keeps the ``1``, which makes the reset visible) and writes the value
    of ``errors/errors`` back to it when non-zero (the kernel's way to clear port
    errors). Attributes an older kernel lacks are skipped; a missing port is an error.
    """
    if not sysfs.exists(port):
        return f"port {port.name} missing from sysfs"
    writes: list[tuple[Path, str]] = [(port / a, "1\n") for a in EVENT_ATTRIBUTES if sysfs.exists(port / a)]
    errors = sysfs.read_hex(port / "errors" / "errors")
    if isinstance(errors, int) and errors != 0:
        writes.append((port / "errors" / "errors", f"0x{errors:x}\n"))
    for path, value in writes:
        try:
            # As reads (plugins.sysfs.read_bytes): an attribute is never a link, and a FIFO in its
            # place must fail (ENXIO), not block PreStartContainer until someone reads it.
            fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
            try:
                os.write(fd, value.encode())
            finally:
                os.close(fd)
        except OSError as error:
            return f"cannot write {path.name}: {error.strerror or error}"
    return None
