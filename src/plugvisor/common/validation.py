"""Turning validation failures into one clear message that names the input and the field.

pydantic's own rendering is written for developers (URLs, input reprs on
separate lines, a "Value error, " before every message our validators raise);
operators reading a systemd journal need
``node.yaml: resources[0].count: Input should be greater than or equal to 1``.
A key nobody knows is most often a typo, so its error names the nearest known
key of the same mapping (``unknown key; did you mean `match`?``). Every reader
of an operator-written file (node.yaml, ``--options-file``, lab profiles)
renders its errors through :func:`problem`.
"""

from __future__ import annotations

import difflib
import os
import sys
import types
import typing
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:  # only annotations: readers of YAML files (the agent's first lines) need no pydantic
    import pydantic
    from pydantic_core import ErrorDetails

_PREFIXES = ("Value error, ", "Assertion failed, ")
"""What pydantic puts before the message of a ``ValueError`` or ``assert`` raised by a validator."""


def shorten(text: str, limit: int = 80) -> str:
    """``text`` cut to ``limit`` characters, saying how long it was.

    Every error that echoes input goes through this: a 20 MB resource name must
    give a one-line error, and a gRPC status must stay far below the 4 MiB
    message limit (else the caller sees RESOURCE_EXHAUSTED, not the error).
    """
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


MAX_PATH_BYTES: Final = 4096
"""Linux's PATH_MAX: no longer path can be opened."""


def path_problem(text: str) -> str | None:
    """Why ``text`` is no absolute path the kernel can open (NUL, control character, too long), or None.

    Every path a person writes in a configuration goes through this before anything uses it: a NUL
    would otherwise surface later as a ``ValueError`` from ``os.stat`` or a path that never matches,
    and a line break is always a slip (and would break out of an exported supervisord line).
    """
    if "\x00" in text:
        return f"{shorten(text)!r} contains a NUL byte"
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in text):
        return f"{shorten(text)!r} contains a control character (a line break?)"
    if len(os.fsencode(text)) > MAX_PATH_BYTES:
        return f"{shorten(text)!r} is longer than {MAX_PATH_BYTES} bytes (PATH_MAX)"
    if not text.startswith("/"):
        return f"{shorten(text)!r} must be an absolute path"
    return None


def absolute_path(value: str) -> str:
    """A kind's absolute path option (a pydantic ``AfterValidator``): :func:`path_problem`, and no ``..``."""
    problem = path_problem(value)
    if problem is None and ".." in PurePosixPath(value).parts:
        problem = f"{shorten(value)!r} must not contain '..'"
    if problem is not None:
        raise ValueError(problem)
    return value


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


def bounded(text: str, limit: int = 80) -> str:
    """Input from outside as it may be shown: cut as errors are (:func:`shorten`), then escaped.

    Claim names and UIDs from the kubelet, names and paths read from files
    others write, errors from the other side of a socket: anything printed in a
    log field, a status line or a gRPC answer goes through this, so that a
    megabyte name gives a line of a few hundred characters and no control
    character reaches a terminal or a log shipper.
    """
    return printable(shorten(text, limit))


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


def unknown_key(key: object, known: Iterable[str] = ()) -> str:
    """The message for a key nobody expects, with the nearest known key when one is close."""
    close = difflib.get_close_matches(str(key), list(known), n=1, cutoff=0.6) if isinstance(key, str) else []
    return f"unknown key; did you mean `{close[0]}`?" if close else "unknown key (check the spelling)"


def _models_in(annotation: Any) -> list[type[pydantic.BaseModel]]:
    """The pydantic models an annotation can hold, looking through Optional, Annotated, unions."""
    import pydantic  # noqa: PLC0415 - loaded already: a ValidationError is being rendered

    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return [annotation]
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _models_in(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]
    return []


def _item_type(annotation: Any) -> Any:
    """The element type of a list/tuple/sequence annotation (or of the mapping's values)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _item_type(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = _item_type(arg)
            if found is not None:
                return found
        return None
    args = typing.get_args(annotation)
    return args[-1] if origin is not None and args else None


def known_keys(model: Any, loc: Sequence[int | str]) -> list[str]:
    """The keys ``model`` accepts in the mapping at ``loc``, spelled as the user writes them (aliases).

    ``model`` is what was validated: a pydantic model, or a type such as ``list[Model]``.
    """
    annotation: Any = model
    for part in loc:
        if isinstance(part, int):
            annotation = _item_type(annotation)
            continue
        models = _models_in(annotation)
        if not models:
            annotation = _item_type(annotation)  # a mapping's value
            continue
        fields = {
            key: info
            for m in models
            for name, info in m.model_fields.items()
            for key in (info.alias, name)
            if key
        }
        if part not in fields:
            return []
        annotation = fields[part].annotation
    return [info.alias or name for m in _models_in(annotation) for name, info in m.model_fields.items()]


def problem(item: ErrorDetails, model: Any = None) -> str:
    """One error's message in the user's words: no pydantic prefix, the nearest key for an unknown one."""
    kind = item["type"]
    if kind == "extra_forbidden":
        loc = tuple(item["loc"])
        known = known_keys(model, loc[:-1]) if model is not None and loc else []
        return unknown_key(loc[-1] if loc else "", known)
    if kind == "missing":
        return "required key is missing"
    message = item["msg"]
    for prefix in _PREFIXES:
        message = message.removeprefix(prefix)
    return message


def describe(error: pydantic.ValidationError, *, source: str, model: Any = None) -> str:
    """One line per problem, each naming ``source`` and the field, with what was expected.

    ``model`` is the model that was validated, so that an unknown key can be
    matched against the keys its mapping accepts.
    """
    return "\n".join(
        f"{source}: {field_path(tuple(item['loc']))}: {problem(item, model)}"
        for item in error.errors(include_url=False)
    )


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
