"""Turning validation failures into one clear message that names the input and the field.

pydantic's own rendering is written for developers (URLs, input reprs on
separate lines); operators reading a systemd journal need
``node.yaml: resources[0].count: Input should be greater than or equal to 1``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # only annotations: readers of YAML files (the agent's first lines) need no pydantic
    import pydantic


def shorten(text: str, limit: int = 80) -> str:
    """``text`` cut to ``limit`` characters, saying how long it was.

    Every error that echoes input goes through this: a 20 MB resource name must
    give a one-line error, and a gRPC status must stay far below the 4 MiB
    message limit (else the caller sees RESOURCE_EXHAUSTED, not the error).
    """
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def printable(text: str) -> str:
    r"""``text`` with every character a terminal would act on written as an escape.

    A newline becomes ``\n``, ESC ``\x1b``, a right-to-left override ``\u202e``, the way
    ``/metrics`` escapes label values. Pod, namespace and container names come from the
    kubelet, device IDs and causes from plugins: what ``plugvisor status`` prints must not
    move the cursor, clear the screen or reorder the text of the operator's terminal.
    """
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else char.encode("unicode_escape").decode() for char in text)


def field_path(loc: tuple[int | str, ...]) -> str:
    """Render a pydantic error location as ``a.b[0].c`` using the user's key names."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.startswith(("function-after", "function-before")):
            continue
        else:
            out += f".{part}" if out else part
    return out or "(top level)"


def describe(error: pydantic.ValidationError, *, source: str) -> str:
    """One line per problem, each naming ``source`` and the field, with what was expected."""
    lines = []
    for item in error.errors(include_url=False):
        where = field_path(tuple(item["loc"]))
        message = item["msg"]
        if item["type"] == "extra_forbidden":
            message = "unknown key (check the spelling; unknown keys are errors)"
        elif item["type"] == "missing":
            message = "required key is missing"
        lines.append(f"{source}: {where}: {message}")
    return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class HugeInteger:
    """Stands in for an integer written with more digits than Python converts.

    CPython refuses to convert a decimal string of more than
    ``sys.get_int_max_str_digits()`` digits (4300 by default: the conversion is
    quadratic, a denial of service) with a ``ValueError`` that every reader of a
    file would have to catch. The readers of operator-written YAML and JSON put
    this marker where the integer was, and turn it into one error naming the
    field once the document is whole.
    """

    digits: int
    line: int | None = None
    """1-based line in the file (YAML only: Python's JSON decoder does not say where)."""
    column: int | None = None


def json_integer(text: str) -> int | HugeInteger:
    """``json.loads(..., parse_int=json_integer)``: an integer, or a :class:`HugeInteger` past the limit."""
    try:
        return int(text)
    except ValueError:
        return HugeInteger(len(text.lstrip("+-")))


def huge_integer_problem(data: Any) -> str | None:
    """``field: an integer of N digits...`` for the first :class:`HugeInteger` in ``data``, else None."""
    stack: list[tuple[tuple[int | str, ...], Any]] = [((), data)]
    while stack:
        loc, item = stack.pop()
        if isinstance(item, HugeInteger):
            return _huge_message(loc, item)
        if isinstance(item, dict):
            for key, value in item.items():
                if isinstance(key, HugeInteger):
                    return _huge_message(loc, key)
                stack.append(((*loc, str(key)), value))
        elif isinstance(item, list):
            stack.extend(((*loc, index), value) for index, value in enumerate(item))
    return None


def _huge_message(loc: tuple[int | str, ...], huge: HugeInteger) -> str:
    where = f"line {huge.line}, column {huge.column}: " if huge.line is not None else ""
    limit = sys.get_int_max_str_digits()
    return (
        f"{field_path(loc)}: {where}an integer of {huge.digits} digits; expected a number of at most "
        f"{limit} digits"
    )
