"""The ``fpga`` keys of a resource entry, validated (unknown keys are errors).

The framework serves one resource per process, so these options say which FPGA
devices form *this* resource: ``family`` picks the device family and Intel's
granularity (``af``: ports carrying given accelerator functions, ``region``:
ports of given FPGA interfaces, ``xilinx``: Xilinx-style user/management PF
pairs), ``match`` narrows it down. :mod:`plugvisor.plugins.fpga.naming`
computes the resource name Intel's or Xilinx's plugin would give each device, so
a configuration can keep those names.

``family`` was called ``mode`` before node.yaml's ``mode`` came to mean the
kubelet API (``device-plugin`` or ``dra``); the old spelling is still taken,
with a warning, and means the same.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Any, Final, Self

import pydantic
import structlog

from plugvisor.common.validation import absolute_path
from plugvisor.plugins.sysfs import AerKind, HexId, PciAddress

_ENV_NAME: Final = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_ID128: Final = re.compile(r"^(0x)?[0-9a-fA-F]{32}$")

XILINX_VENDORS: Final = ("0x10ee", "0x13fe", "0x1d0f", "0x3475")
"""What Xilinx's plugin accepts: Xilinx, Advantech, AWS (F1), Arista."""

MAX_PRE_START_TIMEOUT: Final = 25.0
"""The kubelet gives PreStartContainer 30 s in all; leave room for the in-tree action and the RPC."""


