"""The API server's rules for a ResourceSlice's devices, in one place for both sides of a DRA driver.

A device the API server would refuse makes it refuse the whole slice, and with
it every other device in that slice. :class:`~plugvisor.dra.devices.PublishedDevice`
applies these rules where a kind builds a device, so a kind's mistake is one
error naming the device and the field; the slice publisher
(:mod:`plugvisor.dra.kube.slices`) applies the per-slice ones. The rules are
those of ``resource.k8s.io/v1`` as Kubernetes 1.37 validates them
(``pkg/apis/resource/validation`` and the constants of ``k8s.io/api/resource/v1``),
restated in our own words:

- a device's name is a DNS-1123 label, unique in the pool;
- attribute and capacity names are a C identifier of at most 32 characters,
  optionally after a DNS-subdomain domain of at most 63 and a ``/``;
- a string value is at most 64 UTF-8 bytes (Kubernetes counts bytes), a version at most
  64 characters and semver 2.0.0; an integer fits in 64 bits;
- a capacity is a Kubernetes quantity;
- at most 32 attributes and capacities together per device, 16 taints;
- a taint's key is a label name, its value a label value, its effect one of
  None, NoSchedule, NoExecute;
- at most 128 devices per slice, or 64 once any device in it has taints.

Pure functions over strings and numbers: gRPC-free and client-free, so a kind's
module, the driver and the API-server side all use the same copy.

https://kubernetes.io/docs/reference/kubernetes-api/workload-resources/resource-slice-v1/
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Final

from plugvisor.common.names import node_name_problem, qualified_name_errors
from plugvisor.common.validation import shorten

MAX_DEVICES_PER_SLICE: Final = 128
MAX_DEVICES_PER_SLICE_WITH_TAINTS: Final = 64
MAX_ATTRIBUTES_AND_CAPACITIES: Final = 32
MAX_TAINTS: Final = 16
MAX_VALUE_LENGTH: Final = 64
MAX_DOMAIN_LENGTH: Final = 63
MAX_IDENTIFIER_LENGTH: Final = 32
MAX_LABEL_VALUE_LENGTH: Final = 63
TAINT_EFFECTS: Final = ("None", "NoSchedule", "NoExecute")
INT64_MIN: Final = -(2**63)
INT64_MAX: Final = 2**63 - 1

_C_IDENTIFIER_RE: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_LABEL_VALUE_RE: Final = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_NUMERIC: Final = r"(0|[1-9][0-9]*)"
_PRERELEASE: Final = r"(0|[1-9][0-9]*|[0-9]*[A-Za-z-][0-9A-Za-z-]*)"
_SEMVER_RE: Final = re.compile(
    rf"{_NUMERIC}\.{_NUMERIC}\.{_NUMERIC}(-{_PRERELEASE}(\.{_PRERELEASE})*)?(\+[0-9A-Za-z-]+(\.[0-9A-Za-z-]+)*)?"
)
# <sign><digits>[.<digits>] then a binary suffix, a decimal suffix or an exponent (resource.Quantity).
_QUANTITY_RE: Final = re.compile(
    r"([+-]?)([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E|[eE][+-]?[0-9]+|)"
)
_SUFFIXES: Final = {
    "": Decimal(1),
    "m": Decimal("0.001"),
    "k": Decimal(10) ** 3,
    "M": Decimal(10) ** 6,
    "G": Decimal(10) ** 9,
    "T": Decimal(10) ** 12,
    "P": Decimal(10) ** 15,
    "E": Decimal(10) ** 18,
    **{
        binary: Decimal(1024) ** power for power, binary in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"), 1)
    },
}


def _is_str(value: object) -> bool:
    """Runtime check for kinds written without a type checker (the annotations promise str)."""
    return isinstance(value, str)


def _domain_problem(domain: str) -> str | None:
    if "/" in domain:
        return "more than one '/'"
    if len(domain) > MAX_DOMAIN_LENGTH:
        return f"the domain is longer than {MAX_DOMAIN_LENGTH} characters"
    if node_name_problem(domain.lower()) is not None:  # a DNS subdomain; the API server ignores case here
        return f"the domain {shorten(domain)!r} is not a DNS subdomain"
    return None


def qualified_problem(name: str) -> str | None:
    """Why ``name`` cannot name an attribute or capacity (``[domain/]identifier``); None when it can."""
    domain, sep, identifier = name.rpartition("/")
    if sep and not domain:
        return "the domain before '/' is empty"
    if domain and (problem := _domain_problem(domain)):
        return problem
    if not identifier:
        return "the name after the domain is empty"
    if len(identifier) > MAX_IDENTIFIER_LENGTH:
        return f"{shorten(identifier)!r} is longer than {MAX_IDENTIFIER_LENGTH} characters"
    if not _C_IDENTIFIER_RE.fullmatch(identifier):
        return f"{shorten(identifier)!r} is not a C identifier (letters, digits, '_'; not a digit first)"
    return None


def string_problem(value: str) -> str | None:
    """Why ``value`` cannot be a string attribute; None when it can.

    Kubernetes counts the length in bytes (Go's ``len`` of a string), so UTF-8 bytes here too.
    """
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > MAX_VALUE_LENGTH:
        return f"the value is {size} bytes long (UTF-8); at most {MAX_VALUE_LENGTH} are allowed"
    return None


def clip_value(text: str, limit: int = MAX_VALUE_LENGTH) -> str:
    """``text`` cut to at most ``limit`` UTF-8 bytes, never inside a character (an attribute's value)."""
    data = text.encode("utf-8", "surrogatepass")
    if len(data) <= limit:
        return text
    return data[:limit].decode("utf-8", "ignore")  # a character cut in two is dropped whole


def version_problem(value: str) -> str | None:
    """Why ``value`` cannot be a version attribute (semver 2.0.0, at most 64 characters); None when it can."""
    if not _is_str(value):
        return f"{value!r} is not a string"
    if len(value) > MAX_VALUE_LENGTH:
        return f"the version is {len(value)} characters long; at most {MAX_VALUE_LENGTH} are allowed"
    if not _SEMVER_RE.fullmatch(value):
        return f"{shorten(value)!r} is not a semantic version (MAJOR.MINOR.PATCH, no leading zeros)"
    return None


def int_problem(value: int) -> str | None:
    """Why ``value`` cannot be an int attribute (it must fit in 64 bits); None when it can."""
    if not INT64_MIN <= value <= INT64_MAX:
        return f"{shorten(str(value))} does not fit in a 64-bit integer"
    return None


def parse_quantity(text: str) -> Decimal:
    """The value of a Kubernetes quantity (``80Gi``, ``1500m``, ``1e3``); ValueError naming it if it is none.

    Two quantities are the same capacity when their values are equal: the API
    server stores ``1024Mi`` as ``1Gi``, and that is no change.
    """
    match = _QUANTITY_RE.fullmatch(text) if _is_str(text) else None
    if match is None:
        raise ValueError(f"{shorten(str(text))!r} is not a Kubernetes quantity (e.g. 80Gi, 1500m, 4)")
    sign, digits, suffix = match.groups()
    try:
        number = Decimal(digits)
        exponent = suffix[:1] in ("e", "E")
        value = number.scaleb(int(suffix[1:])) if exponent else number * _SUFFIXES[suffix]
    except (InvalidOperation, ValueError):
        raise ValueError(f"{shorten(text)!r} is not a Kubernetes quantity (out of range)") from None
    return -value if sign == "-" else value


def quantity_problem(text: str) -> str | None:
    """Why ``text`` cannot be a capacity (a Kubernetes quantity); None when it can."""
    try:
        parse_quantity(text)
    except ValueError as exc:
        return str(exc)
    return None


def label_name_problem(key: str) -> str | None:
    """Why ``key`` cannot be a taint's key (a label name); None when it can."""
    errors = qualified_name_errors(key)
    return f"the key {shorten(key)!r}: {'; '.join(errors)}" if errors else None


def label_value_problem(value: str) -> str | None:
    """Why ``value`` cannot be a taint's value (a label value); None when it can."""
    if len(value) > MAX_LABEL_VALUE_LENGTH:
        return f"the value is longer than {MAX_LABEL_VALUE_LENGTH} characters"
    if not _LABEL_VALUE_RE.fullmatch(value):
        return f"the value {shorten(value)!r} is not a label value (alphanumerics, '-', '_', '.')"
    return None


def taint_problem(key: str, value: str, effect: str) -> str | None:
    """Why a device taint cannot be published; None when it can."""
    if not all(_is_str(part) for part in (key, value, effect)):
        return "key, value and effect must be strings"
    if effect not in TAINT_EFFECTS:
        return f"the effect {shorten(effect)!r} is not one of {', '.join(TAINT_EFFECTS)}"
    return label_name_problem(key) or (label_value_problem(value) if value else None)
