"""The reconcile loop: one child per configured resource, kept registered whatever happens.

:class:`Supervisor` is the synchronous core. Events (exits, status reports,
kubelet restarts, a reloaded configuration) are method calls, and :meth:`tick`
runs every child's time-based edges. Unit tests drive it directly with a
:class:`~plugvisor.supervisor.spawner.FakeSpawner` and a
:class:`~plugvisor.supervisor.clock.FakeClock`.

:class:`Agent` is the process around it (``plugvisor run``): the runtime
directory and its lock, stale-socket cleanup, the spawner, the report socket,
the kubelet watch, metrics, systemd, signals, and the asyncio loop that feeds
events to the core and sleeps until the next deadline or event. SIGTERM/SIGINT
stop every child within its bound and exit 0; SIGHUP reloads the file and
restarts only the children whose configuration changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import glob
import os
import random
import shutil
import signal
import stat
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Final

import structlog

from plugvisor.common import monitoring
from plugvisor.common.constants import KUBELET_SOCKET_NAME
from plugvisor.common.sockets import SOCKET_PREFIX, SOCKET_SUFFIX, socket_answers, socket_prefix
from plugvisor.supervisor import prestart, signals, states
from plugvisor.supervisor import status as status_
from plugvisor.supervisor.backoff import BackoffPolicy
from plugvisor.supervisor.child import CAUSE_RELOAD, CAUSE_UNREGISTERED, Child
from plugvisor.supervisor.clock import Clock, SystemClock
from plugvisor.supervisor.config import (
    ChildSpec,
    ConfigError,
    NodeConfig,
    child_specs,
    load_node_config,
)
from plugvisor.supervisor.kubelet_watch import KubeletWatch
from plugvisor.supervisor.reports import ReportListener
from plugvisor.supervisor.spawner import ExecSpawner, ForkServerSpawner, Spawner, SpawnError
from plugvisor.supervisor.systemd import Notifier

if TYPE_CHECKING:
    from plugvisor.supervisor.metrics import Metrics

HOUSEKEEPING_INTERVAL: Final = 1.0
"""The loop wakes at least this often even when nothing happens."""

_log = structlog.get_logger("plugvisor.supervisor")


def backoff_policy(config: NodeConfig) -> BackoffPolicy:
    """The restart policy the file asks for."""
    restart = config.supervisor.restart
    return BackoffPolicy(
        initial=restart.initial_delay,
        multiplier=restart.multiplier,
        cap=restart.max_delay,
        jitter=restart.jitter,
        reset_after=restart.reset_after,
        crash_loop_after=restart.crash_loop_after,
    )


class Supervisor:
    """The children and the rules that keep them up; no I/O of its own beyond the spawner."""

    def __init__(
        self,
        config: NodeConfig,
        *,
        spawner: Spawner,
        clock: Clock,
        log_format: str = "kv",
        log_level: str = "info",
        rand: Callable[[], float] = random.random,
        on_child_exit: Callable[[int], None] | None = None,
        socket_exists: Callable[[str], bool] | None = None,
        sweep_sockets: Callable[[str], list[str]] | None = None,
    ) -> None:
        self.config = config
        self._socket_exists = socket_exists or (lambda name: (self.config.kubelet_dir / name).exists())
        self._sweep_sockets = sweep_sockets or (
            lambda prefix: remove_stale_sockets(self.config.kubelet_dir, prefix)
        )
        self.spawner = spawner
        self.clock = clock
        self._rand = rand
        self._log_format = log_format
        self._log_level = log_level
        self._on_child_exit = on_child_exit
        self.children: dict[str, Child] = {}
        self.retiring: list[Child] = []
        self.kubelet_restarts = 0
        self.kubelet_up_since = clock.monotonic()
        self._lost: set[str] = set()
        self.started_wall = clock.wall()
        self.stopping = False
        self.dirty = True
        self.config_source: str | None = None

    # -- lifecycle --------------------------------------------------------------------

    def specs(self, config: NodeConfig) -> dict[str, ChildSpec]:
        """The child specs of ``config`` with this supervisor's log settings."""
        return child_specs(config, log_format=self._log_format, log_level=self._log_level)

    def _new_child(self, spec: ChildSpec) -> Child:
        return Child(
            spec,
            spawner=self.spawner,
            clock=self.clock,
            policy=backoff_policy(self.config),
            stop_timeout=self.config.supervisor.stop_timeout,
            rand=self._rand,
            on_change=self._changed,
        )

    def _changed(self, child: Child, old: states.ChildState, new: states.ChildState) -> None:
        self.dirty = True

    def start(self) -> None:
        """Start every configured child, in file order."""
        for resource, spec in self.specs(self.config).items():
            child = self._new_child(spec)
            self.children[resource] = child
            child.start()

    def stop(self) -> None:
        """Stop every child (SIGTERM now, SIGKILL after the stop timeout)."""
        self.stopping = True
        for child in self.all_children():
            child.stop()
        self.dirty = True

    @property
    def stopped(self) -> bool:
        """Whether no child has a process any more."""
        return all(child.state is states.STOPPED for child in self.all_children())

    def all_children(self) -> list[Child]:
        """Configured children, then those being removed by a reload."""
        return [*self.children.values(), *self.retiring]

    def reload(self, config: NodeConfig) -> dict[str, list[str]]:
        """Apply a new configuration: start added, stop removed, restart changed, keep the rest.

        Returns the resources in each group (for the log).
        """
        old_config, self.config = self.config, config
        policy = backoff_policy(config)
        specs = self.specs(config)
        summary: dict[str, list[str]] = {"added": [], "removed": [], "changed": [], "unchanged": []}
        for resource in [name for name in self.children if name not in specs]:
            child = self.children.pop(resource)
            child.stop()
            if child.state is not states.STOPPED:
                self.retiring.append(child)
            summary["removed"].append(resource)
        children: dict[str, Child] = {}
        for resource, spec in specs.items():
            existing = self.children.get(resource)
            if existing is None:
                child = self._new_child(spec)
                children[resource] = child
                if not self.stopping:
                    child.start()
                summary["added"].append(resource)
                continue
            children[resource] = existing
            if existing.update(spec, policy=policy, stop_timeout=config.supervisor.stop_timeout):
                if not self.stopping:
                    existing.restart(CAUSE_RELOAD)
                summary["changed"].append(resource)
            else:
                summary["unchanged"].append(resource)
        self.children = children
        for setting in ("spawner", "runtime_dir"):
            if getattr(old_config.supervisor, setting) != getattr(config.supervisor, setting):
                _log.warning("reload_setting_needs_restart", setting=setting)
        if old_config.metrics != config.metrics:
            _log.warning("reload_setting_needs_restart", setting="metrics")
        self.dirty = True
        return summary

    # -- events -------------------------------------------------------------------------

    def _by_pid(self, pid: int) -> Child | None:
        for child in self.all_children():
            if child.pid == pid:
                return child
        return None

    def handle_exit(self, pid: int, returncode: int) -> None:
        """A child process ended."""
        if self._on_child_exit is not None:
            self._on_child_exit(pid)
        child = self._by_pid(pid)
        if child is not None:
            child.on_exit(returncode)
            self.dirty = True
            # A process that died without stopping its server (SIGKILL, OOM) leaves its socket
            # in the kubelet's directory. Every socket of this resource that no process answers
            # on is such a leftover (even one the process never got to report): they go now,
            # before any new process of the resource can have bound its own.
            removed = self._sweep_sockets(socket_prefix(child.resource))
            if removed:
                _log.info("dead_socket_removed", resource=child.resource, sockets=removed)

    def handle_report(self, pid: int, fields: Mapping[str, str]) -> None:
        """A status datagram from process ``pid``."""
        child = self._by_pid(pid)
        if child is None:
            return
        child.on_status(fields)
        self.dirty = True
        endpoint = fields.get("ENDPOINT")
        if "REGISTERED" in fields and endpoint and not self._socket_exists(endpoint):
            # The kubelet restarted (and wiped the socket) while this registration was in
            # flight: it was made with a kubelet that is gone, and the deletion came before
            # we knew the socket was this child's.
            _log.info("registration_outdated", resource=child.resource, socket=endpoint)
            child.on_socket_deleted(endpoint, restart=self.restart_on_kubelet_restart)
            self._lost.add(child.resource)

    @property
    def restart_on_kubelet_restart(self) -> bool:
        """Whether the policy is to restart children (rather than let them re-register)."""
        return self.config.supervisor.on_kubelet_restart == "restart"

    def handle_kubelet_started(self, kubelet_wall: float | None) -> None:
        """``kubelet.sock`` was created: every child registered before it must register again."""
        self.kubelet_restarts += 1
        self.kubelet_up_since = self.clock.monotonic()
        affected = {
            child.resource
            for child in self.children.values()
            if child.on_kubelet_restart(kubelet_wall=kubelet_wall, restart=self.restart_on_kubelet_restart)
        }
        # Children whose socket the starting kubelet deleted lost their registration to this
        # restart too, although that was noticed (and acted on) a moment before.
        affected |= self._lost
        self._lost = set()
        _log.info(
            "kubelet_restart",
            affected=sorted(affected),
            policy=self.config.supervisor.on_kubelet_restart,
        )
        self.dirty = True

    def handle_socket_deleted(self, name: str) -> None:
        """A ``plugvisor-*.sock`` was deleted: if a running child's own, it lost its registration."""
        for child in self.children.values():
            if child.on_socket_deleted(name, restart=self.restart_on_kubelet_restart):
                _log.info("child_socket_deleted", resource=child.resource, socket=name)
                self._lost.add(child.resource)
                self.dirty = True

    def tick(self) -> float | None:
        """Take every due time-based edge; returns the next deadline (monotonic) or None."""
        for child in self.all_children():
            child.transition()
        self.retiring = [child for child in self.retiring if child.state is not states.STOPPED]
        deadlines = [d for d in (child.next_deadline() for child in self.all_children()) if d is not None]
        overdue = self._restart_unregistered()
        if overdue is not None:
            deadlines.append(overdue)
        return min(deadlines) if deadlines else None

    def _restart_unregistered(self) -> float | None:
        """The safety net behind every child's own restart handling; returns the next such deadline.

        A child that stays unregistered for ``registrationTimeout`` while the kubelet
        is up has missed something (a restart it never saw, a call that hangs):
        whatever it waits for, a new process starts clean. With no kubelet there is
        nothing to register with, and nothing to blame the child for.
        """
        if self.stopping or not self._socket_exists(KUBELET_SOCKET_NAME):
            return None
        now = self.clock.monotonic()
        timeout = self.config.supervisor.registration_timeout
        upcoming = []
        for child in self.children.values():
            due = child.registration_overdue(kubelet_up_since=self.kubelet_up_since, timeout=timeout)
            if due is None:
                continue
            if now >= due:
                _log.warning(
                    "child_unregistered_too_long",
                    resource=child.resource,
                    pid=child.pid,
                    seconds=timeout,
                    action="restart",
                )
                child.restart(CAUSE_UNREGISTERED)
                self.dirty = True
            else:
                upcoming.append(due)
        return min(upcoming) if upcoming else None

    # -- reporting -----------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """Every configured resource is registered with the current kubelet."""
        return bool(self.children) and all(
            child.state is states.RUNNING and child.registered for child in self.children.values()
        )

    def readiness(self) -> tuple[bool, str]:
        """``(ready, explanation)`` for ``/readyz``."""
        waiting = [child.resource for child in self.children.values() if not child.registered]
        if self.ready:
            return True, f"ready: {len(self.children)} resources registered"
        return False, "not registered: " + ", ".join(waiting)

    def summary(self) -> str:
        """One line for systemd's STATUS=."""
        total = len(self.children)
        registered = sum(1 for child in self.children.values() if child.registered)
        looping = [child.resource for child in self.children.values() if child.crash_looping]
        text = f"{registered}/{total} resources registered"
        if looping:
            text += "; crash-looping: " + ", ".join(looping)
        return text

    def snapshot(self) -> dict[str, Any]:
        """The whole agent as ``plugvisor status --json`` shows it."""
        return {
            "supervisor": {
                "pid": os.getpid(),
                "started_at": self.started_wall,
                "ready": self.ready,
                "stopping": self.stopping,
                "kubelet_restarts": self.kubelet_restarts,
                "kubelet_dir": str(self.config.kubelet_dir),
                "on_kubelet_restart": self.config.supervisor.on_kubelet_restart,
                "config": self.config_source,
            },
            "children": [child.snapshot() for child in self.all_children()],
        }


