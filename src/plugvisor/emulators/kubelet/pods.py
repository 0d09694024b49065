"""Pods: admission, container starts and pod status, the way the kubelet drives the device manager.

A pod arrives (a manifest file, or :meth:`Pods.add`), is admitted container by
container - init containers first, in order - through the device manager's
``Allocate`` (one Allocate RPC per container and resource), and its containers
are then started in order: regular init containers run to completion, sidecars
and app containers keep running. Every start runs the kubelet's
``GetDeviceRunContainerOptions``: PreStartContainer when the plugin asked for
it, a re-Allocate when the cache has no devices for the container, then the
merge of the cached responses into what the runtime gets (:mod:`runtime_config`).

There is no container runtime: a container "runs" once started, until a test
(or the user) says it exited (:meth:`Pods.exit_container`), restarts it, or
deletes the pod. What survives a kubelet restart mirrors a real node: pod
objects (the API server and mirror pods keep them) and the set of running
containers (the runtime keeps running them); a *node reboot* loses the latter.

Failures land where the kubelet puts them: a failed admission makes the pod
``Failed`` with reason ``UnexpectedAdmissionError`` and message
``Pod was rejected: Allocate failed due to <err>, which is unexpected`` (no
retry); a failed start leaves the container waiting with
``CreateContainerConfigError`` and the error text.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from plugvisor.api.deviceplugin.v1beta1 import api_pb2
from plugvisor.common import constants
from plugvisor.emulators.kubelet import (
    allocation,
    devicemanager,
    errors,
    journal,
    manager,
    manifest,
    model,
    runtime_config,
)


class PodPhase(enum.StrEnum):
    """The pod phases the emulator reaches (``Unknown`` never happens without a runtime)."""

    PENDING = "Pending"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


class ContainerState(enum.StrEnum):
    """A container's state, as the three exclusive members of ``ContainerState`` in the API."""

    WAITING = "waiting"
    RUNNING = "running"
    TERMINATED = "terminated"


TERMINAL_PHASES = frozenset({PodPhase.SUCCEEDED, PodPhase.FAILED})


@dataclass(frozen=True, slots=True)
class ResourceHealth:
    """One device of ``allocatedResourcesStatus``: ``resourceID`` and ``health``."""

    resource_id: str
    health: str


@dataclass(frozen=True, slots=True)
class ResourceStatus:
    """One entry of ``allocatedResourcesStatus``: a resource and its allocated devices' health."""

    name: str
    resources: tuple[ResourceHealth, ...]


@dataclass(frozen=True, slots=True)
class ContainerStatusView:
    """A container's status as ``kubectl get pod -o yaml`` would show it, plus its devices.

    ``devices`` maps resource to the IDs the container holds; ``runtime`` is
    what the container runtime received at the latest start (``None`` before
    one); ``allocated_resources_status`` is ``None`` unless the
    ``ResourceHealthStatus`` gate is on.
    """

    name: str
    kind: allocation.ContainerKind
    state: ContainerState
    reason: str | None
    message: str | None
    exit_code: int | None
    restart_count: int
    devices: Mapping[str, tuple[str, ...]]
    runtime: runtime_config.RuntimeConfig | None
    allocated_resources_status: tuple[ResourceStatus, ...] | None


@dataclass(frozen=True, slots=True)
class PodStatusView:
    """A pod's identity and status, a snapshot taken when asked."""

    name: str
    namespace: str
    uid: str
    source: str | None
    phase: PodPhase
    reason: str | None
    message: str | None
    init_containers: tuple[ContainerStatusView, ...]
    containers: tuple[ContainerStatusView, ...]

    def container(self, name: str) -> ContainerStatusView:
        """Return the (init or app) container called ``name``; raise :class:`KeyError` if none."""
        for status in self.init_containers + self.containers:
            if status.name == name:
                return status
        raise KeyError(name)


@dataclass(slots=True)
class ContainerRecord:
    """A container's mutable state inside the emulator."""

    spec: manifest.ContainerSpec
    state: ContainerState = ContainerState.WAITING
    reason: str | None = "ContainerCreating"
    message: str | None = None
    exit_code: int | None = None
    restart_count: int = 0
    runtime: runtime_config.RuntimeConfig | None = None


