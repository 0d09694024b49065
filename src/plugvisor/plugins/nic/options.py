"""The ``nic`` keys of a resource entry: SR-IOV network device plugin selectors, validated."""

from __future__ import annotations

import re
from typing import Annotated, Final

import pydantic

from plugvisor.plugins.sysfs import AerKind, HexId, PciAddress

_PF_NAME: Final = re.compile(r"^([A-Za-z0-9_.:-]{1,15})(#(\d+(-\d+)?)(,\d+(-\d+)?)*)?$")


class _Model(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


def _pf_name(value: str) -> str:
    if not _PF_NAME.match(value):
        raise ValueError(
            f"{value!r} is not an interface name with an optional VF range, e.g. ens1f0 or ens1f0#0-3,7"
        )
    if "#" in value:
        for part in value.split("#", 1)[1].split(","):
            low, _, high = part.partition("-")
            if high and int(high) < int(low):
                raise ValueError(f"{value!r}: VF range {part} runs backwards")
    return value


PfName = Annotated[str, pydantic.AfterValidator(_pf_name)]


class NicMatch(_Model):
    """Which VFs belong to this resource (every given list must match; within a list, any entry)."""

    vendors: list[HexId] | None = None
    devices: list[HexId] | None = None
    drivers: list[Annotated[str, pydantic.StringConstraints(min_length=1)]] | None = None
    pf_names: list[PfName] | None = pydantic.Field(default=None, alias="pfNames")
    root_devices: list[PciAddress] | None = pydantic.Field(default=None, alias="rootDevices")
    pci_addresses: list[PciAddress] | None = pydantic.Field(default=None, alias="pciAddresses")
    is_rdma: bool | None = pydantic.Field(default=None, alias="isRdma", strict=True)
    """``true``: only VFs with an RDMA device, handed out with their uverbs node and ``rdma_cm``;
    ``false``: only VFs without one (the SR-IOV network device plugin's ``isRdma`` selector)."""

    def pf_ranges(self) -> dict[str, frozenset[int] | None] | None:
        """PF name -> allowed VF indexes (``None``: all), or ``None`` when not selecting by PF name."""
        if self.pf_names is None:
            return None
        ranges: dict[str, frozenset[int] | None] = {}
        for entry in self.pf_names:
            name, _, spec = entry.partition("#")
            if not spec:
                ranges[name] = None
                continue
            allowed: set[int] = set()
            for part in spec.split(","):
                low, _, high = part.partition("-")
                allowed.update(range(int(low), int(high or low) + 1))
            previous = ranges.get(name, frozenset())
            ranges[name] = (
                None if previous is None and name in ranges else frozenset(allowed | (previous or set()))
            )
        return ranges


class NicOptions(_Model):
    """The ``nic`` keys of a resource entry."""

    match: NicMatch = pydantic.Field(default_factory=NicMatch)
    exclude_topology: bool = pydantic.Field(default=False, alias="excludeTopology", strict=True)
    vf_link_health: bool = pydantic.Field(default=False, alias="vfLinkHealth", strict=True)
    aer_unhealthy: list[AerKind] = pydantic.Field(
        default_factory=lambda: [AerKind.FATAL], alias="aerUnhealthy"
    )
