"""The kubelet's view as a JSON file, written atomically and off the hot path.

Scripts, shell tests and the demo read ``<DIR>.kubelet.json`` instead of talking
gRPC. Two properties matter:

* **Atomic**: the file is written to a temporary name in the same directory and
  renamed over the old one, so a reader never sees half a document.
* **Off the hot path**: a state change only marks the view dirty; one background
  task snapshots the state and writes it, so a burst of ListAndWatch updates
  costs one write, and no update waits on the disk.

The file sits *beside* the socket directory on purpose: the kubelet's restart
cleanup would never touch it anyway (it is no socket), but keeping the socket
directory free of our files keeps it looking like the real one.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from plugvisor.emulators.kubelet import model

JsonObject = dict[str, object]

RECENT_EVENTS = 100
"""How many of the latest events the file carries."""


def default_view_path(socket_dir: Path) -> Path:
    """Return ``<DIR>.kubelet.json``: the file next to the socket directory."""
    return socket_dir.with_name(socket_dir.name + ".kubelet.json")


def _iso(wall: float) -> str:
    return datetime.datetime.fromtimestamp(wall, tz=datetime.UTC).isoformat()


def render_resource(view: model.ResourceView) -> JsonObject:
    """Describe one resource as plain JSON data."""
    options = view.options
    return {
        "capacity": view.capacity,
        "allocatable": view.allocatable,
        "registered": view.registered,
        "removed": view.removed,
        "endpoint": view.endpoint,
        "topology_aware": view.topology_aware,
        "options": None
        if options is None
        else {
            "pre_start_required": options.pre_start_required,
            "get_preferred_allocation_available": options.get_preferred_allocation_available,
        },
        "devices": [
            {
                "id": device.id,
                "health": device.health,
                "reported_health": device.reported_health,
                "numa": list(device.numa_nodes),
            }
            for device in view.devices.values()
        ],
    }


def render_event(event: model.Event) -> JsonObject:
    """Describe one event as plain JSON data."""
    return {
        "kind": str(event.kind),
        "message": event.message,
        "resource": event.resource,
        "time": _iso(event.wall),
        "generation": event.generation,
        "fields": dict(event.fields),
    }


def render(
    *,
    kubelet: JsonObject,
    resources: Mapping[str, model.ResourceView],
    allocations: Iterable[JsonObject],
    events: Iterable[model.Event],
) -> JsonObject:
    """Assemble the whole document; ``events`` should already be the recent ones."""
    return {
        "kubelet": kubelet,
        "resources": {name: render_resource(view) for name, view in sorted(resources.items())},
        "allocations": list(allocations),
        "events": [render_event(event) for event in events],
    }


def write_atomically(path: Path, document: JsonObject) -> None:
    """Write ``document`` to ``path`` through a temporary file and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # A unique name per write: a cancelled write may still be running in its thread.
    handle, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    temporary = Path(name)
    os.fchmod(handle, 0o644)  # mkstemp's 0600 would hide the view from scripts of other users
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            json.dump(document, stream, indent=2, sort_keys=False)
            stream.write("\n")
        temporary.replace(path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


class ViewWriter:
    """Coalesces change notifications into background writes of one JSON document."""

    def __init__(
        self,
        path: Path,
        snapshot: Callable[[], JsonObject],
        on_error: Callable[[Path, OSError], None] | None = None,
    ) -> None:
        self.path = path
        self._snapshot = snapshot
        self._on_error = on_error
        """Told of a write that failed (a full disk, a removed directory); the writer goes on either way."""
        self._failing: str | None = None
        """The failure last reported: a file that stays unwritable is reported once, not on every change."""
        self._dirty = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._writing = False
        self._written = asyncio.Event()
        # One write at a time, snapshot taken under the lock: a later write always
        # carries a later state, so renames can never land out of order.
        self._lock = asyncio.Lock()
        self.writes = 0
        """How many times the file was written (for tests of the coalescing)."""

    def mark_dirty(self) -> None:
        """Note that the state changed; cheap, callable from any state-changing code."""
        self._dirty.set()

    def start(self) -> None:
        """Start the background writer (idempotent)."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name=f"view writer {self.path}")

    async def stop(self) -> None:
        """Stop the writer, then write the final state once."""
        task, self._task = self._task, None
        if task is not None:
            async with self._lock:  # never cancel a write half-way: its thread would go on
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.flush()

    async def flush(self) -> None:
        """Write the current state now and wait until it is on disk, or until the write failed (reported)."""
        async with self._lock:
            self._dirty.clear()
            document = self._snapshot()
            self._writing = True
            try:
                await asyncio.to_thread(write_atomically, self.path, document)
                self._failing = None
            except OSError as error:
                if str(error) != self._failing:
                    self._failing = str(error)
                    if self._on_error is not None:
                        self._on_error(self.path, error)
            finally:
                self._writing = False
                self.writes += 1
                written, self._written = self._written, asyncio.Event()
                written.set()

    async def settled(self) -> None:
        """Wait until every change marked so far is on disk (the writer must be running)."""
        while self._dirty.is_set() or self._writing:
            await self._written.wait()

    async def _run(self) -> None:
        while True:
            await self._dirty.wait()
            # Let the rest of a burst of callbacks land before taking the snapshot.
            await asyncio.sleep(0)
            await self.flush()
