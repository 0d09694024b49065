"""The ``npu`` kind: Acme N1 neural processing units (``acme.com/npu``), one device per card.

Written against plugvisor's public contract only (``plugvisor.plugins.PluginKind``,
``plugvisor.deviceplugin``, ``plugvisor.common.monitoring``): read sysfs under the
host root, return one snapshot per scan, answer hooks from the snapshot they are
given. What it reads is what the ``acme_npu`` driver writes (``plugvisor_npu.lab``
writes the same in plugvisor's lab):

- ``sys/class/acme_npu/acme_npu<N>/``: ``serial`` (the device ID: stable when the
  cards are numbered differently after a reboot), ``health`` (``ok`` or what went
  wrong), ``temp``/``temp_crit``; its ``device`` link is the PCI function, whose
  ``numa_node`` and address the kubelet and the metrics get;
- ``/dev/acme_npu<N>``, handed to the container.

``health`` is rewritten in place by the driver, which nothing announces: a change
is seen at the next periodic rescan (``rescanInterval``). A card appearing or
vanishing is seen at once: a uevent on a real node, and in the lab (whose files
come and go by rename) an inotify event in ``sys/class/acme_npu``.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Final

import pydantic

from plugvisor.common.monitoring import DeviceDescription, Reading
from plugvisor.deviceplugin import ContainerAllocation, Device, DeviceSpec, Health, HostPaths, Snapshot
from plugvisor.plugins import PluginKind

__all__ = ["KIND", "NpuOptions", "NpuScan", "NpuSource"]

CLASS: Final = "acme_npu"


class NpuOptions(pydantic.BaseModel):
    """The ``npu`` keys of a ``resources`` entry."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    serials: list[str] | None = pydantic.Field(default=None, min_length=1)
    """Only the cards with these serial numbers; every card when absent."""


@dataclass(frozen=True, slots=True)
class Card:
    """One card as a scan found it."""

    node: str
    """Its class device and device node name (``acme_npu0``)."""
    sysfs: str
    """Its class device directory, for the describe hook's live readings."""
    pci_address: str
    health: str
    """``health`` as the driver wrote it."""
    node_present: bool


@dataclass(frozen=True, slots=True)
class NpuScan:
    """What the hooks need from one scan: each card by device ID (immutable, comparable)."""

    cards: Mapping[str, Card] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "cards", MappingProxyType(dict(self.cards)))


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None


class NpuSource:
    """The device source; it keeps nothing between scans."""

    def __init__(self, options: NpuOptions, paths: HostPaths, *, resource: str) -> None:
        self.options = options
        self.paths = paths
        self.resource = resource

    def scan(self) -> Snapshot[NpuScan]:
        """One device per card of the class (all, or those the options name)."""
        classes = self.paths.sysfs / "class" / CLASS
        names = sorted(p.name for p in classes.iterdir()) if classes.is_dir() else []
        devices: list[Device] = []
        cards: dict[str, Card] = {}
        for name in names:
            entry = classes / name
            serial, health = _read(entry / "serial"), _read(entry / "health")
            function = Path(os.path.realpath(entry / "device"))
            numa = _read(function / "numa_node")
            if serial is None or health is None or numa is None or not numa.lstrip("-").isdigit():
                continue  # unplugged while we looked: the next scan will not see it
            if self.options.serials is not None and serial not in self.options.serials:
                continue
            node = self.paths.devfs / name
            card = Card(name, str(entry), function.name, health, node.exists())
            cards[serial] = card
            devices.append(
                Device(
                    serial,
                    health=Health.HEALTHY if health == "ok" and card.node_present else Health.UNHEALTHY,
                    numa_nodes=[int(numa)] if int(numa) >= 0 else [],
                    specs=[DeviceSpec(f"/dev/{name}", self.paths.for_kubelet(node))],
                )
            )
        return Snapshot(devices, watch=[classes, self.paths.devfs], data=NpuScan(cards))

    def preferred_allocation(
        self, available: Sequence[str], must_include: Sequence[str], size: int, snapshot: Snapshot[NpuScan]
    ) -> Sequence[str]:
        """Cards of one NUMA node first: the node of the cards already chosen, else the fullest one."""

        def node(device_id: str) -> int:
            return next(iter(snapshot.devices[device_id].numa_nodes), -1)

        counts: dict[int, int] = {}
        for device_id in available:
            counts[node(device_id)] = counts.get(node(device_id), 0) + 1
        wanted = node(must_include[0]) if must_include else max(counts, key=lambda n: (counts[n], -n))
        rest = sorted((i for i in available if i not in must_include), key=lambda i: (node(i) != wanted, i))
        return [*must_include, *rest][:size]

    def post_allocate(
        self, allocation: ContainerAllocation, snapshot: Snapshot[NpuScan]
    ) -> ContainerAllocation:
        """Tell the container its cards (``ACME_VISIBLE_CARDS``: device node names, in order)."""
        visible = ",".join(snapshot.data.cards[i].node for i in snapshot.devices)
        return ContainerAllocation(
            specs=allocation.specs,
            mounts=allocation.mounts,
            envs={**allocation.envs, "ACME_VISIBLE_CARDS": visible},
            annotations=allocation.annotations,
            cdi_devices=allocation.cdi_devices,
        )

    def uevent_subsystems(self) -> Collection[str]:
        """On a real node, a card bound or unbound (hot-plug, a driver reload) is a uevent: rescan at once."""
        return ("pci", CLASS)

    def describe(self, snapshot: Snapshot[NpuScan]) -> Mapping[str, DeviceDescription]:
        """For monitoring: the PCI address, why a card is unhealthy (our own causes), its temperature now."""
        out: dict[str, DeviceDescription] = {}
        for device_id, card in snapshot.data.cards.items():
            cause = cause_code = None
            if card.health != "ok":
                cause, cause_code = f"the card reports {card.health}", card.health.replace("_", "-")
            elif not card.node_present:
                cause, cause_code = f"/dev/{card.node} is missing", "device-node-missing"
            readings = []
            for family, attribute in (
                ("plugvisor_device_temperature_celsius", "temp"),
                ("plugvisor_device_temperature_critical_celsius", "temp_crit"),
            ):
                value = _read(Path(card.sysfs, attribute))
                if value is not None and value.isdigit():
                    readings.append(Reading(family, int(value) / 1000, {"sensor": "die"}))
            out[device_id] = DeviceDescription(
                kind="npu",
                pci_address=card.pci_address,
                cause=cause,
                cause_code=cause_code,
                readings=readings,
            )
        return out


KIND: Final = PluginKind("npu", NpuOptions, NpuSource)
"""What the ``plugvisor.plugins`` entry point names."""
