"""One supervised child: the state machine of a resource's plugin process.

Like supervisord's ``Subprocess``, every state write goes through
:meth:`Child.change_state` and every time-based edge lives in
:meth:`Child.transition`, which the supervisor calls on each tick; events
(an exit, a status datagram, a kubelet restart) call the other methods. All OS
effects go through the :class:`~plugvisor.supervisor.spawner.Spawner` and all
time through the :class:`~plugvisor.supervisor.clock.Clock`, so the whole machine
runs under test with fakes and no sleeping.

Restart causes (the ``cause`` label of the restart metric):

- ``crash``: exit status other than 0, 2, 3; ``killed``: ended by a signal;
  ``exited``: status 0 although nobody asked it to stop. These back off.
- ``config``: status 2, the child refused its configuration. Retrying quickly
  cannot help, so it waits the full cap (and is reported) every time.
- ``kubelet-restart``: status 3, or the supervisor saw the kubelet restart and
  restarts the child itself. Immediate, never counted as a failure.
- ``reload``: SIGHUP changed this child's configuration. Immediate.
- ``spawn-error``: the process could not even be created. Backs off.
- ``unregistered``: the process stayed unregistered for ``registrationTimeout``
  while the kubelet was up; whatever it waits for, a new process starts clean.
  Immediate.
"""

from __future__ import annotations

import collections
import contextlib
import random
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import structlog

from plugvisor.common.exitcodes import EXIT_CONFIGURATION, EXIT_KUBELET_RESTARTED
from plugvisor.common.notify import STOP_FOR_GOOD_SIGNAL
from plugvisor.common.validation import bounded, shorten
from plugvisor.supervisor import states
from plugvisor.supervisor.backoff import BackoffPolicy
from plugvisor.supervisor.clock import Clock
from plugvisor.supervisor.config import ChildSpec
from plugvisor.supervisor.spawner import Spawner, SpawnError

CAUSE_CRASH: Final = "crash"
CAUSE_KILLED: Final = "killed"
CAUSE_EXITED: Final = "exited"
CAUSE_CONFIG: Final = "config"
CAUSE_KUBELET_RESTART: Final = "kubelet-restart"
CAUSE_RELOAD: Final = "reload"
CAUSE_SPAWN_ERROR: Final = "spawn-error"
CAUSE_UNREGISTERED: Final = "unregistered"
CAUSES: Final = (
    CAUSE_CRASH,
    CAUSE_KILLED,
    CAUSE_EXITED,
    CAUSE_CONFIG,
    CAUSE_KUBELET_RESTART,
    CAUSE_RELOAD,
    CAUSE_SPAWN_ERROR,
    CAUSE_UNREGISTERED,
)

StateListener = Callable[["Child", states.ChildState, states.ChildState], None]


def classify_exit(returncode: int) -> str:
    """Name the cause of an exit nobody asked for, from its status (negative: killed by that signal)."""
    if returncode < 0:
        return CAUSE_KILLED
    if returncode == EXIT_KUBELET_RESTARTED:
        return CAUSE_KUBELET_RESTART
    if returncode == EXIT_CONFIGURATION:
        return CAUSE_CONFIG
    if returncode == 0:
        return CAUSE_EXITED
    return CAUSE_CRASH


def describe_status(returncode: int) -> str:
    """``exit status 1`` or ``signal SIGKILL``, for logs and ``plugvisor status``."""
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-returncode).name}"
        return f"signal {-returncode}"
    return f"exit status {returncode}"


def describe_exit(returncode: int, *, stopped_by_agent: bool) -> str:
    """How a process ended, in words that say what happened, for logs and ``plugvisor status``.

    A process the agent stopped (a restart for a kubelet restart, a reload, a
    removal) ended as asked: ``stopped by the agent``, with its status only when
    it did not end cleanly (0 or SIGTERM). A plain ``exit status 0`` there read as
    if the process had quit on its own. Status 3 is the plugin's own exit to
    register again (it saw the kubelet restart or its socket go), whichever of
    the two noticed first: a polling plugin notices half a second later than the
    agent, an inotify one often before it.
    """
    if returncode == EXIT_KUBELET_RESTARTED:
        return f"exited to register again ({describe_status(returncode)})"
    if stopped_by_agent:
        clean = returncode in (0, -signal.SIGTERM)
        return "stopped by the agent" if clean else f"stopped by the agent ({describe_status(returncode)})"
    return describe_status(returncode)


@dataclass(frozen=True, slots=True)
class ExitRecord:
    """How a child's latest process ended."""

    cause: str
    returncode: int | None
    detail: str
    wall: float
    uptime: float
    error: str | None = None
    """The process's own last words (its ``ERROR=`` datagram): why it failed, cut and escaped."""


