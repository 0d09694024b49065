"""NVIDIA's user-space side of a lab node: the driver's files and an NVML that answers from the lab.

A real NVIDIA node has, besides ``/dev`` and ``/proc``, the driver's libraries and tools under a
driver root, and plugins learn most of what they know through ``libnvidia-ml.so.1`` (NVML). The
lab writes the same: under ``<lab>/<driverRoot>/lib64`` (or the distribution's
``usr/lib/<triplet>`` when the driver root is ``/``) the libraries a CUDA container gets mounted,
each ``.so.<version>`` with its ``.so.1`` link, and ``bin/`` (``usr/bin``) with the tools.
``libnvidia-ml`` is real: the NVML stand-in (``nvml_standin.c``), compiled with the machine's
``cc`` once per source version and cached (``$XDG_CACHE_HOME/plugvisor/nvml/``), so pynvml loads
it through ctypes exactly as it loads the real one. The other libraries are small markers:
they are mounted into containers, never loaded. Without a C compiler no library is written and
:func:`install` says so once.

The stand-in reads the lab's state from plain ``key=value`` files under
``<lab>/.plugvisor-lab/nvml/`` (never exposed as sysfs): ``system`` and ``gpu<index>``, replaced
atomically by :func:`write_state` whenever the lab changes. Faults that NVML reports carry their
injection time, from which the stand-in raises the events and counts the errors; the
bookkeeping that keeps NVML's counters monotonic across changes is :func:`account`.
"""

# Paths here are root-relative POSIX strings shared with the tree writer (see tree.py).
# ruff: noqa: PTH103, PTH105, PTH111, PTH113, PTH118, PTH123

from __future__ import annotations

import atexit
import hashlib
import importlib.resources
import logging
import os
import shutil
import subprocess
import sysconfig
import tempfile
import time
from typing import Final

from plugvisor.common.hostpaths import multiarch_triplet
from plugvisor.emulators.lab import catalog, gpu, hwmon
from plugvisor.emulators.lab.spec import File, Link, Spec
from plugvisor.emulators.lab.state import DeviceState, LabState
from plugvisor.emulators.lab.tree import LAB_DIR, FakeTree

log = logging.getLogger(__name__)

STATE_DIR: Final = f"{LAB_DIR}/nvml"
"""Where the stand-in reads the lab's GPUs (inside the lab's private directory, not sysfs)."""
EVENT_PERIOD_MS: Final = 1000
"""An active fault raises its event again this often (a GPU that keeps failing until reset)."""
CUDA_BY_DRIVER_BRANCH: Final = (
    (590, 13010),
    (580, 13000),
    (575, 12090),
    (570, 12080),
    (560, 12060),
    (555, 12050),
    (550, 12040),
    (545, 12030),
    (535, 12020),
    (530, 12010),
    (525, 12000),
    (520, 11080),
    (515, 11070),
    (510, 11060),
    (495, 11050),
    (470, 11040),
    (465, 11030),
    (460, 11020),
    (455, 11010),
    (450, 11000),
)
"""The lab's model of ``nvmlSystemGetCudaDriverVersion``: the newest CUDA whose minimum Linux driver branch
(CUDA's release notes, "CUDA Toolkit and Corresponding Driver Versions") is at most the driver's major;
580 -> 13000 is what the real H200 node's 580.159.04 reports."""


def cuda_driver_version(driver_version: str) -> int:
    """The CUDA version (``12040`` for 12.4) a driver of this version supports, as NVML reports it."""
    major = int(driver_version.split(".", 1)[0])
    for branch, cuda in CUDA_BY_DRIVER_BRANCH:
        if major >= branch:
            return cuda
    return CUDA_BY_DRIVER_BRANCH[-1][1]


XID_FALLEN_OFF_BUS: Final = 79
SOURCE_NAME: Final = "nvml_standin.c"
CFLAGS: Final = ("-shared", "-fPIC", "-O2", "-fvisibility=hidden")
_WARNED: list[bool] = []