class _Model(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


def _id128(value: str) -> str:
    if not _ID128.match(value):
        raise ValueError(
            f"{value!r} is not a 128-bit ID: 32 hex digits such as d8424dc4a4a3c413f89e433683f9040b"
        )
    return value.lower().removeprefix("0x")


Id128 = Annotated[str, pydantic.AfterValidator(_id128)]
"""An AFU or interface ID as sysfs spells it (32 lower-case hex digits; ``0x`` and upper case accepted)."""

AbsolutePath = Annotated[str, pydantic.AfterValidator(absolute_path)]
Argv = Annotated[list[Annotated[str, pydantic.StringConstraints(min_length=1)]], pydantic.Field(min_length=1)]


class Family(StrEnum):
    """Which devices form the resource, and at what granularity (Intel's modes, plus Xilinx)."""

    AF = "af"
    """Intel DFL ports, one resource per accelerator function (AFU ID + interface ID)."""
    REGION = "region"
    """Intel DFL ports, one resource per FPGA interface (the pod programs its own AFU)."""
    XILINX = "xilinx"
    """Xilinx-style cards: a user PF (``user_pf``) and its management PF (``mgmt_pf``)."""


class PreStartAction(StrEnum):
    """What PreStartContainer does in-tree before the optional command (DFL ports only)."""

    CLEAR_EVENTS = "clear-events"
    """Write ``1`` to the port's ``ap1_event``/``ap2_event`` and clear ``errors/errors``."""
    NONE = "none"


class FpgaMatch(_Model):
    """Which devices belong to this resource (every given list must match; within a list, any entry)."""

    afu_ids: list[Id128] | None = pydantic.Field(default=None, alias="afuIds")
    interface_ids: list[Id128] | None = pydantic.Field(default=None, alias="interfaceIds")
    shells: list[Annotated[str, pydantic.StringConstraints(min_length=1)]] | None = None
    """Xilinx: shell names (``rom.*/VBNV``)."""
    vendors: list[HexId] | None = None
    """PCI vendor IDs; default any for DFL (any vendor's DFL card), Xilinx's four for ``xilinx``."""
    devices: list[HexId] | None = None
    pci_addresses: list[PciAddress] | None = pydantic.Field(default=None, alias="pciAddresses")


class ReleaseCleanup(_Model):
    """Run a command for each device no container holds any more (seen through PodResources ``List``)."""

    command: Argv
    pod_resources_socket: AbsolutePath | None = pydantic.Field(default=None, alias="podResourcesSocket")
    """Default: beside the device-plugin directory (``<kubelet dir>/../pod-resources/kubelet.sock``)."""
    interval: Annotated[float, pydantic.Field(gt=0.0, le=3600.0)] = 2.0
    timeout: Annotated[float, pydantic.Field(gt=0.0, le=3600.0)] = 120.0


DEPRECATED_FAMILY_KEY: Final = "mode"
"""The key ``family`` had before node.yaml's ``mode`` named the kubelet API."""

_log = structlog.get_logger("plugvisor.plugins.fpga")


class FpgaOptions(_Model):
    """The ``fpga`` keys of a resource entry."""

    family: Family = Family.AF
    match: FpgaMatch = pydantic.Field(default_factory=FpgaMatch)
    visible_devices_env: Annotated[str, pydantic.StringConstraints(pattern=_ENV_NAME.pattern)] = (
        pydantic.Field(default="FPGA_VISIBLE_DEVICES", alias="visibleDevicesEnv")
    )
    mgmt_node: bool = pydantic.Field(default=True, alias="mgmtNode", strict=True)
    """Xilinx: also hand out ``/dev/xclmgmt<instance>`` (as Xilinx's plugin does)."""
    pre_start_action: PreStartAction = pydantic.Field(
        default=PreStartAction.CLEAR_EVENTS, alias="preStartAction"
    )
    pre_start_command: Argv | None = pydantic.Field(default=None, alias="preStartCommand")
    pre_start_timeout: Annotated[float, pydantic.Field(gt=0.0, le=MAX_PRE_START_TIMEOUT)] = pydantic.Field(
        default=20.0, alias="preStartTimeout"
    )
    release_cleanup: ReleaseCleanup | None = pydantic.Field(default=None, alias="releaseCleanup")
    aer_unhealthy: list[AerKind] = pydantic.Field(
        default_factory=lambda: [AerKind.FATAL], alias="aerUnhealthy"
    )

    @pydantic.model_validator(mode="before")
    @classmethod
    def _family_once_called_mode(cls, data: Any) -> Any:
        """Take ``mode: af|region|xilinx`` as ``family``, saying (at every validation) that it is renamed.

        Another value of ``mode`` stays where it is, so the key is refused as
        unknown (node.yaml then says what an entry's ``mode`` may be).
        """
        if not isinstance(data, dict) or data.get(DEPRECATED_FAMILY_KEY) not in set(Family):
            return data
        data = dict(data)
        value = str(data.pop(DEPRECATED_FAMILY_KEY))
        if "family" in data:
            raise ValueError(
                f"give the family once: 'family' ({data['family']!r}), not also its old name "
                f"'mode' ({value!r})"
            )
        data["family"] = value
        _log.warning(
            "deprecated_key",
            key=DEPRECATED_FAMILY_KEY,
            value=value,
            use=f"family: {value}",
            why="an entry's mode is the kubelet API (device-plugin or dra)",
        )
        return data

    @pydantic.model_validator(mode="after")
    def _keys_fit_the_family(self) -> Self:
        m = self.match
        if self.family is Family.XILINX and (m.afu_ids is not None or m.interface_ids is not None):
            raise ValueError("match.afuIds and match.interfaceIds select Intel DFL ports, not family xilinx")
        if self.family is not Family.XILINX and m.shells is not None:
            raise ValueError("match.shells selects Xilinx cards: it needs family xilinx")
        if self.family is Family.REGION and m.afu_ids is not None:
            raise ValueError("match.afuIds needs family af (family region hands out ports by interface ID)")
        return self

    def vendor_ids(self) -> frozenset[int] | None:
        """The wanted vendors as integers (``None``: any)."""
        vendors = self.match.vendors
        if vendors is None and self.family is Family.XILINX:
            vendors = list(XILINX_VENDORS)
        return None if vendors is None else frozenset(int(v, 16) for v in vendors)
