"""What a DRA driver's kubelet plugin needs from the API server, as two small Protocols.

The plugin reads each claim's allocation (which devices of this driver's pool
the scheduler chose) when the kubelet asks it to prepare the claim, and it
publishes its devices as the node's pool. The real implementations talk to
the API server (:mod:`plugvisor.dra.kube`, whose ``async connect(*, driver,
node_name, on_state) -> (ClaimReader, SlicePublisher)`` the driver's command
calls in its event loop); :mod:`plugvisor.dra.local` keeps both in plain files
for a node without one (the emulated world, tests); tests of the plugin itself
use in-memory fakes. The plugin depends on these Protocols only, and on
:class:`PublishState`, which every publisher reports through its ``on_state``
callback and the driver passes on to its agent (``SLICES=``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from plugvisor.common.validation import bounded, shorten
from plugvisor.dra.devices import PublishedDevice


@dataclass(frozen=True, slots=True)
class ClaimRef:
    """A ResourceClaim as the kubelet names it in NodePrepareResources: namespace, name and UID."""

    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        """The reference for a log field or an error, each part cut and escaped: it comes from the kubelet.

        The limits are just above what an API server makes (a 63-character
        namespace, a 253-character name, a UUID), so every valid reference is
        shown whole.
        """
        return f"{bounded(self.namespace, 70)}/{bounded(self.name, 260)} (uid {bounded(self.uid, 140)})"


@dataclass(frozen=True, slots=True)
class AllocatedDevice:
    """One entry of a claim's ``status.allocation.devices.results``.

    ``request`` is the claim's request it serves (``gpus``, or ``gpus/big`` for
    a sub-request of a prioritized list); ``admin_access`` grants access to a
    device that other claims may hold at the same time (monitoring).
    """

    request: str
    driver: str
    pool: str
    device: str
    admin_access: bool = False


class ClaimError(Exception):
    """A claim cannot be read as allocated: not found, another claim of that name (a new UID), unallocated.

    Also an API server that did not answer in time, saying so: the kubelet
    retries every claim that failed, so the driver needs no other distinction.
    """


@dataclass(frozen=True, slots=True)
class PublishState:
    """Where the driver's pool stands in the API server, for the driver's status and logs."""

    synced: bool = False
    """The latest desired state is what the API server holds."""
    devices: int = 0
    """Devices published (the last successful write)."""
    left_out: int = 0
    """Devices of the desired state that are not published (refused, or tainted without taints)."""
    generation: int = 0
    slices: int = 0
    error: str | None = None
    """Why the latest attempt failed (None once one succeeds)."""

    @property
    def summary(self) -> str:
        """One line for the agent (the driver's ``SLICES=`` status field): synced, pending, failing: <why>."""
        if self.synced:
            return "synced"
        return f"failing: {shorten(self.error, 200)}" if self.error else "pending"


@runtime_checkable
class ClaimReader(Protocol):
    """**Protocol:** reads a claim's allocation from the API server."""

    async def allocated_devices(self, *, namespace: str, name: str, uid: str) -> Sequence[AllocatedDevice]:
        """Every allocated device of the claim (of all drivers); raises :class:`ClaimError`."""
        ...


@runtime_checkable
class SlicePublisher(Protocol):
    """**Protocol:** keeps this node's pool of the driver in the API server.

    ``publish`` makes the pool list exactly ``devices`` (a new generation only
    when they changed); called again with the same devices, it puts back what
    was removed meanwhile (the driver does so at every registration: a kubelet
    deletes the node's slices when it starts). It retries and logs API
    errors itself and never raises for them. ``hold`` stops every write, repairs
    included, until the next ``publish``: the driver lost its registration, and
    must not put back what the kubelet removes meanwhile. ``withdraw`` deletes
    the node's slices of the driver, for a driver that stops for good; ``close``
    stops publishing and leaves them, for a driver that is restarting (the
    kubelet keeps a driver's slices for 30 s after it unregisters).
    """

    async def publish(self, devices: Sequence[PublishedDevice]) -> None:
        """Publish the pool's devices."""
        ...

    def hold(self) -> None:
        """Write nothing until the next :meth:`publish`; the slices stay as they are."""
        ...

    async def withdraw(self) -> None:
        """Remove the pool, then release what publishing used."""
        ...

    async def close(self) -> None:
        """Stop publishing and release what it used; the pool stays."""
        ...
