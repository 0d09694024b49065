"""The reconcile loop: one child per configured resource, kept registered whatever happens.

:class:`Supervisor` is the synchronous core. Events (exits, status reports,
kubelet restarts, a reloaded configuration) are method calls, and :meth:`tick`
runs every child's time-based edges. Unit tests drive it directly with a
:class:`~plugvisor.supervisor.spawner.FakeSpawner` and a
:class:`~plugvisor.supervisor.clock.FakeClock`.

:class:`~plugvisor.supervisor.agent.Agent` is the process around it
(``plugvisor run``). The dead-socket sweeps live here because both use them: the
core after each exit, the agent once at start.
"""

from __future__ import annotations

import os
import random
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import structlog

from plugvisor.common.constants import KUBELET_SOCKET_NAME
from plugvisor.common.sockets import SOCKET_PREFIX, socket_answers, socket_files, socket_prefix
from plugvisor.common.validation import bounded
from plugvisor.supervisor import states
from plugvisor.supervisor.backoff import BackoffPolicy
from plugvisor.supervisor.child import CAUSE_RELOAD, CAUSE_UNREGISTERED, Child
from plugvisor.supervisor.clock import Clock
from plugvisor.supervisor.config import (
    ChildSpec,
    NodeConfig,
    child_specs,
    dra_socket_paths,
)
from plugvisor.supervisor.spawner import Spawner

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


