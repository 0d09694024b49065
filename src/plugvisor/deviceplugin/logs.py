"""Structured logging: one line per event, ``key=value`` by default or JSON on request.

structlog's filtering bound logger makes a disabled level cost one method call,
which matters on the Allocate path (allocations are logged at debug).
"""

from __future__ import annotations

import logging
import sys
from typing import Literal

import structlog

LogFormat = Literal["kv", "json"]


def configure_logging(*, level: str = "info", fmt: LogFormat = "kv") -> None:
    """Configure structlog for a plugvisor process (idempotent; last call wins)."""
    numeric = logging.getLevelNamesMapping().get(level.upper())
    if numeric is None:
        raise ValueError(f"log level {level!r} is not one of debug, info, warning, error")
    renderer: structlog.typing.Processor
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer(sort_keys=False)
    else:
        renderer = structlog.processors.KeyValueRenderer(
            key_order=["ts", "level", "event"], drop_missing=True
        )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True, key="ts"),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
