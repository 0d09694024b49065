"""Resource names as Intel's and Xilinx's FPGA plugins form them, kept valid extended resource names.

Pure functions (no I/O): :func:`intel_af_resource` is Intel's ``GetAfuDevType``
(``af-<if[:3]>.<afu[:3]>.<base64url(ifid ++ afuid)>``, 54 characters, so it fits
the 63-character name part), :func:`intel_region_resource` is
``region-<interface id>``, :func:`xilinx_resource` is ``<VBNV>-<timestamp>``.
Any name part that would be invalid (too long, or characters a qualified name
refuses) is shortened to a valid prefix plus a hash of the full name, so two
shells never share a name.
"""

from __future__ import annotations

import base64
import hashlib
import re
from typing import Final

from plugvisor.common.names import extended_resource_name_problem

INTEL_DOMAIN: Final = "fpga.intel.com"
XILINX_DOMAIN: Final = "amd.com"
_MAX_NAME: Final = 63
_UNSAFE: Final = re.compile(r"[^A-Za-z0-9_.-]")


def _hex128(value: str, what: str) -> str:
    text = value.strip().lower().removeprefix("0x")
    if len(text) != 32 or any(c not in "0123456789abcdef" for c in text):
        raise ValueError(f"{what} {value!r} is not 32 hex digits")
    return text


def valid_name_part(name: str) -> str:
    """``name`` if it is a valid name part, else a valid one: safe characters, a hash suffix if changed."""
    cleaned = _UNSAFE.sub("_", name).strip("-_.")
    if cleaned == name and 0 < len(name) <= _MAX_NAME:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:10]
    head = cleaned[: _MAX_NAME - len(digest) - 1].rstrip("-_.")
    return f"{head}-{digest}" if head else digest


def _join(domain: str, name: str) -> str:
    full = f"{domain}/{valid_name_part(name)}"
    problem = extended_resource_name_problem(full)
    if problem is not None:
        raise ValueError(problem)
    return full


def intel_af_resource(interface_id: str, afu_id: str, *, domain: str = INTEL_DOMAIN) -> str:
    """Intel's ``af`` mode resource: ``fpga.intel.com/af-<if[:3]>.<afu[:3]>.<base64url(if+afu)>``."""
    ifid = _hex128(interface_id, "interface ID")
    afu = _hex128(afu_id, "AFU ID")
    encoded = base64.urlsafe_b64encode(bytes.fromhex(ifid + afu)).decode().rstrip("=")
    return _join(domain, f"af-{ifid[:3]}.{afu[:3]}.{encoded}")


def intel_region_resource(interface_id: str, *, domain: str = INTEL_DOMAIN) -> str:
    """Intel's ``region`` mode resource: ``fpga.intel.com/region-<interface id>``."""
    return _join(domain, f"region-{_hex128(interface_id, 'interface ID')}")


def xilinx_resource(vbnv: str, timestamp: str, *, domain: str = XILINX_DOMAIN) -> str:
    """Xilinx's resource: ``amd.com/<VBNV>-<timestamp>`` (shortened with a hash when invalid)."""
    return _join(domain, f"{vbnv}-{timestamp}")


def decode_af_resource(name: str) -> tuple[str, str] | None:
    """``(interface ID, AFU ID)`` from an ``af-`` resource name (with or without domain), else ``None``."""
    part = name.rsplit("/", 1)[-1]
    pieces = part.split(".", 2)
    if len(pieces) != 3 or not pieces[0].startswith("af-"):
        return None
    try:
        raw = base64.urlsafe_b64decode(pieces[2] + "=" * (-len(pieces[2]) % 4))
    except ValueError:
        return None
    if len(raw) != 32:
        return None
    return raw[:16].hex(), raw[16:].hex()