@dataclass(slots=True)
class PodRecord:
    """A pod's mutable state: phase, containers, and whether it is still on the node."""

    spec: manifest.PodSpec
    phase: PodPhase = PodPhase.PENDING
    reason: str | None = None
    message: str | None = None
    deleted: bool = False
    containers: dict[str, ContainerRecord] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for container in self.spec.all_containers():
            self.containers[container.name] = ContainerRecord(spec=container)

    @property
    def name(self) -> str:
        """The pod's name."""
        return self.spec.name

    @property
    def namespace(self) -> str:
        """The pod's namespace."""
        return self.spec.namespace

    @property
    def uid(self) -> str:
        """The pod's UID."""
        return self.spec.uid

    def is_active(self) -> bool:
        """Active = on the node and not terminated: what ``GetActivePods`` returns."""
        return not self.deleted and self.phase not in TERMINAL_PHASES

    def listed_containers(self) -> list[str]:
        """Sidecars then app containers: what PodResources lists."""
        sidecars = [c.name for c in self.spec.init_containers if c.kind is allocation.ContainerKind.SIDECAR]
        return sidecars + [c.name for c in self.spec.containers]

    def update_phase(self) -> None:
        """Derive the phase from the app containers (terminal phases are never left)."""
        if self.phase in TERMINAL_PHASES:
            return
        app = [self.containers[c.name] for c in self.spec.containers]
        if all(c.state is ContainerState.TERMINATED for c in app):
            failed = any(c.exit_code for c in app)
            self.phase = PodPhase.FAILED if failed else PodPhase.SUCCEEDED
        elif any(c.state is ContainerState.RUNNING for c in app):
            self.phase = PodPhase.RUNNING
        else:
            self.phase = PodPhase.PENDING


