"""Finding out that devices were released, for any kind that implements ``ReleaseHandler``.

Real kubelets never tell a plugin that a container stopped holding its devices.
The PodResources API shows which devices each container holds, so the framework
polls its ``List`` (:class:`PodResourcesWatch`): a device listed for some container
at one poll and for none at the next was released. A kubelet that makes the
proposed ``Deallocate`` call reports the same event a second way. Both feed one
:class:`ReleaseTracker`, which makes the kind's ``released`` hook run once per use
of a device, whichever sign comes first.

Limits, by construction: a device released and handed out again between two
polls is not seen as released; devices released while the plugin was not
running are not seen; a failed ``List`` (kubelet restarting, rate limit) changes
nothing, so a kubelet restart never looks like a release.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import grpc
import structlog

from plugvisor.common import constants
from plugvisor.common.hostpaths import beside_kubelet_dir
from plugvisor.deviceplugin.cell import SnapshotCell
from plugvisor.deviceplugin.hooks import ReleaseHandler
from plugvisor.deviceplugin.snapshot import Snapshot

if TYPE_CHECKING:
    from plugvisor.common import monitoring

LIST_TIMEOUT: Final = 5.0


def default_pod_resources_socket(kubelet_dir: Path) -> Path:
    """PodResources beside the device-plugins directory, as the kubelet (and the emulated one) lays it out.

    ``/var/lib/kubelet/device-plugins`` -> ``/var/lib/kubelet/pod-resources/kubelet.sock``; a directory
    with another name ``DIR`` -> ``DIR.pod-resources/kubelet.sock`` (the emulated kubelet's rule).
    """
    return beside_kubelet_dir(kubelet_dir, constants.POD_RESOURCES_DIR_NAME) / constants.KUBELET_SOCKET_NAME


class ReleaseTracker:
    """Once per use: which of the devices reported released still need their cleanup.

    All calls come from the event loop's thread, so it needs no lock.
    """

    def __init__(self) -> None:
        self._clean: set[str] = set()

    def used(self, ids: Iterable[str]) -> None:
        """The devices were handed out (again): their next release needs a cleanup."""
        self._clean.difference_update(ids)

    def releasing(self, ids: Iterable[str]) -> list[str]:
        """Of the released devices, those not cleaned since their last use; they count as clean from now."""
        fresh = [i for i in dict.fromkeys(ids) if i not in self._clean]
        self._clean.update(fresh)
        return fresh

    def failed(self, ids: Iterable[str]) -> None:
        """The cleanup of these devices failed: the next release sign may try again."""
        self._clean.difference_update(ids)


class PodResourcesWatch:
    """Polls the kubelet's PodResources ``List`` for one resource and reports released devices.

    ``on_release`` is awaited with the IDs released since the previous poll;
    ``on_held`` is called with every poll's held set (a device held counts as used).
    """

    def __init__(
        self,
        *,
        socket: Path,
        resource: str,
        interval: float,
        on_release: Callable[[list[str]], Awaitable[None]],
        on_held: Callable[[frozenset[str]], None],
    ) -> None:
        self.socket = socket
        self.resource = resource
        self.interval = interval
        self._on_release = on_release
        self._on_held = on_held
        self.polls = 0
        """How many ``List`` calls have succeeded so far."""
        self.failures = 0
        """How many ``List`` calls have failed so far."""
        self.held: frozenset[str] = frozenset()
        """The devices some container held at the latest successful poll."""
        self._previous: frozenset[str] | None = None
        self._log = structlog.get_logger("plugvisor.release").bind(resource=resource)

    async def run(self) -> None:
        """Poll until cancelled."""
        # Imported when a kind with a release hook starts watching, not by every plugin.
        from plugvisor.api.podresources.v1 import api_pb2, api_pb2_grpc  # noqa: PLC0415
        from plugvisor.deviceplugin.owners import MAX_ANSWER_BYTES  # noqa: PLC0415

        self._log.info("release_watch_started", socket=str(self.socket), interval=self.interval)
        failing: str | None = None
        options = [("grpc.max_receive_message_length", MAX_ANSWER_BYTES)]
        async with grpc.aio.insecure_channel(f"unix:{self.socket}", options=options) as channel:
            stub = api_pb2_grpc.PodResourcesListerStub(channel)
            while True:
                try:
                    response = await stub.List(api_pb2.ListPodResourcesRequest(), timeout=LIST_TIMEOUT)
                except grpc.aio.AioRpcError as error:
                    self.failures += 1
                    reason = f"{error.code()}: {error.details()}"
                    if reason != failing:
                        self._log.warning("pod_resources_unavailable", socket=str(self.socket), error=reason)
                        failing = reason
                    await asyncio.sleep(self.interval)
                    continue
                if failing is not None:
                    self._log.info("pod_resources_available", socket=str(self.socket))
                    failing = None
                await self._observe(
                    frozenset(
                        device_id
                        for pod in response.pod_resources
                        for container in pod.containers
                        for devices in container.devices
                        if devices.resource_name == self.resource
                        for device_id in devices.device_ids
                    )
                )
                await asyncio.sleep(self.interval)

    async def follow(self, owners: SnapshotCell[monitoring.Owners]) -> None:
        """Watch through an agent-wide poller instead of calling ``List`` (until cancelled).

        Every successful poll of the shared :class:`~plugvisor.deviceplugin.owners.OwnerWatch`
        counts as one of ours; a failed one changes nothing, as in :meth:`run`.
        """
        self._log.info("release_watch_started", follows="the agent's PodResources poller")
        seen, last = -1, None
        while True:
            seen, current = await owners.wait_newer(seen)
            if not current.up or current.last_success == last:
                continue
            last = current.last_success
            await self._observe(frozenset(d for (r, d) in current.holders if r == self.resource))

    async def _observe(self, current: frozenset[str]) -> None:
        """One successful look at who holds what: report the held set, then what was released."""
        previous = self._previous
        if current != previous:
            self._log.info("devices_held", devices=sorted(current))
        self._on_held(current)
        if previous is not None and previous - current:
            released = sorted(previous - current)
            self._log.info("devices_released", devices=released)
            with contextlib.suppress(Exception):  # logged by the handler; the watch goes on
                await self._on_release(released)
        self._previous = current
        self.polls += 1
        self.held = current


class Releases:
    """Routes every sign of a release to the kind's ``released`` hook, once per use of each device."""

    def __init__(
        self, handler: ReleaseHandler, snapshots: SnapshotCell[Snapshot[Any]], *, resource: str
    ) -> None:
        self._handler = handler
        self._snapshots = snapshots
        self._tracker = ReleaseTracker()
        self._log = structlog.get_logger("plugvisor.release").bind(resource=resource)

    def used(self, ids: Iterable[str]) -> None:
        """The devices were handed out: their next release needs a cleanup."""
        self._tracker.used(ids)

    def held(self, ids: frozenset[str]) -> None:
        """PodResources lists these devices as held: they are in use."""
        self._tracker.used(ids)

    async def release(self, ids: Iterable[str]) -> None:
        """Run the hook for the released devices not cleaned since their last use (those still listed)."""
        fresh = self._tracker.releasing(ids)
        snapshot = self._snapshots.value.only(fresh)
        gone = [i for i in fresh if i not in snapshot.devices]
        if gone:
            self._log.warning("release_cleanup_skipped", devices=gone, reason="device not listed now")
        failures: list[str] = []
        for device_id in snapshot.devices:  # one at a time: one device's failure is that device's alone
            try:
                await asyncio.to_thread(self._handler.released, snapshot.only([device_id]))
            except Exception as error:  # the next sign of a release tries again
                self._tracker.failed([device_id])
                self._log.error("release_cleanup_failed", device=device_id, error=str(error))
                failures.append(f"{device_id}: {error}")
                continue
            self._log.info("release_cleanup_done", device=device_id)
        if failures:
            raise RuntimeError("; ".join(failures))
