"""Noticing kubelet restarts from the supervisor, with inotify on the device-plugins directory.

A starting kubelet deletes every socket in the directory and then listens on a
new ``kubelet.sock`` (kubelet-facts.md, 3.1). Either sign is enough: a
``kubelet.sock`` created, or one of our children's sockets deleted while that
child was not stopping. The children watch for the same signs themselves; the
supervisor watches too so that it can report restarts, know which children
have lost their registration, and (policy ``restart``) restart them at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Final

import structlog
from asyncinotify import Inotify, Mask

from plugvisor.api import constants
from plugvisor.supervisor.config import SOCKET_PREFIX

KUBELET_SOCKET: Final = constants.KUBELET_SOCKET_NAME

KubeletStarted = Callable[[float | None], None]
"""Called with the new ``kubelet.sock``'s change time (wall clock), or None if it is already gone."""
SocketDeleted = Callable[[str], None]
"""Called with the file name of a deleted ``plugvisor-*.sock``."""


class KubeletWatch:
    """inotify on the kubelet's directory, calling back on kubelet starts and our sockets' deletion."""

    def __init__(
        self, kubelet_dir: Path, *, on_kubelet_started: KubeletStarted, on_socket_deleted: SocketDeleted
    ):
        self.kubelet_dir = kubelet_dir
        self._on_kubelet_started = on_kubelet_started
        self._on_socket_deleted = on_socket_deleted
        self._inotify: Inotify | None = None
        self._task: asyncio.Task[None] | None = None
        self._log = structlog.get_logger("plugvisor.supervisor.kubelet_watch")

    def open(self) -> None:
        """Start watching (creating the directory as the kubelet would, mode 0750)."""
        self.kubelet_dir.mkdir(mode=0o750, parents=True, exist_ok=True)
        inotify = Inotify(sync_timeout=0)
        inotify.add_watch(self.kubelet_dir, Mask.CREATE | Mask.MOVED_TO | Mask.DELETE | Mask.ONLYDIR)
        self._inotify = inotify
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kubelet-watch")

    async def _run(self) -> None:
        assert self._inotify is not None
        async for event in self._inotify:
            name = str(event.name) if event.name is not None else ""
            if event.mask & (Mask.CREATE | Mask.MOVED_TO) and name == KUBELET_SOCKET:
                try:
                    changed: float | None = (self.kubelet_dir / KUBELET_SOCKET).stat().st_ctime
                except OSError:
                    changed = None
                self._log.info("kubelet_started", socket=str(self.kubelet_dir / KUBELET_SOCKET))
                self._on_kubelet_started(changed)
            elif event.mask & Mask.DELETE and name.startswith(SOCKET_PREFIX) and name.endswith(".sock"):
                self._on_socket_deleted(name)

    async def close(self) -> None:
        """Stop watching."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._inotify is not None:
            self._inotify.close()
            self._inotify = None
