"""Registering with the kubelet, and noticing when the kubelet has restarted.

A restarting kubelet deletes every socket in its device-plugins directory, then
listens on a new ``kubelet.sock``; each plugin must serve a fresh socket and
register again, or its resource drops to zero. Plugins in the wild detect this
either by their own socket vanishing (Intel) or by ``kubelet.sock`` being created
(NVIDIA, the kubelet's own Stub). :class:`KubeletDirState` counts both, from the
inotify watch shared with the agent, so the reaction starts within milliseconds.

A ``kubelet.sock`` creation only counts as a restart when the socket is a
different file from the one we registered through (compared by inode and
change time): the event that announces the very kubelet we just registered
with must not trigger a second, spurious registration.

A second plugin that registers the same resource (started by hand with
``--replace``, or another agent's) makes the kubelet follow it, without a word
to us; when it stops, a kubelet up to 1.36 marks every device unhealthy until a
plugin registers again. Its socket is named by the same prefix as ours, so its
creation and removal are counted too (:attr:`DirState.sibling_creations`,
:attr:`DirState.sibling_removals`), and :data:`SIBLING_STOPPED` tells the
runtime to register again, from a fresh socket: a 1.37 kubelet refuses a
second Register from a socket it still holds.

A kubelet that crash-loops restarts within milliseconds of accepting a
registration, so events that announce the *next* restart can be applied while
the Register call is still returning. Two rules keep such a restart from being
missed: every event counted after a Register call *began* is judged against that
call (not against whatever the state is once it has returned), and the files
themselves are checked right after the watch is armed and then every
``safety_interval`` seconds, so that even a lost inotify event (a queue
overflow) costs at most one interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import grpc
import structlog

from plugvisor.api.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from plugvisor.common import constants
from plugvisor.common.kubeletdir import DirChange, DirEvent, KubeletDirWatch
from plugvisor.common.sockets import is_instance_name, socket_answers, socket_files, socket_prefix
from plugvisor.deviceplugin.cell import SnapshotCell
from plugvisor.deviceplugin.errors import RegistrationRejectedError


@dataclass(frozen=True, slots=True)
class SocketIdentity:
    """Tells one socket file from another that later appears at the same path."""

    inode: int
    ctime_ns: int

    @classmethod
    def of(cls, path: Path) -> SocketIdentity | None:
        """The identity of the file at ``path`` now, or None if there is none."""
        try:
            st = path.stat()
        except OSError:
            return None
        return cls(st.st_ino, st.st_ctime_ns)


SIBLING_STOPPED: Final = "another plugin of this resource stopped"
""":meth:`Registrar.wait_for_restart`'s reason when a plugin that may have superseded us went away."""
SIBLING_CUT_WAIT: Final = 3.0
"""Seconds a plugin waits, when only plugins older than its registration stopped, before it registers again.

It took the resource over from them, so the kubelet follows it: up to 1.36 the
kubelet cuts its stream for their end (through ``kubelet.sock`` at once, through
the plugin watcher within its one-second reconcile), and the cut is what makes
it register again, from a socket the kubelet has no stale hold on. Registering
at once instead raced that cut, which could then land on the fresh registration
before its stream was even open, unseen. Only if no cut comes does it register
again anyway (the older one may have registered last after all)."""
SIBLING_STARTED: Final = "another plugin of this resource started"
""":meth:`Registrar.wait_for_restart`'s reason when a socket of our resource that we never served appeared
(:attr:`KubeletDirState.last_sibling`): another plugin, which the kubelet follows once it registers."""


@dataclass(frozen=True, slots=True)
class DirState:
    """What the watch has seen so far in the kubelet's directory (counters only grow)."""

    kubelet_creations: int = 0
    socket_deletions: int = 0
    overflows: int = 0
    sibling_removals: int = 0
    """Sockets of our resource that this process never served, removed: a plugin that may have
    superseded us has gone."""
    sibling_creations: int = 0
    """Sockets of our resource that this process never served, created: another plugin of our resource
    starts, and takes the resource over once it registers."""


