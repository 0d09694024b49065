"""Preparing and unpreparing claims: the kind's allocation path, a CDI spec, the checkpoint.

What NodePrepareResources does for one claim, in order:

1. read the claim's allocation (:class:`~plugvisor.dra.cluster.ClaimReader`)
   and keep the entries of this driver;
2. a claim prepared before answers what it answered then (the kubelet retries,
   and asks again after its own restarts), as long as the allocation names the
   same devices; other devices are refused: the claim must be unprepared first;
3. check every device: in this node's pool, known to the current scan,
   healthy, not prepared for another claim (unless either has admin access);
4. run the kind's hooks as a container start would: the pre-start hook (a
   reset) on all the claim's devices, then per request the default allocation
   (device nodes, mounts, variables) edited by the post-allocate hook;
5. write the claim's CDI spec, then record the claim in the checkpoint, and
   only then answer with the CDI device IDs.

Unprepare runs the kind's release hooks on the claim's devices, removes its
spec and forgets it. Both are idempotent and safe against a kill at any point:
the spec's file name comes from the claim's UID, so an unprepare after a kill
between writing the spec and the checkpoint still removes it. Once the release
hooks have run the claim is released, even if the spec's removal or the
checkpoint's write fails next (a full disk): a retry finishes those without
running the hooks again.

Every failure is a :class:`PrepareError` whose message names the claim and
what went wrong; the servicer puts it in that claim's answer, never failing the
call, and nothing prepared is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import structlog

from plugvisor.common.names import dns_label_problem, node_name_problem
from plugvisor.common.validation import bounded, shorten
from plugvisor.deviceplugin.allocation import build_allocation
from plugvisor.deviceplugin.cell import SnapshotCell
from plugvisor.deviceplugin.hooks import ContainerAllocation, Hooks
from plugvisor.deviceplugin.snapshot import Snapshot
from plugvisor.dra import cdi
from plugvisor.dra.checkpoint import Checkpoint, PreparedClaim, PreparedDevice
from plugvisor.dra.cluster import AllocatedDevice, ClaimError, ClaimReader, ClaimRef
from plugvisor.dra.pool import Pool

T = TypeVar("T")

_SHOWN_NAMES = 10
_UID_MAX = 128
_UID_RE = re.compile(rf"[A-Za-z0-9]([-A-Za-z0-9_.]{{0,{_UID_MAX - 2}}}[A-Za-z0-9])?")
"""A UID the API server would give (a UUID), and safe as a file name and a CDI device name."""
_WORK_SHARE = 0.8
"""Of the time the kubelet gives a call, what reading the claim and the kind's hooks may use (the rest is
for writing the spec and the checkpoint, and the answer)."""


class PrepareError(Exception):
    """Preparing or unpreparing one claim failed; the message is the claim's error in the answer."""


def base_request(request: str) -> str:
    """The claim's request a result serves: ``gpus`` for ``gpus/big`` (a prioritized list's choice).

    Containers name the claim's requests, never the sub-requests; the kubelet
    matches a device's request names against them.
    """
    return request.partition("/")[0]


def _names(names: Sequence[str]) -> str:
    """Device names for a message: the first few distinct ones, cut and escaped, and how many more."""
    distinct = list(dict.fromkeys(names))
    shown = [bounded(name, 80) for name in distinct[:_SHOWN_NAMES]]
    more = f" and {len(distinct) - _SHOWN_NAMES} more" if len(distinct) > _SHOWN_NAMES else ""
    return "[" + ", ".join(f'"{name}"' for name in shown) + "]" + more


def _repeated(names: Sequence[str]) -> str:
    """The names given more than once, each with how many times: ``["gpu-0" 3 times]``."""
    counts = [(name, count) for name, count in Counter(names).items() if count > 1]
    shown = [f'"{bounded(name, 80)}" {count} times' for name, count in counts[:_SHOWN_NAMES]]
    more = f" and {len(counts) - _SHOWN_NAMES} more" if len(counts) > _SHOWN_NAMES else ""
    return "[" + ", ".join(shown) + "]" + more