LIBRARIES: Final = (
    ("libnvidia-ml", "1"),
    ("libcuda", "1"),
    ("libcudadebugger", "1"),
    ("libnvcuvid", "1"),
    ("libnvidia-allocator", "1"),
    ("libnvidia-cfg", "1"),
    ("libnvidia-eglcore", None),
    ("libnvidia-encode", "1"),
    ("libnvidia-fbc", "1"),
    ("libnvidia-glcore", None),
    ("libnvidia-glsi", None),
    ("libnvidia-glvkspirv", None),
    ("libnvidia-gpucomp", None),
    ("libnvidia-nvvm", "4"),
    ("libnvidia-opencl", "1"),
    ("libnvidia-opticalflow", "1"),
    ("libnvidia-pkcs11-openssl3", None),
    ("libnvidia-ptxjitcompiler", "1"),
    ("libEGL_nvidia", "0"),
    ("libGLESv1_CM_nvidia", "1"),
    ("libGLESv2_nvidia", "2"),
    ("libGLX_nvidia", "0"),
)
"""The driver's user-space libraries and the soname each is linked as (None: only ``.so.<version>``)."""
BINARIES: Final = ("nvidia-smi", "nvidia-debugdump", "nvidia-persistenced", "nvidia-cuda-mps-control")


def lib_dir(state: LabState) -> str:
    """Root-relative directory of the driver's libraries."""
    root = state.profile.driver_root.strip("/")
    return f"{root}/lib64" if root else f"usr/lib/{multiarch_triplet()}"


def bin_dir(state: LabState) -> str:
    """Root-relative directory of the driver's tools."""
    root = state.profile.driver_root.strip("/")
    return f"{root}/bin" if root else "usr/bin"


def nvidia_gpus(state: LabState) -> list[DeviceState]:
    """The lab's NVIDIA GPUs in NVML's order (bus order, which is minor order)."""
    found = [d for d in state.devices.values() if d.minor is not None and d.nvml is not None]
    return sorted(found, key=lambda d: d.minor or 0)


# -- the compiled library ------------------------------------------------------------------------


def _source() -> bytes:
    return (importlib.resources.files(__package__) / SOURCE_NAME).read_bytes()


def cache_dir() -> str:
    """Where compiled stand-ins are kept: ``$XDG_CACHE_HOME/plugvisor/nvml`` (``~/.cache`` by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "plugvisor", "nvml")


def installed_dir() -> str:
    """Where an installation keeps a stand-in built ahead of time: ``<data>/share/plugvisor/nvml``.

    ``<data>`` is the installation scheme's data directory (``/usr/local`` in the project's image, a
    virtual environment's root). The release image has no C compiler, so its build stage compiles the
    stand-in into that directory (the Dockerfile); a lab created in a pod then has NVML as one created
    on a machine with ``cc`` does.
    """
    return os.path.join(sysconfig.get_path("data"), "share", "plugvisor", "nvml")


def library_name() -> str:
    """The stand-in's file name: keyed by a hash of its source and flags, so a stale one is never used."""
    return _LIBRARY_NAME


_LIBRARY_NAME: Final = (
    f"libnvidia-ml-{hashlib.sha256(_source() + ' '.join(CFLAGS).encode()).hexdigest()[:16]}.so"
)
"""Computed once, at import, from the source shipped beside this module."""


def compiler() -> str | None:
    """The C compiler the lab uses (``cc`` on the PATH), or None."""
    return shutil.which("cc")


