"""Logging set-up: structlog on top of the standard library, one line per event."""

from __future__ import annotations

import logging
import sys
from typing import Any

import msgspec
import structlog


def _json(event: Any, **_: Any) -> str:
    return msgspec.json.encode(event, enc_hook=str).decode()


def configure_logging(level: str = "info", fmt: str = "auto") -> None:
    """`fmt` is `json`, `console`, or `auto` (console on a terminal, JSON otherwise)."""
    if fmt == "auto":
        fmt = "console" if sys.stderr.isatty() else "json"
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer(serializer=_json)
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    numeric = logging.getLevelName(level.upper())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(
        level=numeric, stream=sys.stderr, format="%(levelname)s %(name)s %(message)s"
    )
    # httpx logs every upstream request at INFO; the access line already has what matters.
    logging.getLogger("httpx").setLevel(max(numeric, logging.WARNING))
