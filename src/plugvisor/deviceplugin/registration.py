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
``--replace``, or another agent's) makes the kubelet follow it and forget us,
without a word to us; when it stops, the resource would be gone from the node
until the next kubelet restart. Its socket is named by the same prefix as ours,
so its removal is counted too (:attr:`DirState.sibling_removals`), and
:data:`SIBLING_STOPPED` tells the runtime to register again, on the same socket.
That registration can land before the kubelet has noticed the other plugin's
stream end; a kubelet up to 1.35 then disconnects whichever client the name has
at that moment, i.e. the one that just registered (kubernetes#121994), either
ending the stream it opened for us or closing the connection before opening it.
So such a registration is *confirmed*: if the kubelet, still listening, ends the
stream of that registration, or opens none within :data:`STREAM_GRACE`, it is
:data:`KUBELET_DROPPED_US` and the runtime registers again (a bounded number of
times in a row). Other registrations are not confirmed: a harness that reads one
list and hangs up must not make a plugin register in a loop.

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
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import grpc
import structlog

from plugvisor.api.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from plugvisor.common import constants
from plugvisor.common.kubeletdir import DirChange, DirEvent, KubeletDirWatch
from plugvisor.common.sockets import is_instance_name, socket_prefix
from plugvisor.deviceplugin.cell import SnapshotCell
from plugvisor.deviceplugin.errors import RegistrationRejectedError

if TYPE_CHECKING:
    from plugvisor.deviceplugin.server import StreamLog


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
KUBELET_DROPPED_US: Final = "the kubelet dropped our registration"
""":meth:`Registrar.wait_for_restart`'s reason when the kubelet we registered with (a confirmed
registration), still listening, ended the stream it opened for it, or opened none."""
STREAM_GRACE: Final = 5.0
"""Seconds a kubelet takes at most to open ListAndWatch after accepting a registration (it does so at
once; this covers a loaded node). A false alarm only costs one more registration."""
REGISTER_AGAIN: Final = frozenset({SIBLING_STOPPED, KUBELET_DROPPED_US})
"""Reasons to register again on the socket we serve (the kubelet did not restart)."""


def kubelet_listens(path: Path) -> bool:
    """Whether a server accepts connections on the unix socket ``path`` (a dead kubelet's file refuses)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.setblocking(False)
        try:
            probe.connect(os.fspath(path))
        except BlockingIOError:  # listening, its backlog full
            return True
        except OSError:
            return False
    return True


@dataclass(frozen=True, slots=True)
class DirState:
    """What the watch has seen so far in the kubelet's directory (counters only grow)."""

    kubelet_creations: int = 0
    socket_deletions: int = 0
    overflows: int = 0
    sibling_removals: int = 0
    """Sockets of our resource that this process never served, removed: a plugin that may have
    superseded us has gone."""


class KubeletDirState:
    """The kubelet directory as registration needs it: counters of kubelet starts and of our socket's removal.

    Fed by the shared :class:`~plugvisor.common.kubeletdir.KubeletDirWatch`; a
    cell, so that any number of waiters see every change.
    """

    def __init__(self, kubelet_dir: Path) -> None:
        self.kubelet_dir = kubelet_dir
        self.kubelet_socket = kubelet_dir / constants.KUBELET_SOCKET_NAME
        self.state: SnapshotCell[DirState] = SnapshotCell(DirState())
        self.own_socket: str | None = None
        self.sibling_prefix: str | None = None
        """Socket names ``<prefix>-*.sock`` are our resource's (see :func:`socket_prefix`)."""
        self.served: set[str] = set()
        """Every socket name this process has registered (so our own old ones are no siblings)."""
        self._watch = KubeletDirWatch(kubelet_dir, self._apply)

    def open(self) -> None:
        """Start watching (before anything is registered, so no event can be missed)."""
        self._watch.open()

    def close(self) -> None:
        """Stop watching."""
        self._watch.close()

    def _is_sibling(self, name: str) -> bool:
        prefix = self.sibling_prefix
        return (
            prefix is not None
            and is_instance_name(name, prefix)
            and name != self.own_socket
            and name not in self.served
        )

    def _apply(self, event: DirEvent) -> None:
        state = self.state.value
        if event.change is DirChange.KUBELET_SOCKET_CREATED:
            state = dataclasses.replace(state, kubelet_creations=state.kubelet_creations + 1)
        elif event.change is DirChange.FILE_REMOVED and event.name == self.own_socket:
            state = dataclasses.replace(state, socket_deletions=state.socket_deletions + 1)
        elif event.change is DirChange.FILE_REMOVED and self._is_sibling(event.name):
            state = dataclasses.replace(state, sibling_removals=state.sibling_removals + 1)
        elif event.change is DirChange.EVENTS_LOST:
            # Count it as a possible restart, so that every waiter looks at the files
            # rather than trusting counters that missed an event.
            state = dataclasses.replace(
                state, kubelet_creations=state.kubelet_creations + 1, overflows=state.overflows + 1
            )
        self.state.publish(state)

    async def run(self) -> None:
        """Turn directory events into DirState changes, forever."""
        await self._watch.run()

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
        streams: SnapshotCell[StreamLog] | None = None,
    ) -> None:
        self._watch = watch
        self._streams = streams
        self._streams_before = 0
        """Streams opened before the latest Register call began: their end says nothing about it."""
        self._confirming = False
        self._registered_at = 0.0
        self._resource = resource
        self._timeout = register_timeout
        self._safety_interval = safety_interval
        self._registered_kubelet: SocketIdentity | None = None
        self._registered_endpoint: Path | None = None
        self._baseline = DirState()
        self._log = structlog.get_logger("plugvisor.registration").bind(resource=resource)
        self.registrations = 0
        watch.sibling_prefix = socket_prefix(resource)

    async def register(
        self, endpoint: str, options: api_pb2.DevicePluginOptions, *, confirm: bool = False
    ) -> float:
        """Register ``endpoint`` (a bare socket file name); returns the seconds it took, retries included.

        ``confirm``: watch that the kubelet keeps this registration (see the module's doc).

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
            await self._watch.wait_for_kubelet()
            if not own_socket.exists():
                raise EndpointLostError(f"{endpoint} was deleted before it could be registered")
            identity = SocketIdentity.of(self._watch.kubelet_socket)
            seen = self._watch.state.version
            # Anything the watch counts from here on happened after this call began, so it
            # may be a restart of the kubelet we are about to register with.
            before = self._watch.state.value
            streams_before = 0 if self._streams is None else self._streams.value.opened
            try:
                await self._register_unless_lost(endpoint, options)
            except grpc.aio.AioRpcError as err:
                self._log.warning(
                    "register_failed", code=err.code().name, error=err.details(), retry_in=delay
                )
                # Whichever comes first: a new kubelet.sock, or the backoff delay.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._watch.state.wait_newer(seen), delay)
                delay = min(delay * 2, 5.0)
                continue
            self._registered_kubelet = identity
            self._registered_endpoint = own_socket
            self._baseline = before
            self._streams_before = streams_before
            self._confirming = confirm and self._streams is not None
            self._registered_at = time.monotonic()
            self.registrations += 1
            elapsed = time.monotonic() - started
            self._log.info("registered", endpoint=endpoint, seconds=round(elapsed, 4))
            return elapsed

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
                return SIBLING_STOPPED
            if reason is None and self._dropped():
                return KUBELET_DROPPED_US
            if reason is not None:
                if seen >= 0:
                    self._log.warning("kubelet_restart_missed_by_watch", reason=reason)
                return reason
            seen = self._watch.state.version
            await self._wait_for_change(seen)

    def _grace_left(self) -> float | None:
        """Seconds until a confirmed registration that has no stream yet counts as dropped (None: n/a)."""
        if not self._confirming or self._streams is None or self._streams.value.opened > self._streams_before:
            return None
        return self._registered_at + STREAM_GRACE - time.monotonic()

    def _dropped(self) -> bool:
        """A confirmed registration's stream ended, or never opened, while the same kubelet listens."""
        if not self._confirming or self._streams is None:
            return False
        grace_left = self._grace_left()
        ended = self._streams.value.last_dropped > self._streams_before
        if not ended and (grace_left is None or grace_left > 0):
            return False
        return kubelet_listens(self._watch.kubelet_socket)

    async def _wait_for_change(self, seen: int) -> None:
        """Until the directory or our streams change, ``safety_interval`` passes, or a stream is overdue."""
        waiters: list[asyncio.Future[Any]] = [asyncio.ensure_future(self._watch.state.wait_newer(seen))]
        if self._streams is not None:
            waiters.append(asyncio.ensure_future(self._streams.wait_newer(self._streams.version)))
        grace_left = self._grace_left()
        timeout = (
            self._safety_interval if grace_left is None else max(min(grace_left, self._safety_interval), 0)
        )
        try:
            await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()

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
