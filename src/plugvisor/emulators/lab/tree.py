"""The only code in the lab that touches the file system.

:class:`FakeTree` owns three promises:

* **The guard.** Nothing is created, changed or deleted under a root that is, or
  looks like, a real ``/sys``, ``/dev`` or ``/proc`` (Intel's ``gpu_fakedev``
  refuses the same way), and no write follows a symlink out of the root.
* **Atomicity for readers.** A scanner polling the tree never sees a half-written
  attribute or a half-built device: files and links are written under a
  temporary name in the lab's own staging directory and renamed into place, and
  a device directory is built whole in staging and renamed in as one entry.
* **Fidelity of nodes.** Device nodes are empty regular files by default (no
  privileges needed) or real character nodes with ``mknod``.
"""

# The writer works on root-relative POSIX strings (the keys of a Spec) and on directory
# descriptors, which pathlib cannot express; os.* is the clearer (and faster) tool here.
# ruff: noqa: PTH100, PTH101, PTH102, PTH103, PTH104, PTH105, PTH108, PTH112, PTH114, PTH115, PTH121, PTH123, PTH208, PTH211

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import posixpath
import re
import shutil
import stat
from collections.abc import Iterable, Iterator, Mapping

from plugvisor.emulators.lab import errors
from plugvisor.emulators.lab.spec import Dir, Entry, File, Link, Node, Spec

LAB_DIR = ".plugvisor-lab"
"""The lab's private directory under the root: state, lock and staging area."""

TOP_LEVEL = ("sys", "dev", "proc")
"""The root's directories that belong to the lab as a whole."""

_SYSFS_HINTS = frozenset({"firmware", "power", "fs", "hypervisor", "block"})
_DEVFS_HINTS = frozenset({"pts", "shm", "mqueue", "hugepages", "stdin", "stdout", "stderr", "fd"})
"""Directories (or the ``/proc/self/fd`` links) a devfs has and a lab never writes."""
_PROCFS_HINTS = frozenset({"self", "cpuinfo", "uptime", "mounts"})
"""(Not ``meminfo``: the lab writes one, for readers of NUMA memory.)"""
_KERNEL_FILESYSTEMS = {"sysfs": "/sys", "devtmpfs": "/dev", "proc": "/proc", "devpts": "/dev"}
"""File system types only a kernel fills; a root on one of them is the real thing, bind-mounted or not."""
_REAL_TREES = ("/sys", "/dev", "/proc")
_SCRATCH = "/dev/shm/"
"""A tmpfs for scratch files, inside /dev by convention only; labs may live there."""
_MOUNTINFO = "/proc/self/mountinfo"
_OCTAL = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    r"""Undo mountinfo's octal escapes (``\040`` is a space, ``\134`` a backslash)."""
    return _OCTAL.sub(lambda match: chr(int(match[1], 8)), field)


def _filesystem_type(path: str) -> str | None:
    """Return the type of the file system ``path`` is on (its longest mount point), or None if unknown."""
    best, fstype = "", None
    try:
        with open(_MOUNTINFO, encoding="utf-8", errors="replace") as lines:
            for line in lines:
                fields = line.split()
                if "-" not in fields:
                    continue
                point = _unescape(fields[4])
                kind = fields[fields.index("-") + 1]
                inside = path == point or path.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, fstype = point, kind
    except OSError:
        return None
    return fstype


def _kernel_tree(path: str) -> str | None:
    """Return the real tree ``path`` *is*: on a kernel file system, or the host's own directory."""
    kernel = _KERNEL_FILESYSTEMS.get(_filesystem_type(path) or "")
    if kernel:
        return kernel
    for tree in _REAL_TREES:
        with contextlib.suppress(OSError):
            if os.path.samefile(path, tree):
                return tree
    return None


def _is_dir_or_link(path: str) -> bool:
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return False
    return stat.S_ISDIR(mode) or stat.S_ISLNK(mode)


def _looks_like_real(path: str) -> str | None:
    """Return which real tree ``path`` is or looks like, or None.

    Precise on purpose: a kernel file system (sysfs, devtmpfs, devpts, procfs), the host's own
    ``/sys``, ``/dev`` or ``/proc`` reached another way (a bind mount in a container, whose ``/dev``
    may be a plain tmpfs), or the layout only a kernel writes (``sys/firmware``, ``dev/pts``,
    ``proc/self``). A character device node is no sign: a lab made with ``--mknod``, or one with a
    profile's ``deviceNodes``, holds real ones.
    """
    try:
        names = set(os.listdir(path))
    except (FileNotFoundError, NotADirectoryError):
        return None
    kernel = _kernel_tree(path)
    if kernel:
        return kernel
    if "kernel" in names and "devices" in names and names & _SYSFS_HINTS:
        return "/sys"
    if any(_is_dir_or_link(posixpath.join(path, name)) for name in names & _DEVFS_HINTS):
        return "/dev"
    if names & _PROCFS_HINTS:
        return "/proc"
    return None