class KubeletDirState:
    """The kubelet directory as registration needs it: counters of kubelet starts and of our socket's removal.

    Fed by the shared :class:`~plugvisor.common.kubeletdir.KubeletDirWatch`; a
    cell, so that any number of waiters see every change. ``log``: the plugin's logger,
    bound to its resource (the watch's lines name it).
    """

    def __init__(self, kubelet_dir: Path, *, log: Any) -> None:
        self.kubelet_dir = kubelet_dir
        self.kubelet_socket = kubelet_dir / constants.KUBELET_SOCKET_NAME
        self.state: SnapshotCell[DirState] = SnapshotCell(DirState())
        self.own_socket: str | None = None
        self._sibling_prefix: str | None = None
        self.served: set[str] = set()
        """Every socket name this process has registered (so our own old ones are no siblings)."""
        self.last_sibling: str | None = None
        """The latest sibling socket created (see :data:`SIBLING_STARTED`)."""
        self._watch = KubeletDirWatch(kubelet_dir, self._apply, log=log)

    def open(self) -> None:
        """Start watching (before anything is registered, so no event can be missed)."""
        self._watch.open()

    def close(self) -> None:
        """Stop watching."""
        self._watch.close()

    @property
    def sibling_prefix(self) -> str | None:
        """Socket names ``<prefix>-*.sock`` are our resource's (see :func:`socket_prefix`)."""
        return self._sibling_prefix

    @sibling_prefix.setter
    def sibling_prefix(self, prefix: str) -> None:
        """Set it, and hear from then on of ``kubelet.sock`` and our resource's sockets only.

        Every name this state counts is one of those (our own sockets are named
        with the prefix too): the others' events were classified only to be
        dropped, ~11 microseconds each, 5 N of them per kubelet restart of N resources.
        """
        self._sibling_prefix = prefix
        self._watch.narrow((constants.KUBELET_SOCKET_NAME, prefix + "-"))

    def _is_sibling(self, name: str) -> bool:
        prefix = self.sibling_prefix
        return (
            prefix is not None
            and is_instance_name(name, prefix)
            and name != self.own_socket
            and name not in self.served
        )

    def _apply(self, event: DirEvent) -> None:
        """Count ``event`` if it concerns us; publish only then.

        Every plugin sees every file of the directory come and go: at a kubelet
        restart of N resources, N sockets go and N come in each of N processes. Only
        the few that change the counters may wake the waiters (each wake-up costs
        them a look at the files), or a restart costs O(N²) wake-ups; and only those
        end the watch's pause in a burst of events (:mod:`plugvisor.common.inotify`).
        """
        before = state = self.state.value
        if event.change is DirChange.KUBELET_SOCKET_CREATED:
            state = dataclasses.replace(state, kubelet_creations=state.kubelet_creations + 1)
        elif event.change is DirChange.FILE_REMOVED and event.name == self.own_socket:
            state = dataclasses.replace(state, socket_deletions=state.socket_deletions + 1)
        elif event.change is DirChange.FILE_REMOVED and self._is_sibling(event.name):
            state = dataclasses.replace(state, sibling_removals=state.sibling_removals + 1)
        elif event.change is DirChange.FILE_CREATED and self._is_sibling(event.name):
            self.last_sibling = event.name
            state = dataclasses.replace(state, sibling_creations=state.sibling_creations + 1)
        elif event.change is DirChange.EVENTS_LOST:
            # Count it as a possible restart, so that every waiter looks at the files
            # rather than trusting counters that missed an event.
            state = dataclasses.replace(
                state, kubelet_creations=state.kubelet_creations + 1, overflows=state.overflows + 1
            )
        if state is not before:
            self.state.publish(state)
            self._watch.hurry()  # the next restart must not wait out a pause meant for others' sockets

    async def run(self) -> None:
        """Turn directory events into DirState changes, forever."""
        await self._watch.run()

    def live_siblings(self) -> list[str]:
        """Names of the sockets of our resource that another live process serves here (blocking probes)."""
        prefix = self.sibling_prefix
        if prefix is None:
            return []
        return [
            path.name
            for path in socket_files(self.kubelet_dir, prefix + "-")
            if path.name not in self.served and socket_answers(path)
        ]

    async def wait_for_kubelet(self, safety_interval: float = 1.0) -> None:
        """Return once kubelet.sock exists: event-driven, with a periodic look in case an event was lost."""
        seen = self.state.version
        while not self.kubelet_socket.exists():
            with contextlib.suppress(TimeoutError):
                seen, _ = await asyncio.wait_for(self.state.wait_newer(seen), safety_interval)


