"""The Docker engine a kind run on these machines starts, and stops, itself (root, under the machine lock).

Used only on the offline route (e2e/kind/offline.py), and only when no engine answers already: then the
run starts Debian's dockerd with a configuration file of its own, outside /etc, that nothing outlives:

- ``capfit`` (tools/kind/capfit.py) registered and made the default runtime, so the privileged containers
  kind makes for its nodes ask runc only for the capabilities this machine's root has (it lacks
  CAP_SYS_RESOURCE; docs/kind.md). On a root with every capability capfit changes nothing.
- its data root under DATA_DIR and its exec root, socket and PID file under RUN_DIR: the images and
  containers of the run go with it, and ``docker`` and ``kind`` are pointed at the socket (DOCKER_HOST),
  leaving /var/run/docker.sock to whoever owns it.

dockerd changes the host as it starts (FORWARD DROP, its nftables tables, IPv4 forwarding, its bridges):
so the machine's lock (e2e/machine_lock.py, the local cluster's too) is taken before anything is recorded
or started and released only after the host was put back and checked against the record (host.py). The
record is written to RECORD first, so a run that was killed is cleaned up by the next one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .. import machine_lock
from ..deployment import REPO
from ..local import hostbin
from .host import HostRecord, alive, docker_processes

RUN_DIR = Path("/run/plugvisor-kind")
DATA_DIR = Path("/var/lib/plugvisor-kind")
SOCKET = RUN_DIR / "docker.sock"
CONFIG = RUN_DIR / "daemon.json"
PIDFILE = RUN_DIR / "dockerd.pid"
RECORD = Path("/var/lib/plugvisor-kind.record.json")
"""The host as it was before the run's dockerd (beside DATA_DIR, which the restore removes)."""
LOG = Path("/tmp/plugvisor-kind-dockerd.log")
CAPFIT = REPO / "tools/kind/capfit.py"
LOCK_TIMEOUT = 1800.0


class EngineError(RuntimeError):
    """dockerd could not be started, or the host is not as it was after it stopped; the message says what."""