class Pods:
    """Every pod the node knows, and the kubelet's steps for them."""

    def __init__(
        self,
        *,
        devices: devicemanager.ManagerImpl,
        journal: journal.Journal,
        health_status: bool,
    ) -> None:
        self._devices = devices
        self._journal = journal
        self._health_status = health_status
        self.records: dict[tuple[str, str], PodRecord] = {}
        self.running: set[tuple[str, str]] = set()
        """The container runtime's view: (pod UID, container) pairs running now; survives kubelet restarts."""

    # -- queries ----------------------------------------------------------------------

    def __iter__(self) -> Iterator[PodRecord]:
        return iter(list(self.records.values()))

    def get(self, namespace: str, name: str) -> PodRecord | None:
        """Return the pod called ``namespace/name``, deleted or not."""
        return self.records.get((namespace, name))

    def active(self) -> list[PodRecord]:
        """Pods that are on the node and not terminated, in arrival order."""
        return [pod for pod in self.records.values() if pod.is_active()]

    def active_uids(self) -> set[str]:
        """UIDs of the active pods."""
        return {pod.uid for pod in self.active()}

    def container_running(self, pod_uid: str, container: str) -> bool:
        """Tell whether the runtime reports the container running (the kubelet's restart snapshot)."""
        return (pod_uid, container) in self.running

    # -- lifecycle --------------------------------------------------------------------

    async def add(self, spec: manifest.PodSpec) -> PodRecord:
        """Admit and start a new pod; an existing pod with the same name is replaced (a new UID) or kept."""
        existing = self.records.get(spec.key)
        if existing is not None and existing.uid == spec.uid and not existing.deleted:
            return existing
        if existing is not None:
            self.delete(spec.namespace, spec.name)
        pod = PodRecord(spec=spec)
        self.records[spec.key] = pod
        self._journal.event(
            model.EventKind.POD_ADDED,
            f"pod {spec.full_name} ({spec.uid}) added" + (f" from {spec.source}" if spec.source else ""),
            pod=spec.full_name,
            pod_uid=spec.uid,
        )
        await self.sync(pod)
        return pod

    async def sync(self, pod: PodRecord) -> None:
        """Admit the pod (unless terminal or deleted), then start every container not running yet."""
        if not pod.is_active():
            return
        if not await self._admit(pod):
            return
        await self._start_containers(pod)

    async def _admit(self, pod: PodRecord) -> bool:
        """Run the device manager's part of admission for every container; reject the pod on failure."""
        devices = self._devices
        try:
            for container in pod.spec.all_containers():
                await devices.allocate_container(pod_uid=pod.uid, container=container)
        except errors.AllocationError as error:
            pod.phase = PodPhase.FAILED
            pod.reason = error.reason
            pod.message = error.pod_status_message
            for record in pod.containers.values():
                if record.state is ContainerState.WAITING:
                    record.reason, record.message = None, None
                elif record.state is ContainerState.RUNNING:
                    # A rejected pod is terminal: the kubelet kills whatever of it still runs
                    # (after a restart, containers the runtime kept running).
                    self._terminate(pod, record, exit_code=137, reason="Killed")
            self._journal.event(
                model.EventKind.POD_REJECTED,
                f"pod {pod.spec.full_name} rejected: {pod.reason}: {pod.message}",
                pod=pod.spec.full_name,
                pod_uid=pod.uid,
                reason=pod.reason,
                error=error.message,
            )
            return False
        return True

    async def _start_containers(self, pod: PodRecord) -> None:
        for spec in pod.spec.init_containers:
            record = pod.containers[spec.name]
            if record.state is ContainerState.TERMINATED and spec.kind is allocation.ContainerKind.INIT:
                continue
            if record.state is not ContainerState.RUNNING and not await self._start(pod, record):
                pod.update_phase()
                return
            if spec.kind is allocation.ContainerKind.INIT:
                # No runtime: a regular init container completes at once.
                self._terminate(pod, record, exit_code=0, reason="Completed")
        for spec in pod.spec.containers:
            record = pod.containers[spec.name]
            if record.state is ContainerState.WAITING:
                await self._start(pod, record)
        pod.update_phase()
        self._journal.changed()

    async def _start(self, pod: PodRecord, record: ContainerRecord) -> bool:
        """Run ``GetDeviceRunContainerOptions`` and start the container; tell whether it started."""
        devices = self._devices
        spec = record.spec
        try:
            needs_reallocate = False
            for resource in sorted(spec.limits):
                if not devices.is_device_plugin_resource(resource) or spec.limits[resource] == 0:
                    continue
                await devices.pre_start(pod_uid=pod.uid, container=spec.name, resource=resource)
                if devices.books.pod_devices.container_devices(pod.uid, spec.name, resource) is None:
                    needs_reallocate = True
            if needs_reallocate:
                await devices.allocate_container(pod_uid=pod.uid, container=spec)
        except errors.KubeletError as error:
            record.state = ContainerState.WAITING
            record.reason = errors.CREATE_CONTAINER_CONFIG_ERROR
            record.message = error.message
            self._journal.event(
                model.EventKind.CONTAINER_START_FAILED,
                f"{pod.spec.full_name}/{spec.name}: {record.reason}: {error.message}",
                pod=pod.spec.full_name,
                pod_uid=pod.uid,
                container=spec.name,
                error=error.message,
            )
            return False
        allocations = devices.books.pod_devices.container_resources(pod.uid, spec.name)
        record.runtime = runtime_config.merge(
            (resource, allocations[resource].response or _EMPTY_RESPONSE) for resource in sorted(allocations)
        )
        record.state = ContainerState.RUNNING
        record.reason = record.message = None
        record.exit_code = None
        self.running.add((pod.uid, spec.name))
        self._journal.event(
            model.EventKind.CONTAINER_STARTED,
            f"{pod.spec.full_name}/{spec.name} started (restart count {record.restart_count})",
            pod=pod.spec.full_name,
            pod_uid=pod.uid,
            container=spec.name,
        )
        return True

    def _terminate(self, pod: PodRecord, record: ContainerRecord, *, exit_code: int, reason: str) -> None:
        was_running = (pod.uid, record.spec.name) in self.running
        record.state = ContainerState.TERMINATED
        record.exit_code = exit_code
        record.reason = reason
        record.message = None
        self.running.discard((pod.uid, record.spec.name))
        if was_running:
            self._devices.container_stopped(pod.uid, record.spec.name)

    async def restart_container(self, namespace: str, name: str, container: str) -> ContainerRecord:
        """Restart a container (a crash and restart): the start step, PreStart included, runs again."""
        pod = self._require(namespace, name)
        record = self._container(pod, container)
        if record.state is ContainerState.RUNNING:
            self._terminate(pod, record, exit_code=1, reason="Error")
        record.restart_count += 1
        record.state = ContainerState.WAITING
        await self._start(pod, record)
        pod.update_phase()
        self._journal.changed()
        return record

    async def exit_container(
        self, namespace: str, name: str, container: str, *, exit_code: int = 0
    ) -> PodRecord:
        """Let a running container exit; the pod's restart policy decides what follows."""
        pod = self._require(namespace, name)
        record = self._container(pod, container)
        policy = pod.spec.restart_policy
        restart = policy == "Always" or (policy == "OnFailure" and exit_code != 0)
        if record.spec.kind is allocation.ContainerKind.SIDECAR:
            restart = True
        if restart:
            await self.restart_container(namespace, name, container)
            return pod
        self._terminate(pod, record, exit_code=exit_code, reason="Completed" if exit_code == 0 else "Error")
        app = [pod.containers[c.name] for c in pod.spec.containers]
        if all(c.state is ContainerState.TERMINATED for c in app):
            for spec in pod.spec.init_containers:
                sidecar = pod.containers[spec.name]
                if sidecar.state is ContainerState.RUNNING:
                    self._terminate(pod, sidecar, exit_code=0, reason="Completed")
        pod.update_phase()
        self._journal.event(
            model.EventKind.CONTAINER_EXITED,
            f"{pod.spec.full_name}/{container} exited with {exit_code}; pod {pod.phase}",
            pod=pod.spec.full_name,
            pod_uid=pod.uid,
            container=container,
            exit_code=exit_code,
        )
        return pod

    def delete(self, namespace: str, name: str) -> PodRecord | None:
        """Delete a pod: its containers stop and it stops being active; its devices are freed lazily."""
        pod = self.records.pop((namespace, name), None)
        if pod is None:
            return None
        pod.deleted = True
        for record in pod.containers.values():
            if record.state is ContainerState.RUNNING:
                self._terminate(pod, record, exit_code=137, reason="Killed")
        self._journal.event(
            model.EventKind.POD_DELETED,
            f"pod {pod.spec.full_name} ({pod.uid}) deleted",
            pod=pod.spec.full_name,
            pod_uid=pod.uid,
        )
        return pod

    def node_rebooted(self) -> None:
        """Forget running containers and bring active pods back to a fresh start (a node reboot)."""
        self.running.clear()
        for pod in self.active():
            for record in pod.containers.values():
                record.state = ContainerState.WAITING
                record.reason, record.message, record.exit_code = "ContainerCreating", None, None
            pod.phase = PodPhase.PENDING

    def _require(self, namespace: str, name: str) -> PodRecord:
        pod = self.records.get((namespace, name))
        if pod is None:
            raise KeyError(f"no pod {namespace}/{name} on this node")
        return pod

    @staticmethod
    def _container(pod: PodRecord, container: str) -> ContainerRecord:
        try:
            return pod.containers[container]
        except KeyError:
            raise KeyError(f"pod {pod.spec.full_name} has no container {container!r}") from None

    # -- views ------------------------------------------------------------------------

    def view(self, pod: PodRecord) -> PodStatusView:
        """Snapshot a pod's status, devices and health as they are now."""
        devices = self._devices.books

        def container_view(record: ContainerRecord) -> ContainerStatusView:
            held = devices.pod_devices.container_resources(pod.uid, record.spec.name)
            by_resource = {resource: tuple(sorted(held[resource].device_ids())) for resource in sorted(held)}
            health: tuple[ResourceStatus, ...] | None = None
            if self._health_status:
                health = tuple(
                    ResourceStatus(
                        name=resource,
                        resources=tuple(
                            ResourceHealth(device, _health(devices, resource, device)) for device in ids
                        ),
                    )
                    for resource, ids in by_resource.items()
                )
            return ContainerStatusView(
                name=record.spec.name,
                kind=record.spec.kind,
                state=record.state,
                reason=record.reason,
                message=record.message,
                exit_code=record.exit_code,
                restart_count=record.restart_count,
                devices=MappingProxyType(by_resource),
                runtime=record.runtime,
                allocated_resources_status=health,
            )

        return PodStatusView(
            name=pod.name,
            namespace=pod.namespace,
            uid=pod.uid,
            source=pod.spec.source,
            phase=pod.phase,
            reason=pod.reason,
            message=pod.message,
            init_containers=tuple(container_view(pod.containers[c.name]) for c in pod.spec.init_containers),
            containers=tuple(container_view(pod.containers[c.name]) for c in pod.spec.containers),
        )


