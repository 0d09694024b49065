"""Turning validation failures into one clear message that names the input and the field.

pydantic's own rendering is written for developers (URLs, input reprs on
separate lines); operators reading a systemd journal need
``node.yaml: resources[0].count: Input should be greater than or equal to 1``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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
