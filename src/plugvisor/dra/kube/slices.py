"""This node's ResourceSlices for one driver, kept equal to the devices the driver has.

The rules come from the scheduler's side of DRA and from upstream's slice
controller (``k8s.io/dynamic-resource-allocation/resourceslice``), whose
behaviour this follows in our own terms:

- One pool per node, named after the node; its slices carry ``nodeName`` and an
  owner reference to the Node, so they go when the Node object goes.
- A pool is split into slices of at most 128 devices (64 once a slice holds a
  tainted device). Slice *i* is named ``<i as 5 hex digits>-<driver>-<node>-``
  plus the API server's random suffix: the scheduler reads slices in name order,
  so device order is allocation preference, and the index matches a stored
  slice to its place in the pool.
- Every slice of a pool carries the pool's generation and slice count; a
  consumer trusts only a pool whose slices of the newest generation are all
  there. A change that needs more than one write (a new slice, two changed
  slices) bumps the generation, so no consumer ever mixes old and new slices;
  a change confined to one slice is a single atomic update and keeps it.
- What the API server would refuse never gets here: a
  :class:`~plugvisor.dra.devices.PublishedDevice` keeps the API's rules of one
  device when it is built (:mod:`plugvisor.dra.validation`); what depends on
  the pool (a name used twice, an attribute named with and without the
  driver's domain) is left out with one log line naming the device and field.
  A slice that the API server refuses anyway (a rule we do not know) has the
  device its error names left out, and the rest is published again.
- Tainted devices: where the cluster keeps device taints (``DRADeviceTaints``:
  GA in 1.37, beta and on in 1.36, off before), the taint is published; where
  it does not (checked once, with a dry-run create), a device with a
  NoSchedule or NoExecute taint is withdrawn from the slice instead.
- :meth:`SlicePublisher.publish` never blocks on the API server: it records the
  newest desired state and a background task writes it, retrying with backoff
  while the API server is down or slow (logged), so nothing is lost and only
  the latest state is ever written. A watch on this node's slices repairs
  what others change or delete (the kubelet deletes a node's slices when it
  starts, and a driver's slices 30 s after it unregisters).
- :meth:`SlicePublisher.hold` stops every write, repairs included, until the
  next :meth:`~SlicePublisher.publish`: a driver that lost its registration
  leaves its slices to the kubelet, which removes them if it does not come
  back; the next publish, at its next registration, writes them again. It
  holds by itself when its slices are deleted by someone else and the
  kubelet's ``kubelet.sock`` is another file than at the last publish: the
  kubelet restarted, deleted the node's slices as it does at its start, and
  will register the driver again (a repair would offer the devices to the
  scheduler before that).

https://kubernetes.io/docs/concepts/scheduling-eviction/dynamic-resource-allocation/
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from decimal import Decimal
from pathlib import Path
from typing import Any, Final, cast

import httpx2
import structlog
from lightkube import ApiError, AsyncClient
from lightkube.resources.core_v1 import Node
from lightkube.resources.resource_v1 import ResourceSlice

from plugvisor.common.validation import shorten
from plugvisor.dra import validation
from plugvisor.dra.cluster import PublishState
from plugvisor.dra.devices import AttributeValue, PublishedDevice, device_json

INDEX_DIGITS: Final = 5
"""Hex digits of a slice's index in its name (upstream's minimum, so both sort alike)."""
RESYNC_DELAY: Final = 1.0
"""Seconds between someone else's change to our slices and our repair (debounces bursts)."""
WITHDRAW_TIMEOUT: Final = 10.0
"""Seconds :meth:`SlicePublisher.withdraw` tries before giving up (the kubelet wipes them 30 s later)."""
MAX_QUICK_RETRIES: Final = 5
"""Syncs started over at once in a row (a stale read, a refused device) before backing off."""
WITHDRAWING_EFFECTS: Final = ("NoSchedule", "NoExecute")
"""Taint effects that keep new claims off a device; where taints are unsupported, the device is withdrawn."""

_log = structlog.get_logger("plugvisor.dra.slices")


class _RetryLaterError(Exception):
    """A failure worth retrying after a backoff (the API server is down, slow, or said so)."""


class _StartOverError(Exception):
    """Start the sync over at once: what we read is stale, or the desired slices changed."""


# -- building the desired pool ----------------------------------------------------------------


def _qualified(name: str, driver: str) -> str:
    return name if "/" in name else f"{driver}/{name}"