def build() -> str | None:
    """Return the path of the compiled stand-in, compiling it once per source version; None without ``cc``.

    The installation's own (:func:`installed_dir`, built with the image) comes first and needs no
    compiler. Otherwise keyed by a hash of the source and flags, written under a temporary name and
    renamed, so concurrent lab creations neither recompile nor see a half-written library. A cache
    directory that cannot be used (``XDG_CACHE_HOME`` naming a file, a read-only home) is said
    once and the library built in a temporary directory of this process instead: a lab is
    never left half-written for want of a cache.
    """
    installed = os.path.join(installed_dir(), library_name())
    if os.path.isfile(installed):
        return installed
    cc = compiler()
    if cc is None:
        return None
    source = _source()
    name = library_name()
    try:
        return _build(cc, source, name, cache_dir())
    except OSError as exc:
        log.warning(
            "the lab's NVML stand-in cannot be cached in %s (%s); built in a temporary directory",
            cache_dir(),
            exc.strerror or exc,
        )
    try:
        return _build(cc, source, name, _temporary_cache())
    except OSError as exc:
        log.warning("the lab's NVML stand-in cannot be built: %s", exc)
        return None


_TEMPORARY: list[str] = []
"""This process's fallback build directory, made once and removed at exit."""


def _temporary_cache() -> str:
    if not _TEMPORARY:
        _TEMPORARY.append(tempfile.mkdtemp(prefix="plugvisor-nvml-"))
        atexit.register(shutil.rmtree, _TEMPORARY[0], True)
    return _TEMPORARY[0]


