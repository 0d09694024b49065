"""A device as a DRA driver publishes it in a ResourceSlice: a name, typed attributes, capacities.

This is the kind-facing half of the DRA model (gRPC-free, like the device
model it extends): a kind's :class:`~plugvisor.dra.hooks.DraDescriber` returns
these values, and the driver hands the healthy ones to the slice publisher.
Values are checked where they are built, with the API server's syntax rules
(resource.k8s.io/v1), so that a kind's mistake is one error naming the device
and the field rather than a slice the API server rejects later:

- a device name is a DNS label;
- an attribute or capacity name is a C identifier of at most 32 characters,
  optionally after a DNS subdomain of at most 63 and a ``/``
  (``resource.kubernetes.io/pcieRoot``); names without a domain belong to the
  driver's own domain (``device.attributes["gpu.plugvisor.io"].model``);
- an attribute is a bool, an int, a string of at most 64 characters or a
  semantic version (:class:`SemVer`); a capacity is a Kubernetes quantity.

Per-slice limits (how many devices, attributes per device) are the
publisher's business: it splits and checks whole slices.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final, TypeAlias

from plugvisor.common.names import dns_label_problem
from plugvisor.common.validation import shorten

STANDARD_DOMAIN: Final = "resource.kubernetes.io"
"""Attributes with one meaning for every driver (``k8s.io/dynamic-resource-allocation/deviceattribute``)."""
PCIE_ROOT: Final = f"{STANDARD_DOMAIN}/pcieRoot"
"""The PCIe root complex (``pci0000:00``): devices that share it, share a host bridge."""
PCI_BUS_ID: Final = f"{STANDARD_DOMAIN}/pciBusID"
"""The PCI address in domain:bus:device.function form (``0000:3b:00.0``)."""
NUMA_NODE: Final = f"{STANDARD_DOMAIN}/numaNode"
"""The device's NUMA node; left out for a device without NUMA affinity."""