async def register(
    kubelet_socket: Path,
    *,
    endpoint: str,
    resource: str,
    options: api_pb2.DevicePluginOptions,
    timeout: float,
) -> None:
    """Call Register once. Raises RegistrationRejectedError for refusals retrying cannot fix.

    The kubelet dials us back and asks for our options *inside* this call, so our
    server must already be serving; ``timeout`` covers that round trip.
    """
    request = api_pb2.RegisterRequest(
        version=constants.VERSION, endpoint=endpoint, resource_name=resource, options=options
    )
    # A private subchannel pool: gRPC otherwise shares connection state per target across channels,
    # and one "connection refused" (a kubelet.sock created a moment before its server listens) would
    # make every retry fail fast for the whole of gRPC's reconnect backoff (1 s and growing).
    channel_options = [("grpc.use_local_subchannel_pool", 1)]
    async with grpc.aio.insecure_channel(f"unix:{kubelet_socket}", options=channel_options) as channel:
        stub = api_pb2_grpc.RegistrationStub(channel)
        try:
            await stub.Register(request, timeout=timeout, wait_for_ready=False)
        except grpc.aio.AioRpcError as err:
            details = err.details() or ""
            if err.code() == grpc.StatusCode.UNKNOWN and (
                "is not supported by kubelet" in details or "ResourceName" in details
            ):
                raise RegistrationRejectedError(
                    f"the kubelet refused to register {resource}: {details}"
                ) from err
            raise


class EndpointLostError(Exception):
    """Our socket file vanished before registration; serve on a fresh one and try again."""


