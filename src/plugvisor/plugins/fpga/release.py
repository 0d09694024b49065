"""Release detection: which devices no container holds any more, from the kubelet's PodResources ``List``.

The framework has no hook for background work, so this is a small component the
fpga source starts itself (lazily, at its first scan): a daemon thread polling
``List`` with the generated *synchronous* client every ``interval`` seconds. A
device that was listed for some container at one poll and for none at the next
was released; ``on_release`` runs for it once, in this thread.

gRPC is imported inside the thread only: importing this module (which the
supervisor does when it validates a configuration) loads no gRPC.

Limits, by construction: a device released and allocated again between two polls
is not seen as released; devices released while the plugin was not running are
not cleaned up; a failed ``List`` (kubelet restarting, rate limit) changes
nothing, so a kubelet restart never looks like a release.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Final

import structlog

LIST_TIMEOUT: Final = 5.0


def default_socket(kubelet_dir: Path) -> Path:
    """PodResources beside the device-plugin directory, as the kubelet (and the emulated one) lays it out.

    ``/var/lib/kubelet/device-plugins`` -> ``/var/lib/kubelet/pod-resources/kubelet.sock``; a directory
    with another name ``DIR`` -> ``DIR.pod-resources/kubelet.sock`` (the emulated kubelet's rule).
    """
    if kubelet_dir.name == "device-plugins":
        return kubelet_dir.parent / "pod-resources" / "kubelet.sock"
    return Path(f"{kubelet_dir}.pod-resources") / "kubelet.sock"


class ReleaseWatcher:
    """Polls PodResources for one resource and calls ``on_release(device_id)`` for each released device."""

    def __init__(
        self,
        *,
        socket: Path,
        resource: str,
        interval: float,
        on_release: Callable[[str], None],
    ) -> None:
        self.socket = socket
        self.resource = resource
        self.interval = interval
        self._on_release = on_release
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._polls = 0
        self._failures = 0
        self._held: frozenset[str] = frozenset()
        self._log = structlog.get_logger("plugvisor.plugins.fpga.release").bind(resource=resource)

    @property
    def polls(self) -> int:
        """How many ``List`` calls have succeeded so far."""
        with self._lock:
            return self._polls

    @property
    def failures(self) -> int:
        """How many ``List`` calls have failed so far."""
        with self._lock:
            return self._failures

    @property
    def held(self) -> frozenset[str]:
        """The devices some container held at the latest successful poll."""
        with self._lock:
            return self._held

    def start(self) -> None:
        """Start polling (once; later calls do nothing)."""
        with self._lock:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name="fpga-release-watch", daemon=True)
        self._thread.start()
        self._log.info("release_watch_started", socket=str(self.socket), interval=self.interval)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop polling and wait for the thread (a cleanup in progress is waited for, up to ``timeout``)."""
        self._stop.set()
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _run(self) -> None:
        import grpc  # noqa: PLC0415 - only the plugin process polls; the supervisor must not load gRPC

        from plugvisor.api.podresources.v1 import api_pb2, api_pb2_grpc  # noqa: PLC0415

        channel = grpc.insecure_channel(f"unix:{self.socket}")
        stub = api_pb2_grpc.PodResourcesListerStub(channel)
        previous: frozenset[str] | None = None
        failing: str | None = None
        try:
            while not self._stop.is_set():
                try:
                    response = stub.List(api_pb2.ListPodResourcesRequest(), timeout=LIST_TIMEOUT)
                except grpc.RpcError as error:
                    reason = f"{error.code()}: {error.details()}"
                    with self._lock:
                        self._failures += 1
                    if reason != failing:
                        self._log.warning("pod_resources_unavailable", socket=str(self.socket), error=reason)
                        failing = reason
                    self._stop.wait(self.interval)
                    continue
                if failing is not None:
                    self._log.info("pod_resources_available", socket=str(self.socket))
                    failing = None
                current = frozenset(
                    device_id
                    for pod in response.pod_resources
                    for container in pod.containers
                    for devices in container.devices
                    if devices.resource_name == self.resource
                    for device_id in devices.device_ids
                )
                if current != previous:
                    self._log.info("devices_held", devices=sorted(current))
                if previous is not None:
                    for device_id in sorted(previous - current):
                        self._release(device_id)
                previous = current
                with self._lock:
                    self._polls += 1
                    self._held = current
                self._stop.wait(self.interval)
        finally:
            channel.close()

    def _release(self, device_id: str) -> None:
        self._log.info("device_released", device=device_id)
        try:
            self._on_release(device_id)
        except Exception as error:  # one failed cleanup must not end the watch
            self._log.error("release_cleanup_failed", device=device_id, error=str(error))
