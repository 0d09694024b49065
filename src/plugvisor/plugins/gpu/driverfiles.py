"""NVIDIA's user-space driver files, what a CUDA container needs besides ``/dev/nvidia*``.

A CUDA program loads ``libcuda.so.1`` (and NVML ``libnvidia-ml.so.1``, the JIT
``libnvidia-ptxjitcompiler.so.1``...) from the *host's* driver: they must match
the kernel module, so no image can ship them. NVIDIA's container toolkit puts them
in the container with a CDI spec of kind ``nvidia.com/gpu`` (``nvidia-ctk cdi
generate``): bind mounts of the libraries and binaries, plus hooks that make the
``.so.1`` links and refresh the loader's cache. This module gives a GPU spec one of
two things, per node:

- **the toolkit's own CDI devices**, when a spec of kind ``nvidia.com/gpu`` in the
  host's ``/etc/cdi`` or ``/var/run/cdi`` has every NVIDIA GPU of the node (by UUID,
  or by the one ``/dev/nvidia<minor>`` node of a device the toolkit names by index:
  its indexes are NVML's, not the minors): the toolkit knows its driver best, so
  plugvisor names its devices (``nvidia.com/gpu=GPU-...``) instead of repeating them;
- **the driver's files themselves** otherwise: each library of :data:`LIBRARIES`
  found under ``<hostRoot>/<driverRoot>`` (in ``lib64``,
  ``lib/<triplet>``, ``usr/lib64``, ``usr/lib/<triplet>``, ``lib``, ``usr/lib``),
  bind-mounted read-only into the container's ``/usr/lib/<triplet>``, and the
  binaries of :data:`BINARIES` (``bin``, ``usr/bin``) into ``/usr/bin``. A link
  such as ``libcuda.so.1 -> libcuda.so.580.159.04`` is mounted as the file it
  names, *at the link's name*: the loader asks for ``libcuda.so.1``, and that name
  is in its path without any ldcache update or link-making hook, because
  ``/usr/lib/<triplet>`` is one of glibc's built-in search directories on Debian
  and Ubuntu (``ld.so --help``: "system search path"), the bases of NVIDIA's CUDA
  images. Where the toolkit's hook binary is on the host (``nvidia-cdi-hook``, or
  ``nvidia-ctk hook``), an ``update-ldcache`` hook is added too, so that images
  whose loader does not search that directory (RHEL's) find them through the cache.

Input from the host is treated as hostile: every link is resolved inside the host
root (:func:`~plugvisor.common.hostpaths.resolve_in_root`) and must stay inside the
driver root and name a file of the same library; a dangling link, a directory, a
device node, a link leaving the driver root are skipped with one log line each.
Listing a directory stops after :data:`MAX_ENTRIES` entries (one log line). What is
found is kept until one of the directories it came from changes (their ``mtime``).
"""

from __future__ import annotations

import os
import re
import stat
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import structlog
import yaml

from plugvisor.common.hostpaths import HostPaths, multiarch_triplet, path_parts

TOOLKIT_KIND: Final = "nvidia.com/gpu"
"""The CDI kind of the NVIDIA container toolkit's GPU devices (``nvidia-ctk cdi generate``)."""
CDI_DIRS: Final = ("/etc/cdi", "/var/run/cdi")
"""Where CDI specs live on a host (the CDI specification's static and dynamic directories)."""

LIBRARIES: Final = (
    "libcuda",
    "libcudadebugger",
    "libnvcuvid",
    "libnvidia-allocator",
    "libnvidia-cfg",
    "libnvidia-eglcore",
    "libnvidia-encode",
    "libnvidia-fbc",
    "libnvidia-glcore",
    "libnvidia-glsi",
    "libnvidia-glvkspirv",
    "libnvidia-gpucomp",
    "libnvidia-ml",
    "libnvidia-ngx",
    "libnvidia-nvvm",
    "libnvidia-opencl",
    "libnvidia-opticalflow",
    "libnvidia-pkcs11",
    "libnvidia-pkcs11-openssl3",
    "libnvidia-ptxjitcompiler",
    "libnvidia-rtcore",
    "libnvidia-tls",
    "libnvoptix",
    "libEGL_nvidia",
    "libGLESv1_CM_nvidia",
    "libGLESv2_nvidia",
    "libGLX_nvidia",
)
"""The driver's user-space libraries a container may load (compute, video, graphics), as the toolkit lists."""
BINARIES: Final = (
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
)
HOOK_BINARIES: Final = (("nvidia-cdi-hook", ()), ("nvidia-ctk", ("hook",)))
"""The toolkit's hook programs, preferred first, with the arguments that select its hooks."""
HOOK_DIRS: Final = ("/usr/bin", "/usr/local/bin", "/usr/sbin")
MAX_ENTRIES: Final = 65536
"""Entries read from one directory at most (a real ``/usr/lib/x86_64-linux-gnu`` has a few thousand)."""
MAX_SPEC_BYTES: Final = 4 << 20
MAX_SPECS: Final = 256
"""CDI spec files read per directory at most, looking for the toolkit's."""

