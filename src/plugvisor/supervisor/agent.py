"""``plugvisor run``: the process around the reconcile loop, from start to clean exit.

:class:`Agent` owns what :class:`~plugvisor.supervisor.supervisor.Supervisor`
(the synchronous core) leaves out: the runtime directory and its lock
(:class:`RuntimeDirLock`), stale-socket cleanup, the spawner, the report socket,
the kubelet watch, metrics, systemd, signals, and the asyncio loop that feeds
events to the core and sleeps until the next deadline or event. SIGTERM/SIGINT
stop every child within its bound and exit 0; SIGHUP reloads the file and
restarts only the children whose configuration changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import shutil
import signal
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Final

import structlog

from plugvisor.common import constants, inotify
from plugvisor.common.notify import STATUS_SOCKET_ENV
from plugvisor.common.validation import shorten
from plugvisor.plugins import kinds
from plugvisor.supervisor import signals
from plugvisor.supervisor import status as status_
from plugvisor.supervisor.clock import SystemClock
from plugvisor.supervisor.config import (
    ConfigError,
    NodeConfig,
    load_node_config,
)
from plugvisor.supervisor.kubelet_watch import KubeletWatch
from plugvisor.supervisor.reports import ReportListener
from plugvisor.supervisor.spawner import (
    ExecSpawner,
    ForkServerSpawner,
    Spawner,
    SpawnError,
    StartLimiter,
)
from plugvisor.supervisor.supervisor import Supervisor, remove_stale_sockets
from plugvisor.supervisor.systemd import SYSTEMD_ENV, Notifier

if TYPE_CHECKING:
    from plugvisor.supervisor.metrics import Metrics

HOUSEKEEPING_INTERVAL: Final = 1.0
"""The loop wakes at least this often even when nothing happens."""
STATE_SHARE: Final = 10
"""After writing the state file (and systemd's ``STATUS=``), the agent waits this many times as long as
the write took before the next one, so that they take at most about a tenth of its time.

Each write renders every child (O(N)), and a kubelet restart of N resources brings several changes
per child: written after each, 256 resources cost 80 % of the agent's CPU while they came back
(bench/bench_scale.py, profiled). A few children write in a fraction of a millisecond, so their
state stays as fresh as ever; readiness is said at once all the same."""
STATE_INTERVAL_MAX: Final = 0.5
"""The longest a change waits to be written, however long writes take."""
MULTIPROC_ENV: Final = "PROMETHEUS_MULTIPROC_DIR"
"""prometheus-client picks its multiprocess value class when it is imported, by this variable's presence."""

_log = structlog.get_logger("plugvisor.supervisor")


def child_env(base: Mapping[str, str], *, runtime_dir: Path, multiprocess_metrics: bool) -> dict[str, str]:
    """The environment of the fork server and, before what the agent adds, of every child.

    Without systemd's variables (only the agent speaks to systemd), with the
    agent's status socket, and with the metrics directory only when the agent
    serves ``/metrics`` (prometheus-client decides at import time whether it writes
    multiprocess files).
    """
    env = {key: value for key, value in base.items() if key not in SYSTEMD_ENV and key != MULTIPROC_ENV}
    env[STATUS_SOCKET_ENV] = str(runtime_dir / status_.REPORT_SOCKET)
    if multiprocess_metrics:
        env[MULTIPROC_ENV] = str(runtime_dir / status_.METRICS_DIR)
    return env


def _code_of(config: NodeConfig) -> dict[str, str]:
    """Each kind in use, with the revision of its installed code as loaded now."""
    return {kind: kinds.kind_revision(kind) for kind in sorted({r.kind for r in config.resources})}


def _has_dra(config: NodeConfig) -> bool:
    """Whether any entry is a DRA driver: only then do the fork server's children need the DRA side loaded."""
    return any(resource.dra for resource in config.resources)


class RuntimeDirLock:
    """``<runtimeDir>/supervisor.pid``, locked for the agent's lifetime: one agent per runtime dir."""

    def __init__(self, runtime_dir: Path) -> None:
        self.path = runtime_dir / status_.PID_FILE
        self._file: IO[str] | None = None

    def acquire(self) -> None:
        """Lock, or raise RuntimeError naming the agent holding the lock, or what is wrong with the file."""
        handle = os.fdopen(status_.open_pid_file(self.path, os.O_RDWR | os.O_CREAT), "r+")
        # `plugvisor status` probes the lock with a shared one for an instant: try for a
        # moment before concluding that another agent holds it.
        for attempt in range(50):
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if attempt == 49:
                    handle.seek(0)
                    holder = handle.read().strip() or "unknown"
                    handle.close()
                    raise RuntimeError(
                        f"another plugvisor agent (pid {holder}) uses {self.path.parent}"
                    ) from None
                time.sleep(0.01)
        self._file = handle
        try:
            handle.seek(0)
            handle.truncate()
            handle.write(f"{os.getpid()}\n")
            handle.flush()
        except OSError as exc:
            # The lock is what counts; the PID in it is for people (a full disk must not stop the agent).
            _log.warning("pid_file_write_failed", file=str(self.path), error=exc.strerror or str(exc))

    def release(self) -> None:
        """Unlock and remove the file."""
        if self._file is not None:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None


class Agent:
    """``plugvisor run``: the supervisor process, start to clean exit."""

    def __init__(
        self,
        config: NodeConfig,
        *,
        config_path: Path | None,
        log_format: str = "kv",
        log_level: str = "info",
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.config = config
        self.config_path = config_path
        self.runtime_dir = config.runtime_dir
        self._log_format = log_format
        self._log_level = log_level
        self._env = dict(os.environ if env is None else env)
        self._wake = asyncio.Event()
        self._stop_requested = False
        self._reload_requested = False
        self.notifier = Notifier(self._env)
        self.supervisor: Supervisor | None = None
        self.metrics_address: tuple[str, int] | None = None
        self._state_error: str | None = None
        self._reports: ReportListener | None = None
        self._follow_starts: Callable[[Callable[[float], float]], None] = lambda _: None
        """After each tick: /metrics gives way to children being started (``metrics.ScrapeGate``)."""
        self._limiter: StartLimiter | None = None
        self._spawner_code: dict[str, str] = {}
        """The kinds (and their code's revisions) the spawner was last given: another set needs a refresh."""
        self._spawner_dra = False
        """Whether the spawner was last told to preload the DRA side: a change needs a refresh too."""

    def _child_env(self) -> dict[str, str]:
        env = child_env(
            self._env, runtime_dir=self.runtime_dir, multiprocess_metrics=self.config.metrics is not None
        )
        watch = self.config.monitoring
        if watch.enabled:
            env[constants.MONITOR_DIR_ENV] = str(self.runtime_dir / status_.MONITOR_DIR)
            env[constants.POD_RESOURCES_INTERVAL_ENV] = str(watch.pod_resources_interval)
            env[constants.TELEMETRY_INTERVAL_ENV] = str(watch.telemetry_interval)
            if watch.pod_resources_socket is not None:
                env[constants.POD_RESOURCES_SOCKET_ENV] = str(watch.pod_resources_socket)
        return env

    def _make_spawner(self, env: Mapping[str, str]) -> Spawner:
        self._spawner_code = _code_of(self.config)
        self._spawner_dra = _has_dra(self.config)
        if self.config.supervisor.spawner == "exec":
            return ExecSpawner(env)
        return ForkServerSpawner(env, preload_kinds=sorted(self._spawner_code), preload_dra=self._spawner_dra)

    def wake(self) -> None:
        """Have the loop look at its inputs now."""
        self._wake.set()

    def request_stop(self) -> None:
        """SIGTERM/SIGINT."""
        self._stop_requested = True
        self.wake()

    def request_reload(self) -> None:
        """SIGHUP."""
        self._reload_requested = True
        self.wake()

    async def run(self) -> int:
        """Run until stopped; returns the exit code (0 after a clean stop)."""
        loop = asyncio.get_running_loop()
        for sig, handler in (
            (signal.SIGTERM, self.request_stop),
            (signal.SIGINT, self.request_stop),
            (signal.SIGHUP, self.request_reload),
        ):
            loop.add_signal_handler(sig, handler)
        early = signals.requested()
        if early is not None:
            _log.info("stop_requested_while_starting", signal=signal.Signals(early).name)
            self.request_stop()
        try:
            return await self._run_with_runtime_dir()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)

    async def _run_with_runtime_dir(self) -> int:
        runtime_dir = self.runtime_dir
        runtime_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
        lock = RuntimeDirLock(runtime_dir)
        try:
            lock.acquire()
        except RuntimeError as exc:
            _log.error("cannot_run", error=str(exc))
            return 1
        try:
            return await self._run_locked(runtime_dir)
        finally:
            lock.release()

    async def _open_spawner(self, env: Mapping[str, str]) -> Spawner | None:
        """The spawner, ready; None when a stop request came first (the spawner is closed then)."""
        spawner = self._make_spawner(env)
        try:
            if not await self._open_unless_stopped(spawner):
                return None
        except SpawnError as exc:
            _log.warning("forkserver_unavailable", error=str(exc), fallback="exec")
            spawner = ExecSpawner(env, fallback=str(exc))
            await spawner.open(self.wake)
        self._limiter = StartLimiter(spawner)
        return self._limiter

    async def _open_unless_stopped(self, spawner: Spawner) -> bool:
        """Open ``spawner``, unless SIGTERM/SIGINT comes first: then close it and return False.

        A fork server that hangs while it imports (SIGSTOPped, a stuck file
        system) is waited for up to its start timeout; a stop must not wait with
        it, or a DaemonSet's grace period ends the agent with SIGKILL.
        """
        opening = asyncio.ensure_future(spawner.open(self.wake))
        try:
            while not opening.done():
                if self._stop_requested:
                    opening.cancel()
                    with contextlib.suppress(asyncio.CancelledError, SpawnError):
                        await opening
                    await spawner.close()
                    _log.info("stopped_while_starting", waited_for="fork server")
                    return False
                self._wake.clear()
                woken = asyncio.ensure_future(self._wake.wait())
                await asyncio.wait({opening, woken}, return_when=asyncio.FIRST_COMPLETED)
                woken.cancel()
        except BaseException:
            opening.cancel()
            raise
        opening.result()  # SpawnError: the caller falls back
        return True

    async def _run_locked(self, runtime_dir: Path) -> int:
        loop = asyncio.get_running_loop()
        removed = remove_stale_sockets(self.config.kubelet_dir)
        if removed:
            _log.info("stale_sockets_removed", sockets=removed)
        multiproc_dir = runtime_dir / status_.METRICS_DIR
        shutil.rmtree(multiproc_dir, ignore_errors=True)
        if self.config.metrics is not None:
            multiproc_dir.mkdir(mode=0o755)
        monitor_dir = runtime_dir / status_.MONITOR_DIR
        shutil.rmtree(monitor_dir, ignore_errors=True)
        monitor_dir.mkdir(mode=0o755)
        report_path = runtime_dir / status_.REPORT_SOCKET
        spawner = await self._open_spawner(self._child_env())
        if spawner is None:
            shutil.rmtree(multiproc_dir, ignore_errors=True)
            shutil.rmtree(monitor_dir, ignore_errors=True)
            return 0
        metrics: Metrics | None = None
        supervisor = Supervisor(
            self.config,
            spawner=spawner,
            clock=SystemClock(),
            log_format=self._log_format,
            log_level=self._log_level,
            on_child_exit=lambda pid: metrics.process_dead(pid) if metrics is not None else None,
        )
        supervisor.config_source = None if self.config_path is None else str(self.config_path)
        self.supervisor = supervisor
        async with contextlib.AsyncExitStack() as cleanup:
            # Undone in reverse order: children first (should anything have failed), the
            # fork server, then the files.
            cleanup.callback(shutil.rmtree, multiproc_dir, ignore_errors=True)
            cleanup.callback(shutil.rmtree, monitor_dir, ignore_errors=True)
            cleanup.callback(status_.remove_state, runtime_dir)
            cleanup.callback(self.notifier.close)
            cleanup.push_async_callback(spawner.close)
            cleanup.callback(self._kill_leftovers, supervisor)
            reports = ReportListener(report_path, self._on_report)
            reports.open()
            cleanup.callback(reports.close)
            self._reports = reports
            # Its watching_by_polling line says it is the agent's: every child writes to this stderr too.
            cleanup.callback(inotify.on_polling(_ignore, log=_log.bind(process="agent")))
            watch = self._open_kubelet_watch()
            cleanup.push_async_callback(watch.close)
            if self.config.metrics is not None:
                # Imported only then: without an endpoint the agent needs no prometheus-client.
                from plugvisor.supervisor import metrics as metrics_  # noqa: PLC0415

                metrics = metrics_.Metrics(
                    supervisor.snapshot,
                    multiproc_dir=multiproc_dir,
                    monitor_dir=monitor_dir if self.config.monitoring.enabled else None,
                )
                self._follow_starts = metrics.gate.follow
                http = metrics_.HttpServer(
                    metrics,
                    supervisor.readiness,
                    host=self.config.metrics.host,
                    port=self.config.metrics.port,
                    source=None if self.config_path is None else str(self.config_path),
                )
                await http.start()
                cleanup.push_async_callback(http.close)
                self.metrics_address = http.address
            if self.notifier.watchdog_interval is not None:
                watchdog = loop.create_task(self._watchdog(self.notifier.watchdog_interval), name="watchdog")
                cleanup.callback(watchdog.cancel)
            _log.info(
                "supervisor_started",
                resources=len(self.config.resources),
                spawner=type(self._limiter.inner).__name__ if self._limiter else None,
                start_slots=self._limiter.slots if self._limiter else None,
                runtime_dir=str(runtime_dir),
                config=str(self.config_path),
            )
            if not self._stop_requested:
                supervisor.start()
            await self._loop(supervisor, runtime_dir)
        _log.info("supervisor_stopped")
        return 0

    def _open_kubelet_watch(self) -> KubeletWatch:
        """The kubelet directory's watch, open (polled when the node's inotify budget is spent)."""
        watch = KubeletWatch(
            self.config.kubelet_dir,
            on_kubelet_started=self._on_kubelet_started,
            on_socket_deleted=self._on_socket_deleted,
        )
        watch.open()
        return watch

    @staticmethod
    def _kill_leftovers(supervisor: Supervisor) -> None:
        """After an unexpected error only: never leave a child behind."""
        for child in supervisor.all_children():
            if child.pid is not None:
                supervisor.spawner.kill(child.pid, signal.SIGKILL)

    async def _loop(self, supervisor: Supervisor, runtime_dir: Path) -> None:
        ready_sent = False
        clock = supervisor.clock
        stop_bound: float | None = None
        state_retry = False
        next_state = 0.0
        while True:
            self._wake.clear()
            if state_retry:
                # A state file that could not be written (a full disk) is tried again on
                # each round (at least every housekeeping interval) until it can be.
                state_retry = False
                supervisor.dirty = True
            if self._stop_requested and not supervisor.stopping:
                _log.info("stopping", children=len(supervisor.all_children()))
                self.notifier.stopping()
                supervisor.stop()
                stop_bound = clock.monotonic() + self.config.supervisor.stop_timeout + 5.0
            if self._reload_requested:
                self._reload_requested = False
                if not supervisor.stopping:
                    self._reload(supervisor, announce=ready_sent)
            self._handle_exits(supervisor)
            deadline = supervisor.tick()
            self._follow_starts(supervisor.starting_until)
            became_ready = supervisor.dirty and supervisor.ready and not ready_sent
            if supervisor.dirty and (clock.monotonic() >= next_state or became_ready or supervisor.stopping):
                supervisor.dirty = False
                began = clock.monotonic()
                state_retry = not self._write_state(runtime_dir, supervisor)
                ready_sent = self._tell_systemd(supervisor, ready_sent=ready_sent)
                took = clock.monotonic() - began
                next_state = clock.monotonic() + min(STATE_SHARE * took, STATE_INTERVAL_MAX)
            if supervisor.stopping and (
                supervisor.stopped or (stop_bound and clock.monotonic() > stop_bound)
            ):
                return
            timeout = HOUSEKEEPING_INTERVAL
            if supervisor.dirty:  # changes not yet written: at the next write's time
                deadline = next_state if deadline is None else min(deadline, next_state)
            if deadline is not None:
                timeout = min(timeout, max(0.0, deadline - clock.monotonic()))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    def _tell_systemd(self, supervisor: Supervisor, *, ready_sent: bool) -> bool:
        """READY=1 once every resource is registered, STATUS= after; returns whether READY=1 was sent."""
        if supervisor.stopping:
            return ready_sent
        if supervisor.ready and not ready_sent:
            _log.info("ready", resources=len(supervisor.children))
            self.notifier.ready(supervisor.summary())
            return True
        self.notifier.status(supervisor.summary())
        return ready_sent

    def _handle_exits(self, supervisor: Supervisor) -> None:
        """The children's exits since the last round, each after the datagrams its process sent.

        A process's last words (``ERROR=``) are in the status socket's queue before
        it exits: read first, its exit record carries them.
        """
        if self._reports is not None:
            self._reports.drain()
        for exit_ in supervisor.spawner.reap():
            supervisor.handle_exit(exit_.pid, exit_.returncode)

    def _write_state(self, runtime_dir: Path, supervisor: Supervisor) -> bool:
        """Best effort: a status file that cannot be written must never stop the supervising.

        Logged once per distinct error, and once more when writing works again.
        """
        try:
            status_.write_state(runtime_dir, supervisor.snapshot())
        except OSError as exc:
            error = f"{exc.strerror or exc} ({runtime_dir / status_.STATE_FILE})"
            if error != self._state_error:
                _log.error("state_write_failed", error=error, note="supervising goes on; retrying")
                self._state_error = error
            return False
        if self._state_error is not None:
            _log.info("state_write_recovered", file=str(runtime_dir / status_.STATE_FILE))
            self._state_error = None
        return True

    def _reload(self, supervisor: Supervisor, *, announce: bool) -> None:
        """Apply SIGHUP; ``announce``: systemd has seen READY=1, so bracket with RELOADING=1 and READY=1."""
        if self.config_path is None:
            _log.warning("reload_ignored", reason="no configuration file")
            return
        if announce:
            self.notifier.reloading(int(supervisor.clock.monotonic() * 1e6))
        # An outside kind reinstalled since it was loaded is unloaded first: the file is then
        # validated with its new options model, and its children restart on the new code.
        changed = kinds.forget_changed_kinds()
        if changed:
            _log.info("kinds_changed", kinds=changed, effect="their children restart on the installed code")
        try:
            config = load_node_config(self.config_path)
        except Exception as exc:  # whatever the file holds, the agent keeps running
            # A ConfigError names the file and field. Anything else is a reader's bug that a file
            # found: still not a reason to take every resource off the node.
            error = str(exc)
            if not isinstance(exc, ConfigError):
                error = f"{self.config_path}: {type(exc).__name__}: {shorten(error, 300)}"
            _log.error("reload_rejected", error=error, keeping="the running configuration")
            supervisor.reload_rejected(error)
            if announce:
                self.notifier.ready(
                    f"reload rejected, running the previous configuration; {supervisor.summary()}"
                )
            return
        code, dra = _code_of(config), _has_dra(config)
        if code != self._spawner_code or dra != self._spawner_dra:
            # Before any child is started for the new file: they must come from the new code.
            supervisor.spawner.refresh(sorted(code), dra=dra)
            self._spawner_code, self._spawner_dra = code, dra
        summary = supervisor.reload(config)
        self.config = config
        _log.info("reloaded", **summary)
        if announce:
            self.notifier.ready(supervisor.summary())

    async def _watchdog(self, interval: float) -> None:
        while True:
            self.notifier.watchdog()
            await asyncio.sleep(interval)

    def _on_report(self, pid: int, fields: dict[str, str]) -> None:
        if self._limiter is not None and ("ENDPOINT" in fields or "REGISTERED" in fields):
            self._limiter.started(pid)  # it serves: the next child may start
        if self.supervisor is not None:
            self.supervisor.handle_report(pid, fields)
            self.wake()

    def _on_kubelet_started(self, kubelet_wall: float | None) -> None:
        if self.supervisor is not None:
            self.supervisor.handle_kubelet_started(kubelet_wall)
            self.wake()

    def _on_socket_deleted(self, name: str) -> None:
        if self.supervisor is not None:
            self.supervisor.handle_socket_deleted(name)
            self.wake()


def run_agent(config_path: Path, *, log_format: str = "kv", log_level: str = "info") -> int:
    """Load the configuration and run the agent until SIGTERM/SIGINT; returns the exit code.

    Raises :class:`ConfigError` (exit status 2 in the CLI) before starting anything.
    """
    config = load_node_config(config_path)
    agent = Agent(config, config_path=config_path, log_format=log_format, log_level=log_level)
    return asyncio.run(agent.run())


def _ignore(_why: str) -> None:
    """The agent's own fallback needs no action: the line says it, its watch keeps working by polling."""
