"""The kubelet's DRA side: registering DRA drivers' kubelet plugins, preparing claims, watching health.

Follows the kubelet of v1.37 (``pkg/kubelet/cm/dra/plugin`` and the claim calls
of ``pkg/kubelet/cm/dra/manager.go``), rule by rule and text by text:

* **registration** (type ``DRAPlugin``, through the plugin watcher): the
  plugin's supported versions must name a DRAPlugin service the kubelet
  speaks, ``v1.DRAPlugin`` or ``v1beta1.DRAPlugin``; the first of the plugin's
  list that the kubelet knows is used. The optional health service is the
  kubelet's most recent one the plugin lists (``v1.DRAResourceHealth``, then
  ``v1alpha1.DRAResourceHealth``). The driver name is not checked by the
  kubelet (the API server checks it in the slices). Several plugins of one
  driver may register (a rolling update); the most recent one whose
  connection is up is called, else the most recent; one endpoint cannot be
  registered twice for a driver. Deregistration (the
  registration socket removed) drops the plugin;
* **claims**: there is no scheduler and no API server here, so the test states
  the allocation: :meth:`DraManager.prepare` takes a ResourceClaim object with
  its ``status.allocation`` (written to ``objects_dir`` first, where a driver
  run with ``--objects-dir`` reads it, as it would read the API server) and
  calls NodePrepareResources of each driver named in it, checking the answer as
  the kubelet does; :meth:`DraManager.unprepare` likewise. What a container
  referencing the claim would be handed (its CDI device IDs) is
  :meth:`DraManager.cdi_devices`;
* **health** (``ResourceHealthStatus`` gate): a ``NodeWatchResources`` stream
  per plugin that advertises a health service, each report replacing the
  driver's device health, retried every 5 s, given up on ``Unimplemented``.

Simplifications (docs/kubelet.md): prepared claims are kept in memory across
restarts of the emulated kubelet rather than in its ``dra_manager_state``
checkpoint; a claim is prepared per call, not per pod (no pod references, no
reservation check); the API server's part (allocation, ``reservedFor``, slice
wiping after a driver's absence) is not played.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import grpc

from plugvisor.api.dra.v1 import api_pb2 as dra_pb2
from plugvisor.api.drahealth.v1 import api_pb2 as health_pb2
from plugvisor.common import constants
from plugvisor.common.atomicfile import write_atomically
from plugvisor.emulators.kubelet import client as client_
from plugvisor.emulators.kubelet import errors, journal, model, names

DRA_SINCE: Final = (1, 34)
"""The first kubelet with ``resource.k8s.io/v1`` and ``v1.DRAPlugin`` on by default (before: gated)."""
CALL_TIMEOUT: Final = float(constants.DRA_CALL_TIMEOUT_SECONDS)
HEALTH_RETRY: Final = 5.0
"""The kubelet opens a failed or ended health stream again after this many seconds."""
HEALTH_MESSAGE_MAX: Final = 1024
_SERVICES: Final = {
    constants.DRA_SERVICE_V1: "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin",
    constants.DRA_SERVICE_V1BETA1: "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin",
}
_HEALTH_SERVICES: Final = {
    constants.DRA_HEALTH_SERVICE_V1: "v1.DRAResourceHealth",
    constants.DRA_HEALTH_SERVICE_V1ALPHA1: "v1alpha1.DRAResourceHealth",
}


def dra_available(version: str) -> bool:
    """Whether a kubelet of ``version`` (``1.35``) registers DRA drivers with its default gates."""
    major, minor = (int(part) for part in version.split(".")[:2])
    return (major, minor) >= DRA_SINCE


class DraCallError(errors.KubeletError):
    """Preparing or unpreparing a claim failed; the kubelet's text (``prepare dynamic resources: ...``)."""


@dataclass(frozen=True, slots=True)
class ResultView:
    """One entry of a claim's allocation, as the test stated it."""

    request: str
    driver: str
    pool: str
    device: str
    admin_access: bool = False


@dataclass(frozen=True, slots=True)
class PreparedDeviceView:
    """One device a driver prepared for a claim, as the kubelet keeps it."""

    driver: str
    pool: str
    device: str
    request_names: tuple[str, ...]
    cdi_device_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ClaimView:
    """A prepared claim (the kubelet's claim info)."""

    namespace: str
    name: str
    uid: str
    devices: tuple[PreparedDeviceView, ...]

    def cdi_devices(self, request: str | None = None) -> list[str]:
        """The CDI device IDs a container referencing the claim (or one of its requests) is handed."""
        return [
            cdi_id
            for device in self.devices
            if request is None or not device.request_names or request in device.request_names
            for cdi_id in device.cdi_device_ids
        ]


