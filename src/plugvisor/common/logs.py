r"""Structured logging for every plugvisor process: one line per event, ``key=value`` or JSON.

Under ``plugvisor run`` the agent and all its children write to the same
standard error, so a record must reach it whole: each one is rendered to a
single line (the renderers escape newlines, tracebacks included) and written
with one ``write(2)`` of the whole line. Python's ``print`` writes the text and
the newline separately, and when standard error is unbuffered (``python -u``,
``PYTHONUNBUFFERED``) two processes' records then interleave mid-line; a log
shipper reading JSON lines chokes on the result. The kernel keeps a single
write to a pipe of up to ``PIPE_BUF`` (4096) bytes in one piece, and a single
write to a file in one piece at the file's offset.

structlog's filtering bound logger makes a disabled level cost one method call,
which matters on the Allocate path (allocations are logged at debug).

Many fields carry input from outside (claim names and UIDs from the kubelet,
device names and paths from files, errors from the other side of a socket), so
every field is cut to :data:`MAX_LOG_FIELD` characters, saying how long it was,
as errors are: a megabyte claim name must not make a megabyte line. The
renderers escape control characters (``repr`` in key=value, ``\uXXXX`` escapes in JSON).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
from collections.abc import Callable
from typing import Any, Final, Literal, TextIO

import click
import structlog

from plugvisor.common.validation import shorten

MAX_LOG_FIELD: Final = 1000
"""The most characters of one field a log line carries; the rest is cut (:func:`cut_long_fields`)."""

LogFormat = Literal["kv", "json"]
LOG_LEVELS: Final = ("debug", "info", "warning", "error")


class LineWriter:
    """A structlog logger that writes each rendered record as one line in one write.

    When the stream has a file descriptor the line goes straight to it with
    ``os.write`` (retried for the rest after a partial write, which only a
    signal or a line longer than the pipe's buffer causes); a stream without one
    (pytest's capture, an ``io.StringIO``) gets the whole line in one ``write``
    call. Logging never raises: a closed or full standard error loses the line.
    """

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        try:
            self._fd: int | None = stream.fileno()
        except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
            self._fd = None

    def msg(self, message: str) -> None:
        """Write one record."""
        line = message + "\n"
        with contextlib.suppress(OSError, ValueError):
            if self._fd is None:
                self._stream.write(line)
                self._stream.flush()
                return
            # Whatever Python buffered for this stream must come out first, to keep the order.
            self._stream.flush()
            data = line.encode(errors="backslashreplace")
            while data:
                written = os.write(self._fd, data)
                data = data[written:]

    log = debug = info = warn = warning = error = err = critical = exception = fatal = failure = msg


class _StdlibBridge(logging.Handler):
    """Records of the standard library's loggers (asyncio's above all) as plugvisor's own lines.

    asyncio reports what it cannot hand to anyone (an exception in a connection
    callback, a task nobody awaited) through ``logging``, which by default prints a
    multi-line traceback in plain text: a log shipper reading ``--log-format json``
    then gets lines that are not JSON. Here such a record is one structlog event,
    its traceback inside (escaped onto the line).
    """

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):  # logging must never raise
            structlog.get_logger(record.name).log(
                record.levelno, record.getMessage(), logger=record.name, exc_info=record.exc_info or False
            )


def cut_long_fields(
    _logger: object, _method: str, event_dict: structlog.typing.EventDict
) -> structlog.typing.EventDict:
    """A structlog processor: every field longer than :data:`MAX_LOG_FIELD` cut, saying how long it was.

    A container (a list of device IDs, a mapping) over the limit becomes the
    start of its ``repr``. Tracebacks are not fields yet when this runs
    (``exc_info`` is rendered after it), so they stay whole.
    """
    for key, value in event_dict.items():
        if isinstance(value, str):
            if len(value) > MAX_LOG_FIELD:
                event_dict[key] = shorten(value, MAX_LOG_FIELD)
        elif isinstance(value, list | tuple | dict | set | frozenset):
            shown = repr(value)
            if len(shown) > MAX_LOG_FIELD:
                event_dict[key] = shorten(shown, MAX_LOG_FIELD)
    return event_dict


_last_error: str | None = None


def note_error(text: str) -> None:
    """Remember ``text`` as this process's latest error (what it says to its agent when it fails).

    Every error-level log record is noted this way; messages written otherwise
    (a command's usage error printed by click) are noted by their writer.
    """
    global _last_error  # noqa: PLW0603 - one per process, like the process's standard error
    _last_error = "; ".join(line.strip() for line in text.splitlines() if line.strip())[:2000]


def last_error() -> str | None:
    """The latest error this process logged or noted (see :func:`note_error`), if any."""
    return _last_error


def remember_errors(
    _logger: object, method: str, event_dict: structlog.typing.EventDict
) -> structlog.typing.EventDict:
    """A structlog processor: an error-level record is noted as ``event: error`` (:func:`note_error`)."""
    if method in ("error", "critical", "exception", "fatal"):
        error = event_dict.get("error")
        note_error(f"{event_dict.get('event')}: {error}" if error else str(event_dict.get("event")))
    return event_dict


def configure_logging(*, level: str = "info", fmt: LogFormat = "kv", stream: TextIO | None = None) -> None:
    """Configure structlog for a plugvisor process (idempotent; last call wins).

    ``stream`` defaults to the process's standard error at the time of the call.
    The standard library's loggers (asyncio's, gRPC's Python side) go through it too.
    """
    numeric = logging.getLevelNamesMapping().get(level.upper())
    if numeric is None:
        raise ValueError(f"log level {level!r} is not one of {', '.join(LOG_LEVELS)}")
    renderer: structlog.typing.Processor
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer(sort_keys=False)
    else:
        renderer = structlog.processors.KeyValueRenderer(
            key_order=["ts", "level", "event"], drop_missing=True
        )
    writer = LineWriter(sys.stderr if stream is None else stream)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            cut_long_fields,
            remember_errors,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True, key="ts"),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=lambda *_args: writer,
        cache_logger_on_first_use=False,
    )
    root = logging.getLogger()
    root.handlers = [handler for handler in root.handlers if not isinstance(handler, _StdlibBridge)]
    root.addHandler(_StdlibBridge(logging.WARNING))


def log_options(*, scope: str = "") -> Callable[[Any], Any]:
    """The ``--log-level`` and ``--log-format`` options every long-running command shares."""
    suffix = f", {scope}" if scope else ""

    def decorate(func: Any) -> Any:
        func = click.option(
            "--log-format",
            type=click.Choice(["kv", "json"]),
            default="kv",
            show_default=True,
            help="One line per event, key=value or JSON.",
        )(func)
        return click.option(
            "--log-level",
            type=click.Choice(LOG_LEVELS),
            default="info",
            show_default=True,
            help=f"Least severe log level printed (to stderr){suffix}.",
        )(func)

    return decorate