def _listen(config: NodeConfig) -> str | None:
    """Where the agent serves /metrics under ``config`` (None: not at all)."""
    return None if config.metrics is None else config.metrics.listen


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
        self._started_with = config
        """The configuration at start: its runtime directory, spawner and metrics listener stay in force."""
        self._socket_exists = socket_exists or (lambda name: (self.config.kubelet_dir / name).exists())
        self._sweep_sockets = sweep_sockets or self._sweep_dead_sockets
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
        self.rejected_reload: tuple[str, float] | None = None
        """The last SIGHUP's refused file's error and when, until a reload is taken."""

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
        self.config = config
        self.rejected_reload = None
        policy = backoff_policy(config)
        specs = self.specs(config)
        summary: dict[str, list[str]] = {"added": [], "removed": [], "changed": [], "unchanged": []}
        for resource in [name for name in self.children if name not in specs]:
            child = self.children.pop(resource)
            child.stop(for_good=True)
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
        started = self._started_with
        for setting, running, wanted in (
            ("spawner", started.supervisor.spawner, config.supervisor.spawner),
            ("runtime_dir", str(started.runtime_dir), str(config.runtime_dir)),
            ("metrics", _listen(started), _listen(config)),
        ):
            if running != wanted:
                _log.warning(
                    "reload_setting_needs_restart", setting=setting, running=running, configured=wanted
                )
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
            removed = (
                self._sweep_dra_sockets(child.resource)
                if child.spec.mode == "dra"
                else self._sweep_sockets(socket_prefix(child.resource))
            )
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
        if (
            "REGISTERED" in fields
            and endpoint
            and self._serves_in_kubelet_dir(child.resource)
            and not self._socket_exists(endpoint)
        ):
            # The kubelet restarted (and wiped the socket) while this registration was in
            # flight: it was made with a kubelet that is gone, and the deletion came before
            # we knew the socket was this child's.
            _log.info("registration_outdated", resource=child.resource, socket=endpoint)
            child.on_socket_deleted(endpoint, restart=self.restart_on_kubelet_restart)
            self._lost.add(child.resource)

    def _sweep_dead_sockets(self, prefix: str) -> list[str]:
        """Remove the dead ``prefix`` sockets where children serve.

        That is the kubelet's directory, and beside it the plugin watcher's
        ``plugins_registry`` when a resource registers that way (whose watcher
        would otherwise keep dialling a dead socket a SIGKILLed child left there).
        """
        removed = remove_stale_sockets(self.config.kubelet_dir, prefix)
        if any(r.registration == "plugin-watcher" for r in self.config.resources):
            removed += remove_stale_sockets(self.config.plugins_registry, prefix)
        return removed

    def _sweep_dra_sockets(self, driver: str) -> list[str]:
        """Remove a DRA driver's sockets that no process answers on (a SIGKILLed driver's).

        The kubelet's plugin watcher would otherwise keep dialling the dead
        registration socket until a new driver process replaces it.
        """
        paths = dra_socket_paths(self.config.kubelet_dir, driver)
        return [str(path) for path in paths if remove_dead_socket(path)]

    def _serves_in_kubelet_dir(self, resource: str) -> bool:
        """Whether ``resource``'s socket is in the kubelet's directory.

        A plugin-watcher child's is in ``plugins_registry`` (a DRA driver's too):
        not finding it in the kubelet's directory means nothing, and taking that
        for an outdated registration restarted such a child after every registration.
        """
        return all(
            r.registration == "kubelet-sock" and not r.dra
            for r in self.config.resources
            if r.name == resource
        )

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

    def starting_until(self, window: float) -> float:
        """Until when (monotonic) a child started in the last ``window`` seconds may still be registering."""
        return max(
            (
                child.started_at + window
                for child in self.all_children()
                if child.state is states.STARTING and child.started_at is not None
            ),
            default=0.0,
        )

    # -- reporting -----------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """Every configured resource is registered with the current kubelet."""
        return bool(self.children) and all(
            child.state is states.RUNNING and child.registered for child in self.children.values()
        )

    def reload_rejected(self, error: str) -> None:
        """A SIGHUP's file was refused (the running configuration kept): shown until a reload is taken."""
        self.rejected_reload = (bounded(error, 600), self.clock.wall())
        self.dirty = True

    def readiness(self) -> tuple[bool, str]:
        """``(ready, explanation)`` for ``/readyz``: each resource not registered, with why when known.

        A rejected reload does not make the node unready (the previous
        configuration serves on) but is said, with the file's error.
        """
        rejected = ""
        if self.rejected_reload is not None:
            rejected = (
                f"; last reload rejected, running the previous configuration: {self.rejected_reload[0]}"
            )
        if self.ready:
            return True, f"ready: {len(self.children)} resources registered{rejected}"
        waiting = [
            child.resource + (f" ({why})" if (why := unregistered_why(child)) else "")
            for child in self.children.values()
            if not child.registered
        ]
        return False, "not registered: " + ", ".join(waiting) + rejected

    def summary(self) -> str:
        """One line for systemd's STATUS=."""
        children = self.children.values()
        registered = sum(1 for child in children if child.registered)
        text = f"{registered}/{len(children)} resources registered"
        for label, resources in (
            ("crash-looping", [child.resource for child in children if child.crash_looping]),
            ("taken over by another plugin", [child.resource for child in children if child.taken_over_by]),
            ("no device", [child.resource for child in children if child.matches_no_device]),
        ):
            if resources:
                text += f"; {label}: " + ", ".join(resources)
        waiting = sorted({child.waiting for child in children if child.waiting and not child.registered})
        if waiting:
            text += "; waiting for " + "; ".join(waiting)
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
                "spawner_fallback": self.spawner.fallback,
                "reload_rejected": None
                if self.rejected_reload is None
                else {"error": self.rejected_reload[0], "at": self.rejected_reload[1]},
            },
            "children": [child.snapshot() for child in self.all_children()],
        }


def unregistered_why(child: Child) -> str | None:
    """Why ``child`` is not registered, as far as the agent knows (its process said so)."""
    if child.taken_over_by is not None:
        return f"taken over by {child.taken_over_by}"
    said = child.waiting or child.unregistered_reason
    if said is None and child.last_exit is not None and child.last_exit.error is not None:
        last = child.last_exit
        return f"{last.cause} ({last.detail}): {last.error}"
    return said


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
    return [path.name for path in socket_files(kubelet_dir, prefix) if remove_dead_socket(path)]
