"""Where a plugin reads the host from, and how it names host paths to the kubelet.

Nothing in plugvisor hard-codes ``/sys`` or ``/dev``: every reader takes a
:class:`HostPaths`, so the same code serves a real node (root ``/``), a plugin
container with the host mounted at ``/host``, and an emulated lab in a temp dir.
(Intel's ``-prefix`` flag is the model; its ``pkg/topology`` ``mockRoot`` global is
the pattern to avoid.)

A host root is another machine's filesystem seen from inside ours, so its
symlinks mean what they mean *there*: Debian and Ubuntu ship ``/var/run -> /run``,
and followed naively from ``/host/var/run`` that link lands in *our* ``/run``.
:func:`resolve_in_root` resolves a path the way the kernel would after
``chroot(root)`` (``openat2``'s ``RESOLVE_IN_ROOT``): an absolute link restarts at
the root, ``..`` stops at it. Every path :class:`HostPaths` hands out goes through
it, so no read and no write of any kind can be led out of the host root by a link.
"""

from __future__ import annotations

import difflib
import errno
import os
import platform
import stat
from collections import deque
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Final

from plugvisor.common import constants

MAX_SYMLINKS: Final = 40
"""Links followed in one resolution before it fails with ``ELOOP`` (Linux's own limit)."""


def resolve_in_root(root: Path, path: str | os.PathLike[str]) -> Path:
    """Resolve ``path`` inside ``root`` as a process chrooted to ``root`` would.

    ``path`` is host-absolute (``/var/run/cdi``) or relative to ``root``. Every
    existing component is looked at with ``lstat``: a symlink is replaced by its
    target, an absolute target restarts at ``root`` and ``..`` never climbs above
    it. Components that do not exist (yet) are kept as written, so the result is
    also where a write should create them. The result is ``root`` joined with
    link-free components; ``root`` itself is trusted as given.

    Raises :class:`OSError` ``ELOOP`` after :data:`MAX_SYMLINKS` links, as the
    kernel does. Between this call and the use of its result the tree may change;
    that race needs a process that can already write the host's filesystem.
    """
    pending = deque(path_parts(path))
    if str(root) == "/":
        # chroot("/") is the identity: the kernel's own resolution is already right.
        return Path("/", *pending)
    resolved: list[str] = []
    links = 0
    while pending:
        name = pending.popleft()
        if name == ".":
            continue
        if name == "..":
            if resolved:
                resolved.pop()
            continue
        candidate = os.path.join(root, *resolved, name)  # noqa: PTH118 - no Path per component
        try:
            mode = os.lstat(candidate).st_mode
        except OSError:
            mode = 0  # missing (or under a non-directory): kept as written, the use reports it
        if stat.S_ISLNK(mode):
            links += 1
            if links > MAX_SYMLINKS:
                where = str(root.joinpath(*path_parts(path)))
                raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), where)
            target = os.readlink(candidate)  # noqa: PTH115 - no Path per component
            if target.startswith("/"):
                resolved.clear()
            pending.extendleft(reversed(path_parts(target)))
            continue
        resolved.append(name)
    return root.joinpath(*resolved)


def writable_dir_problem(path: Path, *, purpose: str, mode: int = 0o750, create: bool = True) -> str | None:
    """Why ``path`` cannot be created (with ``mode``) or written (``purpose``: what goes there), or None.

    ``create=False`` leaves a missing directory missing and checks that it could be
    created (its nearest existing ancestor is a writable directory).
    """
    if not create and not path.exists():
        return _uncreatable(path)
    try:
        path.mkdir(mode=mode, parents=True, exist_ok=True)
    except OSError as exc:
        return f"{path}: cannot create it: {exc.strerror or exc}"
    if not path.is_dir():
        return f"{path}: not a directory"
    why = _not_writable(path)
    return None if why is None else f"{path}: {why}; {purpose}"


