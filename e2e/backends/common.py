"""What every backend shares: the interface the scenarios are written against, progress, waiting."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

from ..deployment import Worker

IMAGE = "plugvisor:e2e"
T = TypeVar("T")

POD_SCRIPT = (
    "import glob, json, os, stat, time\n"
    "nodes = sorted(p for p in glob.glob('/dev/**', recursive=True) if stat.S_ISCHR(os.lstat(p).st_mode))\n"
    "print(json.dumps({'devices': nodes, 'env': dict(os.environ)}), flush=True)\n"
    "time.sleep(1e6)\n"
)
"""What a scenario pod runs on emulated nodes: it reports the character devices and environment it got."""

SHELL_POD_SCRIPT = (
    "echo '--- devices'; find /dev -type c; echo '--- env'; env; echo '--- end'; exec sleep 1000000"
)
"""The same report from a shell (any image with find and env: the pod image, or python:3.11-slim)."""


def parse_shell_report(log: str) -> tuple[tuple[str, ...], dict[str, str]] | None:
    """The devices and environment SHELL_POD_SCRIPT printed, or None before it has printed them all."""
    lines = log.splitlines()
    if "--- end" not in lines:
        return None
    devices = lines[lines.index("--- devices") + 1 : lines.index("--- env")]
    env = dict(
        line.split("=", 1)
        for line in lines[lines.index("--- env") + 1 : lines.index("--- end")]
        if "=" in line
    )
    return tuple(sorted(devices)), env


class Progress:
    """Prints each step and how long the suite has run, live (past pytest's capture)."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.started = time.monotonic()
        self.lines: list[str] = []
        """Every step, for the session's summary (pytest's fd capture hides the live ones without -s)."""

    def __call__(self, message: str) -> None:
        elapsed = time.monotonic() - self.started
        line = f"[e2e {self.backend} +{elapsed:6.1f}s] {message}"
        self.lines.append(line)
        stream = sys.__stderr__ or sys.stderr
        stream.write(f"\n{line}")
        stream.flush()


def wait_until(predicate: Callable[[], T | None], *, timeout: float, what: str, interval: float = 0.2) -> T:
    """Poll until ``predicate`` returns something truthy; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        try:
            value = predicate()
        except (OSError, ValueError, KeyError, subprocess.SubprocessError) as exc:
            value, last_error = None, exc
        if value:
            return value
        if time.monotonic() > deadline:
            detail = f" (last error: {last_error!r})" if last_error else ""
            raise AssertionError(f"{what}: not within {timeout:.0f} s{detail}")
        time.sleep(interval)


@dataclass(frozen=True)
class PodView:
    """A pod as a user sees it: its phase, and what its container was given."""

    phase: str
    devices: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    message: str = ""


class Backend(Protocol):
    name: str
    timeout: float
    workers: list[Worker]
    progress: Progress

    def setup(self) -> None: ...
    def teardown(self) -> None: ...
    def node_resources(self, worker: str) -> tuple[dict[str, int], dict[str, int]]: ...
    def create_pod(self, worker: str, name: str, limits: dict[str, int]) -> None: ...
    def pod(self, name: str) -> PodView | None: ...
    def delete_pod(self, name: str) -> None: ...
    def lab(self, worker: str, command: str, *args: str) -> str: ...
    def lab_read(self, worker: str, path: str) -> str: ...
    def agent_exec(self, worker: str, kind: str, argv: list[str]) -> str: ...
    def delete_agent(self, worker: str, kind: str) -> None: ...
    def restart_kubelet(self, worker: str) -> None: ...
    def diagnose(self) -> str: ...


class CommandError(subprocess.SubprocessError):
    """A command of the scenario failed; waits retry it, anything else reports it with its output."""


def run(
    argv: list[str], *, timeout: float = 120, env: dict[str, str] | None = None, cwd: Path | None = None
) -> str:
    result = subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd, check=False
    )
    if result.returncode != 0:
        raise CommandError(
            f"{' '.join(argv)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
        )
    return result.stdout


def tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"({path}: {exc.strerror})"