def checked_device(device: PublishedDevice, *, driver: str) -> tuple[PublishedDevice, list[str]]:
    """``device`` as the API server would take it from ``driver``, and the problems found (one line each).

    :class:`PublishedDevice` already holds every rule of one device by itself;
    what depends on the driver is left: an attribute named both without the
    domain and with the driver's (``model`` and ``gpu.plugvisor.io/model``) is
    one name twice. The second spelling is dropped and the device kept.
    """
    problems: list[str] = []
    attributes: dict[str, AttributeValue] = {}
    seen: set[str] = set()
    for key, value in device.attributes.items():
        if _qualified(key, driver) in seen:
            problems.append(
                f"device {device.name}: attributes[{shorten(key)}]: named twice (with and without "
                "the driver's domain); attribute left out"
            )
            continue
        seen.add(_qualified(key, driver))
        attributes[key] = value
    if not problems:
        return device, problems
    return replace(device, attributes=attributes), problems


def layout(devices: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Split a pool's devices into slices, in order: at most 128 each, 64 once one has taints.

    Always at least one slice: an empty pool says "the driver runs and has no
    devices", which a consumer tells apart from a driver that is not there.
    """
    chunks: list[list[dict[str, Any]]] = [[]]
    tainted = False
    for device in devices:
        chunk = chunks[-1]
        with_taints = tainted or bool(device.get("taints"))
        limit = (
            validation.MAX_DEVICES_PER_SLICE_WITH_TAINTS if with_taints else validation.MAX_DEVICES_PER_SLICE
        )
        if len(chunk) + 1 > limit:
            chunks.append([])
            tainted = False
            with_taints = bool(device.get("taints"))
        chunks[-1].append(device)
        tainted = with_taints
    return chunks


def comparable(device: Mapping[str, Any]) -> dict[str, Any]:
    """A device's JSON reduced to what it means: capacities by value, taints without their time.

    What the API server fills in (a taint's ``timeAdded``) or writes in its own
    canonical form (``1024Mi`` as ``1Gi``) is no change of ours.
    """
    out = {key: value for key, value in device.items() if value not in (None, {}, [])}
    if "capacity" in out:
        out["capacity"] = {
            key: {**entry, "value": _quantity_value(entry.get("value", ""))}
            for key, entry in out["capacity"].items()
        }
    if "taints" in out:
        out["taints"] = [
            (taint.get("key"), taint.get("value") or "", taint.get("effect")) for taint in out["taints"]
        ]
    return out


def _quantity_value(text: str) -> Decimal | str:
    try:
        return validation.parse_quantity(text)
    except ValueError:
        return text


def _keep_taint_times(desired: list[dict[str, Any]], current: Iterable[Mapping[str, Any]]) -> None:
    """Carry ``timeAdded`` over from the stored devices, so a rewrite does not restart a taint's clock."""
    stored = {device.get("name"): device.get("taints") or [] for device in current}
    for device in desired:
        for taint in device.get("taints", ()):
            for old in stored.get(device["name"], ()):
                same = (old.get("key"), old.get("value") or "", old.get("effect"))
                if same == (taint["key"], taint.get("value") or "", taint["effect"]) and old.get("timeAdded"):
                    taint["timeAdded"] = old["timeAdded"]


def slice_index(name: str) -> int | None:
    """The index a slice's name starts with (``0000a-...`` is 10), or None for a name that has none."""
    prefix, sep, _ = name.partition("-")
    if not sep or len(prefix) != INDEX_DIGITS:
        return None
    try:
        return int(prefix, 16)
    except ValueError:
        return None


_DEVICE_FIELD_RE: Final = re.compile(r"spec\.devices\[(\d+)\]")


def refused_devices(error: ApiError) -> tuple[list[int], str]:
    """The device indexes an API server refusal names, and its message naming the fields."""
    status = error.status
    causes = status.details.causes if status.details is not None and status.details.causes else []
    indexes = sorted(
        {int(match.group(1)) for cause in causes if (match := _DEVICE_FIELD_RE.search(cause.field or ""))}
    )
    message = "; ".join(f"{cause.field}: {cause.message}" for cause in causes) or str(status.message)
    return indexes, shorten(message, 400)


# -- the publisher ------------------------------------------------------------------------------


@dataclass(slots=True)
class _Desired:
    devices: list[PublishedDevice] = field(default_factory=list)
    version: int = 0
    invalid: int = 0
    """Devices :meth:`SlicePublisher.publish` was given but left out (their problems are logged)."""


class SlicePublisher:
    """Keeps this node's pool of one driver equal to the latest :meth:`publish` (module docstring).

    ``on_state`` hears every change of :attr:`state` (the driver reports it to
    the agent). ``kubelet_socket`` is the kubelet's ``kubelet.sock``, whose
    replacement tells a kubelet restart (module docstring); without it every
    deletion by others is repaired. One per driver process; :meth:`close` (the
    process stops for a restart: the slices stay) or :meth:`withdraw` (the
    driver stops for good) ends it, and closes ``client`` too with
    ``close_client``.
    """

    def __init__(
        self,
        client: AsyncClient,
        *,
        driver: str,
        node: str,
        on_state: Callable[[PublishState], None] | None = None,
        resync_delay: float = RESYNC_DELAY,
        backoff_initial: float = 0.5,
        backoff_max: float = 30.0,
        rand: Callable[[], float] = random.random,
        close_client: bool = False,
        kubelet_socket: Path | None = None,
    ) -> None:
        self._client = client
        self._close_client = close_client
        self.driver = driver
        self.node = node
        self._on_state = on_state
        self._resync_delay = resync_delay
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max
        self._rand = rand
        self._log = _log.bind(driver=driver, node=node)
        self._desired = _Desired()
        self._wake = asyncio.Event()
        self._synced = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False
        self._held = False
        self._kubelet_socket = kubelet_socket
        self._kubelet: tuple[int, int] | None = None
        """``kubelet.sock`` at the latest publish: the kubelet the driver was registered with then."""
        self._owner_uid: str | None = None
        self.taints_supported: bool | None = None
        """Whether the cluster keeps device taints (None: not needed, so not asked yet)."""
        self._refused: dict[str, str] = {}
        self._logged: set[str] = set()
        self._known: dict[str, str] = {}
        self._resync: asyncio.TimerHandle | None = None
        self.state = PublishState()

    # -- the interface --------------------------------------------------------------------------

    async def publish(self, devices: Sequence[PublishedDevice]) -> None:
        """Make ``devices`` (in preference order) this node's pool; returns at once (module docstring)."""
        if self._closed:
            raise RuntimeError("the publisher is closed")
        checked: list[PublishedDevice] = []
        names: set[str] = set()
        for device in devices:
            if device.name in names:
                self._log_once(
                    "device_invalid", f"device {device.name}: the name is used twice; the second is left out"
                )
                continue
            kept, problems = checked_device(device, driver=self.driver)
            for problem in problems:
                self._log_once("device_invalid", problem)
            names.add(kept.name)
            checked.append(kept)
        held, self._held = self._held, False
        self._kubelet = _file_identity(self._kubelet_socket)
        if checked == self._desired.devices and self._desired.version:
            if held:  # the watch repaired nothing meanwhile: make sure they are still there
                self._wake.set()
            return
        self._desired = _Desired(checked, self._desired.version + 1, invalid=len(devices) - len(checked))
        self._refused = {}  # a changed device may now pass; the API server says again if not
        self._synced.clear()
        self._set_state(synced=False)
        self._wake.set()
        if not self._tasks:
            self._tasks = [
                asyncio.create_task(self._run(), name=f"slices:{self.driver}"),
                asyncio.create_task(self._watch(), name=f"slices-watch:{self.driver}"),
            ]

    def hold(self) -> None:
        """Write nothing, repairs included, until the next :meth:`publish`; the slices stay as they are."""
        self._held = True
        if self._resync is not None:
            self._resync.cancel()

    async def wait_synced(self, timeout: float | None = None) -> bool:
        """Wait until the API server holds the latest desired state; False after ``timeout`` seconds."""
        try:
            async with asyncio.timeout(timeout):
                await self._synced.wait()
        except TimeoutError:
            return False
        return True

    async def close(self) -> None:
        """Stop writing (the slices stay: the process is restarting, or the kubelet will clean up)."""
        await self._stop()
        await self._release_client()

    async def _release_client(self) -> None:
        if self._close_client:
            self._close_client = False
            await self._client.close()

    async def _stop(self) -> None:
        self._closed = True
        if self._resync is not None:
            self._resync.cancel()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    async def withdraw(self) -> None:
        """Stop, then delete this node's slices of the driver (it stops for good); never raises.

        Tried for :data:`WITHDRAW_TIMEOUT` seconds; what is left then, the kubelet
        deletes 30 s after the driver unregistered, and the Node's deletion
        takes with it in any case.
        """
        await self._stop()
        try:
            await self._delete_pool()
        finally:
            await self._release_client()

    async def _delete_pool(self) -> None:
        delay = self._backoff_initial
        try:
            async with asyncio.timeout(WITHDRAW_TIMEOUT):
                while True:
                    try:
                        for item in await self._list():
                            with contextlib.suppress(_StartOverError):
                                await self._delete(item)
                    except _RetryLaterError as exc:
                        self._log.warning("slices_withdraw_retry", error=str(exc), retry_in=round(delay, 2))
                        await asyncio.sleep(delay)
                        delay = min(delay * 2, self._backoff_max)
                        continue
                    break
        except TimeoutError:
            self._log.error(
                "slices_withdraw_failed", seconds=WITHDRAW_TIMEOUT, note="the kubelet removes them later"
            )
            return
        self._log.info("slices_withdrawn")
        self._set_state(synced=True, devices=0, slices=0, error=None)

    # -- the background work --------------------------------------------------------------------

    async def _run(self) -> None:
        """Write the latest desired state whenever there is one, backing off while that fails."""
        failures = 0
        again = 0
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self._held:
                continue
            desired = self._desired
            try:
                try:
                    await self._sync(desired)
                except _StartOverError:
                    again += 1
                    if again < MAX_QUICK_RETRIES:
                        self._wake.set()
                        continue
                    raise _RetryLaterError("our slices keep changing under us (another writer?)") from None
            except _RetryLaterError as exc:
                failures += 1
                again = 0
                delay = min(self._backoff_initial * 2 ** (failures - 1), self._backoff_max)
                delay *= 1 + 0.2 * (2 * self._rand() - 1)
                self._log.warning(
                    "slices_publish_retry", error=str(exc), attempt=failures, retry_in=round(delay, 2)
                )
                self._set_state(synced=False, error=str(exc))
                await asyncio.sleep(delay)
                self._wake.set()
                continue
            if failures:
                self._log.info("slices_publish_recovered", attempts=failures + 1)
            failures = again = 0
            if desired.version == self._desired.version:
                self._synced.set()

    async def _watch(self) -> None:
        """Repair what others do to our slices: any event we did not cause schedules a sync."""
        failures = 0
        while True:
            try:
                stream = self._client.watch(ResourceSlice, fields=self._selector())
                async for event, item in stream:
                    failures = 0
                    if not self._foreign(event, item):
                        continue
                    if event == "DELETED" and self._kubelet_restarted():
                        if not self._held:
                            self._log.info("kubelet_restarted", slices="left deleted until registered again")
                        self.hold()
                    else:
                        self._schedule_resync()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                failures += 1
                delay = min(self._backoff_initial * 2 ** (failures - 1), self._backoff_max)
                self._log.debug("slices_watch_restart", error=shorten(repr(exc), 200), retry_in=delay)
                await asyncio.sleep(delay)
            self._schedule_resync()  # whatever happened while the watch was down

    def _foreign(self, event: str, item: ResourceSlice) -> bool:
        """Whether a watch event is someone else's doing (ours are in ``_known`` as we make them)."""
        name = str(item.metadata.name) if item.metadata is not None else ""
        if event == "DELETED":
            if name in self._known:  # one we still count on is gone: perhaps with a Node made anew,
                self._owner_uid = None  # whose UID the next slices must name
                return True
            return False
        return item.metadata is None or self._known.get(name) != item.metadata.resourceVersion

    def _kubelet_restarted(self) -> bool:
        """Whether ``kubelet.sock`` is another file (or none) than at the latest publish."""
        return self._kubelet_socket is not None and _file_identity(self._kubelet_socket) != self._kubelet

    def _schedule_resync(self) -> None:
        if self._held:
            return
        if (
            self._resync is None
            or self._resync.cancelled()
            or self._resync.when() <= asyncio.get_running_loop().time()
        ):
            self._resync = asyncio.get_running_loop().call_later(self._resync_delay, self._wake.set)

    # -- one sync ---------------------------------------------------------------------------------

    def _selector(self) -> dict[str, Any]:
        return {"spec.driver": self.driver, "spec.nodeName": self.node}

    async def _sync(self, desired: _Desired) -> None:
        """One pass: read this node's slices, then delete, update and create what differs."""
        owner_uid = await self._owner()
        if self.taints_supported is None and any(device.taints for device in desired.devices):
            self.taints_supported = await self._taints_kept(owner_uid)
        devices, left_out = self._publishable(desired.devices)
        chunks = layout(devices)
        current = await self._list()
        generation = max((item["spec"]["pool"].get("generation", 0) for item in current), default=0)
        matched: dict[int, dict[str, Any]] = {}
        obsolete: list[dict[str, Any]] = []
        for item in current:
            index = slice_index(item["metadata"]["name"])
            older = item["spec"]["pool"].get("generation", 0) < generation
            if older or index is None or index >= len(chunks) or index in matched:
                obsolete.append(item)
            else:
                matched[index] = item
        pool = {"name": self.node, "generation": generation, "resourceSliceCount": len(chunks)}
        changed = {
            index
            for index, item in matched.items()
            if item["spec"]["pool"] != pool
            or [comparable(d) for d in item["spec"].get("devices") or []]
            != [comparable(d) for d in chunks[index]]
        }
        if len(matched) < len(chunks) or len(changed) > 1:
            generation += 1
            pool["generation"] = generation
            changed = set(matched)
        for item in obsolete:
            await self._delete(item)
        for index in sorted(changed):
            item = matched[index]
            _keep_taint_times(chunks[index], item["spec"].get("devices") or [])
            body = {**item, "spec": {**item["spec"], "pool": pool, "devices": chunks[index]}}
            await self._write(body, index, chunks[index], create=False)
        for index in range(len(chunks)):
            if index not in matched:
                await self._write(
                    self._new_slice(index, pool, chunks[index], owner_uid), index, chunks[index], create=True
                )
        if changed or obsolete or len(matched) < len(chunks):
            self._log.info(
                "slices_published", devices=len(devices), slices=len(chunks), generation=generation
            )
        self._set_state(
            synced=True,
            devices=len(devices),
            left_out=left_out,
            generation=generation,
            slices=len(chunks),
            error=None,
        )

    def _publishable(self, devices: list[PublishedDevice]) -> tuple[list[dict[str, Any]], int]:
        """The devices to write: without refused ones, and without withdrawing taints where unsupported."""
        out: list[dict[str, Any]] = []
        for device in devices:
            if device.name in self._refused:
                continue
            if self.taints_supported is False and device.taints:
                if any(taint.effect in WITHDRAWING_EFFECTS for taint in device.taints):
                    continue
                out.append(device_json(replace(device, taints=())))
            else:
                out.append(device_json(device))
        return out, len(devices) - len(out) + self._desired.invalid

    def _new_slice(
        self, index: int, pool: dict[str, Any], devices: list[dict[str, Any]], owner_uid: str
    ) -> dict[str, Any]:
        return {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {
                "generateName": f"{index:0{INDEX_DIGITS}x}-{self.driver}-{self.node}-",
                "ownerReferences": [
                    {
                        "apiVersion": "v1",
                        "kind": "Node",
                        "name": self.node,
                        "uid": owner_uid,
                        "controller": True,
                    }
                ],
            },
            "spec": {"driver": self.driver, "nodeName": self.node, "pool": dict(pool), "devices": devices},
        }

    async def _owner(self) -> str:
        """The Node's UID for the owner reference (read once: a Node's UID never changes)."""
        if self._owner_uid is None:
            try:
                node = await self._client.get(Node, self.node)
            except ApiError as exc:
                if exc.status.code == 404:
                    raise _RetryLaterError(f"node {self.node} does not exist (is NODE_NAME right?)") from None
                raise self._api_failure(exc, f"get node {self.node}") from None
            except httpx2.HTTPError as exc:
                raise _RetryLaterError(f"get node {self.node}: {_describe(exc)}") from None
            assert node.metadata is not None
            self._owner_uid = str(node.metadata.uid)
        return self._owner_uid

    async def _taints_kept(self, owner_uid: str) -> bool:
        """Whether the API server keeps a device's taints: one dry-run create, nothing stored."""
        probe_device = {"name": "probe", "taints": [{"key": "plugvisor.io/probe", "effect": "NoSchedule"}]}
        probe = self._new_slice(
            0, {"name": self.node, "generation": 0, "resourceSliceCount": 1}, [probe_device], owner_uid
        )
        try:
            answer = await self._client.create(_resource_slice(probe), dry_run=True)
        except ApiError as exc:
            raise self._api_failure(exc, "dry-run create of a tainted slice") from None
        except httpx2.HTTPError as exc:
            raise _RetryLaterError(f"dry-run create of a tainted slice: {_describe(exc)}") from None
        kept = bool(answer.spec.devices and answer.spec.devices[0].taints)
        if not kept:
            self._log.warning(
                "device_taints_unsupported",
                note="this cluster drops device taints (feature DRADeviceTaints off): "
                "devices with NoSchedule or NoExecute taints are withdrawn from the pool instead",
            )
        return kept

    async def _list(self) -> list[dict[str, Any]]:
        try:
            items = [
                item.to_dict() async for item in self._client.list(ResourceSlice, fields=self._selector())
            ]
        except ApiError as exc:
            raise self._api_failure(exc, "list resourceslices") from None
        except httpx2.HTTPError as exc:
            raise _RetryLaterError(f"list resourceslices: {_describe(exc)}") from None
        self._known = {
            item["metadata"]["name"]: item["metadata"].get("resourceVersion", "") for item in items
        }
        return items

    async def _delete(self, item: Mapping[str, Any]) -> None:
        name = item["metadata"]["name"]
        try:
            await self._client.delete(ResourceSlice, name)
        except ApiError as exc:
            if exc.status.code != 404:  # already gone is what we wanted
                raise self._api_failure(exc, f"delete resourceslice {name}") from None
        except httpx2.HTTPError as exc:
            raise _RetryLaterError(f"delete resourceslice {name}: {_describe(exc)}") from None
        self._known.pop(name, None)

    async def _write(
        self, body: dict[str, Any], index: int, devices: list[dict[str, Any]], *, create: bool
    ) -> None:
        """Create or update slice ``index``; a refusal leaves out the devices it names (or all of them)."""
        verb = "create" if create else "update"
        what = (
            f"{verb} resourceslice #{index}" if create else f"{verb} resourceslice {body['metadata']['name']}"
        )
        try:
            obj = _resource_slice(body)
            stored = await (self._client.create(obj) if create else self._client.replace(obj))
        except ApiError as exc:
            if exc.status.code in (400, 422):
                self._refuse(exc, index, devices)
                raise _StartOverError from None
            if exc.status.code in (404, 409):  # changed or deleted since we read it
                raise _StartOverError from None
            raise self._api_failure(exc, what) from None
        except httpx2.HTTPError as exc:
            raise _RetryLaterError(f"{what}: {_describe(exc)}") from None
        assert stored.metadata is not None
        self._known[str(stored.metadata.name)] = str(stored.metadata.resourceVersion)

    def _refuse(self, error: ApiError, index: int, devices: list[dict[str, Any]]) -> None:
        indexes, message = refused_devices(error)
        named = [devices[i]["name"] for i in indexes if i < len(devices)]
        if not named:
            if not devices:
                # Not one device to blame: the slice itself is refused, and will be on every try.
                raise _RetryLaterError(f"the API server refuses this node's empty resourceslice: {message}")
            named = [device["name"] for device in devices]
        for name in named:
            self._refused[name] = message
        self._log.error(
            "resourceslice_refused",
            slice_index=index,
            devices=named,
            error=message,
            action="left out until the driver publishes a change; the other devices are published",
        )

    def _api_failure(self, error: ApiError, what: str) -> _RetryLaterError:
        code = error.status.code
        hint = ""
        if code in (401, 403):
            hint = " (check the driver's ServiceAccount and RBAC: deploy/kubernetes has the rules)"
        return _RetryLaterError(
            f"{what}: HTTP {code} {shorten(str(error.status.message or error.status.reason), 300)}{hint}"
        )

    def _set_state(self, **changes: Any) -> None:
        state = replace(self.state, **changes)
        if state != self.state:
            self.state = state
            if self._on_state is not None:
                self._on_state(state)

    def _log_once(self, event: str, problem: str) -> None:
        if problem not in self._logged:
            if len(self._logged) > 10_000:
                self._logged.clear()
            self._logged.add(problem)
            self._log.error(event, problem=problem)


def _file_identity(path: Path | None) -> tuple[int, int] | None:
    """Tells a file from another made later at the same path (inode, change time); None if there is none."""
    if path is None:
        return None
    try:
        info = path.stat()
    except OSError:
        return None
    return info.st_ino, info.st_ctime_ns


def _resource_slice(body: dict[str, Any]) -> ResourceSlice:
    return cast(ResourceSlice, ResourceSlice.from_dict(body))


def _describe(error: httpx2.HTTPError) -> str:
    """A transport failure in a few words (the exception's repr is noisy)."""
    text = str(error) or type(error).__name__
    return f"{type(error).__name__}: {shorten(text, 200)}"
