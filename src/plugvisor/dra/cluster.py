"""What a DRA driver's kubelet plugin needs from the API server, as two small Protocols.

The plugin reads each claim's allocation (which devices of this driver's pool
the scheduler chose) when the kubelet asks it to prepare the claim, and it
publishes its devices as the node's pool. The real implementations talk to
the API server (:mod:`plugvisor.dra.kube`, whose ``async connect(*, driver,
node_name) -> (ClaimReader, SlicePublisher)`` the driver's command calls in
its event loop); :mod:`plugvisor.dra.local` keeps both in plain files for a
node without one (the emulated world, tests); tests of the plugin itself use
in-memory fakes. The plugin depends on these Protocols only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from plugvisor.dra.devices import PublishedDevice


@dataclass(frozen=True, slots=True)
class ClaimRef:
    """A ResourceClaim as the kubelet names it in NodePrepareResources: namespace, name and UID."""

    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name} (uid {self.uid})"


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
    """A claim cannot be read as allocated: not found, another claim of that name (a new UID), unallocated."""


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
    when they changed); it retries and logs API errors itself and never raises
    for them. ``withdraw`` deletes the node's slices of the driver, for a driver
    that stops for good.
    """

    async def publish(self, devices: Sequence[PublishedDevice]) -> None:
        """Publish the pool's devices."""
        ...

    async def withdraw(self) -> None:
        """Remove the pool."""
        ...