def check_root(root: str | os.PathLike[str]) -> str:
    """Return the resolved root, or raise :class:`~.errors.UnsafeRootError` if it must not be touched.

    Called before every create, change and delete, so an operator who points the
    lab at ``/`` (or at a chroot with the host's ``/sys`` bind-mounted in) gets a
    refusal instead of a wiped sysfs.
    """
    given = os.fspath(root)
    lexical = os.path.abspath(given)
    try:
        real = os.path.realpath(given, strict=False)
        _looks_like_real(real)
    except OSError as exc:
        raise errors.UnsafeRootError(
            f"lab root {given!r} cannot be resolved ({exc.strerror}); expected a directory the lab can own"
        ) from None
    for tree in _REAL_TREES:
        if not lexical.startswith(_SCRATCH) and (lexical == tree or lexical.startswith(tree + "/")):
            raise errors.UnsafeRootError(
                f"lab root {given!r} is inside the real {tree} (whatever it resolves to); "
                "refusing to write there"
            )
    if real == "/":
        raise errors.UnsafeRootError(f"lab root {given!r} is the file system root; refusing to write there")
    for tree in _REAL_TREES:
        if real.startswith(_SCRATCH):
            break
        if real == tree or real.startswith(tree + "/"):
            raise errors.UnsafeRootError(
                f"lab root {given!r} resolves to {real!r}, inside the real {tree}; refusing to write there"
            )
    what = _looks_like_real(real)
    if what:
        raise errors.UnsafeRootError(f"lab root {given!r} looks like a real {what}; refusing to write there")
    for top in TOP_LEVEL:
        sub = posixpath.join(real, top)
        if os.path.islink(sub):
            raise errors.UnsafeRootError(
                f"{sub!r} is a symlink (to {os.readlink(sub)!r}); a lab's {top}/ must be a plain directory"
            )
        if os.path.isdir(sub) and os.path.ismount(sub):
            raise errors.UnsafeRootError(f"{sub!r} is a mount point; it looks like a real /{top}, refusing")
        what = _looks_like_real(sub)
        if what:
            raise errors.UnsafeRootError(f"{sub!r} looks like a real {what}; refusing to write there")
    return real


def _ancestors(path: str) -> Iterator[str]:
    """Yield the strict ancestors of a relative path, nearest first."""
    while True:
        path = posixpath.dirname(path)
        if not path:
            return
        yield path


def _tops(dirs: Iterable[str]) -> list[str]:
    """Return the directories that have no ancestor among ``dirs``."""
    pool = set(dirs)
    return sorted(d for d in pool if not any(a in pool for a in _ancestors(d)))


def _check_rel(rel: str) -> None:
    """Refuse a spec path that could leave the root (absolute, ``..`` or empty components)."""
    if not rel or rel.startswith("/") or (".." in rel and ".." in rel.split("/")) or "//" in rel:
        raise errors.UnsafeRootError(f"lab path {rel!r} is not a plain path below the root; refusing it")


def _require_real_dir(path: str, info: os.stat_result) -> None:
    """Raise unless ``info`` (from ``lstat``) is a real directory: never a symlink, never a file."""
    if stat.S_ISLNK(info.st_mode):
        raise errors.UnsafeRootError(
            f"{path!r} is a symlink (to {os.readlink(path)!r}); the lab writes only through real "
            "directories inside its root"
        )
    if not stat.S_ISDIR(info.st_mode):
        raise errors.UnsafeRootError(f"{path!r} is not a directory; the lab expected one there")


def check_dir(root: str, rel: str) -> bool:
    """Return whether ``root/rel`` exists; raise if any part of it below ``root`` is not a real directory.

    Every lab write goes through directories checked here, component by component
    with ``lstat``, so a symlink planted anywhere inside the root (absolute,
    relative or dangling) can never carry a write out of it.
    """
    path = root
    for part in rel.split("/"):
        if not part:
            continue
        if part == "..":
            raise errors.UnsafeRootError(f"lab path {rel!r} climbs out of the root; refusing it")
        path = f"{path}/{part}"
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            return False
        _require_real_dir(path, info)
    return True