def _build(cc: str, source: bytes, name: str, directory: str) -> str | None:
    """Compile into ``directory`` as ``name`` (OSError when it cannot be used); None when ``cc`` fails."""
    target = os.path.join(directory, name)
    if os.path.isfile(target):
        return target
    os.makedirs(directory, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as work:
        src = os.path.join(work, SOURCE_NAME)
        with open(src, "wb") as handle:
            handle.write(source)
        out = os.path.join(work, "libnvidia-ml.so")
        result = subprocess.run(
            [cc, *CFLAGS, "-o", out, src, "-lpthread"], capture_output=True, text=True, check=False
        )
        if result.returncode != 0:
            log.warning("the lab's NVML stand-in did not compile with %s: %s", cc, result.stderr.strip())
            return None
        os.replace(out, target)
    return target


# -- the driver root -------------------------------------------------------------------------------


def _script(name: str) -> bytes:
    return (
        "#!/bin/sh\n"
        f"# {name} of the plugvisor lab's NVIDIA driver: present where the real tool is, does nothing.\n"
        f'echo "{name}: this is a plugvisor lab node; the GPUs are emulated" >&2\n'
        "exit 0\n"
    ).encode()


def driver_files(state: LabState, library: bytes | None) -> Spec:
    """The driver root's files; the libraries only when ``library`` (the compiled stand-in) is given."""
    version = state.profile.nvidia_driver_version
    spec: Spec = {}
    libs = lib_dir(state)
    if library is not None:
        for name, soname in LIBRARIES:
            full = f"{name}.so.{version}"
            content = library if name == "libnvidia-ml" else f"plugvisor lab marker: {full}\n".encode()
            spec[f"{libs}/{full}"] = File(content, 0o755)
            if soname is not None:
                spec[f"{libs}/{name}.so.{soname}"] = Link(full)
    for name in BINARIES:
        spec[f"{bin_dir(state)}/{name}"] = File(_script(name), 0o755)
    return spec


def install(tree: FakeTree, state: LabState) -> list[str]:
    """Write the driver root and NVML's state for a lab with NVIDIA GPUs; return what the user should know.

    Without a C compiler the libraries are left out (a node whose driver has no NVML), which
    is said once per process in the log and returned for the CLI to print.
    """
    if not nvidia_gpus(state):
        return []
    notes: list[str] = []
    path = build()
    library = None
    if path is None:
        why = (
            "no C compiler (cc)"
            if compiler() is None
            else "the NVML stand-in could not be built (see the log)"
        )
        note = f"{why}: the lab's NVIDIA driver has no libnvidia-ml (NVML) or other libraries"
        notes.append(note)
        if not _WARNED:  # at info: the note is the lab's to show (the CLI prints it), not said twice
            _WARNED.append(True)
            log.info("%s", note)
    else:
        with open(path, "rb") as handle:
            library = handle.read()
    for rel, entry in driver_files(state, library).items():
        tree.put(rel, entry)
    write_state(tree, state, None)
    return notes


def standin_present(root: str, state: LabState) -> bool:
    """Whether the lab has its NVML stand-in (it has none when no C compiler built it)."""
    return os.path.isfile(os.path.join(root, lib_dir(state), "libnvidia-ml.so.1"))


NVML_FAULTS: Final = ("ecc-dbe", "ecc-sbe")
"""Faults only NVML shows (besides ``xid-<N>``): without the stand-in nothing can see them."""


def uninstall(tree: FakeTree, state: LabState) -> None:
    """Remove what :func:`install` wrote for ``state`` (before a lab is replaced)."""
    for rel in driver_files(state, b""):
        tree.remove(rel)
    for name in ("system", *(f"gpu{i}" for i in range(len(nvidia_gpus(state))))):
        tree.remove(f"{STATE_DIR}/{name}")


# -- the state the stand-in reads ------------------------------------------------------------------


def _serial(dev: DeviceState) -> str:
    """A 13-digit board serial, stable for the GPU (derived from its UUID, as the lab has no other)."""
    digest = int(hashlib.sha256((dev.uuid or dev.name).encode()).hexdigest(), 16)
    return f"16520{digest % 10**8:08d}"


def _power_mw(dev: DeviceState) -> int:
    facts = catalog.GPUS[dev.model].nvml
    assert facts is not None
    if hwmon.OVERHEAT in dev.faults:
        return facts.power_limit_mw * 97 // 100
    return facts.power_mw


def gpu_file(state: LabState, dev: DeviceState) -> bytes:
    """One GPU's ``key=value`` lines, as the stand-in parses them."""
    model = catalog.GPUS[dev.model]
    facts = model.nvml
    assert facts is not None and dev.nvml is not None and dev.minor is not None
    counters = dev.nvml
    address = dev.primary.address
    ident = model.identity
    hot = hwmon.OVERHEAT in dev.faults
    values: list[tuple[str, str | int]] = [
        ("name", model.name),
        ("uuid", dev.uuid or ""),
        ("serial", _serial(dev)),
        ("vbios", model.vbios),
        ("bus_id", f"{address.domain:08x}:{address.bus:02x}:{address.device:02x}.{address.function}"),
        ("brand", facts.brand),
        ("architecture", facts.architecture),
        ("cc_major", facts.compute_capability[0]),
        ("cc_minor", facts.compute_capability[1]),
        ("minor", dev.minor),
        ("domain", address.domain),
        ("bus", address.bus),
        ("device", address.device),
        ("pci_device_id", f"0x{ident.device << 16 | ident.vendor:08x}"),
        ("pci_subsystem_id", f"0x{ident.subsystem_device << 16 | ident.subsystem_vendor:08x}"),
        ("memory_total", facts.memory_bytes),
        ("memory_used", facts.memory_used_bytes),
        ("memory_reserved", facts.memory_used_bytes),
        ("temperature", facts.hot_temperature_c if hot else facts.temperature_c),
        ("power_mw", _power_mw(dev)),
        ("power_limit_mw", facts.power_limit_mw),
        ("energy_mj", f"{counters.energy_mj}@{counters.energy_at_ns}"),
        ("util_gpu", 0),
        ("util_memory", 0),
        ("clock_graphics", facts.clocks_mhz[0]),
        ("clock_sm", facts.clocks_mhz[1]),
        ("clock_memory", facts.clocks_mhz[2]),
        ("clock_video", facts.clocks_mhz[3]),
        ("pcie_replay", 0),
        ("ecc_sbe_volatile", counters.ecc_volatile[0]),
        ("ecc_dbe_volatile", counters.ecc_volatile[1]),
        ("ecc_sbe_aggregate", counters.ecc_aggregate[0]),
        ("ecc_dbe_aggregate", counters.ecc_aggregate[1]),
        ("ecc_sbe_since", counters.fault_since_ns.get(gpu.ECC_SBE, 0)),
        ("ecc_dbe_since", counters.fault_since_ns.get(gpu.ECC_DBE, 0)),
        ("lost_at", counters.lost_at_ns),
    ]
    for fault in dev.faults:
        try:
            number = gpu.parse_xid(fault)
        except ValueError:  # recorded by an older lab that took "xid-079": no XID NVML could raise
            continue
        if number is not None:
            values.append(("xid", f"{number}@{counters.fault_since_ns.get(fault, 0)}"))
    return "".join(f"{key}={value}\n" for key, value in values).encode()


def system_file(state: LabState) -> bytes:
    """The node's ``key=value`` lines: versions, GPU count, event period."""
    version = state.profile.nvidia_driver_version
    cuda = cuda_driver_version(version)
    values = (
        ("driver_version", version),
        ("nvml_version", f"{cuda // 1000}.{version}"),  # NVML's own: "13.580.159.04" on the H200 node
        ("cuda_driver_version", cuda),
        ("count", len(nvidia_gpus(state))),
        ("event_period_ms", EVENT_PERIOD_MS),
    )
    return "".join(f"{key}={value}\n" for key, value in values).encode()


def write_state(tree: FakeTree, state: LabState, names: list[str] | None) -> None:
    """Replace the stand-in's files of the named devices (all, and ``system``, with None), atomically."""
    gpus = nvidia_gpus(state)
    if not gpus:
        return
    if names is None:
        tree.put(f"{STATE_DIR}/system", File(system_file(state), 0o644))
    for index, dev in enumerate(gpus):
        if names is None or dev.name in names:
            tree.put(f"{STATE_DIR}/gpu{index}", File(gpu_file(state, dev), 0o644))


# -- keeping the counters -------------------------------------------------------------------------


def _ticks(since: int, now: int) -> int:
    """How many times a fault raised at ``since`` has fired by ``now`` (at once, then every period)."""
    return (now - since) // (EVENT_PERIOD_MS * 1_000_000) + 1 if since and now >= since else 0


def account(before: DeviceState, after: DeviceState, now: int | None = None) -> None:
    """Carry NVML's counters across one lab change of a GPU (``before`` is its state until now).

    The energy counter takes what the old draw added; a fault that appears gets its injection
    time; an ECC fault that goes folds the errors it raised into the counts; a GPU that falls off
    the bus or is unplugged is lost from now, one that comes back answers again with its volatile
    ECC counts reset (the driver enumerated it afresh).
    """
    if after.nvml is None or before.nvml is None or after.kind != "gpu":
        return
    now = time.time_ns() if now is None else now
    counters = after.nvml
    old = before.nvml
    if old.energy_at_ns:
        counters.energy_mj = old.energy_mj + _power_mw(before) * (now - old.energy_at_ns) // 1_000_000_000
    counters.energy_at_ns = now
    since = dict(old.fault_since_ns)
    for fault in after.faults:
        since.setdefault(fault, now)
    volatile, aggregate = list(counters.ecc_volatile), list(counters.ecc_aggregate)
    for fault, started in list(since.items()):
        if fault in after.faults:
            continue
        del since[fault]
        if fault in (gpu.ECC_SBE, gpu.ECC_DBE):
            which = 0 if fault == gpu.ECC_SBE else 1
            volatile[which] += _ticks(started, now)
            aggregate[which] += _ticks(started, now)
    counters.fault_since_ns = since
    lost = not after.present or gpu.FALLEN_OFF_BUS in after.faults
    if lost and not counters.lost_at_ns:
        counters.lost_at_ns = now
    elif not lost:
        counters.lost_at_ns = 0
    if after.present and not before.present:
        volatile = [0, 0]
    counters.ecc_volatile = (volatile[0], volatile[1])
    counters.ecc_aggregate = (aggregate[0], aggregate[1])


def start(state: LabState, now: int | None = None) -> None:
    """Start the energy counters of a new lab's NVIDIA GPUs at zero, now."""
    now = time.time_ns() if now is None else now
    for dev in nvidia_gpus(state):
        assert dev.nvml is not None
        dev.nvml.energy_at_ns = now
