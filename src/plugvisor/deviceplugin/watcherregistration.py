"""Plugin-watcher registration: the plugin's socket sits in ``plugins_registry`` and the kubelet dials back.

The kubelet's plugin manager watches ``<root>/plugins_registry``; for each new
socket it calls ``pluginregistration.Registration/GetInfo`` (answered here with
type ``DevicePlugin``, the resource name, an empty endpoint meaning "this very
socket", and ``v1beta1``), validates, connects to the DevicePlugin service on the
same socket, and tells the plugin the outcome with ``NotifyRegistrationStatus``.

So in this mode the plugin never calls Register and has nothing to do when the
kubelet restarts: the restarted kubelet finds the socket again and dials back,
which arrives here as another successful status. A refusal arrives as a status
with the kubelet's error text; the kubelet retries on its own (with back-off), so
it is logged and the plugin keeps serving (the text cut to
:data:`MAX_ERROR_LENGTH`: it comes from the other side of a socket).

What the kubelet does react to is the socket itself: deleted (or replaced by
another file), the plugin is deregistered, its devices unhealthy, and it is
registered again only for a new socket. :class:`RegistrySocketWatch` notices
this (inotify on the directory, and a look every second in case an event was
lost; polled when the process has no inotify left) so that the plugin serves a
fresh socket at once, as a plugin whose
``kubelet.sock`` registration was wiped does.
"""

from __future__ import annotations

import asyncio
import contextlib
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import grpc
import structlog
from asyncinotify import Mask

from plugvisor.api.pluginregistration.v1 import api_pb2 as reg_pb2
from plugvisor.common import constants
from plugvisor.common import inotify as inotify_
from plugvisor.common.sockets import BIND_TO_LISTEN, is_instance_name, socket_answers, socket_files
from plugvisor.common.validation import bounded
from plugvisor.deviceplugin.registration import SIBLING_CUT_WAIT, SIBLING_STOPPED, SocketIdentity

MAX_ERROR_LENGTH: Final = 400
"""A NotifyRegistrationStatus error is logged cut to this many characters (a 1 MB error was a 1 MB line)."""

REGISTRY_MASK: Final = Mask.CREATE | Mask.MOVED_TO | Mask.DELETE | Mask.MOVED_FROM | Mask.DELETE_SELF


@dataclass(frozen=True, slots=True)
class Verdict:
    """One ``NotifyRegistrationStatus``: whether the kubelet registered the plugin, and why not."""

    registered: bool
    error: str
    seconds: float
    """From the kubelet's GetInfo to this status: how long the kubelet's registration took."""


class WatcherRegistrar:
    """Serves ``pluginregistration.Registration`` for one resource and collects the kubelet's verdicts."""

    def __init__(self, resource: str) -> None:
        self.resource = resource
        self._verdicts: asyncio.Queue[Verdict] = asyncio.Queue()
        self._info_at: float | None = None
        self._log = structlog.get_logger("plugvisor.registration").bind(
            resource=resource, mode="plugin-watcher"
        )

    def handler(self) -> grpc.GenericRpcHandler:
        """The service's handlers, to add to the plugin's own gRPC server."""
        return grpc.method_handlers_generic_handler(
            "pluginregistration.Registration",
            {
                "GetInfo": grpc.unary_unary_rpc_method_handler(
                    self._get_info,
                    request_deserializer=reg_pb2.InfoRequest.FromString,
                    response_serializer=reg_pb2.PluginInfo.SerializeToString,
                ),
                "NotifyRegistrationStatus": grpc.unary_unary_rpc_method_handler(
                    self._notify,
                    request_deserializer=reg_pb2.RegistrationStatus.FromString,
                    response_serializer=reg_pb2.RegistrationStatusResponse.SerializeToString,
                ),
            },
        )

    async def _get_info(self, request: reg_pb2.InfoRequest, context: object) -> reg_pb2.PluginInfo:
        del request, context
        self._info_at = time.monotonic()
        return reg_pb2.PluginInfo(
            type=constants.DEVICE_PLUGIN_TYPE,
            name=self.resource,
            endpoint="",  # the kubelet then dials this very socket
            supported_versions=list(constants.SUPPORTED_VERSIONS),
        )

    async def _notify(
        self, request: reg_pb2.RegistrationStatus, context: object
    ) -> reg_pb2.RegistrationStatusResponse:
        del context
        started = self._info_at if self._info_at is not None else time.monotonic()
        verdict = Verdict(request.plugin_registered, request.error, round(time.monotonic() - started, 6))
        if not verdict.registered:
            self._log.warning("registration_refused", error=bounded(verdict.error, MAX_ERROR_LENGTH))
        self._verdicts.put_nowait(verdict)
        return reg_pb2.RegistrationStatusResponse()

    async def wait_registered(self) -> Verdict:
        """Return at the kubelet's next successful registration (refusals are logged and skipped)."""
        while True:
            verdict = await self._verdicts.get()
            if verdict.registered:
                return verdict