@dataclass(frozen=True, slots=True)
class DeviceHealthView:
    """A device's health as the kubelet last heard it from the driver's health stream."""

    driver: str
    pool: str
    device: str
    health: str
    """``Healthy``, ``Unhealthy`` or ``Unknown``."""
    message: str
    received_at: float


def resource_claim(
    namespace: str, name: str, uid: str, results: Sequence[ResultView | tuple[str, str, str, str]]
) -> dict[str, Any]:
    """A ResourceClaim object allocated as ``results`` say (``(request, driver, pool, device)`` each)."""
    entries = [result if isinstance(result, ResultView) else ResultView(*result) for result in results]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"namespace": namespace, "name": name, "uid": uid},
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {
                            "request": entry.request,
                            "driver": entry.driver,
                            "pool": entry.pool,
                            "device": entry.device,
                            **({"adminAccess": True} if entry.admin_access else {}),
                        }
                        for entry in entries
                    ]
                }
            }
        },
    }


def claim_results(claim: Mapping[str, Any]) -> tuple[str, str, str, list[ResultView]]:
    """A ResourceClaim object's identity and allocation; raises :class:`ValueError` naming what is missing."""
    try:
        meta = claim["metadata"]
        namespace, name, uid = str(meta["namespace"]), str(meta["name"]), str(meta["uid"])
        results = claim["status"]["allocation"]["devices"]["results"]
        return (
            namespace,
            name,
            uid,
            [
                ResultView(
                    str(r["request"]),
                    str(r["driver"]),
                    str(r["pool"]),
                    str(r["device"]),
                    bool(r.get("adminAccess")),
                )
                for r in results
            ],
        )
    except (KeyError, TypeError) as exc:
        raise ValueError(f"not an allocated ResourceClaim object (missing {exc})") from None


class DraPlugin:
    """One registered kubelet plugin of a driver: its connection and the services chosen for it."""

    def __init__(self, driver: str, endpoint: str, service: str, health_service: str | None) -> None:
        self.driver = driver
        self.endpoint = endpoint
        self.service = service
        self.health_service = health_service
        self.channel = grpc.aio.insecure_channel(
            "unix:" + endpoint, options=[("grpc.use_local_subchannel_pool", 1)]
        )
        self.health_task: asyncio.Task[None] | None = None
        self.closed = False
        """Set by :meth:`close`: the health stream is not opened again."""
        self.channel.get_state(try_to_connect=True)  # as the kubelet's conn.Connect(): know early

    @property
    def connected(self) -> bool:
        """Whether the connection to the endpoint is up (the kubelet's ``monitoredPlugin.connected``).

        Asking reconnects a dropped connection, as the kubelet does at every
        connection end, so a plugin that comes back counts again.
        """
        return self.channel.get_state(try_to_connect=True) is grpc.ChannelConnectivity.READY

    async def call(self, method: str, request: Any, response_type: Any, timeout: float) -> Any:
        """One unary call of the chosen DRAPlugin version (its messages are v1's, byte for byte)."""
        rpc = self.channel.unary_unary(
            f"/{_SERVICES[self.service]}/{method}",
            request_serializer=type(request).SerializeToString,
            response_deserializer=response_type.FromString,
        )
        return await rpc(request, timeout=timeout)

    async def close(self) -> None:
        """Stop the health stream and drop the connection."""
        # The flag, not only the cancellation: a cancel that lands while the stream is ending surfaces
        # from gRPC as the call's CANCELLED status, and the watch would open a new stream for ever.
        self.closed = True
        if self.health_task is not None:
            self.health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.health_task
        await self.channel.close()


