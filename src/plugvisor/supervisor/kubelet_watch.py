"""Noticing kubelet restarts from the agent, through the kubelet-directory watch the plugins use too.

Either sign of a restart is enough (see :mod:`plugvisor.common.kubeletdir`): a
``kubelet.sock`` created, or one of our children's sockets removed while that
child was not stopping. The children watch for the same signs themselves; the
agent watches too so that it can report restarts, know which children have lost
their registration, and (policy ``restart``) restart them at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path

import structlog

from plugvisor.common.kubeletdir import DirChange, DirEvent, KubeletDirWatch
from plugvisor.common.sockets import is_plugvisor_socket

KubeletStarted = Callable[[float | None], None]
"""Called with the new ``kubelet.sock``'s change time (wall clock), or None if it is already gone."""
SocketDeleted = Callable[[str], None]
"""Called with the file name of a removed ``plugvisor-*.sock``."""


class KubeletWatch:
    """Calls back on kubelet starts and on the removal of any of our plugin sockets."""

    def __init__(
        self, kubelet_dir: Path, *, on_kubelet_started: KubeletStarted, on_socket_deleted: SocketDeleted
    ):
        self.kubelet_dir = kubelet_dir
        self._on_kubelet_started = on_kubelet_started
        self._on_socket_deleted = on_socket_deleted
        self._log = structlog.get_logger("plugvisor.supervisor.kubelet_watch")
        # The directory's own lines (created, deleted, events lost) are said by every plugin too.
        self._watch = KubeletDirWatch(kubelet_dir, self._on_event, log=self._log.bind(process="agent"))
        self._kubelet_inode: int | None = None
        self._task: asyncio.Task[None] | None = None

    def open(self) -> None:
        """Start watching (creating the directory as the kubelet would) on the running loop."""
        self._watch.open()
        with contextlib.suppress(OSError):
            self._kubelet_inode = self._watch.kubelet_socket.stat().st_ino
        if self._kubelet_inode is None:
            # Said once, for every child: they say it to the agent, which shows it per resource.
            self._log.warning(
                "waiting_for_kubelet",
                socket=str(self._watch.kubelet_socket),
                meaning="no kubelet listens there: the kubelet is not running, or kubeletDir is not its "
                "directory; resources register once one does",
            )
        self._task = asyncio.get_running_loop().create_task(self._watch.run(), name="kubelet-watch")

    def _on_event(self, event: DirEvent) -> None:
        if event.change is DirChange.FILE_REMOVED:
            if is_plugvisor_socket(event.name):
                self._watch.hurry()  # every child's socket counts: no pause in a burst of them
                self._on_socket_deleted(event.name)
            return
        if event.change not in (DirChange.KUBELET_SOCKET_CREATED, DirChange.EVENTS_LOST):
            return
        self._watch.hurry()
        socket = self._watch.kubelet_socket
        try:
            st = socket.stat()
        except OSError:
            inode: int | None = None
            changed: float | None = None
        else:
            inode, changed = st.st_ino, st.st_ctime
        if event.change is DirChange.EVENTS_LOST and (inode is None or inode == self._kubelet_inode):
            return  # events were dropped, but kubelet.sock is the one we knew: no start to report
        self._kubelet_inode = inode
        seen = "after lost events" if event.change is DirChange.EVENTS_LOST else "created"
        self._log.info("kubelet_started", socket=str(socket), seen=seen)
        self._on_kubelet_started(changed)

    async def close(self) -> None:
        """Stop watching."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._watch.close()
