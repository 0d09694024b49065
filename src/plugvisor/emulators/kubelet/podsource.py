"""The pods directory: static-pod style, a manifest file per pod, watched with inotify.

This follows the kubelet's file source (``--pod-manifest-path``): every
non-hidden regular file in the directory is one Pod manifest; each change
re-reads the directory and the result *is* the set of pods from this source, so
a removed file terminates its pod, an edited file (new content, new UID) is a
new pod, and a file that no longer parses drops its pod too. Bad manifests are
reported (once per content) and never stop the emulator.

Editors and ``kubectl``-like tools write files in several steps; the watcher
waits for a short quiet period before re-reading, so a half-written file is
not reported as invalid more than the upstream kubelet would.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from asyncinotify import Inotify, Mask

from plugvisor.emulators.kubelet import manifest

QUIET_PERIOD: Final = 0.05
"""Seconds without further events before the directory is read again."""

_MASK: Final = (
    Mask.CREATE | Mask.CLOSE_WRITE | Mask.MOVED_TO | Mask.MOVED_FROM | Mask.DELETE | Mask.MODIFY | Mask.ATTRIB
)


@dataclass(frozen=True, slots=True)
class ScanResult:
    """What one read of the directory found: valid pods by file, and files that are not valid pods."""

    pods: dict[str, manifest.PodSpec] = field(default_factory=dict)
    invalid: dict[str, str] = field(default_factory=dict)
    """Path to error message."""


def scan(directory: Path, *, node_name: str, kubelet_version: str) -> ScanResult:
    """Read every non-hidden regular file of ``directory`` as a static Pod manifest."""
    result = ScanResult()
    if not directory.is_dir():
        return result
    for path in sorted(directory.iterdir()):
        if path.name.startswith(".") or not path.is_file():
            continue
        source = str(path)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            result.invalid[source] = f"{source}: cannot read: {error}"
            continue
        try:
            result.pods[source] = manifest.parse_manifest(
                text, source=source, node_name=node_name, kubelet_version=kubelet_version, static=True
            )
        except manifest.ManifestError as error:
            digest = hashlib.sha256(text.encode()).hexdigest()[:12]
            result.invalid[source + "#" + digest] = str(error)
    return result


class DirectoryWatcher:
    """Calls ``on_change`` whenever the directory's content changed (after a quiet period)."""

    def __init__(self, directory: Path, on_change: Callable[[], Awaitable[None]]) -> None:
        self.directory = directory
        self._on_change = on_change
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Create the directory if needed and start watching it."""
        self.directory.mkdir(parents=True, exist_ok=True)
        inotify = Inotify()
        inotify.add_watch(self.directory, _MASK)
        self._task = asyncio.create_task(self._run(inotify), name=f"pods dir {self.directory}")

    async def stop(self) -> None:
        """Stop watching."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self, inotify: Inotify) -> None:
        with inotify:
            while True:
                await inotify.get()
                while True:  # drain a burst of events before reading the directory
                    # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow a
                    # cancellation that arrives as the read completes, and stop() would hang.
                    try:
                        async with asyncio.timeout(QUIET_PERIOD):
                            await inotify.get()
                    except TimeoutError:
                        break
                await self._on_change()