_LIBRARY: Final = re.compile(
    r"^(?P<library>" + "|".join(re.escape(name) for name in LIBRARIES) + r")\.so\.[0-9][0-9.]*$"
)
_SPEC_SUFFIXES: Final = (".json", ".yaml", ".yml")


def library_dirs(machine: str | None = None) -> tuple[str, ...]:
    """Where libraries are looked for under the driver root, first found first used."""
    arch = multiarch_triplet(machine)
    return ("lib64", f"lib/{arch}", "usr/lib64", f"usr/lib/{arch}", "lib", "usr/lib")


BINARY_DIRS: Final = ("bin", "usr/bin")


@dataclass(frozen=True, slots=True)
class Mount:
    """A read-only bind mount: the host's file (as the runtime names it) at a path in the container."""

    host_path: str
    container_path: str

    def render(self) -> dict[str, Any]:
        """The CDI ``mounts`` entry."""
        return {
            "hostPath": self.host_path,
            "containerPath": self.container_path,
            "options": ["ro", "nosuid", "nodev", "rbind", "rprivate"],
        }


@dataclass(frozen=True, slots=True)
class Hook:
    """An OCI ``createContainer`` hook: a program of the host run with these arguments."""

    path: str
    args: tuple[str, ...]

    def render(self) -> dict[str, Any]:
        """The CDI ``hooks`` entry."""
        return {"hookName": "createContainer", "path": self.path, "args": list(self.args)}


@dataclass(frozen=True, slots=True)
class DriverFiles:
    """What a container with NVIDIA GPUs gets on this node: the toolkit's devices, or the files."""

    toolkit_devices: frozenset[str] = frozenset()
    """The device names of the toolkit's ``nvidia.com/gpu`` spec (``0``, ``GPU-...``, ``all``)."""
    toolkit_minors: tuple[tuple[int, str], ...] = ()
    """Each whole GPU of the toolkit's spec by the minor of its one ``/dev/nvidia<minor>`` node: the toolkit's
    index names are NVML's indexes, which need not be the minor numbers plugvisor knows GPUs by."""
    libraries: tuple[Mount, ...] = ()
    binaries: tuple[Mount, ...] = ()
    hooks: tuple[Hook, ...] = ()
    library_dir: str = ""
    """The container's directory the libraries are mounted in."""

    @property
    def mounts(self) -> tuple[Mount, ...]:
        """Libraries, then binaries."""
        return (*self.libraries, *self.binaries)

    def toolkit_name(self, uuid: str | None, minor: int | None) -> str | None:
        """The toolkit's name for a GPU: its UUID, else the device of its minor's node; None if absent."""
        if uuid and uuid in self.toolkit_devices:
            return uuid
        return dict(self.toolkit_minors).get(minor) if minor is not None else None


