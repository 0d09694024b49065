"""NVML for the gpu kind: identity, health events and telemetry of NVIDIA GPUs, where the driver is there.

Discovery stays in sysfs (:mod:`.discovery`): it works without NVIDIA's
user-space driver, in a container without the library and on a node whose
driver is half-installed. NVML only *adds* to the GPUs sysfs found, matched by
PCI bus ID:

- identity, read once when the plugin starts: product name, brand and
  architecture in the words NVIDIA's DRA driver publishes (go-nvlib's), CUDA
  compute capability, memory total, MIG mode; and, for the node, the driver
  and CUDA driver versions;
- health: one event set for every GPU, registered for XID critical errors,
  double-bit and single-bit ECC errors, waited on by one thread
  (:class:`Nvml`); a GPU whose NVML calls answer ``GPU_IS_LOST`` is lost;
- telemetry: a few NVML calls per GPU at each description (:meth:`Nvml.readings`).

How it is loaded: ``pynvml`` (``nvidia-ml-py``) is one pure-Python file that
opens ``libnvidia-ml.so.1`` with ctypes in ``nvmlInit``. Here the library is
looked for under the configured driver root first (:func:`library_candidates`,
the same places NVIDIA's toolkit looks) and pynvml's handle is set to a
``ctypes.CDLL`` of the path found, before ``nvmlInit``. All of it happens in the
plugin process, in :meth:`Nvml.open` (the kind's lifecycle ``start``): never in
the agent or the fork server, which fork and must not carry a driver
library's threads and file descriptors into their children. This module
imports nothing of pynvml at load time, since the agent imports the kind to
validate its configuration.

Nothing here is fatal. A node without the library, or with one of the wrong
version, or whose ``nvmlInit`` fails, runs on sysfs alone, with one log line
saying why (:class:`Unavailable`). An NVML error for one field of one GPU
(``NOT_SUPPORTED``, a function an old library lacks) leaves that field out
with one log line; ``GPU_IS_LOST`` makes that GPU unhealthy.
"""

# os.path rather than pathlib: candidate paths are joined under a host root that HostPaths resolves.
# ruff: noqa: PTH118

from __future__ import annotations

import ctypes
import functools
import os
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import structlog

from plugvisor.common.hostpaths import HostPaths
from plugvisor.common.monitoring import Reading
from plugvisor.dra.validation import clip_value
from plugvisor.plugins.gpu.driverfiles import library_dirs
from plugvisor.plugins.gpu.options import Nvml as NvmlOptions

LIBRARY: Final = "libnvidia-ml.so.1"
ARCHITECTURES: Final = {
    2: "Kepler",
    3: "Maxwell",
    4: "Pascal",
    5: "Volta",
    6: "Turing",
    7: "Ampere",
    8: "Ada Lovelace",
    9: "Hopper",
    10: "Blackwell",
    11: "Orin",
    0xFFFFFFFF: "Unknown",
}
"""``nvmlDeviceArchitecture_t`` in go-nvlib's words (``GetArchitectureAsString``, NVIDIA's DRA driver)."""

BRANDS: Final = {
    0: "Unknown",
    1: "Quadro",
    2: "Tesla",
    3: "NVS",
    4: "Grid",
    5: "GeForce",
    6: "Titan",
    7: "NvidiaVApps",
    8: "NvidiaVPC",
    9: "NvidiaVCS",
    10: "NvidiaVWS",
    11: "NvidiaCloudGaming",
    12: "QuadroRTX",
    13: "NvidiaRTX",
    14: "Nvidia",
    15: "GeForceRTX",
    16: "TitanRTX",
}
"""``nvmlBrandType_t`` in the words of go-nvlib's ``GetBrandAsString`` (NVIDIA's DRA driver)."""

EVENT_SBE: Final = 0x1
EVENT_DBE: Final = 0x2
EVENT_XID: Final = 0x8
_HEALTH_EVENTS: Final = EVENT_XID | EVENT_DBE | EVENT_SBE

# NVML return codes (nvml.h), as pynvml's NVMLError.value carries them.
ERROR_NOT_SUPPORTED: Final = 3
ERROR_TIMEOUT: Final = 10
ERROR_FUNCTION_NOT_FOUND: Final = 13
ERROR_GPU_IS_LOST: Final = 15