class DraManager:
    """The kubelet's DRA manager and plugin manager, as a plugin-watcher handler for ``DRAPlugin``."""

    def __init__(
        self,
        *,
        journal: journal.Journal,
        health_status: bool = False,
        objects_dir: Path | None = None,
        call_timeout: float = CALL_TIMEOUT,
    ) -> None:
        self._journal = journal
        self._health_status = health_status
        self.objects_dir = objects_dir
        self.call_timeout = call_timeout
        self.plugins: dict[str, list[DraPlugin]] = {}
        """Registered plugins by driver, in registration order (the last one is called)."""
        self.claims: dict[tuple[str, str], ClaimView] = {}
        """Prepared claims by (namespace, name)."""
        self.health: dict[tuple[str, str, str], DeviceHealthView] = {}
        """Device health by (driver, pool, device), from the drivers' health streams."""

    # -- the plugin watcher's handler --------------------------------------------------------

    def validate_plugin(self, name: str, endpoint: str, versions: list[str]) -> str | None:
        """``ValidatePlugin``: a DRAPlugin service the kubelet speaks, else the kubelet's text."""
        problem = _services_problem(versions)
        if problem is None:
            return None
        return (
            f"invalid supported gRPC versions of DRA driver plugin {name} at endpoint {endpoint}: {problem}"
        )

    async def register_plugin(self, name: str, endpoint: str, versions: list[str]) -> None:
        """``RegisterPlugin``: choose the services, refuse a second registration of one endpoint, connect."""
        problem = _services_problem(versions)
        if problem is not None:
            raise client_.ConnectError(
                f"invalid supported gRPC versions of DRA driver plugin {name} at endpoint {endpoint}: "
                f"{problem}"
            )
        service = next(v for v in versions if v in _SERVICES)
        health = next((h for h in _HEALTH_SERVICES if h in versions), None)
        registered = self.plugins.setdefault(name, [])
        if any(plugin.endpoint == endpoint for plugin in registered):
            raise client_.ConnectError(f"endpoint {endpoint} already registered for DRA driver plugin {name}")
        plugin = DraPlugin(name, endpoint, service, health)
        registered.append(plugin)
        if self._health_status and health is not None:
            plugin.health_task = asyncio.create_task(self._watch_health(plugin), name=f"dra health {name}")
        self._journal.changed()

    async def deregister_plugin(self, name: str, endpoint: str) -> None:
        """``DeRegisterPlugin``: forget the plugin at ``endpoint``."""
        registered = self.plugins.get(name, [])
        for plugin in [p for p in registered if p.endpoint == endpoint]:
            registered.remove(plugin)
            await plugin.close()
        if not registered:
            self.plugins.pop(name, None)
        self._journal.changed()

    async def stop(self) -> None:
        """The kubelet stops: every connection goes; prepared claims stay (the kubelet keeps them)."""
        for registered in list(self.plugins.values()):
            for plugin in registered:
                await plugin.close()
        self.plugins.clear()
        self.health.clear()

    def plugin(self, driver: str) -> DraPlugin:
        """``GetPlugin``: the most recent connected plugin of ``driver``, else the most recent one.

        A rolling update's new instance takes the calls once its endpoint serves,
        not when it registers; :class:`DraCallError` (the kubelet's text) when
        there is none.
        """
        if not driver:
            raise DraCallError("DRA driver name is empty")
        registered = self.plugins.get(driver)
        if not registered:
            raise DraCallError(f"DRA driver {driver} is not registered")
        return next((plugin for plugin in reversed(registered) if plugin.connected), registered[-1])

    # -- claims ------------------------------------------------------------------------------

    async def prepare(self, claim: Mapping[str, Any]) -> ClaimView:
        """Prepare an allocated ResourceClaim object with every driver it names, as the kubelet does.

        Raises :class:`DraCallError` with the kubelet's text when any driver
        fails it (the kubelet would retry; so may the test).
        """
        namespace, name, uid, results = claim_results(claim)
        known = self.claims.get((namespace, name))
        if known is not None:
            if known.uid != uid:
                raise _prepare_error(
                    f"old ResourceClaim with same name {name} and different UID {known.uid} still exists "
                    "(previous pod force-deleted?!)"
                )
            return known
        if self.objects_dir is not None:
            path = self.objects_dir / "resourceclaims" / namespace / f"{name}.json"
            content = json.dumps(claim, indent=1).encode()
            await asyncio.to_thread(write_atomically, path, content, durable=False)
        drivers = list(dict.fromkeys(result.driver for result in results))
        plugins = {driver: self.plugin_for(driver, prepare=True) for driver in drivers}
        request = dra_pb2.NodePrepareResourcesRequest(
            claims=[dra_pb2.Claim(namespace=namespace, uid=uid, name=name)]
        )
        devices: list[PreparedDeviceView] = []
        for driver, plugin in plugins.items():
            response = await self._call(plugin, "NodePrepareResources", request, prepare=True)
            for claim_uid, result in response.claims.items():
                if claim_uid != uid:
                    raise _prepare_error(
                        f"NodePrepareResources returned result for unknown claim UID {claim_uid}"
                    )
                if result.error:
                    raise _prepare_error(
                        f"NodePrepareResources failed for ResourceClaim {name}: {result.error}"
                    )
                devices += [
                    PreparedDeviceView(
                        driver, d.pool_name, d.device_name, tuple(d.request_names), tuple(d.cdi_device_ids)
                    )
                    for d in result.devices
                ]
            if uid not in response.claims:
                raise _prepare_error("NodePrepareResources skipped 1 ResourceClaims")
        view = ClaimView(namespace, name, uid, tuple(devices))
        self.claims[(namespace, name)] = view
        self._journal.event(
            model.EventKind.CLAIM_PREPARED,
            f"ResourceClaim {namespace}/{name} prepared: {len(devices)} devices",
            claim=f"{namespace}/{name}",
            cdi_devices=",".join(view.cdi_devices()),
        )
        return view

    async def unprepare(self, namespace: str, name: str) -> None:
        """Unprepare a prepared claim with every driver that prepared it; :class:`DraCallError` on failure."""
        known = self.claims.get((namespace, name))
        if known is None:
            return
        request = dra_pb2.NodeUnprepareResourcesRequest(
            claims=[dra_pb2.Claim(namespace=namespace, uid=known.uid, name=name)]
        )
        for driver in dict.fromkeys(device.driver for device in known.devices):
            plugin = self.plugin_for(driver, prepare=False)
            response = await self._call(plugin, "NodeUnprepareResources", request, prepare=False)
            for claim_uid, result in response.claims.items():
                if claim_uid != known.uid:
                    raise _unprepare_error(
                        f"NodeUnprepareResources returned result for unknown claim UID {claim_uid}"
                    )
                if result.error:
                    raise _unprepare_error(
                        f"NodeUnprepareResources failed for ResourceClaim {name}: {result.error}"
                    )
            if known.uid not in response.claims:
                raise _unprepare_error("NodeUnprepareResources skipped 1 ResourceClaims")
        del self.claims[(namespace, name)]
        self._journal.event(model.EventKind.CLAIM_UNPREPARED, f"ResourceClaim {namespace}/{name} unprepared")

    def cdi_devices(self, namespace: str, name: str, request: str | None = None) -> list[str]:
        """What a container referencing the prepared claim (or one request of it) gets: its CDI device IDs."""
        known = self.claims.get((namespace, name))
        return [] if known is None else known.cdi_devices(request)

    def plugin_for(self, driver: str, *, prepare: bool) -> DraPlugin:
        """:meth:`plugin`, with the failure worded as the prepare or unprepare path words it."""
        try:
            return self.plugin(driver)
        except DraCallError as exc:
            raise (_prepare_error if prepare else _unprepare_error)(exc.message) from None

    async def _call(self, plugin: DraPlugin, method: str, request: Any, *, prepare: bool) -> Any:
        response_type = (
            dra_pb2.NodePrepareResourcesResponse if prepare else dra_pb2.NodeUnprepareResourcesResponse
        )
        try:
            return await plugin.call(method, request, response_type, self.call_timeout)
        except grpc.aio.AioRpcError as error:
            raise (_prepare_error if prepare else _unprepare_error)(
                f"{method}: {errors.go_rpc_error(error)}"
            ) from None

    # -- health ------------------------------------------------------------------------------

    async def _watch_health(self, plugin: DraPlugin) -> None:
        assert plugin.health_service is not None
        path = f"/{_HEALTH_SERVICES[plugin.health_service]}/NodeWatchResources"
        while not plugin.closed:
            stream = plugin.channel.unary_stream(
                path,
                request_serializer=health_pb2.NodeWatchResourcesRequest.SerializeToString,
                response_deserializer=health_pb2.NodeWatchResourcesResponse.FromString,
            )(health_pb2.NodeWatchResourcesRequest())
            try:
                async for response in stream:
                    self._health_report(plugin.driver, response)
            except grpc.aio.AioRpcError as error:
                if error.code() is grpc.StatusCode.UNIMPLEMENTED:
                    return  # the driver lists the service but reports no health: the kubelet stops watching
            finally:
                self._clear_health(plugin.driver)
            if not plugin.closed:
                await asyncio.sleep(HEALTH_RETRY)

    def _health_report(self, driver: str, response: health_pb2.NodeWatchResourcesResponse) -> None:
        now = time.time()
        names = {health_pb2.HEALTHY: "Healthy", health_pb2.UNHEALTHY: "Unhealthy"}
        for device in response.devices:
            message = device.message
            if len(message) > HEALTH_MESSAGE_MAX:
                message = message[: HEALTH_MESSAGE_MAX - 3] + "..."
            key = (driver, device.device.pool_name, device.device.device_name)
            self.health[key] = DeviceHealthView(
                *key, names.get(device.health, "Unknown"), message, received_at=now
            )
        self._journal.changed()

    def _clear_health(self, driver: str) -> None:
        for key in [key for key in self.health if key[0] == driver]:
            del self.health[key]
        self._journal.changed()


def _services_problem(versions: Sequence[str]) -> str | None:
    """``validateSupportedServices``: why none of the plugin's services will do, or None."""
    if not versions:
        return "empty list of supported gRPC services (aka supported versions)"
    if not any(version in _SERVICES for version in versions):
        return (
            f"none of services supported by the plugin ({names.go_quote_list(list(versions))}) "
            f"are supported by the kubelet ({names.go_quote_list(list(_SERVICES))})"
        )
    return None


def _prepare_error(message: str) -> DraCallError:
    return DraCallError(f"prepare dynamic resources: {message}")


def _unprepare_error(message: str) -> DraCallError:
    return DraCallError(f"unprepare dynamic resources: {message}")
