"""What ``plugvisor status`` reads: a JSON state file in the runtime directory.

The supervisor rewrites ``<runtimeDir>/state.json`` (atomically, by rename)
whenever something a reader would see changes: a state, a PID, a registration,
a device count, a restart. A file was chosen over a control socket because it
needs no protocol, works for any reader with permission (``jq`` included), and
keeps ``plugvisor status`` working while the supervisor is busy; the PID in the
file tells a live agent from a stale file. Uptimes are computed by the reader
from the start times, so the file need not be rewritten as time passes.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import stat
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from plugvisor.common import monitoring
from plugvisor.common.atomicfile import write_atomically
from plugvisor.common.validation import printable, shorten

STATE_FILE: Final = "state.json"
STALE_STATE_FILE: Final = "state.stale.json"
PID_FILE: Final = "supervisor.pid"
REPORT_SOCKET: Final = "status.sock"
METRICS_DIR: Final = "prometheus"
MONITOR_DIR: Final = "monitor"


class NoAgentError(Exception):
    """No running supervisor uses that runtime directory (the message says what was found)."""


class BadStateError(NoAgentError):
    """The state file is there but is not what the agent writes (edited, truncated, another program's)."""


_CHILD_FIELDS: Final = {
    "resource": (str,),
    "state": (str,),
    "pid": (int, type(None)),
    "restarts": (int,),
    "registered": (bool,),
    "crash_looping": (bool,),
    "started_at": (int, float, type(None)),
    "last_exit": (dict, type(None)),
    "devices": (dict, type(None)),
}


def _shape_problem(document: Any) -> str | None:  # noqa: PLR0911 - one return per problem found
    """Where ``document`` differs from what :func:`render` needs, or ``None``."""
    if not isinstance(document, dict):
        return f"top level is {type(document).__name__}, expected an object"
    supervisor = document.get("supervisor")
    if not isinstance(supervisor, dict) or type(supervisor.get("pid")) is not int:
        return "supervisor.pid: expected an integer"
    if not isinstance(supervisor.get("started_at", 0), int | float):
        return "supervisor.started_at: expected a number"
    children = document.get("children", [])
    if not isinstance(children, list):
        return "children: expected a list"
    for index, child in enumerate(children):
        if not isinstance(child, dict):
            return f"children[{index}]: expected an object"
        for key, types in _CHILD_FIELDS.items():
            if key in ("resource", "state") and key not in child:
                return f"children[{index}].{key}: missing"
            if key in child and not isinstance(child[key], types):
                return f"children[{index}].{key}: unexpected {type(child[key]).__name__}"
        last = child.get("last_exit")
        if last is not None and not {"cause", "status"} <= last.keys():
            return f"children[{index}].last_exit: expected cause and status"
        devices = child.get("devices")
        if devices is not None and not all(isinstance(devices.get(k), int) for k in ("healthy", "total")):
            return f"children[{index}].devices: expected integer healthy and total"
    return None


def write_state(runtime_dir: Path, document: dict[str, Any]) -> None:
    """Replace the state file atomically (readers never see half a file).

    When the new state cannot be written (a full disk), the last one is renamed
    to :data:`STALE_STATE_FILE` (a rename needs no space), so that readers show
    it as what it is, the state as of its modification time, rather than as the
    present; the next write that succeeds removes it.
    """
    target = runtime_dir / STATE_FILE
    try:
        # An unpredictable temporary name, never followed if planted as a link (a runtime
        # directory an operator made world-writable); removed if the write fails (a full disk).
        # One line: with ``indent`` Python's json falls back to its pure-Python encoder, 5-10x slower,
        # and the agent writes this after changes of any of up to 256 children (`status --json`
        # prints it indented for people).
        content = json.dumps(document, sort_keys=True) + "\n"
        write_atomically(target, content.encode(), durable=False)
    except OSError:
        with contextlib.suppress(OSError):
            target.replace(runtime_dir / STALE_STATE_FILE)
        raise
    with contextlib.suppress(FileNotFoundError):
        (runtime_dir / STALE_STATE_FILE).unlink()


def remove_state(runtime_dir: Path) -> None:
    """Remove the state file (the supervisor stopped)."""
    for name in (STATE_FILE, STALE_STATE_FILE):
        with contextlib.suppress(FileNotFoundError):
            (runtime_dir / name).unlink()


def open_pid_file(path: Path, flags: int) -> int:
    """Open ``supervisor.pid`` with ``flags``; a link or anything but a regular file is a RuntimeError.

    Never blocking (a FIFO there would hang the agent's start and ``plugvisor
    status``) and never through a link (root would write its PID into its target).
    """
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        why = "a symbolic link" if exc.errno == errno.ELOOP else exc.strerror
        raise RuntimeError(f"{path}: cannot open it ({why}); expected a regular file") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise RuntimeError(f"{path}: not a regular file; expected a regular file (remove it)")
    os.set_blocking(fd, True)
    return fd


def lock_holder(runtime_dir: Path) -> str | None:
    """The PID (as written, possibly empty) of the live agent that owns ``runtime_dir``, or None.

    The agent holds an exclusive lock on ``supervisor.pid`` for its whole life and
    wrote its PID into it; a shared lock we can take means nobody holds that one.
    (The agent retries its own lock for a moment, so this brief probe never makes
    a starting agent fail.) An empty PID: the agent could not write it (a full
    disk); the lock still says it runs.
    """
    try:
        with os.fdopen(open_pid_file(runtime_dir / PID_FILE, os.O_RDONLY)) as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return handle.read(64).strip()
            fcntl.flock(handle, fcntl.LOCK_UN)
    except (OSError, RuntimeError):  # missing, or not the agent's file: no agent holds it
        pass
    return None


def agent_holds_lock(runtime_dir: Path, pid: int) -> bool:
    """Whether a live agent with ``pid`` owns ``runtime_dir``.

    A PID alone proves nothing: after a reboot or a crash any process may have it.
    """
    return lock_holder(runtime_dir) in ("", str(pid))


MAX_STATE_BYTES: Final = 64 * 2**20
"""The largest state file read: an agent with thousands of resources writes a few MiB; more is not one."""


def read_state(runtime_dir: Path, *, now: float | None = None) -> dict[str, Any]:
    """The running agent's state, with uptimes as of ``now``; raises :class:`NoAgentError`.

    A state the agent could not replace (see :func:`write_state`) comes with
    ``stale: {"written_at": <its modification time>}``; a fresh one with ``stale: null``.
    """
    path = runtime_dir / STATE_FILE
    stale_path = runtime_dir / STALE_STATE_FILE
    if not path.exists() and stale_path.exists():
        path = stale_path
    if path.exists() and not path.is_file():  # a FIFO would block the reader forever
        raise BadStateError(f"{path} is not a plugvisor agent state file: not a regular file")
    try:
        written_at = path.stat().st_mtime
        with path.open("rb") as handle:
            content = handle.read(MAX_STATE_BYTES + 1)
        if len(content) > MAX_STATE_BYTES:
            raise BadStateError(
                f"{path} is not a plugvisor agent state file: larger than {MAX_STATE_BYTES:,} bytes"
            )
        document: dict[str, Any] = json.loads(content)
    except FileNotFoundError:
        holder = lock_holder(runtime_dir)
        if holder is not None:
            raise NoAgentError(
                f"the plugvisor agent{f' (pid {holder})' if holder else ''} runs but has no state file in "
                f"{runtime_dir}: it could not write one (no space left there? its log says "
                "state_write_failed)"
            ) from None
        raise NoAgentError(
            f"no plugvisor agent state in {runtime_dir} (is `plugvisor run` running?)"
        ) from None
    except OSError as exc:
        raise NoAgentError(f"cannot read {path}: {exc.strerror or exc}") from None
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, nested absurdly deep
        raise BadStateError(f"{path} is not a plugvisor agent state file: {exc}") from None
    problem = _shape_problem(document)
    if problem is not None:
        raise BadStateError(f"{path} is not a plugvisor agent state file: {problem}")
    pid = document.get("supervisor", {}).get("pid")
    if not isinstance(pid, int) or not agent_holds_lock(runtime_dir, pid):
        raise NoAgentError(f"{path} is stale: no agent with PID {pid} holds {runtime_dir / PID_FILE}")
    document["stale"] = {"written_at": written_at} if path == stale_path else None
    now = time.time() if now is None else now
    supervisor = document["supervisor"]
    if isinstance(supervisor.get("started_at"), int | float):
        supervisor["uptime"] = round(now - supervisor["started_at"], 3)
    for child in document.get("children", []):
        started = child.get("started_at")
        child["uptime"] = round(now - started, 3) if isinstance(started, int | float) else None
    return document


def attach_devices(document: dict[str, Any], runtime_dir: Path) -> dict[str, Any]:
    """Add each child's devices (health, cause, holders) and the PodResources poller's state.

    Read from the monitor directory the children write (``plugvisor.common.monitoring``);
    a child whose report is missing or from an earlier process gets ``devices_detail: null``.
    """
    monitor_dir = runtime_dir / MONITOR_DIR
    owners = monitoring.read_owners(monitor_dir)
    holders = owners.holders if owners is not None else {}
    for child in document.get("children", []):
        report = monitoring.read_report(monitor_dir, child["resource"])
        if report is None or not child.get("pid") or report.pid != child["pid"]:
            child["devices_detail"] = None
            continue
        child["devices_detail"] = [
            {
                "id": device.id,
                "healthy": device.healthy,
                "cause": device.description.cause,
                "numa_nodes": list(device.numa_nodes),
                "pci_address": device.description.pci_address or None,
                "holders": [
                    {"namespace": h.namespace, "pod": h.pod, "container": h.container}
                    for h in holders.get((child["resource"], device.id), ())
                ],
            }
            for device in report.devices
        ]
    document["pod_resources"] = (
        None
        if owners is None
        else {"up": owners.up, "error": owners.error, "last_success": owners.last_success, "pid": owners.pid}
    )
    return document


def _device_lines(document: dict[str, Any]) -> list[str]:
    """Held and unhealthy devices, one per line (free healthy ones are left out: there may be thousands)."""
    rows = [("RESOURCE", "DEVICE", "HEALTH", "HELD BY (namespace/pod/container)")]
    for child in document.get("children", []):
        for device in child.get("devices_detail") or []:
            held = ", ".join(f"{h['namespace']}/{h['pod']}/{h['container']}" for h in device["holders"])
            if device["healthy"] and not held:
                continue
            health = "healthy" if device["healthy"] else f"unhealthy: {device['cause'] or 'unknown'}"
            rows.append((child["resource"], device["id"], health, held or "-"))
    lines: list[str] = []
    pod_resources = document.get("pod_resources")
    if pod_resources is not None and not pod_resources["up"]:
        lines.append(printable(f"PodResources unavailable ({pod_resources['error']}): holders as last seen"))
    if len(rows) == 1:
        return lines
    lines.append("devices held or unhealthy:")
    return lines + _table(rows)


def _table(rows: Sequence[tuple[str, ...]]) -> list[str]:
    """``rows`` in aligned columns, every cell escaped (:func:`~plugvisor.common.validation.printable`).

    Names come from the kubelet (pods, namespaces, containers) and from plugins
    (device IDs, causes): a newline or an escape sequence in one must not reach the
    terminal as such.
    """
    cells = [tuple(printable(cell) for cell in row) for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in cells
    ]


def _not_registered_lines(children: list[dict[str, Any]]) -> list[str]:
    """Why each resource that is not registered is not, when its process said so.

    A process that failed said why in its last words (``last_exit.error``):
    that line is shown for a resource in backoff or starting again, so that a
    crash loop's cause is here, not only in the log.
    """
    lines = []
    for child in children:
        if child.get("registered"):
            continue
        last = child.get("last_exit") or {}
        failed = f"{last.get('cause')} ({last.get('status')}): {last.get('error')}"
        if child.get("state") not in ("STARTING", "RUNNING"):
            if last.get("error"):
                lines.append(printable(f"  {child['resource']}: {failed}"))
            continue
        if child.get("taken_over_by"):
            why = (
                f"taken over by {child['taken_over_by']} (another plugin of this resource, a second agent?); "
                "standing by, registers again when it stops"
            )
        elif child.get("waiting"):
            why = f"waiting for {child['waiting']}"
        elif child.get("unregistered_reason"):
            why = f"registering again: {child['unregistered_reason']}"
        elif last.get("error"):
            why = failed
        else:
            continue
        lines.append(printable(f"  {child['resource']}: {why}"))
    return ["not registered:", *lines] if lines else []


def _polling_lines(children: list[dict[str, Any]]) -> list[str]:
    """Why the children that watch by polling do (one line per reason: 200 children share one)."""
    by_reason: dict[str, list[str]] = {}
    for child in children:
        if child.get("watch") == "polling":
            by_reason.setdefault(str(child.get("watch_reason") or "-"), []).append(str(child["resource"]))
    lines = []
    for reason, resources in by_reason.items():
        named = shorten(", ".join(resources), 200)
        lines.append(printable(f"  {len(resources)} ({named}): {shorten(reason, 300)}"))
    if not lines:
        return []
    return ["watching files by polling, not inotify (changes are seen later, nothing is lost):", *lines]


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"


def render(document: dict[str, Any]) -> str:
    """The human view: one header line, then one row per child."""
    supervisor = document["supervisor"]
    children = document.get("children", [])
    registered = sum(1 for child in children if child.get("registered"))
    lines = [
        printable(
            f"plugvisor agent pid {supervisor['pid']}, up {_duration(supervisor.get('uptime'))}, "
            f"{registered}/{len(children)} resources registered, "
            f"{supervisor.get('kubelet_restarts', 0)} kubelet restarts seen, "
            f"config {supervisor.get('config')}"
        )
    ]
    fallback = supervisor.get("spawner_fallback")
    if fallback:
        lines.append(
            printable(
                f"fork server unavailable ({shorten(str(fallback), 300)}): children are started by exec, "
                "slower to start; restart the agent to bring the fork server back"
            )
        )
    rejected = supervisor.get("reload_rejected")
    if isinstance(rejected, dict):
        at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rejected.get("at") or 0))
        lines.append(
            printable(
                f"last reload (SIGHUP) rejected at {at}, running the previous configuration: "
                f"{shorten(str(rejected.get('error')), 600)}"
            )
        )
    stale = document.get("stale")
    if stale is not None:
        written = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stale["written_at"]))
        lines.insert(
            0,
            f"STALE: the agent could not write its state since {written} (no space left? its log says "
            "state_write_failed); below is the state as of then",
        )
    header = ("RESOURCE", "STATE", "PID", "UPTIME", "RESTARTS", "LAST EXIT", "DEVICES", "WATCH")
    rows = [header]
    for child in children:
        state = child["state"]
        if child.get("crash_looping"):
            state += " (crash loop)"
        if child.get("taken_over_by"):
            state += " (taken over)"
        elif child.get("waiting") and not child.get("registered"):
            state += " (waiting)"
        elif child["state"] == "RUNNING" and not child.get("registered"):
            state += " (re-registering)"
        last = child.get("last_exit")
        last_exit = "-" if last is None else f"{last['cause']} ({last['status']})"
        devices = child.get("devices")
        counts = "-" if devices is None else f"{devices['healthy']}/{devices['total']}"
        if child.get("slices"):  # a DRA driver: where its ResourceSlices stand
            counts += f", slices {shorten(str(child['slices']), 60)}"
        rows.append(
            (
                child["resource"],
                state,
                str(child["pid"]) if child.get("pid") else "-",
                _duration(child.get("uptime")),
                str(child.get("restarts", 0)),
                last_exit,
                counts,
                child.get("watch") or "-",
            )
        )
    lines += _table(rows)
    lines += _polling_lines(children)
    lines += _not_registered_lines(children)
    nothing = [child["resource"] for child in children if child.get("matches_no_device")]
    if nothing:
        lines.append("no device found (check the kind's vendor, class or paths, and hostRoot):")
        lines += [printable(f"  {resource}: matches no device") for resource in nothing]
    lines += _device_lines(document)
    return "\n".join(lines)