WAIT_MS: Final = 500
"""How long one event wait blocks: the longest a stop waits for the event thread, and the recovery tick."""
RECHECK_SECONDS: Final = 1.0
"""How often the event thread asks a lost GPU again (and looks its handle up again when it was replugged)."""
LOOKUP_SECONDS: Final = 10.0
"""How often a GPU sysfs lists but NVML did not know is looked up by bus ID (plugged in, or found late)."""

_GPU: Final = {"sensor": "gpu"}
_READINGS: Final[tuple[tuple[str, dict[str, str], str, str, tuple[int, ...], int], ...]] = (
    ("plugvisor_device_temperature_celsius", _GPU, "temperature", "nvmlDeviceGetTemperature", (0,), 1),
    ("plugvisor_device_power_watts", _GPU, "power", "nvmlDeviceGetPowerUsage", (), -1000),
    ("plugvisor_device_energy_joules", _GPU, "energy", "nvmlDeviceGetTotalEnergyConsumption", (), -1000),
    ("plugvisor_gpu_sm_clock_hertz", {}, "smClock", "nvmlDeviceGetClockInfo", (1,), 1_000_000),
    ("plugvisor_gpu_pcie_replays", {}, "pcieReplays", "nvmlDeviceGetPcieReplayCounter", (), 1),
    ("plugvisor_gpu_ecc_errors", {"type": "sbe"}, "eccSbe", "nvmlDeviceGetTotalEccErrors", (0, 0), 1),
    ("plugvisor_gpu_ecc_errors", {"type": "dbe"}, "eccDbe", "nvmlDeviceGetTotalEccErrors", (1, 0), 1),
)  # fmt: skip
"""Per-GPU telemetry: family, labels, the field's name in logs, the pynvml function, its arguments after the
handle (``NVML_TEMPERATURE_GPU``, ``NVML_CLOCK_SM``, ``(UNCORRECTED or CORRECTED, NVML_VOLATILE_ECC)``), and
the factor to the family's unit (negative: a divisor, so that 88820 mW is exactly 88.82 W)."""

TAINT_XID: Final = "gpu.plugvisor.io/xid"
TAINT_ECC: Final = "gpu.plugvisor.io/ecc"
TAINT_LOST: Final = "gpu.plugvisor.io/gpu-lost"


def library_candidates(paths: HostPaths, driver_root: str) -> list[Path]:
    """Where ``libnvidia-ml.so.1`` may be under the driver root, in search order, as paths in this process.

    Each directory is resolved inside the host root (a link in the driver
    root that points at ``/usr/lib/...`` means the host's, never this
    container's); the library's own name is kept as written, so that a message
    names where it was looked for (:func:`_load` resolves it). A directory that
    cannot be resolved (a link loop) is skipped and the search goes on, as
    :class:`~plugvisor.plugins.gpu.driverfiles.DriverLocator` skips it too.
    """
    found: list[Path] = []
    for directory in library_dirs():
        try:
            candidate = paths.host(os.path.join(driver_root, directory)) / LIBRARY
        except OSError:
            continue
        if candidate not in found:
            found.append(candidate)
    return found


def nvml_bus_id(bdf: str) -> str:
    """A sysfs PCI address as NVML writes bus IDs: ``0000:3b:00.0`` -> ``00000000:3B:00.0``."""
    domain, _, rest = bdf.partition(":")
    return f"{int(domain, 16):08X}:{rest.upper()}" if rest else bdf.upper()


def normalized_bus_id(bus_id: str) -> str:
    """NVML's ``00000000:3B:00.0`` as sysfs names it: ``0000:3b:00.0`` (a 16-bit domain, lower case)."""
    domain, sep, rest = bus_id.strip().lower().partition(":")
    if not sep:
        return bus_id.strip().lower()
    try:
        return f"{int(domain, 16):04x}:{rest}"
    except ValueError:
        return bus_id.strip().lower()


class Unavailable(Exception):  # noqa: N818 - a state with a reason, not an error of the caller
    """NVML cannot be used on this node; the text says why (not found, wrong version, init error).

    ``absent`` is True when there is simply no NVML (no library, no pynvml): a
    node without NVIDIA's driver, said at info. False when a library is there
    and fails (not a library, the wrong version, ``nvmlInit`` failing): a
    broken driver install someone should look at, said as a warning.
    """

    def __init__(self, reason: str, *, absent: bool = False) -> None:
        super().__init__(reason)
        self.absent = absent