class RegistrySocketWatch:
    """Watches our socket in ``plugins_registry`` for as long as it is ours, and our resource's others.

    :meth:`lost` returns why the socket no longer brings registrations: deleted,
    replaced by another file, or another plugin of our resource stopped and none
    is left (:data:`SIBLING_STOPPED`): if it had taken the resource over
    (reported through ``on_taken_over``), a kubelet up to 1.36 marked every device
    unhealthy at its end, and a fresh socket is what the kubelet registers again.
    When only plugins older than our socket stopped (we took the resource over
    from them), that answer waits :data:`SIBLING_CUT_WAIT` seconds, for the stream
    cut their end brings up to 1.36, which the runtime sees first. While taken
    over, the other plugin is looked at every ``interval`` seconds: one that was
    killed leaves its socket behind.
    """

    def __init__(
        self,
        watches: inotify_.WatchGroup,
        *,
        prefix: str,
        served: set[str],
        on_taken_over: Callable[[str], None],
        interval: float = 1.0,
    ) -> None:
        self._watches = watches
        # Only our resource's sockets (ours among them) matter here: every other plugin's coming and
        # going in plugins_registry would wake the loop for a stat of our own socket, and no more.
        watches.narrow((prefix + "-",))
        self._prefix = prefix
        self._served = served
        self._on_taken_over = on_taken_over
        self._interval = interval

    def _is_sibling(self, name: str) -> bool:
        return is_instance_name(name, self._prefix) and name not in self._served

    async def lost(self, path: Path) -> str:
        """Return why the socket at ``path`` (ours, just bound) no longer brings registrations."""
        directory = path.parent
        # A directory that cannot be watched (gone a moment) is looked at every interval instead.
        with contextlib.suppress(OSError):
            self._watches.add_watch(directory, REGISTRY_MASK)
        identity = SocketIdentity.of(path)
        # The plugins of our resource that may take (or have taken) it over: those serving now, and
        # those that start. A removal of any other (gone before we served) is old news.
        known = set(await asyncio.to_thread(self._live_siblings, directory))
        # One created since ours may register after us, and take the resource over. Those from
        # before were taken over by us: their end, up to 1.36, cuts our stream (SIBLING_CUT_WAIT).
        started = any(newer_than(directory / name, identity) for name in known)
        settle_until: float | None = None
        taken_over_by: str | None = None
        created: str | None = None  # a sibling socket just created (the newest plugin wins)
        removed = looked = False
        loop = asyncio.get_running_loop()
        while True:
            current = SocketIdentity.of(path)
            if current is None:
                return f"its socket {path.name} was deleted from {directory}"
            if current != identity:
                return f"its socket {path.name} in {directory} was replaced by another file"
            if created is not None:
                known.add(created)
                started = True
                if taken_over_by is None and await wait_until_answers(directory / created):
                    taken_over_by = created
                    self._on_taken_over(created)
            elif settle_until is not None and loop.time() >= settle_until:
                settle_until = None
                if not await asyncio.to_thread(self._live_siblings, directory):
                    return SIBLING_STOPPED
            elif known and (removed or looked):
                known = set(await asyncio.to_thread(self._live_siblings, directory))
                if not known:
                    if started:
                        return SIBLING_STOPPED
                    settle_until = loop.time() + SIBLING_CUT_WAIT
            created, removed, looked = None, False, False
            wait = self._interval if settle_until is None else max(0.0, settle_until - loop.time())
            try:
                async with asyncio.timeout(wait):
                    event = await self._watches.get()
            except TimeoutError:
                looked = taken_over_by is not None
                continue
            name = event.name
            if self._is_sibling(name) and event.mask & (Mask.CREATE | Mask.MOVED_TO):
                created = name
            removed = self._is_sibling(name) or bool(event.mask & Mask.Q_OVERFLOW)

    def _live_siblings(self, directory: Path) -> list[str]:
        return [
            path.name
            for path in socket_files(directory, self._prefix + "-")
            if path.name not in self._served and socket_answers(path)
        ]


def newer_than(path: Path, identity: SocketIdentity | None) -> bool:
    """Whether the file at ``path`` was made after the one ``identity`` names (False if either is gone)."""
    other = SocketIdentity.of(path)
    return identity is not None and other is not None and other.ctime_ns > identity.ctime_ns


async def wait_until_answers(path: Path, timeout: float = BIND_TO_LISTEN) -> bool:
    """Whether a process answers on the unix socket at ``path`` within ``timeout`` seconds.

    A server's socket file exists from its bind, a moment before it listens: a
    socket just created is given that moment before it counts as not answering.
    """
    deadline = time.monotonic() + timeout
    while True:
        answers = await asyncio.to_thread(_answers, path)
        if answers is not None:
            return answers
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.05)


def _answers(path: Path) -> bool | None:
    """True: a process answers; False: nobody will (gone, or not a socket); None: not (yet)."""
    try:
        if not stat.S_ISSOCK(path.lstat().st_mode):
            return False
    except OSError:
        return False
    return True if socket_answers(path) else None
