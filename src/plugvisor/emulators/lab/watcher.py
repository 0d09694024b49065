"""Making ``sriov_numvfs`` writable by anyone, the way the kernel's is.

On a real node, ``echo 8 > .../sriov_numvfs`` makes VFs appear; operators, CNI
plugins and people do exactly that, and the SR-IOV plugin's best-known bug
(sriov#276) is about what happens next. In the lab the attribute is a plain
file, so this watcher stands in for the kernel: it waits for a write to finish
(inotify ``IN_CLOSE_WRITE`` on each PF directory), applies it through
:meth:`.Lab.set_num_vfs`, and when the kernel would have refused the write
(EBUSY for N -> M, ERANGE beyond ``sriov_totalvfs``, EINVAL for junk) it puts
the old value back and logs why.

The lab's own writes are renames (``IN_MOVED_TO``), so the watcher never reacts
to itself. It follows plug/unplug by re-reading the state whenever the state
file is replaced, and by asking the kernel for each PF directory's watch again
every time: a re-plugged PF is a new directory, perhaps with the old one's inode
number (file systems reuse them), and only the kernel can tell the two apart
(``inotify_add_watch`` returns the existing watch for the same inode, a new one
otherwise).
"""

from __future__ import annotations

import asyncio
import contextlib
import posixpath
from pathlib import Path
from types import TracebackType

import structlog
from asyncinotify import Inotify, Mask, Watch

from plugvisor.emulators.lab import errors
from plugvisor.emulators.lab.lab import Lab
from plugvisor.emulators.lab.spec import File
from plugvisor.emulators.lab.state import STATE_FILE, DeviceKind
from plugvisor.emulators.lab.tree import LAB_DIR, FakeTree

log = structlog.get_logger("plugvisor.lab.watcher")

ATTRIBUTE = "sriov_numvfs"


def _inotify_watches(fd: int) -> set[tuple[int, int]]:
    """The (watch descriptor, inode) pairs the kernel holds for inotify instance ``fd`` of this process."""
    try:
        lines = Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines()
    except OSError:
        return set()
    pairs = set()
    for line in lines:
        if line.startswith("inotify "):
            fields = dict(item.split(":", 1) for item in line.split()[1:] if ":" in item)
            pairs.add((int(fields["wd"], 16), int(fields["ino"], 16)))  # both printed in hex
    return pairs


