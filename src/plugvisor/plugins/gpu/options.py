"""The ``gpu`` keys of a resource entry, validated (unknown keys are errors)."""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Final

import pydantic

from plugvisor.common import constants
from plugvisor.common.validation import absolute_path, shorten
from plugvisor.plugins.sysfs import AerKind, HexId, PciAddress, hex_ids
from plugvisor.plugins.topology import Policy

NVIDIA: Final = 0x10DE
AMD: Final = 0x1002
INTEL: Final = 0x8086
DISPLAY_CLASS: Final = 0x03
"""PCI base class of display controllers (VGA 0x0300, 3D 0x0302, other 0x0380)."""
ACCELERATOR_CLASS: Final = 0x12
"""PCI base class of processing accelerators: AMD Instinct GPUs (MI200/MI300) use it, and so do FPGAs."""

_ENV_NAME: Final = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class _Model(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


AbsolutePath = Annotated[str, pydantic.AfterValidator(absolute_path)]


class IdStrategy(StrEnum):
    """How device IDs are formed (NVIDIA's ``deviceIDStrategy``, plus the PCI address)."""

    UUID = "uuid"
    PCI = "pci"
    INDEX = "index"


class Match(_Model):
    """Which PCI functions are GPUs of this resource (all given lists must match; each list is OR)."""

    vendors: list[HexId] = pydantic.Field(default_factory=lambda: ["0x10de", "0x1002", "0x8086"])
    devices: list[HexId] | None = None
    drivers: list[Annotated[str, pydantic.StringConstraints(min_length=1)]] | None = None
    pci_addresses: list[PciAddress] | None = pydantic.Field(default=None, alias="pciAddresses")
    classes: list[Annotated[str, pydantic.StringConstraints(pattern=r"^(0x)?[0-9a-fA-F]{2}$")]] | None = None
    """PCI base classes; by default display controllers (0x03) of any vendor plus AMD accelerators (0x12)."""

    def accepts_class(self, base_class: int, vendor: int) -> bool:
        """Whether a function of this base class and vendor can be a GPU of this resource."""
        if self.classes is not None:
            return base_class in {int(c, 16) for c in self.classes}
        return base_class == DISPLAY_CLASS or (base_class == ACCELERATOR_CLASS and vendor == AMD)

    def vendor_ids(self) -> frozenset[int]:
        """The vendor IDs as integers."""
        return hex_ids(self.vendors) or frozenset()

    def device_ids(self) -> frozenset[int] | None:
        """The device IDs as integers, or ``None`` for any."""
        return hex_ids(self.devices)


DEFAULT_IGNORED_XIDS: Final = frozenset({13, 31, 43, 45, 68, 109})
"""XIDs NVIDIA's device plugin and DRA driver ignore by default: errors of the application (13 graphics
engine exception, 31 MMU fault, 43 GPU stopped processing, 45 preemptive cleanup, 68 video processor
exception) or of a context the driver already recovered (109 context switch timeout), not of the GPU."""

MAX_XIDS: Final = 1024
"""The longest XID list a resource may give (NVIDIA documents a few dozen XIDs)."""


def _xids(value: object, *, keywords: tuple[str, ...]) -> str | tuple[int, ...]:
    """One of ``keywords`` or a list of XID numbers (1-65535); else one error line saying what was wanted."""
    expected = " or ".join(repr(k) for k in keywords) + " or a list of XID numbers (1-65535)"
    if isinstance(value, str):
        if value in keywords:
            return value
        raise ValueError(f"expected {expected}, got {shorten(value)!r}")
    if not isinstance(value, list):
        raise ValueError(f"expected {expected}, got {type(value).__name__}")  # noqa: TRY004 - pydantic's error
    if len(value) > MAX_XIDS:
        raise ValueError(f"{len(value)} XIDs; at most {MAX_XIDS} are allowed")
    for position, xid in enumerate(value):
        if isinstance(xid, bool) or not isinstance(xid, int) or not 1 <= xid <= 65535:
            shown = shorten(repr(xid))
            raise ValueError(f"item {position}: {shown} is not an XID number (an integer from 1 to 65535)")
    return tuple(sorted(set(value)))


DisableChecks = Annotated[
    str | tuple[int, ...], pydantic.PlainValidator(lambda v: _xids(v, keywords=("all", "xids")))
]
EnableChecks = Annotated[
    str | tuple[int, ...], pydantic.PlainValidator(lambda v: _xids(v, keywords=("all",)))
]


def _enabled(value: object) -> str | bool:
    if value == "auto" or value is False:
        return value
    raise ValueError(f"expected 'auto' or false, got {shorten(repr(value))}")


class Nvml(_Model):
    """The ``nvml:`` keys of a gpu resource: whether NVML is used, which of its events make a GPU unhealthy.

    ``disableHealthChecks`` and ``enableHealthChecks`` work as NVIDIA's device
    plugin's ``DP_DISABLE_HEALTHCHECKS`` and ``DP_ENABLE_HEALTHCHECKS``: ``all``
    turns NVML health off (identity and telemetry stay), ``xids`` turns the
    XID check off (double-bit ECC and a lost GPU still count), a list adds XIDs
    to the ignored ones; ``enableHealthChecks`` takes XIDs back from the
    ignored ones (NVIDIA's defaults included), ``all`` takes every one back.
    """

    enabled: Annotated[str | bool, pydantic.PlainValidator(_enabled)] = "auto"
    """``auto``: NVML where ``libnvidia-ml.so.1`` loads, sysfs alone where not; ``false``: never load it."""
    disable_health_checks: DisableChecks = pydantic.Field(default=(), alias="disableHealthChecks")
    enable_health_checks: EnableChecks = pydantic.Field(default=(), alias="enableHealthChecks")
    recover_after_seconds: Annotated[int, pydantic.Field(strict=True, ge=0, le=86400)] = pydantic.Field(
        default=300, alias="recoverAfterSeconds"
    )
    """A GPU made unhealthy by an NVML event is healthy again after this long with no critical event while
    NVML answers for it; 0 keeps it unhealthy until the plugin restarts (NVIDIA's behaviour)."""

    @property
    def health(self) -> bool:
        """Whether NVML events make GPUs unhealthy at all."""
        return self.disable_health_checks != "all"

    def xid_is_critical(self, xid: int) -> bool:
        """Whether an XID critical error event with this XID makes its GPU unhealthy."""
        if self.disable_health_checks in ("all", "xids"):
            return False
        if self.enable_health_checks == "all" or xid in self.enable_health_checks:
            return True
        return xid not in DEFAULT_IGNORED_XIDS and xid not in self.disable_health_checks


class GpuOptions(_Model):
    """The ``gpu`` keys of a resource entry."""

    match: Match = pydantic.Field(default_factory=Match)
    device_id_strategy: IdStrategy = pydantic.Field(default=IdStrategy.UUID, alias="deviceIdStrategy")
    replicas: Annotated[int, pydantic.Field(ge=1, le=64, strict=True)] = 1
    allocation_policy: Policy = pydantic.Field(default=Policy.SPREAD, alias="allocationPolicy")
    visible_devices_env: Annotated[str, pydantic.StringConstraints(pattern=_ENV_NAME.pattern)] = (
        pydantic.Field(default="NVIDIA_VISIBLE_DEVICES", alias="visibleDevicesEnv")
    )
    cdi: bool = pydantic.Field(default=False, strict=True)
    cdi_dir: AbsolutePath = pydantic.Field(default=constants.DEFAULT_CDI_DIR, alias="cdiDir")
    pass_device_specs: bool | None = pydantic.Field(default=None, alias="passDeviceSpecs", strict=True)
    aer_unhealthy: list[AerKind] = pydantic.Field(
        default_factory=lambda: [AerKind.FATAL], alias="aerUnhealthy"
    )
    driver_root: AbsolutePath = pydantic.Field(default="/", alias="driverRoot")
    """Where NVIDIA's user-space driver files (libnvidia-ml, libcuda, ...) live on the host, as NVIDIA's
    charts' ``driverRoot``: ``/`` for a driver installed on the host, ``/run/nvidia/driver`` for the GPU
    operator's driver container, ``/usr/local/nvidia`` on some images. Read under ``hostRoot``."""

    nvml: Nvml = pydantic.Field(default_factory=Nvml)
    """NVML identity, health and telemetry (see :class:`Nvml`)."""

    @property
    def device_specs(self) -> bool:
        """Whether Allocate returns DeviceSpecs (default: only without CDI, as NVIDIA's ``cdi-cri``)."""
        return (not self.cdi) if self.pass_device_specs is None else self.pass_device_specs