ATTRIBUTE_VALUE_MAX: Final = 64
_DOMAIN_MAX: Final = 63
_IDENTIFIER_MAX: Final = 32
_LABEL: Final = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DOMAIN_RE: Final = re.compile(rf"{_LABEL}(\.{_LABEL})*")
_IDENTIFIER_RE: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# semver.org 2.0.0, as the API server parses it (no leading "v", no leading zeros).
_NUMBER: Final = r"(0|[1-9]\d*)"
_PRE: Final = r"(0|[1-9]\d*|\d*[A-Za-z-][0-9A-Za-z-]*)"
_SEMVER_RE: Final = re.compile(
    rf"{_NUMBER}\.{_NUMBER}\.{_NUMBER}(-{_PRE}(\.{_PRE})*)?(\+[0-9A-Za-z-]+(\.[0-9A-Za-z-]+)*)?"
)
_QUANTITY_RE: Final = re.compile(
    r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+|Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?"
)
_BINARY_SUFFIXES: Final = (("Ei", 60), ("Pi", 50), ("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10))


def _is_str(value: object) -> bool:
    """Runtime check for kinds written without a type checker (the annotations promise str)."""
    return isinstance(value, str)


class InvalidDraDeviceError(ValueError):
    """A DRA device description a kind built is not something the API server would take."""


@dataclass(frozen=True, slots=True)
class SemVer:
    """An attribute value that is a semantic version (semver.org 2.0.0); CEL compares these as versions."""

    value: str

    def __post_init__(self) -> None:
        if not _is_str(self.value) or not _SEMVER_RE.fullmatch(self.value):
            raise InvalidDraDeviceError(f"{shorten(str(self.value), 80)!r} is not a semantic version")
        if len(self.value) > ATTRIBUTE_VALUE_MAX:
            raise InvalidDraDeviceError(
                f"version {self.value!r} is longer than {ATTRIBUTE_VALUE_MAX} characters"
            )

    def __str__(self) -> str:
        return self.value

    @classmethod
    def tolerant(cls, text: str) -> SemVer | None:
        """A version from what drivers print (``550.54.15``, ``535.104.05``, ``6.8``), or None.

        Leading zeros are dropped and missing minor or patch numbers are 0, as
        Go's tolerant semver parsing does; anything else that is not a version
        gives None.
        """
        core, plus, build = text.strip().lstrip("vV").partition("+")
        core, minus, pre = core.partition("-")
        numbers = core.split(".")
        if not 1 <= len(numbers) <= 3 or not all(n.isdigit() for n in numbers):
            return None
        numbers += ["0"] * (3 - len(numbers))
        candidate = ".".join(str(int(n)) for n in numbers) + (minus + pre) + (plus + build)
        try:
            return cls(candidate)
        except InvalidDraDeviceError:
            return None


AttributeValue: TypeAlias = bool | int | str | SemVer
"""What an attribute may hold: exactly one of the API's ``bool``, ``int``, ``string`` and ``version``."""


@dataclass(frozen=True, slots=True)
class DeviceTaint:
    """A taint on a published device (clusters with DRA device taints); ``effect`` is the API's."""

    key: str
    value: str = ""
    effect: str = "NoSchedule"


def qualified_name_problem(name: str) -> str | None:
    """Why ``name`` is not an attribute or capacity name (``[domain/]identifier``), or None."""
    domain, slash, identifier = name.rpartition("/")
    if slash and (not domain or len(domain) > _DOMAIN_MAX or not _DOMAIN_RE.fullmatch(domain)):
        return f"the domain of {name!r} must be a DNS subdomain of at most {_DOMAIN_MAX} characters"
    if not identifier or len(identifier) > _IDENTIFIER_MAX or not _IDENTIFIER_RE.fullmatch(identifier):
        return (
            f"{shorten(name, 80)!r} must be a C identifier of at most {_IDENTIFIER_MAX} characters "
            "(letters, digits, '_'; not starting with a digit), optionally after '<domain>/'"
        )
    return None


def quantity_problem(value: str) -> str | None:
    """Why ``value`` is not a Kubernetes quantity (``80Gi``, ``1500m``, ``2``), or None."""
    if _is_str(value) and _QUANTITY_RE.fullmatch(value):
        return None
    return f"{shorten(str(value), 80)!r} is not a Kubernetes quantity such as 80Gi, 1500m or 2"


def bytes_quantity(count: int) -> str:
    """A byte count as a quantity: with the largest binary suffix that divides it (``80Gi``), else plain."""
    for suffix, shift in _BINARY_SUFFIXES:
        if count > 0 and count % (1 << shift) == 0:
            return f"{count >> shift}{suffix}"
    return str(count)


def _attribute_problem(value: object) -> str | None:
    if isinstance(value, bool | int | SemVer):
        return None
    if isinstance(value, str):
        if len(value) > ATTRIBUTE_VALUE_MAX:
            return f"the string {shorten(value, 80)!r} is longer than {ATTRIBUTE_VALUE_MAX} characters"
        return None
    return f"{type(value).__name__} is not an attribute value: use bool, int, str or SemVer"


@dataclass(frozen=True, slots=True)
class PublishedDevice:
    """One device of the driver's pool, as the ResourceSlice lists it (and users select it with CEL)."""

    name: str
    attributes: Mapping[str, AttributeValue] = field(default_factory=lambda: MappingProxyType({}))
    capacity: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    taints: tuple[DeviceTaint, ...] = ()

    def __post_init__(self) -> None:
        if not _is_str(self.name):
            raise InvalidDraDeviceError(f"DRA device name must be a string, got {self.name!r}")
        problem = dns_label_problem(self.name, what="DRA device name")
        if problem is not None:
            raise InvalidDraDeviceError(problem)
        for key, value in self.attributes.items():
            problem = qualified_name_problem(key) or _attribute_problem(value)
            if problem is not None:
                raise InvalidDraDeviceError(f"device {self.name!r}: attribute {key!r}: {problem}")
        for key, value in self.capacity.items():
            problem = qualified_name_problem(key) or quantity_problem(value)
            if problem is not None:
                raise InvalidDraDeviceError(f"device {self.name!r}: capacity {key!r}: {problem}")
        object.__setattr__(self, "attributes", MappingProxyType(dict(sorted(self.attributes.items()))))
        object.__setattr__(self, "capacity", MappingProxyType(dict(sorted(self.capacity.items()))))
        object.__setattr__(self, "taints", tuple(self.taints))

    def __hash__(self) -> int:
        return hash(self.name)