class Registrar:
    """Registers one endpoint, retrying until the kubelet answers, then reports restarts.

    Retries are event-driven first (a new kubelet.sock), with a capped backoff as
    the fallback for a kubelet that is up but slow to answer.
    """

    def __init__(
        self,
        watch: KubeletDirState,
        *,
        resource: str,
        register_timeout: float = 30.0,
        safety_interval: float = 1.0,
        on_waiting: Callable[[str], None] | None = None,
    ) -> None:
        """``on_waiting`` is told (once per registration and reason) what registration waits for."""
        self._watch = watch
        self._on_waiting = on_waiting
        self._waiting_for: str | None = None
        self._resource = resource
        self._timeout = register_timeout
        self._safety_interval = safety_interval
        self._registered_kubelet: SocketIdentity | None = None
        self._registered_endpoint: Path | None = None
        self._baseline = DirState()
        self._log = structlog.get_logger("plugvisor.registration").bind(resource=resource)
        self.registrations = 0
        watch.sibling_prefix = socket_prefix(resource)

    @property
    def dir_state(self) -> KubeletDirState:
        """The kubelet directory this registrar follows."""
        return self._watch

    @property
    def registered_kubelet(self) -> SocketIdentity | None:
        """The ``kubelet.sock`` the last successful Register went through, as it was just before the call.

        None before the first success (or when it was gone then). The stream
        the kubelet opens while Register returns belongs to this kubelet, so
        a stream's end is judged against it (a restart, or a cut).
        """
        return self._registered_kubelet

    async def register(self, endpoint: str, options: api_pb2.DevicePluginOptions) -> float:
        """Register ``endpoint`` (a bare socket file name); returns the seconds it took, retries included.

        Raises :class:`EndpointLostError` when our socket file disappears first: a
        kubelet that starts after us deletes every socket in its directory before
        it listens, so by the time ``kubelet.sock`` exists ours may be gone, and
        registering it would only make the kubelet's dial time out.
        """
        started = time.monotonic()
        self._watch.own_socket = endpoint
        self._watch.served.add(endpoint)
        own_socket = self._watch.kubelet_dir / endpoint
        delay = 0.05
        while True:
            if not self._watch.kubelet_socket.exists():
                self._waiting(f"a kubelet: {self._watch.kubelet_socket} does not exist")
                await self._watch.wait_for_kubelet()
            if not own_socket.exists():
                raise EndpointLostError(f"{endpoint} was deleted before it could be registered")
            identity = SocketIdentity.of(self._watch.kubelet_socket)
            seen = self._watch.state.version
            # Anything the watch counts from here on happened after this call began, so it
            # may be a restart of the kubelet we are about to register with.
            before = self._watch.state.value
            try:
                await self._register_unless_lost(endpoint, options)
            except grpc.aio.AioRpcError as err:
                self._log.warning(
                    "register_failed", code=err.code().name, error=err.details(), retry_in=delay
                )
                socket = self._watch.kubelet_socket
                self._waiting(f"the kubelet to answer on {socket} ({err.code().name})")
                # Whichever comes first: a new kubelet.sock, or the backoff delay.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._watch.state.wait_newer(seen), delay)
                delay = min(delay * 2, 5.0)
                continue
            self._waiting_for = None
            self._registered_kubelet = identity
            self._registered_endpoint = own_socket
            self._baseline = before
            self.registrations += 1
            elapsed = time.monotonic() - started
            self._log.info("registered", endpoint=endpoint, seconds=round(elapsed, 4))
            return elapsed

    def _waiting(self, what: str) -> None:
        """Say once (per registration and reason) what registration waits for.

        The operator is not left guessing (a mistyped kubelet directory, a kubelet that
        is not running), and the log is not flooded.
        """
        if what == self._waiting_for:
            return
        self._waiting_for = what
        if self._on_waiting is not None:
            self._on_waiting(what)

    async def _register_unless_lost(self, endpoint: str, options: api_pb2.DevicePluginOptions) -> None:
        """Call Register, abandoning it at once if our socket is deleted meanwhile.

        Without this, a wipe that lands during the call leaves us waiting out the
        kubelet's 10 s dial deadline for a socket that no longer exists.
        """
        state = self._watch.state
        deletions = state.value.socket_deletions
        seen = state.version
        call = asyncio.create_task(
            register(
                self._watch.kubelet_socket,
                endpoint=endpoint,
                resource=self._resource,
                options=options,
                timeout=self._timeout,
            )
        )
        try:
            while True:
                waiter = asyncio.create_task(state.wait_newer(seen))
                done, _ = await asyncio.wait({call, waiter}, return_when=asyncio.FIRST_COMPLETED)
                if call in done:
                    waiter.cancel()
                    call.result()
                    return
                seen, now = waiter.result()
                if now.socket_deletions > deletions:
                    raise EndpointLostError(f"{endpoint} was deleted while registering it")
        finally:
            call.cancel()

    async def wait_for_restart(self) -> str:
        """Return (with the reason) once the kubelet we registered with is gone or replaced.

        Judged against the state when the last Register call began, so a restart
        whose events arrived while that call was returning is seen at once; and
        the files are checked right away and then every ``safety_interval``
        seconds, so a restart whose events were lost is seen within that bound.
        """
        baseline = self._baseline
        seen = -1
        while True:
            state = self._watch.state.value
            if state.socket_deletions > baseline.socket_deletions:
                return "plugin socket deleted"
            if state.kubelet_creations > baseline.kubelet_creations:
                if SocketIdentity.of(self._watch.kubelet_socket) != self._registered_kubelet:
                    return "kubelet.sock re-created"
                # The creation event of the very kubelet we registered with: not a restart.
                baseline = dataclasses.replace(
                    baseline, kubelet_creations=state.kubelet_creations, overflows=state.overflows
                )
            reason = self._restart_seen_in_files()
            if reason is None and state.sibling_removals > baseline.sibling_removals:
                # Taken into the baseline: the caller decides (a live sibling may remain), and the
                # next wait must not report the same removal again.
                self._baseline = dataclasses.replace(self._baseline, sibling_removals=state.sibling_removals)
                return SIBLING_STOPPED
            if reason is None and state.sibling_creations > baseline.sibling_creations:
                self._baseline = dataclasses.replace(
                    self._baseline, sibling_creations=state.sibling_creations
                )
                return SIBLING_STARTED
            if reason is not None:
                if seen >= 0:
                    # Before the watch said so: its event was lost, or is held back in a burst of
                    # the other plugins' events (inotify's pause, a busy directory's slower looks).
                    self._log.info("kubelet_restart_seen_in_files", reason=reason)
                return reason
            seen = self._watch.state.version
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._watch.state.wait_newer(seen), self._safety_interval)

    def _restart_seen_in_files(self) -> str | None:
        """What the directory itself says, independent of any event: two stat calls."""
        if self._registered_endpoint is not None and not self._registered_endpoint.exists():
            return "plugin socket deleted"
        current = SocketIdentity.of(self._watch.kubelet_socket)
        # A missing kubelet.sock means a kubelet that stopped: it deletes our socket when it
        # starts again, which is the sign to act on. Only the inode counts here: a change
        # time moved by a chmod or a label must not look like a new kubelet every interval.
        registered = self._registered_kubelet
        if current is not None and (registered is None or current.inode != registered.inode):
            return "kubelet.sock re-created"
        return None