def _not_writable(path: Path) -> str | None:
    """Why this process cannot create entries in the directory ``path``, or None when it can."""
    if os.access(path, os.W_OK | os.X_OK):
        return None
    return (
        "on a read-only filesystem"
        if os.statvfs(path).f_flag & os.ST_RDONLY
        else "not writable by this process"
    )


def _uncreatable(path: Path) -> str | None:
    """Why the missing ``path`` could not be created (its nearest existing ancestor), or None."""
    if path.is_symlink():
        return f"{path}: a symbolic link to {path.readlink()}, which does not exist"
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{path}: cannot create it: Not a directory"
    why = _not_writable(ancestor)
    return None if why is None else f"{path}: cannot create it: {ancestor} is {why}"


def beside_kubelet_dir(kubelet_dir: Path, name: str) -> Path:
    """The kubelet's directory ``name`` (``plugins_registry``, ``pod-resources``) for its device-plugins one.

    ``/var/lib/kubelet/device-plugins`` -> ``/var/lib/kubelet/<name>``, as the kubelet lays out its root;
    a directory with another name ``D`` -> ``D.<name>``, the emulated kubelet's rule, so that several
    emulated kubelets in one directory (``/tmp/a``, ``/tmp/b``) do not share one plugins_registry, and a
    plugin given only ``D`` finds the one the emulated kubelet given ``D`` watches.
    """
    if kubelet_dir.name == constants.DEVICE_PLUGINS_DIR_NAME:
        return kubelet_dir.parent / name
    return Path(f"{kubelet_dir}.{name}")


def kubelet_dir_problem(path: Path) -> str | None:
    """Why no plugin could serve its socket in ``path``, or ``None``.

    Checked before anything starts (``plugvisor plugin``, ``plugvisor run`` and
    every reload), so that a read-only, uncreatable or mistyped directory is one
    clear error naming it, not a bind failure deep in gRPC in every child. A
    missing directory is not created here: the watch that creates it says so
    (:class:`~plugvisor.common.kubeletdir.KubeletDirWatch`), since a directory
    nobody else made may well be a typo.
    """
    return writable_dir_problem(path, purpose="plugins create their sockets there", create=False)


KUBELET_DIR_NAME: Final = "device-plugins"
"""The name a kubelet gives its device-plugins directory, under its root dir (``--root-dir``)."""


def missing_kubelet_dir_problem(path: Path) -> str | None:
    """Why a ``kubeletDir`` that does not exist is a mistake rather than a kubelet not started yet, or None.

    A kubelet creates ``<root-dir>/device-plugins`` when it starts, in a root
    dir that exists once it is installed (its configuration, its
    ``plugins_registry``), and the directory stays across its restarts and the
    node's reboots. So a missing ``kubeletDir`` whose parent exists is a
    kubelet that has not started yet: it is created (mode 0750, as the kubelet
    would) and waited on, saying so. Refused, with nothing created:

    - a missing parent too (``/var/lib/kubelt/device-plugins``): no kubelet
      root there, the path is a typo, or the agent started before the kubelet
      was ever installed (the systemd unit's ``Restart=`` retries);
    - a last component that is a near miss of ``device-plugins``
      (``device-plugin``): no kubelet writes there. Any other name is taken
      as given (an emulated kubelet's directory may have any name).
    """
    if path.exists() or path.is_symlink():
        return None
    if not path.parent.is_dir():
        return (
            f"{path}: does not exist, nor does {path.parent}: a kubelet creates <root-dir>/"
            f"{KUBELET_DIR_NAME} in its existing root dir when it starts; a typo? (nothing was created)"
        )
    name = path.name
    if name != KUBELET_DIR_NAME and difflib.get_close_matches(
        name.lower(), [KUBELET_DIR_NAME], n=1, cutoff=0.8
    ):
        return (
            f"{path}: does not exist; did you mean {path.parent / KUBELET_DIR_NAME}? (a kubelet names its "
            f"directory {KUBELET_DIR_NAME}; nothing was created)"
        )
    return None