class NumVfsWatcher:
    """Applies writes to every PF's ``sriov_numvfs`` until stopped.

    Run it with :meth:`run` (and an ``asyncio.Event`` to stop it), or as an
    async context manager that starts it in a task and returns once every PF is
    watched.
    """

    def __init__(self, root: str | Path) -> None:
        self.lab = Lab.open(root)
        self._tree = FakeTree(self.lab.root)
        self._pf_dirs: dict[str, str] = {}
        self._watches: dict[str, Watch] = {}
        """PF directory -> its inotify watch (a re-plugged PF is another directory with another watch)."""
        self.applied = 0
        """Writes applied so far (for tests and the CLI's summary)."""
        self.rejected = 0
        """Writes refused and rolled back."""
        self._fd = -1
        self._stop = asyncio.Event()
        self._ready = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def _sync(self, inotify: Inotify) -> None:
        """Watch the directory of every PF that is plugged in now."""
        self._pf_dirs = {}
        for dev in self.lab.state().devices.values():
            if dev.kind is DeviceKind.NIC_PF and dev.present:
                path = str(self.lab.root / dev.primary.path)
                self._pf_dirs[path] = dev.name
        for path in list(self._watches):
            if path not in self._pf_dirs:
                self._forget(inotify, path)
        for path in self._pf_dirs:
            try:
                watch = inotify.add_watch(path, Mask.CLOSE_WRITE | Mask.ONLYDIR)
            except (FileNotFoundError, NotADirectoryError):
                continue  # unplugged again since the state was read: the next state change says so
            if self._watches.get(path) is not watch:
                self._forget(inotify, path)  # the directory it watched is gone (IN_IGNORED may be queued)
                self._watches[path] = watch

    def _forget(self, inotify: Inotify, path: str) -> None:
        watch = self._watches.pop(path, None)
        if watch is not None:
            with contextlib.suppress(OSError, KeyError, ValueError):  # the kernel dropped it already
                inotify.rm_watch(watch)

    def watching(self, pf_dir: str | Path) -> bool:
        """Whether writes in ``pf_dir`` (as it is now on disk) reach this watcher.

        Asks the kernel through /proc (the watch's device and inode) rather than comparing
        inode numbers alone, which a re-plugged directory may share with the one it replaced.
        """
        watch = self._watches.get(str(pf_dir))
        if watch is None:
            return False
        try:
            info = Path(pf_dir).stat()
        except OSError:
            return False
        return (watch.wd, info.st_ino) in _inotify_watches(self._fd)

    async def _apply(self, pf_dir: str) -> None:
        name = self._pf_dirs.get(pf_dir)
        if name is None:
            return
        rel = posixpath.relpath(posixpath.join(pf_dir, ATTRIBUTE), str(self.lab.root))
        raw = await asyncio.to_thread(self._tree.read, rel)
        current = self.lab.device(name).num_vfs or 0
        try:
            count = int(raw.decode().strip())
        except ValueError:
            await self._reject(rel, name, current, f"invalid argument {raw!r}; expected a decimal VF count")
            return
        if count == current:
            return
        try:
            await asyncio.to_thread(self.lab.set_num_vfs, name, count)
        except errors.LabError as exc:
            await self._reject(rel, name, current, str(exc))
            return
        self.applied += 1
        log.info("sriov_numvfs applied", pf=name, num_vfs=count)

    async def _reject(self, rel: str, name: str, current: int, reason: str) -> None:
        await asyncio.to_thread(self._tree.put, rel, File(f"{current}\n".encode(), 0o644))
        self.rejected += 1  # only once the old value is back: a writer waiting on this may write again
        log.warning("sriov_numvfs write refused, value restored", pf=name, num_vfs=current, reason=reason)

    async def run(self) -> None:
        """Watch until :meth:`stop` is called."""
        lab_dir = str(self.lab.root / LAB_DIR)
        state_name = posixpath.basename(STATE_FILE)
        with Inotify() as inotify:
            self._fd = inotify.fd
            inotify.add_watch(lab_dir, Mask.MOVED_TO | Mask.CLOSE_WRITE | Mask.ONLYDIR)
            self._sync(inotify)
            self._ready.set()
            log.info("watching sriov_numvfs", root=str(self.lab.root), pfs=len(self._pf_dirs))
            stop = asyncio.ensure_future(self._stop.wait())
            try:
                while not self._stop.is_set():
                    get = asyncio.ensure_future(inotify.get())
                    done, _ = await asyncio.wait({get, stop}, return_when=asyncio.FIRST_COMPLETED)
                    if get not in done:
                        get.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await get
                        break
                    event = get.result()
                    where = str(event.watch.path) if event.watch is not None else ""
                    if event.mask & Mask.IGNORED:
                        if self._watches.get(where) is event.watch:
                            del self._watches[where]  # its directory went; a re-plug changes the state too
                    elif where == lab_dir and event.name is not None and str(event.name) == state_name:
                        self._sync(inotify)
                    elif event.name is not None and str(event.name) == ATTRIBUTE:
                        await self._apply(where)
            finally:
                stop.cancel()

    def stop(self) -> None:
        """Ask :meth:`run` to return."""
        self._stop.set()

    async def __aenter__(self) -> NumVfsWatcher:
        self._task = asyncio.create_task(self.run())
        ready = asyncio.ensure_future(self._ready.wait())
        await asyncio.wait({ready, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if self._task.done():
            ready.cancel()
            self._task.result()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
        if self._task is not None:
            await self._task