def request_name_problem(request: str) -> str | None:
    """Why a result's request name is none an API server allows, or None.

    A claim's request is named by a DNS label (at most 63 characters), a
    prioritized list's choice by ``REQUEST/SUBREQUEST``, each a DNS label. The
    request becomes part of the CDI device's name and of the spec, as the UID
    does, so anything else (a NUL, a ``/`` too many, a megabyte) is refused
    before anything is written.
    """
    parts = request.split("/")
    if len(parts) <= 2 and all(dns_label_problem(part) is None for part in parts):
        return None
    return (
        f'request name "{bounded(request, 80)}" is not a DNS label (at most 63 lowercase letters, digits '
        "and '-', a letter or digit at each end), nor two joined by '/' (a request and its sub-request)"
    )


@dataclass(frozen=True, slots=True)
class _Plan:
    """A claim's devices, checked: the allocation entries and the kind's device ID of each."""

    allocated: tuple[AllocatedDevice, ...]
    device_ids: tuple[str, ...]
    pool: Pool


class ClaimPreparer:
    """Prepares and unprepares the claims of one driver on this node; owns the prepared claims."""

    def __init__(
        self,
        *,
        driver: str,
        pool_name: str,
        pools: SnapshotCell[Pool],
        hooks: Hooks,
        claims: ClaimReader,
        checkpoint: Checkpoint,
        cdi_dir: Path,
        prepared: dict[str, PreparedClaim] | None = None,
    ) -> None:
        self.driver = driver
        self.pool_name = pool_name
        self.cdi_dir = cdi_dir
        self.checkpoint = checkpoint
        self.prepared: dict[str, PreparedClaim] = dict(prepared or {})
        """The prepared claims by UID: what the checkpoint holds, less the released ones not yet recorded."""
        self._unrecorded: set[str] = set()
        """Claims released (their hooks ran) that the checkpoint still lists: its write failed (a full disk).

        They are no longer prepared: their devices are free, a prepare of one
        prepares it anew, and the kubelet's retry of their unprepare only
        writes the checkpoint again (so does any later write of it)."""
        self._pools = pools
        self._hooks = hooks
        self._claims = claims
        self._lock = asyncio.Lock()
        self._log = structlog.get_logger("plugvisor.dra").bind(driver=driver)
        self._take_release_markers()

    def _take_release_markers(self) -> None:
        """Claims the checkpoint lists that a release marker says were released: released, unrecorded.

        An earlier process of this driver ran their release hooks but could not
        write the checkpoint (:func:`plugvisor.dra.cdi.mark_released`); their
        devices are free, and the kubelet's retry only records it.
        """
        for uid in cdi.released(self.cdi_dir, self.driver) & self.prepared.keys():
            self._log.info("claim_released_before", claim=str(self.prepared[uid].claim))
            del self.prepared[uid]
            self._unrecorded.add(uid)

    def device_names(self) -> dict[str, str]:
        """The name in the pool of each device a prepared claim holds: names the next pools must keep."""
        return {d.device_id: d.device for claim in self.prepared.values() for d in claim.devices}

    async def reload(self, load: Callable[[], dict[str, PreparedClaim]]) -> None:
        """Take the prepared claims from ``load`` (the checkpoint), between two calls.

        For a driver that serves again after another process of the same driver
        served meanwhile: that one prepared and unprepared claims in the same
        checkpoint.
        """
        async with self._lock:
            self.prepared = await asyncio.to_thread(load)
            self._unrecorded.clear()
            await asyncio.to_thread(self._take_release_markers)

    # -- prepare -----------------------------------------------------------------------

    async def prepare(self, claim: ClaimRef, *, budget: float) -> PreparedClaim:
        """Prepare ``claim`` (or answer what it was prepared with); raises :class:`PrepareError`.

        ``budget``: the seconds left of the kubelet's call.
        """
        _check_ref(claim)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + budget * _WORK_SHARE
        try:
            allocated = await asyncio.wait_for(
                self._claims.allocated_devices(namespace=claim.namespace, name=claim.name, uid=claim.uid),
                deadline - loop.time(),
            )
        # The API server's failure is this claim's error, or answered from the checkpoint.
        except Exception as exc:
            known = self.prepared.get(claim.uid)
            reason = "timed out" if isinstance(exc, TimeoutError) else str(exc) or type(exc).__name__
            if known is not None:
                self._log.warning("claim_unreadable_answered_from_checkpoint", claim=str(claim), error=reason)
                return await self._again(known)
            if isinstance(exc, ClaimError):
                raise PrepareError(f"claim {claim}: {reason}") from None
            raise PrepareError(f"claim {claim}: cannot read its allocation: {shorten(reason, 300)}") from None
        mine = tuple(device for device in allocated if device.driver == self.driver)
        if not mine:
            raise PrepareError(f"claim {claim}: its allocation has no device of driver {self.driver}")
        async with self._lock:
            known = self.prepared.get(claim.uid)
            if known is not None:
                wanted = sorted((d.pool, d.device) for d in mine)
                had = sorted((d.pool, d.device) for d in known.devices)
                if wanted != had:
                    raise PrepareError(
                        f"claim {claim}: already prepared with devices {_names(known.device_names)}, but its "
                        f"allocation now names {_names([d.device for d in mine])}; unprepare it first"
                    )
                return await self._again(known)
            plan = self._plan(claim, mine)
            return await self._prepare(claim, plan, deadline)

    def _plan(self, claim: ClaimRef, mine: Sequence[AllocatedDevice]) -> _Plan:
        pool = self._pools.value
        elsewhere = [d.device for d in mine if d.pool != self.pool_name]
        if elsewhere:
            raise PrepareError(
                f"claim {claim}: devices {_names(elsewhere)} are not in this node's pool {self.pool_name!r} "
                f"of driver {self.driver}"
            )
        for device in mine:
            problem = request_name_problem(device.request)
            if problem is not None:
                raise PrepareError(f"claim {claim}: {problem}")
        names = [d.device for d in mine]
        if len(set(names)) != len(names):
            twice = _repeated(names)
            raise PrepareError(f"claim {claim}: its allocation names a device more than once: {twice}")
        unknown = [name for name in names if name not in pool.ids]
        if unknown:
            raise PrepareError(
                f"claim {claim}: devices {_names(unknown)} are not devices of driver {self.driver} "
                "on this node "
                f"({len(pool.devices)} devices: {_names(list(pool.devices))})"
            )
        unhealthy = [name for name in names if not pool.is_healthy(name)]
        if unhealthy:
            raise PrepareError(f"claim {claim}: devices {_names(unhealthy)} are unhealthy")
        for device in mine:
            if device.admin_access:
                continue
            for other in self.prepared.values():
                # By the kind's ID: the other claim may know the device by the name it had then.
                held = {d.device_id for d in other.devices if not d.admin_access}
                if pool.ids[device.device] in held:
                    raise PrepareError(
                        f"claim {claim}: device {device.device!r} is already prepared for claim "
                        f"{other.claim}; "
                        "a device is one claim's at a time (unless with admin access)"
                    )
        return _Plan(tuple(mine), tuple(pool.ids[name] for name in names), pool)

    async def _prepare(self, claim: ClaimRef, plan: _Plan, deadline: float) -> PreparedClaim:
        snapshot = plan.pool.snapshot
        pre_start = self._hooks.pre_start
        if pre_start is not None:
            chosen = snapshot.only(plan.device_ids)
            await self._hook(
                "resetting the devices", claim, pre_start.pre_start_container, chosen, deadline=deadline
            )
        by_request: dict[str, list[str]] = {}
        for device, device_id in zip(plan.allocated, plan.device_ids, strict=True):
            by_request.setdefault(base_request(device.request), []).append(device_id)
        allocations: list[tuple[str, ContainerAllocation]] = []
        for request, ids in by_request.items():
            allocations.append((request, await self._allocation(claim, snapshot, ids, deadline)))
        devices: list[PreparedDevice] = []
        first_of: dict[str, tuple[str, ...]] = {}
        for request, allocation in allocations:
            edits = cdi.container_edits(allocation)
            own = (cdi.qualified(self.driver, cdi.device_name(claim.uid, request)),) if edits else ()
            first_of[request] = own + tuple(allocation.cdi_devices)
        for device, device_id in zip(plan.allocated, plan.device_ids, strict=True):
            request = base_request(device.request)
            devices.append(
                PreparedDevice(
                    request_names=(request,),
                    pool=device.pool,
                    device=device.device,
                    device_id=device_id,
                    cdi_device_ids=first_of.pop(request, ()),
                    admin_access=device.admin_access,
                )
            )
        prepared = PreparedClaim(claim, tuple(devices))
        spec = cdi.render(self.driver, prepared, allocations)
        if spec is not None:
            prepared = PreparedClaim(
                claim, prepared.devices, cdi.spec_file_name(self.driver, claim.uid), spec
            )
            await self._write_spec(prepared)
        await self._record(prepared)
        self._log.info(
            "claim_prepared",
            claim=str(claim),
            devices=list(prepared.device_names),
            cdi_spec=prepared.cdi_spec,
        )
        return prepared

    async def _allocation(
        self, claim: ClaimRef, snapshot: Snapshot[Any], ids: Sequence[str], deadline: float
    ) -> ContainerAllocation:
        """What a container gets for these devices: the default allocation, edited by the kind's hook."""
        chosen = snapshot.only(ids)
        allocation = build_allocation(chosen.devices)
        post = self._hooks.post_allocate
        if post is None:
            return allocation
        edited: ContainerAllocation = await self._hook(
            "the post-allocate hook", claim, post.post_allocate, allocation, chosen, deadline=deadline
        )
        return edited

    async def _hook(
        self, what: str, claim: ClaimRef, call: Callable[..., T], *args: Any, deadline: float
    ) -> T:
        """Run a kind's hook in a worker thread within the call's time; its failure is the claim's error."""
        remaining = deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            raise PrepareError(f"claim {claim}: no time left for {what}")
        try:
            return await asyncio.wait_for(asyncio.to_thread(call, *args), remaining)
        except TimeoutError:
            raise PrepareError(f"claim {claim}: {what} did not finish within {remaining:.1f} s") from None
        except Exception as exc:  # the kind's failure is reported by name, the driver goes on
            self._log.exception("hook_failed", claim=str(claim), hook=what)
            raise PrepareError(f"claim {claim}: {what} failed: {shorten(str(exc), 300)}") from None

    async def _write_spec(self, prepared: PreparedClaim) -> None:
        assert prepared.cdi_spec is not None and prepared.spec is not None
        try:
            await asyncio.to_thread(cdi.write, self.cdi_dir, prepared.cdi_spec, prepared.spec)
        except OSError as exc:
            raise PrepareError(
                f"claim {prepared.claim}: cannot write its CDI spec {self.cdi_dir / prepared.cdi_spec}: "
                f"{exc.strerror or exc}"
            ) from None

    async def _commit(self, claims: dict[str, PreparedClaim]) -> None:
        """Save ``claims`` as the checkpoint, then make them this driver's prepared claims.

        Shielded by its callers: a call cancelled meanwhile (its socket served
        again, the driver stopping) must not leave the file and the memory
        telling two stories.
        """
        await asyncio.to_thread(self.checkpoint.save, claims.values())
        recorded, self._unrecorded = self._unrecorded, set()
        self.prepared = claims
        for uid in recorded - claims.keys():  # the file says it now: the markers are done with
            try:
                await asyncio.to_thread(cdi.unmark_released, self.cdi_dir, self.driver, uid)
            except OSError as exc:
                self._log.warning("release_marker_not_removed", uid=uid, error=exc.strerror or str(exc))

    async def _record(self, prepared: PreparedClaim) -> None:
        """Add the claim to the checkpoint; undo the spec when the checkpoint cannot be written."""
        claims = {**self.prepared, prepared.claim.uid: prepared}
        try:
            # Prepared anew after a release the file never recorded (or a marker left behind): the
            # marker goes first, so that no restart takes this preparation for the released one.
            await asyncio.to_thread(cdi.unmark_released, self.cdi_dir, self.driver, prepared.claim.uid)
            await asyncio.shield(self._commit(claims))
        except OSError as exc:
            if prepared.cdi_spec is not None:
                with contextlib.suppress(OSError):
                    await asyncio.to_thread(cdi.remove, self.cdi_dir, prepared.cdi_spec)
            raise PrepareError(
                f"claim {prepared.claim}: cannot record it in {self.checkpoint.path}: {exc.strerror or exc}"
            ) from None

    async def _again(self, known: PreparedClaim) -> PreparedClaim:
        """A claim prepared before: the same answer, its spec written again if it is gone."""
        if (
            known.cdi_spec is not None
            and known.spec is not None
            and not await asyncio.to_thread(cdi.exists, self.cdi_dir, known.cdi_spec)
        ):
            self._log.warning("cdi_spec_restored", claim=str(known.claim), cdi_spec=known.cdi_spec)
            await self._write_spec(known)
        return known

    # -- unprepare ---------------------------------------------------------------------

    async def unprepare(self, claim: ClaimRef, *, budget: float) -> None:
        """Release the claim's devices, remove its spec, forget it; raises :class:`PrepareError`.

        A claim this driver does not know is unprepared already (the kubelet
        retries): its spec, should a kill have left one, is still removed. Once
        the release hooks have run the claim is no longer prepared, whatever
        happens to the spec's removal or the checkpoint's write next: the
        kubelet's retry finishes those and never runs the hooks a second time.
        """
        _check_ref(claim)
        async with self._lock:
            known = self.prepared.get(claim.uid)
            deadline = asyncio.get_running_loop().time() + budget * _WORK_SHARE
            if known is not None:
                await self._release(known, deadline)
                self.prepared = {uid: c for uid, c in self.prepared.items() if uid != claim.uid}
                self._unrecorded.add(claim.uid)
            spec = known.cdi_spec if known is not None else None
            spec = spec or cdi.spec_file_name(self.driver, claim.uid)
            try:
                removed = await asyncio.to_thread(cdi.remove, self.cdi_dir, spec)
            except OSError as exc:
                raise PrepareError(
                    f"claim {claim}: cannot remove its CDI spec {self.cdi_dir / spec}: {exc.strerror or exc}"
                ) from None
            if claim.uid not in self._unrecorded:
                if removed:
                    self._log.info("cdi_spec_of_unknown_claim_removed", claim=str(claim), cdi_spec=spec)
                return
            try:
                await asyncio.shield(self._commit(dict(self.prepared)))
            except OSError as exc:
                self._log.warning("claim_released_but_still_recorded", claim=str(claim), error=str(exc))
                try:
                    await asyncio.to_thread(cdi.mark_released, self.cdi_dir, self.driver, claim.uid)
                except OSError as marker:
                    self._log.error(
                        "release_marker_not_written",
                        claim=str(claim),
                        error=marker.strerror or str(marker),
                        effect="a restart before the checkpoint is written runs its release hooks again",
                    )
                raise PrepareError(
                    f"claim {claim}: cannot record its removal in {self.checkpoint.path}: "
                    f"{exc.strerror or exc}"
                ) from None
        devices = list(known.device_names) if known is not None else "released before"
        self._log.info("claim_unprepared", claim=str(claim), devices=devices)

    async def _release(self, known: PreparedClaim, deadline: float) -> None:
        """Run the kind's release hooks on the claim's devices still present (a scrub, a de-program)."""
        chosen = self._pools.value.snapshot.only(known.device_ids)
        gone = [i for i in known.device_ids if i not in chosen.devices]
        if gone:
            self._log.info("released_devices_gone", claim=str(known.claim), devices=gone)
        if self._hooks.deallocate is not None:
            hook = self._hooks.deallocate.deallocate
            await self._hook("the deallocate hook", known.claim, hook, chosen, deadline=deadline)
        if self._hooks.release is not None:
            await self._hook(
                "the release hook", known.claim, self._hooks.release.released, chosen, deadline=deadline
            )


def _check_ref(claim: ClaimRef) -> None:
    missing = [name for name in ("namespace", "name", "uid") if not getattr(claim, name)]
    if missing:
        raise PrepareError(f"claim {claim}: the kubelet's request has no {', '.join(missing)}")
    problem = _ref_problem(claim)
    if problem is not None:  # the reference shows itself cut and escaped
        raise PrepareError(f"claim {claim}: the kubelet's request is invalid: {problem}")


def _ref_problem(claim: ClaimRef) -> str | None:
    """Why the reference is none an API server makes; the UID matters most, as it names files.

    The UID becomes the spec's file name and its CDI devices' names: a ``/`` or
    ``..`` in it would write and remove files outside the CDI directory, and a
    character CDI does not take would fail the container's start rather than
    the prepare.
    """
    if not _UID_RE.fullmatch(claim.uid):
        return (
            f"a UID is at most {_UID_MAX} letters, digits, '-', '_' or '.', starting and ending with a "
            "letter or digit (a UUID)"
        )
    if node_name_problem(claim.name) is not None:  # a claim's name is a DNS subdomain, as a node's
        return "the name is not a DNS subdomain"
    return None if dns_label_problem(claim.namespace) is None else "the namespace is not a DNS label"