def host_root_problem(root: Path) -> str | None:
    """Why ``root`` cannot serve as a host root (missing, a file, a looping ``sys``...), or ``None``."""
    if not root.exists():
        return f"{root}: does not exist; expected the host's / (or an emulated lab root)"
    if not root.is_dir():
        return f"{root}: not a directory; expected the host's / (or an emulated lab root)"
    for name in ("sys", "dev", "proc"):
        try:
            resolve_in_root(root, name)
        except OSError as exc:
            return f"{root / name}: {exc.strerror} (resolved inside the host root)"
    return None


def path_parts(path: str | os.PathLike[str]) -> tuple[str, ...]:
    """The components of ``path`` below ``/`` (what joins it onto a root)."""
    return tuple(part for part in PurePosixPath(path).parts if part.strip("/"))  # "//" is an anchor too


@dataclass(frozen=True, slots=True)
class HostPaths:
    """The host's filesystem as one plugin process sees it.

    ``root`` is where sysfs/devfs/procfs are read (``root/sys``, ``root/dev``...).
    ``spec_root`` prefixes the host paths handed to the kubelet in DeviceSpecs and
    Mounts. It defaults to ``root``, which is right on a bare-metal node (both are
    ``/``) and in the emulated lab (the fake nodes really live under the lab root);
    a plugin container that sees the host at ``/host`` sets ``spec_root=/`` because
    the container runtime opens paths in the host's namespace.
    """

    root: Path = Path("/")
    kubelet_dir: Path = Path(constants.DEVICE_PLUGIN_PATH)
    spec_root: Path | None = None

    @property
    def sysfs(self) -> Path:
        """``<root>/sys``, resolved inside the root."""
        return resolve_in_root(self.root, "sys")

    @property
    def devfs(self) -> Path:
        """``<root>/dev``, resolved inside the root."""
        return resolve_in_root(self.root, "dev")

    @property
    def procfs(self) -> Path:
        """``<root>/proc``, resolved inside the root."""
        return resolve_in_root(self.root, "proc")

    @property
    def kubelet_socket(self) -> Path:
        """The kubelet's Registration socket."""
        return self.kubelet_dir / constants.KUBELET_SOCKET_NAME

    def host(self, absolute: str | PurePosixPath) -> Path:
        """Map a host-absolute path such as ``/dev/fuse`` to where this process reads or writes it.

        Resolved inside the root (:func:`resolve_in_root`): ``/var/run/cdi`` on a
        host whose ``/var/run`` links to ``/run`` is ``<root>/run/cdi``.
        """
        rel = PurePosixPath(absolute)
        if not rel.is_absolute():
            raise ValueError(f"host path {str(absolute)!r} must be absolute")
        return resolve_in_root(self.root, rel)

    def inside(self, local: Path) -> Path:
        """Resolve a path read under ``root`` (``<root>/sys/...``) inside the root, as :meth:`host` does."""
        return resolve_in_root(self.root, local.relative_to(self.root))

    def for_kubelet(self, local: Path) -> str:
        """Name a path read under ``root`` the way the container runtime on the host must see it."""
        spec_root = self.root if self.spec_root is None else self.spec_root
        rel = local.relative_to(self.root)
        return str(spec_root / rel)


def multiarch_triplet(machine: str | None = None) -> str:
    """The multiarch triplet of this machine (``x86_64-linux-gnu``, ``aarch64-linux-gnu``).

    Debian and Ubuntu keep a host's libraries in ``/usr/lib/<triplet>``: the gpu kind looks for
    NVIDIA's driver there, and the lab writes it there, so both name the directory with this one
    function (``arm64``, as some systems call the machine, is Debian's ``aarch64``).
    """
    machine = (machine or platform.machine() or "x86_64").lower()
    return f"{'aarch64' if machine == 'arm64' else machine}-linux-gnu"