@dataclass(frozen=True, slots=True)
class Identity:
    """What NVML tells of one GPU that sysfs cannot (each field None where NVML would not say)."""

    product_name: str | None = None
    brand: str | None = None
    architecture: str | None = None
    compute_capability: str | None = None
    """``major.minor`` (``9.0``), as NVIDIA's DRA driver words it before it becomes a version."""
    memory_bytes: int | None = None
    mig_enabled: bool | None = None


@dataclass(frozen=True, slots=True)
class System:
    """The node's driver as NVML reports it."""

    driver_version: str | None = None
    """``580.159.04``: NVML's own words (the DRA attribute makes a version of it)."""
    cuda_driver_version: str | None = None
    """``13.0``: the CUDA version the driver supports, from NVML's 13000."""


@dataclass(frozen=True, slots=True)
class GpuView:
    """One GPU's NVML side in a scan: identity, and the health problems and taints of the moment."""

    identity: Identity
    problems: tuple[str, ...] = ()
    taints: tuple[tuple[str, str], ...] = ()
    """``(key, value)`` of each DRA device taint the GPU should carry (NoSchedule)."""


@dataclass(slots=True)
class _Health:
    """What the event thread learned of one GPU."""

    last_xid: int = 0
    """The last XID NVML reported for the GPU, critical or not (dcgm-exporter's ``XID_ERRORS``)."""
    critical_xid: int = 0
    critical_at: float | None = None
    """When the last event that makes the GPU unhealthy arrived (monotonic), None while it is healthy."""
    dbe: bool = False
    lost: bool = False
    events: int = 0


@dataclass(slots=True)
class _Gpu:
    bus_id: str
    handle: Any
    identity: Identity
    health: _Health = field(default_factory=_Health)
    absent: bool = False
    """Not in the latest scan's sysfs (unplugged): what NVML says of it then belongs to the GPU that left."""
    stale: bool = False
    """Came back, but NVML had no new handle for it yet: the event thread keeps asking for one."""


