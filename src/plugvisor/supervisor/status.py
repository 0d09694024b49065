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
import json
import os
import time
from pathlib import Path
from typing import Any, Final

STATE_FILE: Final = "state.json"
PID_FILE: Final = "supervisor.pid"
REPORT_SOCKET: Final = "status.sock"
METRICS_DIR: Final = "prometheus"


class NoAgentError(Exception):
    """No running supervisor uses that runtime directory (the message says what was found)."""


def write_state(runtime_dir: Path, document: dict[str, Any]) -> None:
    """Replace the state file atomically (readers never see half a file)."""
    target = runtime_dir / STATE_FILE
    temporary = runtime_dir / f".{STATE_FILE}.{os.getpid()}"
    temporary.write_text(json.dumps(document, indent=1, sort_keys=True) + "\n")
    temporary.chmod(0o644)
    temporary.replace(target)


def remove_state(runtime_dir: Path) -> None:
    """Remove the state file (the supervisor stopped)."""
    with contextlib.suppress(FileNotFoundError):
        (runtime_dir / STATE_FILE).unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_state(runtime_dir: Path, *, now: float | None = None) -> dict[str, Any]:
    """The running agent's state, with uptimes as of ``now``; raises :class:`NoAgentError`."""
    path = runtime_dir / STATE_FILE
    try:
        document: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        raise NoAgentError(
            f"no plugvisor agent state in {runtime_dir} (is `plugvisor run` running?)"
        ) from None
    except (OSError, ValueError) as exc:
        raise NoAgentError(f"cannot read {path}: {exc}") from None
    pid = document.get("supervisor", {}).get("pid")
    if not isinstance(pid, int) or not _alive(pid):
        raise NoAgentError(f"{path} is stale: supervisor PID {pid} is not running")
    now = time.time() if now is None else now
    supervisor = document["supervisor"]
    if isinstance(supervisor.get("started_at"), int | float):
        supervisor["uptime"] = round(now - supervisor["started_at"], 3)
    for child in document.get("children", []):
        started = child.get("started_at")
        child["uptime"] = round(now - started, 3) if isinstance(started, int | float) else None
    return document


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
        f"plugvisor agent pid {supervisor['pid']}, up {_duration(supervisor.get('uptime'))}, "
        f"{registered}/{len(children)} resources registered, "
        f"{supervisor.get('kubelet_restarts', 0)} kubelet restarts seen, config {supervisor.get('config')}"
    ]
    header = ("RESOURCE", "STATE", "PID", "UPTIME", "RESTARTS", "LAST EXIT", "DEVICES")
    rows = [header]
    for child in children:
        state = child["state"]
        if child.get("crash_looping"):
            state += " (crash loop)"
        if child["state"] == "RUNNING" and not child.get("registered"):
            state += " (re-registering)"
        last = child.get("last_exit")
        last_exit = "-" if last is None else f"{last['cause']} ({last['status']})"
        devices = child.get("devices")
        rows.append(
            (
                child["resource"],
                state,
                str(child["pid"]) if child.get("pid") else "-",
                _duration(child.get("uptime")),
                str(child.get("restarts", 0)),
                last_exit,
                "-" if devices is None else f"{devices['healthy']}/{devices['total']}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines)