def ensure_dir(root: str, rel: str) -> str:
    """Create ``root/rel`` one real directory at a time, checking each part before going below it.

    See :func:`check_dir`: no part may be a symlink or a non-directory; the check
    runs on each component before anything is created under it.
    """
    os.makedirs(root, exist_ok=True)
    path = root
    for part in rel.split("/"):
        if not part:
            continue
        if part == "..":
            raise errors.UnsafeRootError(f"lab path {rel!r} climbs out of the root; refusing it")
        path = f"{path}/{part}"
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o755)
        info = os.lstat(path)
        _require_real_dir(path, info)
    return path


class FakeTree:
    """A safe, atomic writer for one lab root.

    All paths given to it are relative to the root and use ``/``.
    """

    def __init__(self, root: str | os.PathLike[str], *, mknod: bool = False) -> None:
        self.root = check_root(root)
        self.mknod = mknod
        self.lab_dir = posixpath.join(self.root, LAB_DIR)
        self.staging = posixpath.join(self.lab_dir, "tmp")
        self._counter = itertools.count()

    # -- small helpers -------------------------------------------------------------------------

    def abspath(self, rel: str) -> str:
        """Return the absolute path of a root-relative path."""
        return posixpath.join(self.root, rel)

    def _tmp(self, hint: str) -> str:
        ensure_dir(self.root, f"{LAB_DIR}/tmp")
        return posixpath.join(self.staging, f"{os.getpid()}-{next(self._counter)}-{posixpath.basename(hint)}")

    def _ensure_parent(self, rel: str, checked: set[str]) -> None:
        """Create the parent directories of ``rel``, refusing to follow a symlink out of the root."""
        _check_rel(rel)
        parent = posixpath.dirname(rel)
        if not parent or parent in checked:
            return
        ensure_dir(self.root, parent)
        checked.add(parent)
        checked.update(_ancestors(parent))

    def _create(self, full: str, entry: Entry) -> None:
        """Create one entry at an absolute path that does not exist yet."""
        if isinstance(entry, File):
            fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_EXCL, entry.mode)
            try:
                os.write(fd, entry.content)
                if entry.size > len(entry.content):
                    os.ftruncate(fd, entry.size)
            finally:
                os.close(fd)
        elif isinstance(entry, Link):
            os.symlink(entry.target, full)
        elif isinstance(entry, Node):
            if self.mknod:
                os.mknod(full, stat.S_IFCHR | entry.mode, os.makedev(entry.major, entry.minor))
            else:
                os.close(os.open(full, os.O_WRONLY | os.O_CREAT | os.O_EXCL, entry.mode))
            os.chmod(full, entry.mode)
        else:
            os.makedirs(full, mode=entry.mode, exist_ok=True)

    # -- bulk writing ----------------------------------------------------------------------------

    def materialize(self, spec: Mapping[str, Entry], base: str) -> None:
        """Write ``spec`` under the absolute directory ``base``, which nobody reads yet.

        Used for staging: the result is renamed into place afterwards, so there is
        no per-file atomicity to pay for here. Entries are created relative to an
        open directory descriptor, which spares the kernel a full path walk per
        file; with ``big``'s quarter of a million entries that is most of the cost.
        """
        os.makedirs(base, exist_ok=True)
        made: set[str] = {""}
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        dir_fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
        current = ""
        try:
            for rel, entry in spec.items():
                cut = rel.rfind("/")
                parent, name = (rel[:cut], rel[cut + 1 :]) if cut >= 0 else ("", rel)
                if parent not in made:
                    os.makedirs(base + "/" + parent, exist_ok=True)
                    made.add(parent)
                    made.update(_ancestors(parent))
                if isinstance(entry, Dir):
                    if rel not in made:
                        os.makedirs(base + "/" + rel, mode=entry.mode, exist_ok=True)
                        made.add(rel)
                    continue
                if parent != current:
                    os.close(dir_fd)
                    dir_fd = os.open(base + "/" + parent if parent else base, os.O_RDONLY | os.O_DIRECTORY)
                    current = parent
                if isinstance(entry, File):
                    fd = os.open(name, flags, entry.mode, dir_fd=dir_fd)
                    try:
                        os.write(fd, entry.content)
                        if entry.size > len(entry.content):
                            os.ftruncate(fd, entry.size)
                    finally:
                        os.close(fd)
                elif isinstance(entry, Link):
                    os.symlink(entry.target, name, dir_fd=dir_fd)
                else:
                    self._create(base + "/" + rel, entry)
        finally:
            os.close(dir_fd)

    def stage(self, spec: Mapping[str, Entry]) -> str:
        """Materialize ``spec`` in a fresh staging directory and return its absolute path."""
        for rel in spec:
            _check_rel(rel)
        base = self._tmp("stage")
        self.materialize(spec, base)
        return base

    def discard(self, path: str) -> None:
        """Delete a staging or trash directory."""
        shutil.rmtree(path, ignore_errors=True)

    def check_mknod(self) -> None:
        """Raise :class:`~.errors.MknodNotPermittedError` unless this process can create char nodes."""
        probe = self._tmp("mknod-probe")
        try:
            os.mknod(probe, stat.S_IFCHR | 0o600, os.makedev(1, 3))
        except PermissionError as exc:
            raise errors.MknodNotPermittedError(
                "--mknod needs CAP_MKNOD to create character device nodes, and this process lacks it "
                f"({exc.strerror}); run as root or in a privileged container, or drop --mknod for plain files"
            ) from exc
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(probe)

    # -- atomic single-entry changes --------------------------------------------------------------

    def put(self, rel: str, entry: Entry, checked: set[str] | None = None) -> None:
        """Create or replace one non-directory entry atomically (temporary name, then rename)."""
        self._ensure_parent(rel, checked if checked is not None else set())
        tmp = self._tmp(rel)
        self._create(tmp, entry)
        os.replace(tmp, self.abspath(rel))

    def remove(self, rel: str) -> None:
        """Remove one non-directory entry if it is there (never through a symlinked directory)."""
        _check_rel(rel)
        if not check_dir(self.root, posixpath.dirname(rel)):
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.abspath(rel))

    def remove_dir(self, rel: str) -> None:
        """Remove a directory in one step for readers: rename it away, then delete it."""
        _check_rel(rel)
        if not check_dir(self.root, posixpath.dirname(rel)):
            return
        full = self.abspath(rel)
        if not os.path.lexists(full):
            return
        if os.path.islink(full) or not os.path.isdir(full):
            os.unlink(full)
            return
        trash = self._tmp("trash")
        os.rename(full, trash)
        shutil.rmtree(trash, ignore_errors=True)

    def read(self, rel: str, limit: int = 1 << 20) -> bytes:
        """Return the content (at most ``limit`` bytes) of a regular file under the root, never via a link."""
        _check_rel(rel)
        check_dir(self.root, posixpath.dirname(rel))
        try:
            fd = os.open(self.abspath(rel), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise errors.UnsafeRootError(
                    f"{self.abspath(rel)!r} is a symlink; the lab reads only its own files"
                ) from None
            raise
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise errors.UnsafeRootError(f"{self.abspath(rel)!r} is not a regular file")
            return os.read(fd, limit)
        finally:
            os.close(fd)

    # -- the diff -------------------------------------------------------------------------------

    def apply(self, old: Mapping[str, Entry], new: Mapping[str, Entry]) -> None:
        """Change the tree from ``old`` to ``new``, writing only what differs.

        Order is chosen for readers: links into a disappearing device go before the
        device does, and a new device appears whole before any link points at it.
        """
        removed = [p for p in old if p not in new]
        changed = [p for p, e in new.items() if old.get(p) != e]
        removed_dirs = {p for p in removed if isinstance(old[p], Dir)}

        def inside(path: str, dirs: set[str]) -> bool:
            return any(a in dirs for a in _ancestors(path))

        leaves = [p for p in removed if p not in removed_dirs and not inside(p, removed_dirs)]
        leaves.sort(key=lambda p: not isinstance(old[p], Link))
        for rel in new:
            _check_rel(rel)
        for rel in leaves:
            self.remove(rel)
        for rel in reversed(_tops(removed_dirs)):
            self.remove_dir(rel)

        checked: set[str] = set()
        new_dirs = {p for p in changed if isinstance(new[p], Dir) and not os.path.isdir(self.abspath(p))}
        tops = _tops(new_dirs)
        top_set = set(tops)
        buckets: dict[str, Spec] = {top: {} for top in tops}
        rest: list[str] = []
        for rel in changed:
            owner = next((a for a in _ancestors(rel) if a in top_set), None)
            if owner is not None:
                buckets[owner][rel[len(owner) + 1 :]] = new[rel]
            elif rel not in top_set and not isinstance(new[rel], Dir):
                rest.append(rel)
            elif rel not in top_set:
                self._ensure_parent(rel, checked)
                ensure_dir(self.root, rel)
        for top in tops:
            self._ensure_parent(top, checked)
            staged = self.stage(buckets[top])
            os.chmod(staged, 0o755)  # noqa: S103 - sysfs directories are 0755
            os.rename(staged, self.abspath(top))
        rest.sort(key=lambda p: isinstance(new[p], Link))
        for rel in rest:
            self.put(rel, new[rel], checked)
