"""Reading the YAML files an operator writes: bounded, strict, and every failure names the file.

A node configuration or a kind's options file is a few kilobytes written by a
person. What can go wrong with one is mostly a slip (a key written twice, a
byte that is not UTF-8, the wrong path given) and sometimes worse (a FIFO that
would block a reader forever, a multi-gigabyte file, an alias "billion laughs"
that expands to more values than memory holds). Each of these is turned into a
:class:`YamlFileError` whose message names the file, and where it can, the
line and the key, before anything else looks at the content.

Duplicate keys are errors because PyYAML silently keeps the last one: with
``count: 1`` and ``count: 5`` in one entry, which did the operator mean? Unknown
keys are already errors; a repeated one deserves the same.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path
from typing import Any, Final

import yaml

from plugvisor.common.validation import HugeInteger, huge_integer_problem, printable, shorten

MAX_FILE_BYTES: Final = 1 << 20
"""Largest file read (1 MiB): a node configuration of hundreds of resources is tens of kilobytes."""

MAX_VALUES: Final = 100_000
"""Most values (scalars, lists, mappings) a document may hold once aliases are expanded."""

MAX_DEPTH: Final = 100
"""Deepest nesting of lists and mappings: a configuration nests a handful of levels. PyYAML composes
nodes recursively, so a 2 KB file of brackets would otherwise end in a RecursionError (the C loader in a
segmentation fault) instead of an error naming the file."""

_MERGE_TAG: Final = "tag:yaml.org,2002:merge"


class YamlFileError(ValueError):
    """The file cannot be used; the message names it (and the line and key when known)."""


class BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, where a value its constructors cannot build is an error with a line.

    PyYAML's own constructors raise bare ``ValueError``, ``KeyError`` or
    ``AttributeError`` from deep inside for ``date: 2024-13-01``, ``!!int abc`` or
    ``!!bool maybe``, with no position: every such value becomes a
    :class:`yaml.constructor.ConstructorError` at its line and column. An integer
    too long for Python to convert becomes a
    :class:`~plugvisor.common.validation.HugeInteger`, so that
    :func:`~plugvisor.common.validation.huge_integer_problem` can name its field.
    """

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        """PyYAML's, with a constructor's bare exception turned into an error at the node's position."""
        try:
            return super().construct_object(node, deep=deep)
        except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as exc:
            kind = str(node.tag).rsplit(":", 1)[-1]
            value = shorten(str(node.value), 40) if isinstance(node, yaml.ScalarNode) else "this value"
            # A ValueError says why ("month must be in 1..12"); the others only how PyYAML tripped.
            why = f" ({shorten(str(exc))})" if type(exc) is ValueError else ""
            raise yaml.constructor.ConstructorError(
                None, None, f"{value!r} is not a valid {kind}{why}", node.start_mark
            ) from None

    def construct_bounded_int(self, node: yaml.ScalarNode) -> int | HugeInteger:
        """PyYAML's integer, or a :class:`~plugvisor.common.validation.HugeInteger` past Python's limit."""
        try:
            value: int = self.construct_yaml_int(node)
        except ValueError:
            digits = sum(char.isdigit() for char in str(node.value))
            if digits <= sys.get_int_max_str_digits():
                raise
            return HugeInteger(digits, node.start_mark.line + 1, node.start_mark.column + 1)
        return value


BoundedLoader.add_constructor("tag:yaml.org,2002:int", BoundedLoader.construct_bounded_int)


class _StrictLoader(BoundedLoader):
    """The bounded loader, refusing a repeated key and nesting deeper than :data:`MAX_DEPTH`."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]
                problem = f"nested more than {MAX_DEPTH} levels deep"
                raise yaml.composer.ComposerError(None, None, problem, mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == _MERGE_TAG:
                    continue  # `<<: *defaults` keys are meant to be overridden by the mapping's own
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:
                    continue  # an unhashable key: PyYAML's own check reports it
                if first is not None:
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"duplicate key {shorten(str(key))!r} (first at line {first})",
                        key_node.start_mark,
                    )
                seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def _count_values(data: Any, budget: int) -> int:
    """Count values as a consumer walking the document would meet them (aliases counted each time)."""
    stack = [data]
    count = 0
    while stack:
        item = stack.pop()
        count += 1
        if count > budget:
            break
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return count


def parse_yaml(text: str, *, source: str) -> Any:
    """Parse one YAML document strictly: no repeated key, no integer too long to convert, bounded size."""
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = exc.problem or str(exc)
        raise YamlFileError(f"{source}: {where}not valid YAML: {problem}") from None
    except yaml.YAMLError as exc:
        raise YamlFileError(f"{source}: not valid YAML: {shorten(str(exc), 300)}") from None
    if _count_values(data, MAX_VALUES) > MAX_VALUES:
        raise YamlFileError(
            f"{source}: more than {MAX_VALUES} values once anchors and aliases are expanded; "
            "a configuration file this large is a mistake"
        )
    huge = huge_integer_problem(data)
    if huge is not None:
        raise YamlFileError(f"{source}: {huge}")
    return data


def read_yaml(path: Path) -> Any:
    """Read and parse the YAML file at ``path``: a regular file of at most 1 MiB of UTF-8 text."""
    shown = shorten(printable(str(path)), 200)  # input too: no escape reaches a terminal
    try:
        # O_NONBLOCK: a FIFO given by mistake must be refused, not block the reader forever.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise YamlFileError(f"{shown}: cannot read: {exc.strerror or exc}") from None
    except ValueError as exc:  # an embedded NUL
        raise YamlFileError(f"{shown}: cannot read: {exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
            raise YamlFileError(f"{shown}: cannot read: {kind}; expected a YAML file")
        with os.fdopen(os.dup(fd), "rb") as handle:
            raw = handle.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise YamlFileError(f"{shown}: cannot read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(raw) > MAX_FILE_BYTES:
        raise YamlFileError(f"{shown}: larger than {MAX_FILE_BYTES // 1024} KiB; expected a YAML file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        byte = raw[exc.start]
        raise YamlFileError(
            f"{shown}: line {line}, column {column}: byte 0x{byte:02x} is not UTF-8; expected UTF-8 YAML text"
        ) from None
    return parse_yaml(text, source=shown)