def docker_answers(env: dict[str, str]) -> bool:
    """Whether ``docker info`` gets an answer from an engine (the one DOCKER_HOST in ``env`` names)."""
    try:
        result = subprocess.run(["docker", "info"], capture_output=True, env=env, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0


def daemon_config() -> dict[str, Any]:
    """The daemon's configuration file: capfit the default runtime, every root of its own."""
    return {
        "runtimes": {"capfit": {"path": str(CAPFIT)}},
        "default-runtime": "capfit",
        "data-root": str(DATA_DIR / "docker"),
        "exec-root": str(RUN_DIR / "exec"),
        "pidfile": str(PIDFILE),
        "hosts": [f"unix://{SOCKET}"],
    }


class Engine:
    """A Docker engine for the run: one that answers already, or dockerd started (and stopped) here."""

    def __init__(self, progress: Callable[[str], None]) -> None:
        self.progress = progress
        self.env: dict[str, str] = dict(os.environ)
        self.lock: int | None = None
        self.record: HostRecord | None = None
        self.popen: subprocess.Popen[bytes] | None = None

    @property
    def started(self) -> bool:
        """Whether this run holds the lock and a dockerd of its own (then it must stop it and check)."""
        return self.lock is not None

    def ensure(self) -> None:
        """Use the engine that answers, or take the lock and start dockerd; raise EngineError if neither."""
        if docker_answers(self.env):
            self.progress("a Docker engine answers already: using it as it is")
            return
        self.lock = machine_lock.acquire(LOCK_TIMEOUT, progress=self.progress, what="the kind run (dockerd)")
        try:
            if RECORD.exists():
                self.progress(f"a kind run was not cleaned up ({RECORD} exists): cleaning up after it first")
                self._stop_stale()
            self.record = HostRecord.take()
            self.progress(f"the host before dockerd: {self.record.summary()}")
            RECORD.write_text(json.dumps(asdict(self.record)))
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        started = time.monotonic()
        for directory in (RUN_DIR, DATA_DIR):
            directory.mkdir(parents=True, exist_ok=True)
        CONFIG.write_text(json.dumps(daemon_config(), indent=1))
        dockerd = hostbin.system_binary("dockerd")
        with LOG.open("wb") as out:
            self.popen = subprocess.Popen(
                [dockerd, "--config-file", str(CONFIG)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True,
                env={**os.environ, "PATH": os.pathsep.join(hostbin.SYSTEM_DIRS)},
            )  # fmt: skip
        self.env["DOCKER_HOST"] = f"unix://{SOCKET}"
        deadline = time.monotonic() + 60
        while not docker_answers(self.env):
            if self.popen.poll() is not None or time.monotonic() > deadline:
                raise EngineError(
                    f"dockerd did not answer within 60 s; its log, last lines:\n{self.log_tail()}"
                )
            time.sleep(0.5)
        self.progress(
            f"dockerd started ({time.monotonic() - started:.1f} s): {dockerd} --config-file {CONFIG}"
            f" (default runtime capfit), DOCKER_HOST={self.env['DOCKER_HOST']}"
        )

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(LOG.read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            return f"({LOG}: {exc.strerror})"

    def _stop_stale(self) -> None:
        """A killed run's dockerd (its PID file) stopped, the host put back from that run's record."""
        try:
            stale = HostRecord(**{k: _tuples(v) for k, v in json.loads(RECORD.read_text()).items()})
        except (OSError, ValueError, TypeError) as exc:
            raise EngineError(
                f"{RECORD}: unreadable ({exc}); remove it once the host is checked by hand"
            ) from None
        try:
            pid = int(PIDFILE.read_text().strip())
        except (OSError, ValueError):
            pid = 0
        if pid and alive(pid):
            os.kill(pid, signal.SIGTERM)
            _wait_gone([pid], 60)
        _wait_gone(list(docker_processes()), 30, kill=True)
        for step in stale.restore([RUN_DIR, DATA_DIR]):
            self.progress(f"  {step}")
        RECORD.unlink()
        left = stale.differences([RUN_DIR, DATA_DIR])
        if left:
            raise EngineError("the killed kind run's host could not be put back:\n  " + "\n  ".join(left))

    def stop(self) -> None:
        """Stop our dockerd (its containers, containerd and shims go with it), put the host back, check it.

        Raises EngineError naming every difference from the record; releases the lock either way.
        """
        if self.lock is None:
            return
        try:
            started = time.monotonic()
            if self.popen is not None and self.popen.poll() is None:
                self.popen.terminate()
                try:
                    self.popen.wait(90)
                except subprocess.TimeoutExpired:
                    self.progress("dockerd did not stop within 90 s of SIGTERM: killed")
                    self.popen.kill()
                    self.popen.wait()
            _wait_gone(list(docker_processes()), 30, kill=True)
            self.progress(f"dockerd stopped ({time.monotonic() - started:.1f} s)")
            if self.record is None:
                return
            steps = self.record.restore([RUN_DIR, DATA_DIR])
            self.progress("host put back: " + ("; ".join(steps) or "nothing to undo"))
            left = self.record.differences([RUN_DIR, DATA_DIR])
            if left:
                raise EngineError(
                    "host check: after dockerd the host differs from its record\n  " + "\n  ".join(left)
                )
            RECORD.unlink(missing_ok=True)
            LOG.unlink(missing_ok=True)  # kept only when something failed, for the person looking into it
            self.progress(f"host check: as before dockerd ({self.record.summary()})")
        finally:
            machine_lock.release(self.lock)
            self.lock = None


def _tuples(value: Any) -> Any:
    """JSON's lists back to the record's tuples (of tuples)."""
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    return value


def _wait_gone(pids: list[int], timeout: float, *, kill: bool = False) -> None:
    """Wait for ``pids`` to exit; past ``timeout``, SIGKILL those left (``kill``) or raise."""
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids):
        if time.monotonic() > deadline:
            if not kill:
                raise EngineError(
                    f"processes {[p for p in pids if alive(p)]} did not exit within {timeout:.0f} s"
                )
            for pid in pids:
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)
            kill = False
            deadline = time.monotonic() + 10
        time.sleep(0.2)