def remove_dead_socket(path: Path) -> bool:
    """Delete the unix socket at ``path`` unless a live process serves it; returns whether it did."""
    try:
        if not stat.S_ISSOCK(path.lstat().st_mode) or socket_answers(path):
            return False
        path.unlink()
    except OSError:
        return False
    return True


def remove_stale_sockets(kubelet_dir: Path, prefix: str = SOCKET_PREFIX) -> list[str]:
    """Delete ``<prefix>*.sock`` files in the kubelet dir that no live process serves.

    A supervisor that was SIGKILLed leaves its children's sockets behind; the
    kubelet ignores them, but operators and the next start should not have to.
    Sockets that answer belong to a live plugin (another agent's) and are kept.
    """
    removed = []
    with contextlib.suppress(OSError):
        for path in sorted(kubelet_dir.glob(f"{glob.escape(prefix)}*{SOCKET_SUFFIX}")):
            if remove_dead_socket(path):
                removed.append(path.name)
    return removed


class RuntimeDirLock:
    """``<runtimeDir>/supervisor.pid``, locked for the agent's lifetime: one agent per runtime dir."""

    def __init__(self, runtime_dir: Path) -> None:
        self.path = runtime_dir / status_.PID_FILE
        self._file: IO[str] | None = None

    def acquire(self) -> None:
        """Lock, or raise RuntimeError naming the agent that holds the lock."""
        handle = self.path.open("a+")
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

    def _child_env(self) -> dict[str, str]:
        env = prestart.child_env(
            self._env, runtime_dir=self.runtime_dir, multiprocess_metrics=self.config.metrics is not None
        )
        watch = self.config.monitoring
        if watch.enabled:
            env[monitoring.MONITOR_DIR_ENV] = str(self.runtime_dir / status_.MONITOR_DIR)
            env[monitoring.POD_RESOURCES_INTERVAL_ENV] = str(watch.pod_resources_interval)
            env[monitoring.TELEMETRY_INTERVAL_ENV] = str(watch.telemetry_interval)
            if watch.pod_resources_socket is not None:
                env[monitoring.POD_RESOURCES_SOCKET_ENV] = str(watch.pod_resources_socket)
        return env

    def _make_spawner(self, env: Mapping[str, str]) -> Spawner:
        early = prestart.take()
        if self.config.supervisor.spawner == "exec":
            prestart.discard(early)
            return ExecSpawner(env)
        kinds = sorted({resource.kind for resource in self.config.resources})
        metrics = self.config.metrics is not None
        if early is not None and not early.suits(
            kinds, multiprocess_metrics=metrics, runtime_dir=self.runtime_dir
        ):
            _log.info("forkserver_prestart_discarded", started_for=early.preload_kinds, kinds=kinds)
            prestart.discard(early)
            early = None
        return ForkServerSpawner(env, preload_kinds=kinds, prestarted=None if early is None else early.proc)

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

    async def _open_spawner(self, env: Mapping[str, str]) -> Spawner:
        spawner = self._make_spawner(env)
        try:
            await spawner.open(self.wake)
        except SpawnError as exc:
            _log.warning("forkserver_unavailable", error=str(exc), fallback="exec")
            spawner = ExecSpawner(env)
            await spawner.open(self.wake)
        return spawner

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
            watch = KubeletWatch(
                self.config.kubelet_dir,
                on_kubelet_started=self._on_kubelet_started,
                on_socket_deleted=self._on_socket_deleted,
            )
            watch.open()
            cleanup.push_async_callback(watch.close)
            if self.config.metrics is not None:
                # Imported only then: without an endpoint the agent needs no prometheus-client.
                from plugvisor.supervisor import metrics as metrics_  # noqa: PLC0415

                metrics = metrics_.Metrics(
                    supervisor.snapshot,
                    multiproc_dir=multiproc_dir,
                    monitor_dir=monitor_dir if self.config.monitoring.enabled else None,
                )
                http = metrics_.HttpServer(
                    metrics,
                    supervisor.readiness,
                    host=self.config.metrics.host,
                    port=self.config.metrics.port,
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
                spawner=type(spawner).__name__,
                runtime_dir=str(runtime_dir),
                config=str(self.config_path),
            )
            if not self._stop_requested:
                supervisor.start()
            await self._loop(supervisor, runtime_dir)
        _log.info("supervisor_stopped")
        return 0

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
            for exit_ in supervisor.spawner.reap():
                supervisor.handle_exit(exit_.pid, exit_.returncode)
            deadline = supervisor.tick()
            if supervisor.dirty:
                supervisor.dirty = False
                if not self._write_state(runtime_dir, supervisor):
                    state_retry = True
                if supervisor.ready and not ready_sent and not supervisor.stopping:
                    ready_sent = True
                    _log.info("ready", resources=len(supervisor.children))
                    self.notifier.ready(supervisor.summary())
                elif not supervisor.stopping:
                    self.notifier.status(supervisor.summary())
            if supervisor.stopping and (
                supervisor.stopped or (stop_bound and clock.monotonic() > stop_bound)
            ):
                return
            timeout = HOUSEKEEPING_INTERVAL
            if deadline is not None:
                timeout = min(timeout, max(0.0, deadline - clock.monotonic()))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

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
        try:
            config = load_node_config(self.config_path)
        except ConfigError as exc:
            _log.error("reload_rejected", error=str(exc), keeping="the running configuration")
            if announce:
                self.notifier.ready(
                    f"reload rejected, running the previous configuration; {supervisor.summary()}"
                )
            return
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
    try:
        config = load_node_config(config_path)
        agent = Agent(config, config_path=config_path, log_format=log_format, log_level=log_level)
        return asyncio.run(agent.run())
    finally:
        prestart.discard()  # a fork server started early that the agent did not take
