"""Logging set-up: structlog on top of the standard library, one line per event."""

from __future__ import annotations

import logging
import sys
from typing import Any

import msgspec
import structlog

# The loggers litellm gives a handler of its own when imported (proxy/upstream/litellm.py
# takes it away: their records come here).
LITELLM_LOGGERS = ("LiteLLM", "LiteLLM Router", "LiteLLM Proxy")


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
    stamp = structlog.processors.TimeStamper(fmt="iso", utc=True)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            stamp,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    # The standard library's records (uvicorn, Alembic, asyncio, their tracebacks) in the same
    # format: one JSON object per line, with the logger's name.
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[
            structlog.stdlib.add_logger_name,
            structlog.stdlib.add_log_level,
            stamp,
            _drop_color_message,
        ],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            renderer,
        ],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)
    logging.captureWarnings(True)  # (warnings too, as records of `py.warnings`)
    # Warnings and errors only, whatever the level: httpx logs every upstream request at
    # info (the access line has what matters), and at debug httpcore, hpack and litellm log
    # the requests themselves, message content included (`server.log_content` decides that).
    for name in ("httpx", "httpcore", "hpack", *LITELLM_LOGGERS):
        logging.getLogger(name).setLevel(max(numeric, logging.WARNING))


def _drop_color_message(_: Any, __: str, event: structlog.types.EventDict) -> Any:
    """uvicorn repeats its message, with terminal colours, as `color_message`."""
    event.pop("color_message", None)
    return event