_EMPTY_RESPONSE = api_pb2.ContainerAllocateResponse()


def _health(devices: manager.DeviceManager, resource: str, device: str) -> str:
    if device in devices.healthy.get(resource, set()):
        return constants.HEALTHY
    if device in devices.unhealthy.get(resource, set()):
        return constants.UNHEALTHY
    return "Unknown"


def render(views: Sequence[PodStatusView]) -> dict[str, object]:
    """Describe pods as plain JSON, in the API's spelling where there is one."""

    def container(status: ContainerStatusView) -> dict[str, object]:
        state: dict[str, object] = {}
        if status.state is ContainerState.TERMINATED:
            state = {"terminated": {"exitCode": status.exit_code, "reason": status.reason}}
        elif status.state is ContainerState.RUNNING:
            state = {"running": {}}
        else:
            reasons = (("reason", status.reason), ("message", status.message))
            state = {"waiting": {key: value for key, value in reasons if value}}
        document: dict[str, object] = {
            "name": status.name,
            "kind": str(status.kind),
            "state": state,
            "restartCount": status.restart_count,
            "devices": {resource: list(ids) for resource, ids in status.devices.items()},
            "runtime": status.runtime.to_json() if status.runtime is not None else None,
        }
        if status.allocated_resources_status is not None:
            document["allocatedResourcesStatus"] = [
                {
                    "name": entry.name,
                    "resources": [{"resourceID": r.resource_id, "health": r.health} for r in entry.resources],
                }
                for entry in status.allocated_resources_status
            ]
        return document

    return {
        "pods": [
            {
                "metadata": {"name": view.name, "namespace": view.namespace, "uid": view.uid},
                "source": view.source,
                "status": {
                    "phase": str(view.phase),
                    **({"reason": view.reason} if view.reason else {}),
                    **({"message": view.message} if view.message else {}),
                    "initContainerStatuses": [container(c) for c in view.init_containers],
                    "containerStatuses": [container(c) for c in view.containers],
                },
            }
            for view in views
        ]
    }
