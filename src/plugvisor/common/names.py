"""Kubernetes name rules the kubelet applies to device plugins, reproduced exactly.

The kubelet rejects a registration whose resource name is not an *extended
resource name*; checking it on our side first turns a remote, late failure into
an early one with a clear message. The emulated kubelet uses the same function,
so the rule lives in one place; its test vectors come from the kubelet's own
(docs/kubelet-contract.md, section 2).
"""

from __future__ import annotations

import re
from typing import Final

from plugvisor.common.validation import shorten

_DNS1123_LABEL: Final = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
# Matched with fullmatch: "$" would also accept a trailing newline, which Go's regexp
# (and so the kubelet) rejects.
_DNS1123_SUBDOMAIN_RE: Final = re.compile(rf"{_DNS1123_LABEL}(\.{_DNS1123_LABEL})*")
_QUALIFIED_NAME_RE: Final = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_DNS1123_LABEL_RE: Final = re.compile(_DNS1123_LABEL)
_DNS1123_SUBDOMAIN_MAX: Final = 253
_DNS1123_LABEL_MAX: Final = 63
_QUALIFIED_NAME_MAX: Final = 63
_DRA_DRIVER_NAME_MAX: Final = 63


def qualified_name_errors(value: str) -> list[str]:
    """Return why ``value`` is not a Kubernetes qualified name (empty when it is one).

    A qualified name is ``[prefix/]name``: an optional DNS-1123 subdomain prefix and a
    name part of 1-63 characters, alphanumeric at both ends.
    """
    errors: list[str] = []
    parts = value.split("/")
    if len(parts) == 1:
        name = parts[0]
    elif len(parts) == 2:
        prefix, name = parts
        if not prefix:
            errors.append("prefix part must be non-empty")
        elif len(prefix) > _DNS1123_SUBDOMAIN_MAX:
            errors.append(f"prefix part must be no more than {_DNS1123_SUBDOMAIN_MAX} characters")
        elif not _DNS1123_SUBDOMAIN_RE.fullmatch(prefix):
            errors.append("prefix part must be a lowercase RFC 1123 subdomain")
    else:
        return ["a qualified name must consist of alphanumeric characters and at most one '/'"]
    if not name:
        errors.append("name part must be non-empty")
    elif len(name) > _QUALIFIED_NAME_MAX:
        errors.append(f"name part must be no more than {_QUALIFIED_NAME_MAX} characters")
    elif not _QUALIFIED_NAME_RE.fullmatch(name):
        errors.append(
            "name part must consist of alphanumeric characters, '-', '_' or '.', "
            "and must start and end with an alphanumeric character"
        )
    return errors


def is_extended_resource_name(name: str) -> bool:
    """Apply the kubelet's ``IsExtendedResourceName``: ``domain/name``, not native, not a quota name."""
    if "/" not in name or "kubernetes.io/" in name or name.startswith("requests."):
        return False
    return not qualified_name_errors("requests." + name)


def extended_resource_name_problem(name: str) -> str | None:
    """Explain, for a human, why ``name`` cannot be registered; None when it can (bounded echo)."""
    shown = repr(shorten(name, 330))  # a valid name has at most 253 + 1 + 63 characters
    if "/" not in name:
        return f"{shown} has no domain: expected <domain>/<name>, e.g. vendor.example/gpu"
    if "kubernetes.io/" in name:
        return f"{shown} uses a kubernetes.io domain, which is reserved for native resources"
    if name.startswith("requests."):
        return f"{shown} starts with 'requests.', which is reserved for quota"
    errors = qualified_name_errors("requests." + name)
    if errors:
        return f"{shown} is not a valid extended resource name: " + "; ".join(errors)
    return None


def dns_label_problem(value: str, *, what: str = "name") -> str | None:
    """Why ``value`` is not a DNS-1123 label (at most 63 of ``a-z``, ``0-9``, ``-``, alphanumeric ends)."""
    shown = repr(shorten(value, 80))
    if not value:
        return f"{what} must not be empty"
    if len(value) > _DNS1123_LABEL_MAX:
        return f"{what} {shown} is {len(value)} characters; at most {_DNS1123_LABEL_MAX} are allowed"
    if not _DNS1123_LABEL_RE.fullmatch(value):
        return (
            f"{what} {shown} must be a DNS label: lowercase letters, digits and '-', "
            "starting and ending with a letter or digit"
        )
    return None


def dra_driver_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a DRA driver's name, or None.

    The API server takes a ResourceSlice's ``driver`` only as a DNS subdomain
    of at most 63 characters (the kubelet itself checks nothing but that it is
    not empty); by convention it ends in a domain the vendor owns, such as
    ``gpu.plugvisor.io``.
    """
    shown = repr(shorten(name, 80))
    if not name:
        return "a DRA driver name must not be empty; expected a DNS subdomain such as gpu.example.com"
    if len(name) > _DRA_DRIVER_NAME_MAX:
        return (
            f"DRA driver name {shown} is {len(name)} characters; at most {_DRA_DRIVER_NAME_MAX} are allowed"
        )
    if not _DNS1123_SUBDOMAIN_RE.fullmatch(name):
        return (
            f"DRA driver name {shown} is not a DNS subdomain: lowercase letters, digits, '-' and '.', "
            "e.g. gpu.example.com"
        )
    return None


def node_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a Node's name (a DNS-1123 subdomain); None when it can."""
    if not name:
        return "must not be empty"
    if len(name) > _DNS1123_SUBDOMAIN_MAX:
        return f"{shorten(name)!r} is longer than {_DNS1123_SUBDOMAIN_MAX} characters"
    if not _DNS1123_SUBDOMAIN_RE.fullmatch(name):
        return f"{shorten(name)!r} is not a lowercase DNS-1123 subdomain (a Node's name)"
    return None


_GO_ESCAPES: Final = {
    '"': '\\"',
    "\\": "\\\\",
    "\a": "\\a",
    "\b": "\\b",
    "\f": "\\f",
    "\n": "\\n",
    "\r": "\\r",
    "\t": "\\t",
    "\v": "\\v",
}


def _go_escape(ch: str) -> str:
    escaped = _GO_ESCAPES.get(ch)
    if escaped is not None:
        return escaped
    if ch.isprintable():
        return ch
    code = ord(ch)
    if code < 0x80:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def go_quote(value: str) -> str:
    r"""Render ``value`` as Go's ``%q`` does, so error strings match the kubelet's byte for byte.

    Go's ``strconv.Quote`` uses double quotes and escapes ``"``, ``\`` and
    non-printable characters; printable Unicode stays as it is.
    """
    return '"' + "".join(_go_escape(ch) for ch in value) + '"'
