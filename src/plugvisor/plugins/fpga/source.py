"""The ``fpga`` device source and its hooks: IDs, health, Allocate contents, PreStart, release cleanup."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

import pydantic
import structlog

from plugvisor.common.hostpaths import HostPaths
from plugvisor.deviceplugin.devices import Device, DeviceSet, DeviceSpec, Health
from plugvisor.plugins import sysfs
from plugvisor.plugins.fpga import naming
from plugvisor.plugins.fpga.discovery import FpgaDevice, FpgaScanner
from plugvisor.plugins.fpga.options import FpgaOptions, Mode, PreStartAction
from plugvisor.plugins.fpga.release import ReleaseWatcher, default_socket

EVENT_ATTRIBUTES: Final = ("ap1_event", "ap2_event")
"""DFL port attributes that clear their event when ``1`` is written."""
_STDERR_TAIL: Final = 300


def intel_resource_name(device: FpgaDevice, mode: Mode) -> str | None:
    """The name Intel's plugin (mode ``af``/``region``) or Xilinx's would give ``device``'s resource.

    ``None`` when the IDs it needs are unknown (an AFU never read right, a shell never read).
    """
    if device.flavor == "xilinx":
        if device.shell is None or device.timestamp is None:
            return None
        return naming.xilinx_resource(device.shell, device.timestamp)
    if device.interface_id is None:
        return None
    if mode is Mode.REGION:
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

    One entry per distinct name in each mode (``af`` by AFU and interface ID,
    ``region`` by interface ID, ``xilinx`` by shell), ready to paste into a
    configuration's ``resources`` list.
    """
    paths = HostPaths(root=Path(root))
    entries: dict[str, dict[str, Any]] = {}
    served: dict[str, list[str]] = {}
    for mode in Mode:
        scanner = FpgaScanner(FpgaOptions(mode=mode), paths)
        functions, _ = scanner.candidates()
        for function in functions:
            devices = (
                [d for d in [scanner.xilinx_device(function)] if d is not None]
                if mode is Mode.XILINX
                else scanner.dfl_devices(function)
            )
            for device in devices:
                name = intel_resource_name(device, mode)
                if name is None:
                    continue
                match: dict[str, list[str]]
                if mode is Mode.AF:
                    match = {"afuIds": [str(device.afu_id)], "interfaceIds": [str(device.interface_id)]}
                elif mode is Mode.REGION:
                    match = {"interfaceIds": [str(device.interface_id)]}
                else:
                    match = {"shells": [str(device.shell)]}
                entries.setdefault(name, {"name": name, "kind": "fpga", "mode": mode.value, "match": match})
                served.setdefault(name, []).append(device.id)
    return [Suggestion(entries[k], tuple(served[k])) for k in sorted(entries)]


