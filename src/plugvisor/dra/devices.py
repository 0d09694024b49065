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
- an attribute is a bool, a 64-bit int, a string of at most 64 characters or
  a semantic version (:class:`SemVer`); a capacity is a Kubernetes quantity;
- at most 32 attributes and capacities together, 16 taints, each taint a
  label key, a label value and one of the API's effects.

The rules are :mod:`plugvisor.dra.validation`'s, which the slice publisher
shares; per-slice limits (how many devices a slice holds) are the publisher's
business. :func:`device_json` is the form both publishers write.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final, TypeAlias

from plugvisor.common.names import dns_label_problem
from plugvisor.common.validation import shorten
from plugvisor.dra import validation

STANDARD_DOMAIN: Final = "resource.kubernetes.io"
"""Attributes with one meaning for every driver (``k8s.io/dynamic-resource-allocation/deviceattribute``)."""
PCIE_ROOT: Final = f"{STANDARD_DOMAIN}/pcieRoot"
"""The PCIe root complex (``pci0000:00``): devices that share it, share a host bridge."""
PCI_BUS_ID: Final = f"{STANDARD_DOMAIN}/pciBusID"
"""The PCI address in domain:bus:device.function form (``0000:3b:00.0``)."""
NUMA_NODE: Final = f"{STANDARD_DOMAIN}/numaNode"
"""The device's NUMA node; left out for a device without NUMA affinity."""

_BINARY_SUFFIXES: Final = (("Ei", 60), ("Pi", 50), ("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10))


class InvalidDraDeviceError(ValueError):
    """A DRA device description a kind built is not something the API server would take."""


@dataclass(frozen=True, slots=True)
class SemVer:
    """An attribute value that is a semantic version (semver.org 2.0.0); CEL compares these as versions."""

    value: str

    def __post_init__(self) -> None:
        problem = validation.version_problem(self.value)
        if problem is not None:
            raise InvalidDraDeviceError(problem)

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
    """A taint on a published device (clusters with DRA device taints).

    ``NoSchedule`` keeps new claims off the device, ``NoExecute`` also evicts
    its users; where the cluster drops taints, the publisher withdraws a
    device that has either instead.
    """

    key: str
    value: str = ""
    effect: str = "NoSchedule"

    def __post_init__(self) -> None:
        problem = validation.taint_problem(self.key, self.value, self.effect)
        if problem is not None:
            raise InvalidDraDeviceError(f"taint {shorten(str(self.key))!r}: {problem}")


def bytes_quantity(count: int) -> str:
    """A byte count as a quantity: with the largest binary suffix that divides it (``80Gi``), else plain."""
    for suffix, shift in _BINARY_SUFFIXES:
        if count > 0 and count % (1 << shift) == 0:
            return f"{count >> shift}{suffix}"
    return str(count)


def _attribute_problem(value: object) -> str | None:
    if isinstance(value, bool | SemVer):  # bool before int: a bool is an int to Python
        return None
    if isinstance(value, int):
        return validation.int_problem(value)
    if isinstance(value, str):
        return validation.string_problem(value)
    return f"{type(value).__name__} is not an attribute value: use bool, int, str or SemVer"


@dataclass(frozen=True, slots=True)
class PublishedDevice:
    """One device of the driver's pool, as the ResourceSlice lists it (and users select it with CEL)."""

    name: str
    attributes: Mapping[str, AttributeValue] = field(default_factory=lambda: MappingProxyType({}))
    capacity: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    taints: tuple[DeviceTaint, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise InvalidDraDeviceError(f"DRA device name must be a string, got {self.name!r}")
        problem = dns_label_problem(self.name, what="DRA device name")
        if problem is not None:
            raise InvalidDraDeviceError(problem)
        for key, value in self.attributes.items():
            problem = validation.qualified_problem(str(key)) or _attribute_problem(value)
            if problem is not None:
                raise InvalidDraDeviceError(f"device {self.name!r}: attribute {key!r}: {problem}")
        for key, quantity in self.capacity.items():
            problem = validation.qualified_problem(str(key)) or validation.quantity_problem(quantity)
            if problem is not None:
                raise InvalidDraDeviceError(f"device {self.name!r}: capacity {key!r}: {problem}")
        entries = len(self.attributes) + len(self.capacity)
        if entries > validation.MAX_ATTRIBUTES_AND_CAPACITIES:
            raise InvalidDraDeviceError(
                f"device {self.name!r}: {entries} attributes and capacities; "
                f"at most {validation.MAX_ATTRIBUTES_AND_CAPACITIES} are allowed"
            )
        taints = tuple(self.taints)
        if len(taints) > validation.MAX_TAINTS:
            raise InvalidDraDeviceError(
                f"device {self.name!r}: {len(taints)} taints; at most {validation.MAX_TAINTS} are allowed"
            )
        if not all(isinstance(taint, DeviceTaint) for taint in taints):
            raise InvalidDraDeviceError(f"device {self.name!r}: taints must be DeviceTaint values")
        object.__setattr__(self, "attributes", MappingProxyType(dict(sorted(self.attributes.items()))))
        object.__setattr__(self, "capacity", MappingProxyType(dict(sorted(self.capacity.items()))))
        object.__setattr__(self, "taints", taints)

    def __hash__(self) -> int:
        return hash(self.name)


def attribute_json(value: AttributeValue) -> dict[str, Any]:
    """An attribute value in the API's form (exactly one of ``bool``, ``int``, ``string``, ``version``)."""
    if isinstance(value, bool):  # before int: a bool is an int to Python
        return {"bool": value}
    if isinstance(value, int):
        return {"int": value}
    if isinstance(value, SemVer):
        return {"version": value.value}
    return {"string": value}


def device_json(device: PublishedDevice) -> dict[str, Any]:
    """A device in a ResourceSlice's ``spec.devices`` (``resource.k8s.io/v1``)."""
    body: dict[str, Any] = {"name": device.name}
    if device.attributes:
        body["attributes"] = {key: attribute_json(value) for key, value in device.attributes.items()}
    if device.capacity:
        body["capacity"] = {key: {"value": value} for key, value in device.capacity.items()}
    if device.taints:
        body["taints"] = [
            {"key": t.key, "effect": t.effect, **({"value": t.value} if t.value else {})}
            for t in device.taints
        ]
    return body