@dataclass
class DriverLocator:
    """Finds a node's :class:`DriverFiles` under ``<hostRoot>/<driverRoot>``, again when a directory changed.

    One per resource, used from the plugin's worker threads (post-allocate hooks,
    several DRA claims at once): one find at a time, under a lock. Each problem is
    logged once, until it goes away.
    """

    paths: HostPaths
    driver_root: str = "/"
    machine: str | None = None
    log: Any = field(default_factory=lambda: structlog.get_logger("plugvisor.plugins.gpu.driver"))
    _signature: tuple[tuple[str, int, int], ...] | None = None
    _found: DriverFiles = field(default_factory=DriverFiles)
    _reported: set[str] = field(default_factory=set)
    _seen: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def find(self) -> DriverFiles:
        """The driver files as they are now (the last answer when no directory they came from changed)."""
        with self._lock:
            return self._find()

    def _find(self) -> DriverFiles:
        directories = self._directories()
        signature = tuple(_stamp(d) for d in directories)
        if signature != self._signature:
            self._seen = set()
            self._found = self._read()
            self._reported &= self._seen  # a problem that went away is reported again if it comes back
            self._signature = signature
        return self._found

    # -- what is read -----------------------------------------------------------------

    def _root(self) -> Path:
        return self._host(self.driver_root)

    def _host(self, absolute: str) -> Path:
        """Where a host path is read, resolved inside the host root.

        A path that cannot be resolved (a link loop) is said once and kept as
        written, so that reading it fails and it is treated as absent.
        """
        try:
            return self.paths.host(absolute)
        except OSError as exc:
            self._report(absolute, f"cannot resolve it: {exc.strerror or exc}; nothing read from it")
            return self.paths.root.joinpath(*path_parts(absolute))

    def _directories(self) -> list[Path]:
        root = self._root()
        names = [*library_dirs(self.machine), *BINARY_DIRS]
        found = [_inside(self.paths, root / name) for name in names]
        found += [self._host(d) for d in (*CDI_DIRS, *HOOK_DIRS)]
        return found

    def _read(self) -> DriverFiles:
        toolkit, minors = self._toolkit_devices()
        arch = multiarch_triplet(self.machine)
        library_dir = f"/usr/lib/{arch}"
        root = self._root()
        libraries = self._libraries(root, library_dir)
        binaries = self._binaries(root)
        hooks: tuple[Hook, ...] = ()
        hook = self._hook_program()
        if hook is not None and libraries:
            path, selector = hook
            name = path.rsplit("/", 1)[-1]  # argv[0]: the toolkit's programs read their name from it
            hooks = (Hook(path, (name, *selector, "update-ldcache", "--folder", library_dir)),)
        return DriverFiles(toolkit, minors, libraries, binaries, hooks, library_dir)

    def _libraries(self, root: Path, library_dir: str) -> tuple[Mount, ...]:
        claimed: dict[str, Path] = {}  # library -> the directory it is taken from
        mounts: dict[str, Mount] = {}
        listed: set[Path] = set()
        for name in library_dirs(self.machine):
            directory = _inside(self.paths, root / name)
            if directory in listed:  # /lib -> usr/lib on a merged /usr: one directory, read once
                continue
            listed.add(directory)
            for entry in self._entries(directory):
                match = _LIBRARY.match(entry)
                if match is None:
                    continue
                library = match.group("library")
                if claimed.setdefault(library, directory) != directory:
                    continue  # the first directory that has a library is the one it comes from
                target = self._regular_file(directory / entry, root, _same_library(library))
                if target is not None and entry not in mounts:
                    mounts[entry] = Mount(self.paths.for_kubelet(target), f"{library_dir}/{entry}")
        return tuple(mounts[name] for name in sorted(mounts))

    def _binaries(self, root: Path) -> tuple[Mount, ...]:
        mounts: dict[str, Mount] = {}
        for name in BINARY_DIRS:
            directory = _inside(self.paths, root / name)
            for binary in BINARIES:
                if binary in mounts or not os.path.lexists(directory / binary):
                    continue
                target = self._regular_file(directory / binary, root, lambda _n: True, executable=True)
                if target is not None:
                    mounts[binary] = Mount(self.paths.for_kubelet(target), f"/usr/bin/{binary}")
        return tuple(mounts[name] for name in sorted(mounts))

    def _hook_program(self) -> tuple[str, tuple[str, ...]] | None:
        """The toolkit's hook program as the runtime names it (``specRoot``: the hook runs on the host)."""
        for program, selector in HOOK_BINARIES:
            for directory in HOOK_DIRS:
                local = self._host(f"{directory}/{program}")
                try:
                    mode = local.stat().st_mode
                except OSError:
                    continue
                if stat.S_ISREG(mode) and mode & 0o111:
                    return self.paths.for_kubelet(local), tuple(selector)
        return None

    def _toolkit_devices(self) -> tuple[frozenset[str], tuple[tuple[int, str], ...]]:
        names: set[str] = set()
        minors: dict[int, str] = {}
        for cdi_dir in CDI_DIRS:
            directory = self._host(cdi_dir)
            entries = sorted(e for e in self._entries(directory) if e.endswith(_SPEC_SUFFIXES))
            if len(entries) > MAX_SPECS:
                self._report(
                    f"{directory}: specs", f"{len(entries)} spec files; only the first {MAX_SPECS} read"
                )
            for entry in entries[:MAX_SPECS]:
                if entry.startswith("k8s."):
                    continue  # transient specs (DRA claims, plugvisor's own) are nobody's toolkit
                found = self._toolkit_spec(directory / entry)
                names |= set(found)
                for name, minor in sorted(found.items()):
                    if minor is not None:
                        minors.setdefault(minor, name)
        return frozenset(names), tuple(sorted(minors.items()))

    def _toolkit_spec(self, path: Path) -> dict[str, int | None]:
        """The spec's devices by name, each with the minor of its one GPU node (None: none, or several)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as handle:
                if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                    return {}
                data = handle.read(MAX_SPEC_BYTES + 1)
        except OSError:
            return {}  # a link, or gone: not a spec the runtime would read either way
        if len(data) > MAX_SPEC_BYTES or b"nvidia.com/gpu" not in data:
            return {}
        try:
            document = yaml.safe_load(data)
        except yaml.YAMLError as exc:
            self._report(str(path), f"not a CDI spec plugvisor can read: {str(exc).splitlines()[0][:200]}")
            return {}
        if not isinstance(document, Mapping) or document.get("kind") != TOOLKIT_KIND:
            return {}
        found: dict[str, int | None] = {}
        devices = document.get("devices")
        for device in devices if isinstance(devices, list) else ():
            name = device.get("name") if isinstance(device, Mapping) else None
            if isinstance(name, str) and 0 < len(name) <= 256:
                found[name] = None if ":" in name or name == "all" else _one_gpu_minor(device)
        return found

    # -- reading the host safely ------------------------------------------------------------

    def _entries(self, directory: Path) -> list[str]:
        names: list[str] = []
        try:
            with os.scandir(directory) as listing:
                for entry in listing:
                    if len(names) >= MAX_ENTRIES:
                        self._report(str(directory), f"more than {MAX_ENTRIES} entries; the rest not read")
                        break
                    names.append(entry.name)
        except OSError:
            return []  # missing (most of the search list is, on any one node)
        return names

    def _regular_file(  # noqa: PLR0911 - one return per reason a file is refused
        self, local: Path, root: Path, acceptable: Any, *, executable: bool = False
    ) -> Path | None:
        """The regular file ``local`` is or names, inside the host root and the driver root, or None."""
        try:
            target = self.paths.inside(local)
        except OSError as exc:
            self._report(str(local), f"cannot resolve it: {exc.strerror or exc}")
            return None
        if not target.is_relative_to(root):
            self._report(
                str(local), f"leads to {_shown(self.paths, target)}, outside the driver root; skipped"
            )
            return None
        try:
            mode = target.stat().st_mode
        except OSError:
            self._report(str(local), f"a dangling link (to {_shown(self.paths, target)}); skipped")
            return None
        if stat.S_ISDIR(mode):
            self._report(str(local), "a directory, not a library or program file; skipped")
            return None
        if not stat.S_ISREG(mode):
            self._report(str(local), "not a regular file; skipped")
            return None
        if not acceptable(target.name):
            self._report(str(local), f"a link to {target.name}, another file than its name says; skipped")
            return None
        if executable and not mode & 0o111:
            self._report(str(local), "not executable; skipped")
            return None
        return target

    def _report(self, where: str, problem: str) -> None:
        key = f"{where}\0{problem}"
        self._seen.add(key)
        if key not in self._reported:
            self._reported.add(key)
            self.log.warning("driver_file_skipped", path=where[:300], problem=problem[:300])


_GPU_NODE: Final = re.compile(r"^/dev/nvidia([0-9]{1,6})$")


def _one_gpu_minor(device: Mapping[str, Any]) -> int | None:
    """The minor of the one ``/dev/nvidia<minor>`` node a toolkit device has, or None."""
    edits = device.get("containerEdits")
    nodes = edits.get("deviceNodes") if isinstance(edits, Mapping) else None
    minors = {
        int(match.group(1))
        for node in (nodes if isinstance(nodes, list) else ())
        if isinstance(node, Mapping) and isinstance(node.get("path"), str)
        for match in [_GPU_NODE.match(node["path"])]
        if match
    }
    return minors.pop() if len(minors) == 1 else None


def _inside(paths: HostPaths, local: Path) -> Path:
    try:
        return paths.inside(local)
    except OSError:
        return local  # a looping link: listing it fails, and that is reported as its absence


def _stamp(directory: Path) -> tuple[str, int, int]:
    try:
        found = directory.stat()
    except OSError:
        return (str(directory), 0, 0)
    return (str(directory), found.st_ino, found.st_mtime_ns)


def _same_library(library: str) -> Any:
    def accepts(name: str) -> bool:
        match = _LIBRARY.match(name)
        return match is not None and match.group("library") == library

    return accepts


def _shown(paths: HostPaths, local: Path) -> str:
    """A path under the host root as the host names it."""
    try:
        return "/" + "/".join(path_parts(local.relative_to(paths.root)))
    except ValueError:
        return str(local)


def toolkit_ids(files: DriverFiles, gpus: Iterable[tuple[str | None, int | None]]) -> list[str] | None:
    """The toolkit's CDI IDs for these GPUs (UUID, minor), or None when its spec lacks any of them."""
    ids: list[str] = []
    for uuid, minor in gpus:
        name = files.toolkit_name(uuid, minor)
        if name is None:
            return None
        ids.append(f"{TOOLKIT_KIND}={name}")
    return ids


__all__ = [
    "BINARIES",
    "LIBRARIES",
    "DriverFiles",
    "DriverLocator",
    "Hook",
    "Mount",
    "library_dirs",
    "toolkit_ids",
]