class Child:
    """The process of one resource, through starts, exits, backoff, stops and restarts."""

    def __init__(
        self,
        spec: ChildSpec,
        *,
        spawner: Spawner,
        clock: Clock,
        policy: BackoffPolicy,
        stop_timeout: float,
        rand: Callable[[], float] = random.random,
        on_change: StateListener | None = None,
    ) -> None:
        self.spec = spec
        self.policy = policy
        self.stop_timeout = stop_timeout
        self._spawner = spawner
        self._clock = clock
        self._rand = rand
        self._on_change = on_change
        self._log = structlog.get_logger("plugvisor.supervisor").bind(resource=spec.resource)
        self.state: states.ChildState = states.STOPPED
        self.wanted = False
        self.pid: int | None = None
        self.started_at: float | None = None
        self.started_wall: float | None = None
        self.failures = 0
        self.crash_looping = False
        self.delay: float = 0.0
        self.delay_until: float | None = None
        self.stop_deadline: float | None = None
        self.killed = False
        self.restart_after_stop: str | None = None
        self.restarts: collections.Counter[str] = collections.Counter()
        self.last_exit: ExitRecord | None = None
        self.spawn_error: str | None = None
        self.spawning = False
        self._cancel_spawn = False
        self._attempt = 0
        self.registered = False
        self.unregistered_since: float | None = None
        self.registered_wall: float | None = None
        self.registrations = 0
        self.registrations_total = 0
        self.endpoint: str | None = None
        self.devices: tuple[int, int] | None = None
        self.slices: str | None = None
        """A DRA driver's ResourceSlices (its SLICES= field): ``synced``, ``pending``, ``failing: <why>``."""
        self.waiting: str | None = None
        """What the process says its registration waits for (no kubelet, a kubelet that does not answer)."""
        self.taken_over_by: str | None = None
        """The socket of another plugin of this resource that the kubelet follows now (a second agent's)."""
        self.unregistered_reason: str | None = None
        self._error: str | None = None
        """What the current process said was its last error (``ERROR=``), kept for its exit record."""
        self._said_no_device = False
        """Whether ``resource_matches_no_device`` was logged (once, until a device appears)."""
        """Why the process said it lost its registration (a kubelet restart, its socket removed)."""
        self.polling: str | None = None
        """Why the process watches files by polling (its WATCH= field: no inotify left); None: inotify."""

    @property
    def resource(self) -> str:
        """The resource this child serves."""
        return self.spec.resource

    # -- the single writer of the state ------------------------------------------------

    def change_state(self, new: states.ChildState) -> None:
        """Move to ``new``; the only place where ``state`` is written."""
        old, self.state = self.state, new
        if new is states.BACKOFF:
            self._log.warning(
                "child_backoff",
                delay=round(self.delay, 3),
                failures=self.failures,
                crash_looping=self.crash_looping,
            )
        else:
            self._log.info("child_state", state=new.name, previous=old.name, pid=self.pid)
        if self._on_change is not None:
            self._on_change(self, old, new)

    # -- commands ------------------------------------------------------------------------

    def start(self) -> None:
        """Start a process now (STOPPED or BACKOFF -> STARTING)."""
        assert self.state in (states.STOPPED, states.BACKOFF), self.state
        self.wanted = True
        self._spawn()

    def stop(self, *, for_good: bool = False) -> None:
        """Stop: SIGTERM now, SIGKILL when ``stop_timeout`` is overrun (see :meth:`transition`).

        ``for_good``: the resource left the configuration and no process of it
        will follow. A DRA driver is then told so with
        :data:`~plugvisor.common.notify.STOP_FOR_GOOD_SIGNAL` instead of SIGTERM,
        and withdraws its ResourceSlices; stopped with the agent, it keeps them
        for the agent's next start.
        """
        self.wanted = False
        self.restart_after_stop = None
        if self.state in (states.STARTING, states.RUNNING):
            self._terminate(STOP_FOR_GOOD_SIGNAL if for_good and self.spec.mode == "dra" else signal.SIGTERM)
        elif self.state is states.BACKOFF:
            self.delay_until = None
            self.change_state(states.STOPPED)

    def restart(self, cause: str) -> None:
        """Restart at once, without backoff (a reload or a kubelet restart); stops the process first."""
        self.wanted = True
        if self.state in (states.STARTING, states.RUNNING):
            self.restart_after_stop = cause
            self._terminate()
        elif self.state is states.STOPPING:
            self.restart_after_stop = cause
        else:
            self.restarts[cause] += 1
            self._spawn()

    def update(self, spec: ChildSpec, *, policy: BackoffPolicy, stop_timeout: float) -> bool:
        """Take a reloaded configuration; returns whether the process must restart for it."""
        self.policy = policy
        self.stop_timeout = stop_timeout
        if spec == self.spec:
            return False
        self.spec = spec
        return True

    # -- events --------------------------------------------------------------------------

    def on_exit(self, returncode: int) -> None:
        """The process ended with ``returncode`` (negative: killed by that signal)."""
        if self.state not in states.ALIVE:
            return
        now = self._clock.monotonic()
        uptime = now - (self.started_at if self.started_at is not None else now)
        detail = describe_exit(returncode, stopped_by_agent=self.state is states.STOPPING)
        if self.state is states.STOPPING:
            cause = self.restart_after_stop or "stopped"
        else:
            cause = classify_exit(returncode)
        error, self._error = self._error, None
        self.last_exit = ExitRecord(cause, returncode, detail, self._clock.wall(), round(uptime, 3), error)
        self._log.info(
            "child_exited", pid=self.pid, status=detail, cause=cause, uptime=round(uptime, 3), error=error
        )
        self._forget_process()
        if self.state is states.STOPPING:
            restart, self.restart_after_stop = self.restart_after_stop, None
            if restart is not None and self.wanted:
                self.restarts[restart] += 1
                self._spawn()
            else:
                self.change_state(states.STOPPED)
            return
        self.restarts[cause] += 1
        if cause == CAUSE_KUBELET_RESTART:
            self._spawn()
            return
        if uptime >= self.policy.reset_after:
            self.failures = 0
        self._back_off(cap=cause == CAUSE_CONFIG)

    def on_status(self, fields: Mapping[str, str]) -> None:
        """A status datagram from the process (see :mod:`plugvisor.common.notify`)."""
        if self.state not in (states.STARTING, states.RUNNING):
            return
        devices = fields.get("DEVICES")
        if devices is not None:
            healthy, _, total = devices.partition("/")
            if healthy.isdigit() and total.isdigit():
                self.devices = (int(healthy), int(total))
                self._note_device_count()
        self._note_texts(fields)
        lost = fields.get("KUBELET_RESTART") or fields.get("UNREGISTERED")
        if lost:
            self.unregistered_reason = shorten(lost, 300)
            self._lose_registration()
        taken_over_by = fields.get("TAKEN_OVER")
        if taken_over_by and taken_over_by != self.taken_over_by:
            self.taken_over_by = shorten(taken_over_by, 300)
            self._log.warning(
                "resource_taken_over",
                pid=self.pid,
                by=self.taken_over_by,
                meaning="another plugin of this resource (a second agent?) registered it; the kubelet uses "
                "that one now, and this child registers again when it stops",
            )
            self._lose_registration()
        registered = fields.get("REGISTERED")
        if registered is not None and registered.isdigit():
            if self.taken_over_by is not None:
                self._log.info("resource_back", pid=self.pid, was_taken_over_by=self.taken_over_by)
            self.registrations = int(registered)
            self.registrations_total += 1
            self.registered = True
            self.unregistered_since = None
            self.registered_wall = self._clock.wall()
            self.waiting = self.taken_over_by = self.unregistered_reason = None
            if self.state is states.STARTING:
                self.change_state(states.RUNNING)

    def _note_texts(self, fields: Mapping[str, str]) -> None:
        """The datagram's free-text fields, each cut: last error, endpoint, slices, waits, watch mode."""
        if "ERROR" in fields:
            self._error = bounded(fields["ERROR"], 300) or None
        if "ENDPOINT" in fields:
            self.endpoint = fields["ENDPOINT"]
        if "SLICES" in fields:
            self.slices = shorten(fields["SLICES"], 300)
        if "WAITING" in fields:
            self.waiting = shorten(fields["WAITING"], 300) or None
        mode, _, why = fields.get("WATCH", "").partition(": ")
        if mode == "polling":
            self.polling = shorten(why, 300) or "no reason given"

    @property
    def matches_no_device(self) -> bool:
        """The process serves and found no device at all (a vendor ID typo, a wrong hostRoot?)."""
        return self.devices is not None and self.devices[1] == 0 and self.state in states.ALIVE

    def _note_device_count(self) -> None:
        if not self.matches_no_device:
            self._said_no_device = False
            return
        if not self._said_no_device:
            self._said_no_device = True
            self._log.warning(
                "resource_matches_no_device",
                pid=self.pid,
                kind=self.spec.kind,
                hint="the kind's selection (vendor, device class, paths) finds nothing under hostRoot: a "
                "typo? It registers with 0 devices; devices that appear later are picked up",
            )

    def on_kubelet_restart(self, *, kubelet_wall: float | None, restart: bool) -> bool:
        """The kubelet restarted (its socket is newer than ``kubelet_wall``... our registration).

        A process that registered before the new ``kubelet.sock`` appeared has
        lost its registration; with ``restart`` it is restarted at once. A process
        that registered after it (it noticed first) is left alone. Returns whether
        this child was affected.
        """
        if self.state is not states.RUNNING or self.registered_wall is None:
            return False
        if kubelet_wall is not None and self.registered_wall >= kubelet_wall:
            return False
        self._lose_registration()
        # A DRA driver is never restarted for it: the new kubelet's plugin watcher dials its
        # registration socket again, and a restart would only interrupt its claims and slices.
        if restart and self.spec.mode != "dra":
            self.restart(CAUSE_KUBELET_RESTART)
        return True

    def on_socket_deleted(self, name: str, *, restart: bool) -> bool:
        """A socket was deleted from the kubelet dir; if it was this process's own, treat as a restart."""
        if self.state is not states.RUNNING or name != self.endpoint:
            return False
        self._lose_registration()
        if restart:
            self.restart(CAUSE_KUBELET_RESTART)
        return True

    def _lose_registration(self) -> None:
        if self.registered:
            self.unregistered_since = self._clock.monotonic()
        self.registered = False

    def registration_overdue(self, *, kubelet_up_since: float, timeout: float) -> float | None:
        """When this process will have been unregistered for too long with the kubelet up (monotonic).

        None when it is registered or has no process to blame (yet).
        """
        if self.state not in (states.STARTING, states.RUNNING) or self.registered or self.pid is None:
            return None
        if self.taken_over_by is not None:
            # Not lost: handed over. A new process would take the resource back (the agent's children
            # replace), and two agents would take it from each other every registrationTimeout.
            return None
        since = self.unregistered_since if self.unregistered_since is not None else self.started_at
        if since is None:
            return None
        return max(since, kubelet_up_since) + timeout

    # -- time ------------------------------------------------------------------------------

    def transition(self) -> None:
        """Take every time-based edge that is due (called on each supervisor tick)."""
        now = self._clock.monotonic()
        state = self.state
        if state is states.BACKOFF:
            # BACKOFF -> STARTING: the delay is over.
            if self.wanted and self.delay_until is not None and now >= self.delay_until:
                self._spawn()
        elif state in (states.STARTING, states.RUNNING):
            # A process that stayed up long enough wipes the failure count (the backoff resets).
            if (
                self.failures
                and self.started_at is not None
                and now - self.started_at >= self.policy.reset_after
            ):
                self._log.info("child_backoff_reset", failures=self.failures)
                self.failures = 0
                self.crash_looping = False
        elif (
            state is states.STOPPING
            and not self.killed
            and self.stop_deadline is not None
            and now >= self.stop_deadline
            and self.pid is not None
        ):
            # STOPPING -> (SIGKILL): the process overran its stop bound.
            self._log.warning("child_stop_timeout", pid=self.pid, timeout=self.stop_timeout)
            self.killed = True
            self._spawner.kill(self.pid, signal.SIGKILL)

    def next_deadline(self) -> float | None:
        """When :meth:`transition` next has something to do (monotonic), or None."""
        if self.state is states.BACKOFF and self.wanted:
            return self.delay_until
        if self.state is states.STOPPING and not self.killed and self.pid is not None:
            # (With no PID yet, the spawn's answer is what moves things on, not the clock.)
            return self.stop_deadline
        if self.state in (states.STARTING, states.RUNNING) and self.failures and self.started_at is not None:
            return self.started_at + self.policy.reset_after
        return None

    # -- reporting ------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The child as ``plugvisor status --json`` shows it."""
        now = self._clock.monotonic()
        alive = self.state in states.ALIVE and self.started_at is not None
        exit_ = self.last_exit
        return {
            "resource": self.resource,
            "kind": self.spec.kind,
            "mode": self.spec.mode,
            "state": self.state.name,
            "pid": self.pid,
            "started_at": self.started_wall if alive else None,
            "uptime": round(now - self.started_at, 3) if alive and self.started_at is not None else None,
            "registered": self.registered,
            "registrations": self.registrations_total,
            "endpoint": self.endpoint,
            "devices": None
            if self.devices is None
            else {"healthy": self.devices[0], "total": self.devices[1]},
            "restarts": sum(self.restarts.values()),
            "restarts_by_cause": dict(sorted(self.restarts.items())),
            "failures": self.failures,
            "crash_looping": self.crash_looping,
            "backoff_delay": round(self.delay, 3) if self.state is states.BACKOFF else None,
            "next_start_in": round(max(0.0, self.delay_until - now), 3)
            if self.state is states.BACKOFF and self.delay_until is not None
            else None,
            "last_exit": None
            if exit_ is None
            else {
                "cause": exit_.cause,
                "status": exit_.detail,
                "at": exit_.wall,
                "uptime": exit_.uptime,
                "error": exit_.error,
            },
            "matches_no_device": self.matches_no_device,
            "spawn_error": self.spawn_error,
            "slices": self.slices,
            "waiting": self.waiting,
            "taken_over_by": self.taken_over_by,
            "unregistered_reason": self.unregistered_reason,
            "watch": ("polling" if self.polling is not None else "inotify") if self.pid is not None else None,
            "watch_reason": self.polling,
        }

    # -- internals ------------------------------------------------------------------------

    def _spawn(self) -> None:
        """Ask for a process; the spawner answers now or later (see :meth:`_spawned`)."""
        self.delay_until = None
        self._attempt += 1
        attempt = self._attempt
        self.spawning = True
        self._cancel_spawn = False
        self.pid = None
        self._error = None
        self.started_at = self._clock.monotonic()
        self.started_wall = self._clock.wall()
        self.killed = False
        self.stop_deadline = None
        self._spawner.spawn(self.spec, lambda result: self._spawned(attempt, result))
        if self.spawning and self._attempt == attempt and self.state is not states.STARTING:
            # No answer yet: STARTING without a PID until the spawner has one.
            self.change_state(states.STARTING)

    def _spawned(self, attempt: int, result: int | SpawnError) -> None:
        """The spawner's answer for spawn ``attempt``: a PID or the reason there is none."""
        if attempt != self._attempt or not self.spawning:
            # An answer nobody waits for any more: such a process must not live on unseen.
            if isinstance(result, int):
                self._log.warning("child_spawn_answer_late", pid=result)
                self._spawner.kill(result, signal.SIGKILL)
            return
        self.spawning = False
        if isinstance(result, SpawnError):
            self.spawn_error = str(result)
            self._log.error("child_spawn_failed", error=str(result))
            self.restarts[CAUSE_SPAWN_ERROR] += 1
            self.started_at = None
            self.started_wall = None
            if self._cancel_spawn:
                restart, self.restart_after_stop = self.restart_after_stop, None
                if restart is not None and self.wanted:
                    self._spawn()
                else:
                    self.change_state(states.STOPPED)
                return
            self._back_off(cap=False, counts=not result.helper_fault)
            return
        self.spawn_error = None
        self.pid = result
        # Up (and blamed for not registering) from now: a spawn may have waited for a start slot.
        self.started_at = self._clock.monotonic()
        self.started_wall = self._clock.wall()
        if self._cancel_spawn:
            # Stopped (or restarted) while the spawn was in flight: stop the new process now.
            self._spawner.kill(result, signal.SIGTERM)
        elif self.state is states.STARTING:
            self._log.info("child_spawned", pid=result)
        else:
            self.change_state(states.STARTING)

    def _back_off(self, *, cap: bool, counts: bool = True) -> None:
        if counts:
            self.failures += 1
            self.crash_looping = cap or self.policy.crash_looping(self.failures)
            self.delay = self.policy.cap if cap else self.policy.delay(self.failures, rand=self._rand)
        else:
            # Not this child's failure (the fork server's): try again after the first step.
            self.delay = self.policy.initial
        self.delay_until = self._clock.monotonic() + self.delay
        self.change_state(states.BACKOFF)

    def _terminate(self, sig: signal.Signals = signal.SIGTERM) -> None:
        self.stop_deadline = self._clock.monotonic() + self.stop_timeout
        self.killed = False
        self.change_state(states.STOPPING)
        if self.pid is not None:
            self._spawner.kill(self.pid, sig)
        elif self.spawning:
            # The spawn is still in flight: its process is stopped on arrival (see _spawned).
            self._cancel_spawn = True

    def _forget_process(self) -> None:
        self.pid = None
        self.started_at = None
        self.started_wall = None
        self.registered = False
        self.unregistered_since = None
        self.registered_wall = None
        self.registrations = 0
        self.endpoint = None
        self.devices = None
        self.slices = None
        self.waiting = self.taken_over_by = self.unregistered_reason = self.polling = None
        self.stop_deadline = None
        self.killed = False