def _text(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class Nvml:
    """NVML opened in this process: the GPUs it knows by PCI bus ID, their health, their telemetry.

    ``api`` is the pynvml module (or, in unit tests, an object with the same
    functions raising pynvml's ``NVMLError``): this class is the one place
    that talks to it. Thread-safe: the scan, the monitor and the event thread
    share it under one lock; NVML itself is thread-safe.
    """

    def __init__(
        self,
        api: Any,
        options: NvmlOptions,
        *,
        resource: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._api = api
        self.options = options
        self._clock = clock
        self._log = structlog.get_logger("plugvisor.plugins.gpu.nvml").bind(resource=resource)
        self._lock = threading.Lock()
        self._gpus: dict[str, _Gpu] = {}
        self._by_handle: dict[int | None, str] = {}
        self._logged: set[tuple[str, ...]] = set()
        self._failing: dict[tuple[str, str], str] = {}
        """Each (GPU, field) failing now, with its error: said when it starts or changes."""
        self._event_set: Any = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._changed: Callable[[], None] = lambda: None
        self._watch_later = False
        self._looked_up: dict[str, float] = {}
        self.system = System()

    # -- opening ---------------------------------------------------------------------

    @classmethod
    def open(cls, paths: HostPaths, driver_root: str, options: NvmlOptions, *, resource: str = "") -> Nvml:
        """Load NVML from the driver root (or the loader's path on a plain host), init it, read the GPUs.

        Raises :class:`Unavailable` with the reason when it cannot be used.
        """
        try:
            import pynvml  # noqa: PLC0415 - only in the plugin process, only when NVML is wanted
        except ImportError as exc:
            raise Unavailable(f"nvidia-ml-py (pynvml) is not installed: {exc}", absent=True) from None
        library = _load(pynvml, paths, driver_root)
        nvml = cls(pynvml, options, resource=resource)
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            if exc.value == ERROR_FUNCTION_NOT_FOUND:
                raise Unavailable(f"{library} is the wrong version: it has no nvmlInitWithFlags") from None
            raise Unavailable(f"{library}: nvmlInit failed: {exc}") from None
        except Exception as exc:  # a library that is no NVML can fail any way (a crash aside)
            raise Unavailable(f"{library}: nvmlInit failed: {type(exc).__name__}: {exc}") from None
        try:
            nvml.enumerate()
        except Unavailable as exc:
            _shutdown(pynvml, nvml._log)
            raise Unavailable(f"{library}: {exc}") from None
        nvml._log.info(
            "nvml_opened",
            library=library,
            gpus=len(nvml._gpus),
            driver_version=nvml.system.driver_version,
            cuda_driver_version=nvml.system.cuda_driver_version,
        )
        return nvml

    def enumerate(self) -> None:
        """Read the node's driver versions and every GPU's handle and identity (once, at start)."""
        api = self._api
        try:
            count = int(api.nvmlDeviceGetCount())
        except api.NVMLError as exc:
            if exc.value == ERROR_FUNCTION_NOT_FOUND:
                raise Unavailable("the wrong version: it has no nvmlDeviceGetCount_v2") from None
            raise Unavailable(f"nvmlDeviceGetCount failed: {exc}") from None
        self.system = System(
            driver_version=self._system_field("driverVersion", api.nvmlSystemGetDriverVersion),
            cuda_driver_version=_cuda_version(
                self._system_field("cudaDriverVersion", api.nvmlSystemGetCudaDriverVersion_v2)
            ),
        )
        for index in range(count):
            try:
                handle = api.nvmlDeviceGetHandleByIndex(index)
                bus_id = normalized_bus_id(_text(api.nvmlDeviceGetPciInfo_v3(handle).busId))
            except api.NVMLError as exc:
                self._once(("gpu", str(index)), "nvml_gpu_skipped", index=index, error=str(exc))
                continue
            self._gpus[bus_id] = _Gpu(bus_id, handle, self._identity(bus_id, handle))
            self._by_handle[_address(handle)] = bus_id

    def _system_field(self, name: str, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except self._api.NVMLError as exc:
            self._once(("system", name), "nvml_field_absent", field=name, error=str(exc))
            return None

    def _identity(self, bus_id: str, handle: Any) -> Identity:
        api = self._api
        name = self._field(bus_id, "productName", lambda: _text(api.nvmlDeviceGetName(handle)))
        brand = self._field(bus_id, "brand", lambda: api.nvmlDeviceGetBrand(handle))
        arch = self._field(bus_id, "architecture", lambda: api.nvmlDeviceGetArchitecture(handle))
        capability = self._field(
            bus_id, "cudaComputeCapability", lambda: api.nvmlDeviceGetCudaComputeCapability(handle)
        )
        memory = self._field(bus_id, "memory", lambda: api.nvmlDeviceGetMemoryInfo(handle).total)
        mig = self._field(bus_id, "migMode", lambda: api.nvmlDeviceGetMigMode(handle))
        return Identity(
            product_name=clip_value(name) if name else None,
            brand=None if brand is None else BRANDS.get(int(brand)),
            architecture=None if arch is None else ARCHITECTURES.get(int(arch)),
            compute_capability=None if capability is None else f"{int(capability[0])}.{int(capability[1])}",
            memory_bytes=int(memory) if memory else None,
            mig_enabled=None if mig is None else int(mig[0]) == 1,
        )

    def _field(self, bus_id: str, name: str, call: Callable[[], Any]) -> Any:
        """One NVML answer for one GPU, or None with one log line (per GPU and field) saying why.

        Besides NVML's own errors, anything pynvml raises (its ``NVMLLibraryMismatchError``, a ctypes
        error from a library whose signature differs) leaves the field out the same way: a scan or a
        scrape never fails for one field.
        """
        try:
            value = call()
        except self._api.NVMLError as exc:
            code = exc.value
            if code == ERROR_GPU_IS_LOST:
                self._mark_lost(bus_id)
            elif code == ERROR_FUNCTION_NOT_FOUND:  # an older library: the same for every GPU
                self._once(("absent", name), "nvml_field_absent", field=name, error=str(exc), gpus="all")
                return None
            self._field_failed(bus_id, name, str(exc))
            return None
        except Exception as exc:
            self._field_failed(bus_id, name, f"{type(exc).__name__}: {exc}")
            return None
        with self._lock:
            failed = self._failing.pop((bus_id, name), None)
        if failed is not None:
            self._log.info("nvml_field_back", gpu=bus_id, field=name, was=failed)
        return value

    def _field_failed(self, bus_id: str, name: str, error: str) -> None:
        """Say a field's failure when it starts or its cause changes.

        One line per cause, again after the field answered in between, never at every scrape.
        """
        with self._lock:
            before = self._failing.get((bus_id, name))
            self._failing[(bus_id, name)] = error
        if before != error:
            self._log.warning("nvml_field_absent", gpu=bus_id, field=name, error=error)

    def _once(self, key: tuple[str, ...], event: str, **values: Any) -> None:
        with self._lock:
            if key in self._logged:
                return
            self._logged.add(key)
        self._log.warning(event, **values)

    # -- what a scan asks ------------------------------------------------------------

    def track(self, present: Collection[str], nvidia: Collection[str] | None = None) -> None:
        """Note which GPUs sysfs lists now: one that comes back after it was gone is a new GPU to NVML.

        Its health starts over (an XID the leaving GPU raised is not the
        returning one's), its handle is looked up again and registered for
        events again, as the driver gives a re-probed GPU a new one. A GPU of
        ``nvidia`` (default: all of ``present``) that NVML did not know (lost
        when the plugin started, plugged in since) is looked up by bus ID, at
        most every :data:`LOOKUP_SECONDS`, and known from then on.
        """
        with self._lock:
            known = list(self._gpus.items())
        for bus_id, gpu in known:
            if bus_id not in present:
                gpu.absent = True
            elif gpu.absent:
                self._returned(gpu)
        now = self._clock()
        for bus_id in sorted(set(present if nvidia is None else nvidia) - self._gpus.keys()):
            last = self._looked_up.get(bus_id)
            if last is None or now - last >= LOOKUP_SECONDS:
                self._looked_up[bus_id] = now
                self._adopt(bus_id)

    def _adopt(self, bus_id: str) -> None:
        """Know a GPU NVML did not list at start, if it has a handle for its bus ID now."""
        try:
            handle = self._api.nvmlDeviceGetHandleByPciBusId(nvml_bus_id(bus_id).encode())
        except Exception as exc:  # not (yet) NVML's: asked again later
            self._once(
                ("adopt", bus_id), "nvml_gpu_unknown", gpu=bus_id, error=f"{type(exc).__name__}: {exc}"
            )
            return
        gpu = _Gpu(bus_id, handle, self._identity(bus_id, handle))
        with self._lock:
            self._gpus[bus_id] = gpu
            self._by_handle[_address(handle)] = bus_id
            self._looked_up.pop(bus_id, None)
            self._logged.discard(("adopt", bus_id))
        self._log.info("nvml_gpu_found", gpu=bus_id, effect="identity, health and telemetry from NVML")
        if self._event_set is not None:
            self._register(gpu)
        elif self._watch_later:
            self.watch_events(self._changed)

    def _returned(self, gpu: _Gpu) -> None:
        with self._lock:
            gpu.absent = False
            gpu.health = _Health()
        error = self._new_handle(gpu)
        if error is not None:  # the old handle is kept, and the event thread asks for a new one
            gpu.stale = True
            self._log.warning("nvml_gpu_back", gpu=gpu.bus_id, handle="kept", error=error)
            return
        self._log.info("nvml_gpu_back", gpu=gpu.bus_id, health="starts over")

    def _new_handle(self, gpu: _Gpu) -> str | None:
        """Look the GPU's handle up by bus ID again (registering a new one for events); the error, or None."""
        try:
            handle = self._api.nvmlDeviceGetHandleByPciBusId(nvml_bus_id(gpu.bus_id).encode())
        except Exception as exc:  # NVML's errors and pynvml's
            return f"{type(exc).__name__}: {exc}"
        gpu.stale = False
        if _address(handle) == _address(gpu.handle):
            return None
        with self._lock:
            self._by_handle.pop(_address(gpu.handle), None)
            gpu.handle = handle
            self._by_handle[_address(handle)] = gpu.bus_id
        if self._event_set is not None:
            self._register(gpu)
        return None

    def _recheck(self) -> bool:
        """Ask each lost GPU again, with a handle looked up anew; returns whether one answers again."""
        with self._lock:
            waiting = [g for g in self._gpus.values() if not g.absent and (g.health.lost or g.stale)]
        answered = False
        for gpu in waiting:
            self._new_handle(gpu)  # none yet: the handle it has is asked
            self._probe(gpu)
            answered |= not gpu.health.lost
        return answered

    @property
    def bus_ids(self) -> list[str]:
        """The GPUs NVML knows, by PCI address as sysfs writes it."""
        return sorted(self._gpus)

    def view(self, bus_id: str) -> GpuView | None:
        """The GPU's identity and health now (None for a GPU NVML does not know)."""
        gpu = self._gpus.get(bus_id)
        if gpu is None:
            return None
        if self.options.health:
            self._probe(gpu)
        with self._lock:
            problems, taints = self._problems(gpu.health)
        return GpuView(gpu.identity, problems, taints)

    def _probe(self, gpu: _Gpu) -> None:
        """Ask NVML something of the GPU: ``GPU_IS_LOST`` marks it lost, an answer makes a lost one found."""
        try:
            self._api.nvmlDeviceGetTemperature(gpu.handle, 0)
        except self._api.NVMLError as exc:
            if exc.value == ERROR_GPU_IS_LOST:
                self._mark_lost(gpu.bus_id)
            return
        except Exception:  # not an answer about the GPU: nothing learned
            return
        with self._lock:
            found, gpu.health.lost = gpu.health.lost, False
        if found:
            self._log.info("nvml_gpu_answers_again", gpu=gpu.bus_id)

    def _problems(self, health: _Health) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
        """The health problems and taints of one GPU now, expiring events past the quiet period."""
        if not self.options.health:
            return (), ()
        if health.lost:
            return ("GPU lost (NVML GPU_IS_LOST)",), ((TAINT_LOST, ""),)
        if health.critical_at is None:
            return (), ()
        quiet = self.options.recover_after_seconds
        if quiet and self._clock() - health.critical_at >= quiet:
            health.critical_at, health.critical_xid, health.dbe = None, 0, False
            return (), ()
        problems: list[str] = []
        taints: list[tuple[str, str]] = []
        if health.critical_xid:
            problems.append(f"xid {health.critical_xid} (NVML XID critical error)")
            taints.append((TAINT_XID, str(health.critical_xid)))
        if health.dbe:
            problems.append("double-bit ECC error (NVML)")
            taints.append((TAINT_ECC, "dbe"))
        return tuple(problems), tuple(taints)

    def _mark_lost(self, bus_id: str) -> None:
        gpu = self._gpus.get(bus_id)
        if gpu is None:
            return
        with self._lock:
            if gpu.health.lost:
                return
            gpu.health.lost = True
        self._log.error("nvml_gpu_lost", gpu=bus_id, effect="unhealthy until NVML answers for it again")
        self._changed()

    # -- telemetry -------------------------------------------------------------------

    def readings(self, bus_id: str) -> list[Reading]:
        """dcgm-exporter's default counters for one GPU, as readings (a field NVML refuses is left out)."""
        gpu = self._gpus.get(bus_id)
        if gpu is None:
            return []
        readings = [Reading("plugvisor_gpu_last_xid", float(gpu.health.last_xid))]
        if gpu.health.lost:
            return readings
        api, handle = self._api, gpu.handle
        for family, labels, name, function, arguments, scale in _READINGS:
            value = self._field(bus_id, name, functools.partial(getattr(api, function), handle, *arguments))
            if value is not None:
                number = float(value) / -scale if scale < 0 else float(value) * scale
                readings.append(Reading(family, number, labels))
        utilization = self._field(bus_id, "utilization", lambda: api.nvmlDeviceGetUtilizationRates(handle))
        if utilization is not None:
            readings.append(Reading("plugvisor_gpu_utilization_ratio", utilization.gpu / 100.0))
            readings.append(
                Reading("plugvisor_gpu_memory_copy_utilization_ratio", utilization.memory / 100.0)
            )
        memory = self._field(bus_id, "memoryUsed", lambda: api.nvmlDeviceGetMemoryInfo(handle))
        if memory is not None:
            readings.append(Reading("plugvisor_gpu_memory_used_bytes", float(memory.used)))
            readings.append(Reading("plugvisor_gpu_memory_total_bytes", float(memory.total)))
        return readings

    # -- health events ---------------------------------------------------------------

    def watch_events(self, changed: Callable[[], None]) -> bool:
        """Register every GPU for health events and start the thread that waits on them.

        ``changed`` is called (from that thread) when a GPU's health changed, to
        have the device set scanned again. Returns whether events are watched:
        not when health checks are off or the library cannot make an event set
        (then one line says why, and health stays sysfs's).
        """
        self._changed = changed
        if not self.options.health:
            return False
        if not self._gpus:
            self._watch_later = True  # started once NVML knows a GPU (:meth:`track`)
            return False
        self._watch_later = False
        api = self._api
        try:
            self._event_set = api.nvmlEventSetCreate()
        except api.NVMLError as exc:
            self._once(("events",), "nvml_events_unavailable", error=str(exc), effect="no NVML health")
            return False
        for gpu in self._gpus.values():
            self._register(gpu)
        self._thread = threading.Thread(target=self._wait_loop, name="nvml-events", daemon=True)
        self._thread.start()
        return True

    def _register(self, gpu: _Gpu) -> None:
        """Register one GPU for the health events it supports (all three when it cannot say)."""
        api = self._api
        try:
            supported = int(api.nvmlDeviceGetSupportedEventTypes(gpu.handle)) & _HEALTH_EVENTS
            api.nvmlDeviceRegisterEvents(gpu.handle, supported or _HEALTH_EVENTS, self._event_set)
        except api.NVMLError as exc:
            if exc.value == ERROR_GPU_IS_LOST:
                self._mark_lost(gpu.bus_id)
            self._once(("register", gpu.bus_id), "nvml_events_not_registered", gpu=gpu.bus_id, error=str(exc))

    def _wait_loop(self) -> None:
        api = self._api
        failures = 0
        recheck_at = self._clock()
        while not self._stop.is_set():
            try:
                data = api.nvmlEventSetWait_v2(self._event_set, WAIT_MS)
            except api.NVMLError as exc:
                if exc.value != ERROR_TIMEOUT:
                    failures += 1
                    self._once(("wait", str(exc.value)), "nvml_event_wait_failed", error=str(exc))
                    self._stop.wait(min(5.0, 0.1 * failures))
            except Exception as exc:  # a library bug must not end health watching silently
                self._once(("wait-bug",), "nvml_event_wait_failed", error=f"{type(exc).__name__}: {exc}")
                self._stop.wait(1.0)
            else:
                failures = 0
                if self.event(_address(data.device), int(data.eventType), int(data.eventData)):
                    self._changed()
            if self._expired():
                self._changed()
            if self._clock() >= recheck_at:
                recheck_at = self._clock() + RECHECK_SECONDS
                if self._recheck():
                    self._changed()

    def event(self, handle_address: int | None, event_type: int, data: int) -> bool:
        """Take one NVML event; returns whether it changed the GPU's health (a rescan is then due)."""
        bus_id = self._by_handle.get(handle_address)
        gpu = self._gpus.get(bus_id) if bus_id is not None else None
        if gpu is None:
            self._once(("unknown-handle",), "nvml_event_for_unknown_gpu", event_type=event_type, data=data)
            return False
        health = gpu.health
        now = self._clock()
        with self._lock:
            health.events += 1
            was_healthy = health.critical_at is None
            before = (health.critical_xid, health.dbe)
            if event_type & EVENT_XID:
                health.last_xid = data
                if not self.options.xid_is_critical(data):
                    said = ("xid-ignored", gpu.bus_id, str(data))  # once per GPU and XID: a fault repeats it
                    if said not in self._logged:
                        self._logged.add(said)
                        self._log.info("nvml_xid_ignored", gpu=bus_id, xid=data, effect="said once")
                    return False
                health.critical_xid = data
            elif event_type & EVENT_DBE:
                health.dbe = True
            else:
                return False  # single-bit ECC: counted by NVML, read as telemetry
            health.critical_at = now
        if was_healthy:
            self._log.error(
                "nvml_gpu_unhealthy",
                gpu=bus_id,
                xid=health.critical_xid or None,
                double_bit_ecc=health.dbe,
                recover_after_seconds=self.options.recover_after_seconds or "never",
            )
        return was_healthy or before != (health.critical_xid, health.dbe)

    def _expired(self) -> bool:
        """Whether a GPU's quiet period just ended (its events expire here): a rescan then sees it healthy."""
        quiet = self.options.recover_after_seconds
        if not quiet:
            return False
        now = self._clock()
        expired: list[str] = []
        with self._lock:
            for gpu in self._gpus.values():
                health = gpu.health
                if health.critical_at is not None and now - health.critical_at >= quiet:
                    health.critical_at, health.critical_xid, health.dbe = None, 0, False
                    expired.append(gpu.bus_id)
        for bus_id in expired:
            self._log.info("nvml_gpu_quiet", gpu=bus_id, quiet_seconds=quiet, effect="healthy again")
        return bool(expired)

    # -- closing ---------------------------------------------------------------------

    def close(self) -> None:
        """Stop the event thread, free the event set, shut NVML down (errors logged, never raised)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * WAIT_MS / 1000)
        api = self._api
        if self._event_set is not None and (self._thread is None or not self._thread.is_alive()):
            try:
                api.nvmlEventSetFree(self._event_set)
            except api.NVMLError as exc:
                self._log.warning("nvml_close_failed", step="nvmlEventSetFree", error=str(exc))
        _shutdown(api, self._log)


def _address(handle: Any) -> int | None:
    """A device handle's pointer value: what ties an event's ``device`` to the GPU it was registered for."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return id(handle)  # a test double's handle


def _cuda_version(value: object) -> str | None:
    """NVML's ``13000`` as ``13.0`` (NVIDIA's DRA driver: major = v/1000, minor = v%1000/10)."""
    if not isinstance(value, int) or value <= 0:
        return None
    return f"{value // 1000}.{value % 1000 // 10}"


def _shutdown(api: Any, log: Any) -> None:
    """``nvmlShutdown``; a failure is said through ``log``, bound to the process's name as every NVML line."""
    try:
        api.nvmlShutdown()
    except api.NVMLError as exc:
        log.warning("nvml_close_failed", step="nvmlShutdown", error=str(exc))


_loaded: dict[str, str] = {}
"""The path pynvml's handle was set to in this process, under ``"path"``."""


def _load(pynvml: Any, paths: HostPaths, driver_root: str) -> str:
    """Point pynvml at the driver root's ``libnvidia-ml.so.1`` (CDLL of the path); returns what was loaded.

    With both roots ``/`` and nothing found in the list, the dynamic loader's
    own search (``ld.so.cache``, ``LD_LIBRARY_PATH``) is tried, as pynvml would.
    """
    candidates = library_candidates(paths, driver_root)
    tried: list[str] = []
    library: ctypes.CDLL | None = None
    where = ""
    for candidate in candidates:
        if not os.path.lexists(candidate):
            continue
        try:
            target = paths.inside(candidate)
        except OSError as exc:
            tried.append(f"{candidate}: cannot resolve it: {exc.strerror or exc}")
            continue
        if not target.exists():
            tried.append(f"{candidate}: a dangling link (to {target})")
            continue
        try:
            library = ctypes.CDLL(str(target))
        except OSError as exc:
            tried.append(f"{candidate}: {exc}")
            continue
        where = str(target)
        break
    if library is None and str(paths.root) == "/" and os.path.normpath(driver_root) == "/":
        try:
            library = ctypes.CDLL(LIBRARY)
            where = f"{LIBRARY} (the loader's search path)"
        except OSError as exc:
            tried.append(f"{LIBRARY} from the loader's search path: {exc}")
    if library is None:
        if tried:
            raise Unavailable(f"{LIBRARY} cannot be loaded: {'; '.join(tried)}")
        shown = ", ".join(str(c) for c in candidates)
        raise Unavailable(
            f"{LIBRARY} not found under driverRoot {driver_root} (looked in {shown})", absent=True
        )
    with pynvml.libLoadLock:
        if pynvml.nvmlLib is not None and _loaded.get("path") != where:
            if pynvml._nvmlLib_refcount > 0:
                raise Unavailable(f"another NVML library ({_loaded.get('path')}) is in use in this process")
            pynvml._nvmlGetFunctionPointer_cache.clear()
        pynvml.nvmlLib = library
        _loaded["path"] = where
    return where
