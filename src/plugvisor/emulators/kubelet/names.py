"""The kubelet's own name rules and Go's quoting, written from upstream for the emulator alone.

The framework checks resource names too (to fail early, with a friendlier
message), but the emulator must not borrow that code: a wrong rule there would
then be "confirmed" by the emulator that is supposed to catch it. So this module
is an independent transcription of the upstream sources, and
``tests/unit/test_name_rules_agree.py`` holds both copies against the same
upstream vectors. An import-linter contract keeps the emulator from importing
the framework's rule module (``plugvisor.common.names``).

Upstream sources (``kubernetes/kubernetes``):

* ``pkg/apis/core/v1/helper/helpers.go``: ``IsExtendedResourceName``,
  ``IsNativeResource``, ``IsPrefixedNativeResource``;
* ``staging/src/k8s.io/apimachinery/pkg/util/validation/validation.go``:
  ``IsQualifiedName``, ``IsDNS1123Label``, ``IsDNS1123Subdomain`` and their
  error texts (which the API server's manifest validation reports);
* Go's ``strconv.Quote`` for every ``%q`` in the kubelet's error strings.

Go's regexp matches the whole string with ``^...$`` and, unlike Python's ``$``,
never accepts a trailing newline, hence ``fullmatch`` throughout.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Final

DNS1123_LABEL_MAX_LENGTH: Final = 63
DNS1123_SUBDOMAIN_MAX_LENGTH: Final = 253
QUALIFIED_NAME_MAX_LENGTH: Final = 63

_LABEL_FMT: Final = "[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_SUBDOMAIN_FMT: Final = _LABEL_FMT + r"(\." + _LABEL_FMT + ")*"
_QUALIFIED_NAME_FMT: Final = "([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"

_LABEL: Final = re.compile(_LABEL_FMT)
_SUBDOMAIN: Final = re.compile(_SUBDOMAIN_FMT)
_QUALIFIED_NAME: Final = re.compile(_QUALIFIED_NAME_FMT)

_NATIVE_DOMAIN: Final = "kubernetes.io/"
_QUOTA_PREFIX: Final = "requests."


def _regex_error(message: str, fmt: str, *examples: str) -> str:
    """``validation.RegexError``: the message, examples, and the regular expression used.

    Upstream appends ``'example', `` per example and joins them with `` or ``,
    which leaves two spaces before each "or"; kept, since users grep for it.
    """
    shown = " or ".join(f"'{example}', " for example in examples)
    return f"{message} (e.g. {shown}regex used for validation is '{fmt}')"


def dns1123_label_errors(value: str) -> list[str]:
    """``IsDNS1123Label``: empty when ``value`` is a DNS-1123 label, else the API server's reasons."""
    errors: list[str] = []
    if len(value) > DNS1123_LABEL_MAX_LENGTH:
        errors.append(f"must be no more than {DNS1123_LABEL_MAX_LENGTH} characters")
    if not _LABEL.fullmatch(value):
        errors.append(
            _regex_error(
                "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', "
                "and must start and end with an alphanumeric character",
                _LABEL_FMT,
                "my-name",
                "123-abc",
            )
        )
    return errors


def dns1123_subdomain_errors(value: str) -> list[str]:
    """``IsDNS1123Subdomain``: empty when ``value`` is a DNS-1123 subdomain, else the reasons."""
    errors: list[str] = []
    if len(value) > DNS1123_SUBDOMAIN_MAX_LENGTH:
        errors.append(f"must be no more than {DNS1123_SUBDOMAIN_MAX_LENGTH} characters")
    if not _SUBDOMAIN.fullmatch(value):
        errors.append(
            _regex_error(
                "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, "
                "'-' or '.', and must start and end with an alphanumeric character",
                _SUBDOMAIN_FMT,
                "example.com",
            )
        )
    return errors


def qualified_name_errors(value: str) -> list[str]:
    """``IsQualifiedName``: ``[prefix/]name``, a DNS-1123 subdomain prefix and a 1-63 character name."""
    parts = value.split("/")
    if len(parts) == 1:
        prefix, name = None, parts[0]
    elif len(parts) == 2:
        prefix, name = parts
    else:
        return [
            _regex_error(
                "a qualified name must consist of alphanumeric characters, '-', '_' or '.', "
                "and must start and end with an alphanumeric character",
                _QUALIFIED_NAME_FMT,
                "MyName",
                "my.name",
                "123-abc",
            )
            + " with an optional DNS subdomain prefix and '/' (e.g. 'example.com/MyName')"
        ]
    errors: list[str] = []
    if prefix is not None:
        if not prefix:
            errors.append("prefix part must be non-empty")
        else:
            errors.extend("prefix part " + message for message in dns1123_subdomain_errors(prefix))
    if not name:
        errors.append("name part must be non-empty")
    elif len(name) > QUALIFIED_NAME_MAX_LENGTH:
        errors.append(f"name part must be no more than {QUALIFIED_NAME_MAX_LENGTH} characters")
    if not _QUALIFIED_NAME.fullmatch(name):
        errors.append(
            "name part "
            + _regex_error(
                "must consist of alphanumeric characters, '-', '_' or '.', "
                "and must start and end with an alphanumeric character",
                _QUALIFIED_NAME_FMT,
                "MyName",
                "my.name",
                "123-abc",
            )
        )
    return errors


def is_native_resource(name: str) -> bool:
    """``IsNativeResource``: no domain at all, or a ``kubernetes.io/`` one anywhere in the name."""
    return "/" not in name or _NATIVE_DOMAIN in name


def is_extended_resource_name(name: str) -> bool:
    """``IsExtendedResourceName``: not native, not a quota name, and ``requests.<name>`` is qualified."""
    if is_native_resource(name) or name.startswith(_QUOTA_PREFIX):
        return False
    return not qualified_name_errors(_QUOTA_PREFIX + name)


def go_quote(value: str) -> str:
    r"""``strconv.Quote``, as every ``%q`` in the kubelet's messages renders a string.

    Double quotes; ``\a \b \f \n \r \t \v``, ``\\`` and ``\"`` escaped by name;
    other characters Go does not consider printable as ``\xNN`` (below 0x80),
    ``\uNNNN`` or ``\UNNNNNNNN``; printable Unicode kept as it is.
    """
    out = ['"']
    for ch in value:
        if ch in _NAMED_ESCAPES:
            out.append(_NAMED_ESCAPES[ch])
        elif _go_printable(ch):
            out.append(ch)
        elif ord(ch) < 0x80:
            out.append(f"\\x{ord(ch):02x}")
        elif ord(ch) <= 0xFFFF:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(f"\\U{ord(ch):08x}")
    out.append('"')
    return "".join(out)


def go_quote_list(values: tuple[str, ...] | list[str]) -> str:
    """A ``[]string`` under ``%q``: each element quoted, space-separated, in brackets."""
    return "[" + " ".join(go_quote(value) for value in values) + "]"


def go_list(values: tuple[str, ...] | list[str]) -> str:
    """A ``[]string`` under ``%v``: elements as they are, space-separated, in brackets."""
    return "[" + " ".join(values) + "]"


_NAMED_ESCAPES: Final = {
    "\a": "\\a",
    "\b": "\\b",
    "\f": "\\f",
    "\n": "\\n",
    "\r": "\\r",
    "\t": "\\t",
    "\v": "\\v",
    "\\": "\\\\",
    '"': '\\"',
}


def _go_printable(ch: str) -> bool:
    """``strconv.IsPrint``: letters, marks, numbers, punctuation, symbols and the ASCII space."""
    if ch == " ":
        return True
    return unicodedata.category(ch)[0] in "LMNPS"