class FpgaSource:
    """Device source for FPGA ports and cards (the ``fpga`` kind), with a PreStartContainer hook."""

    def __init__(self, options: FpgaOptions, paths: HostPaths, *, resource: str) -> None:
        self.options = options
        self.paths = paths
        self.resource = resource
        self.scanner = FpgaScanner(options, paths)
        self._log = structlog.get_logger("plugvisor.plugins.fpga").bind(resource=resource)
        self._problems = sysfs.ProblemLog(self._log)
        self._watch: tuple[Path, ...] = ()
        self._known: Mapping[str, FpgaDevice] = {}
        self._lock = threading.Lock()
        self.release_watcher: ReleaseWatcher | None = None
        self._cleaned: set[str] = set()
        self._cleaned_lock = threading.Lock()
        cleanup = options.release_cleanup
        if cleanup is not None:
            socket = (
                Path(cleanup.pod_resources_socket)
                if cleanup.pod_resources_socket is not None
                else default_socket(paths.kubelet_dir)
            )
            self.release_watcher = ReleaseWatcher(
                socket=socket, resource=resource, interval=cleanup.interval, on_release=self.release_cleanup
            )

    # -- discovery -----------------------------------------------------------------

    def scan(self) -> DeviceSet:
        """Read every selected port or card; one device each, health included.

        The first scan also starts the release watcher when ``releaseCleanup`` is set.
        """
        if self.release_watcher is not None:
            self.release_watcher.start()
        functions, broken = self.scanner.candidates()
        for bdf, why in broken:
            self._problems.report(bdf, str(why), skipped=True)
        found: list[FpgaDevice] = []
        watch = {self.paths.sysfs / sysfs.PCI_DEVICES, self.paths.devfs}
        for function in functions:
            if self.options.mode is Mode.XILINX:
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
        with self._lock:
            self._known = {d.id: d for d in found}
            self._watch = tuple(sorted(watch, key=str))
        return DeviceSet(devices)

    def _spec(self, local: Path) -> DeviceSpec:
        return DeviceSpec("/" + str(local.relative_to(self.paths.root)), self.paths.for_kubelet(local))

    def uevent_subsystems(self) -> tuple[str, ...]:
        """Rescan on real nodes when the kernel announces PCI, FPGA region or DFL changes."""
        return ("pci", "fpga_region", "dfl")

    def watch_paths(self) -> Sequence[Path]:
        """The bus directory, each card's function, region and port directories, devfs."""
        with self._lock:
            return self._watch or (self.paths.sysfs / sysfs.PCI_DEVICES,)

    def device(self, device_id: str) -> FpgaDevice | None:
        """The device of that ID as the latest scan read it."""
        with self._lock:
            return self._known.get(device_id)

    # -- PreStartContainer -----------------------------------------------------------

    def pre_start_container(self, devices: DeviceSet) -> None:
        """Re-initialise each port before a container starts: the in-tree action, then the command.

        Everything shares one deadline (``preStartTimeout``, at most 25 s of the
        kubelet's 30); any failure fails the container start with a message
        naming the device.
        """
        deadline = time.monotonic() + self.options.pre_start_timeout
        failures: list[str] = []
        with self._cleaned_lock:
            self._cleaned.difference_update(devices)  # in use again: the next release cleans it
        for device_id in devices:
            device = self.device(device_id)
            if device is None:
                failures.append(f"{device_id}: not a device of {self.resource}")
                continue
            if device.flavor == "dfl" and self.options.pre_start_action is PreStartAction.CLEAR_EVENTS:
                problem = clear_port_events(device.sysfs_path)
                if problem is not None:
                    failures.append(f"{device_id}: {problem}")
                    continue
            if self.options.pre_start_command is not None:
                problem = self._run(self.options.pre_start_command, device, deadline - time.monotonic())
                if problem is not None:
                    failures.append(f"{device_id}: pre-start command {problem}")
                    continue
            self._log.info("device_prepared", device=device_id)
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

    def release_cleanup(self, device_id: str) -> None:
        """Run the ``releaseCleanup`` command for a device no container holds any more.

        Release can be noticed twice (the PodResources watch and, where a kubelet
        makes it, the proposed Deallocate call); a device is cleaned once per use,
        and its next container start (PreStart) makes it eligible again.
        """
        cleanup = self.options.release_cleanup
        device = self.device(device_id)
        if cleanup is None or device is None:
            self._log.warning("release_cleanup_skipped", device=device_id, reason="device not listed now")
            return
        with self._cleaned_lock:
            if device_id in self._cleaned:
                return
            self._cleaned.add(device_id)
        problem = self._run(cleanup.command, device, cleanup.timeout)
        if problem is not None:
            with self._cleaned_lock:
                self._cleaned.discard(device_id)
            raise RuntimeError(f"cleanup command {problem}")
        self._log.info("release_cleanup_done", device=device_id)

    def deallocate(self, devices: DeviceSet) -> None:
        """The proposed Deallocate call (emulated kubelet, behind a gate): clean the devices at once."""
        if self.options.release_cleanup is None:
            self._log.info("deallocate_without_cleanup", devices=list(devices))
            return
        for device_id in devices:
            self.release_cleanup(device_id)

    def close(self) -> None:
        """Stop the release watcher, if one runs."""
        if self.release_watcher is not None:
            self.release_watcher.stop()


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
            fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
            try:
                os.write(fd, value.encode())
            finally:
                os.close(fd)
        except OSError as error:
            return f"cannot write {path.name}: {error.strerror or error}"
    return None


class FpgaKind:
    """The ``fpga`` kind object registered under the ``plugvisor.plugins`` entry point."""

    name: Literal["fpga"] = "fpga"
    options_model: type[pydantic.BaseModel] = FpgaOptions

    def build(self, options: Any, paths: HostPaths, *, resource: str) -> FpgaSource:
        """Create the source; ``options`` is a validated :class:`FpgaOptions`."""
        if not isinstance(options, FpgaOptions):
            options = FpgaOptions.model_validate(options)
        return FpgaSource(options, paths, resource=resource)
