"""Turning an `UpstreamReply` into the client's response, streams relayed as they arrive."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import structlog
from litestar import Request, Response
from litestar.response import Stream

from proxy.access import log_access, request_info
from proxy.errors import ProxyError, sse_error_event
from proxy.upstream.base import UpstreamReply

log = structlog.get_logger("memproxy.relay")
_STREAM_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def to_response(request: Request[Any, Any, Any], reply: UpstreamReply) -> Response[Any]:
    if reply.chunks is None:
        return Response(
            content=reply.body or b"",
            status_code=reply.status,
            headers=reply.headers,
            media_type=reply.media_type,
        )
    headers = (
        {**reply.headers, **_STREAM_HEADERS}
        if reply.media_type.startswith("text/event-stream")
        else reply.headers
    )
    return Stream(
        relay(request, reply.chunks),
        status_code=reply.status,
        headers=headers,
        media_type=reply.media_type,
    )


async def relay(
    request: Request[Any, Any, Any], chunks: AsyncIterator[bytes]
) -> AsyncIterator[bytes]:
    """Pass chunks on unchanged; a failure after the first byte becomes a final error event.

    Closing this generator (the client went away) closes the upstream iterator, which closes
    the upstream connection and so cancels the upstream request.
    """
    info = request_info(request.scope)
    try:
        async for chunk in chunks:
            yield chunk
    except ProxyError as exc:
        info.outcome = "upstream_error"
        log.warning("stream_broken", request_id=info.request_id, error=exc.message)
        yield sse_error_event(exc)
    except (asyncio.CancelledError, GeneratorExit):
        info.outcome = "client_disconnected"
        log_access(request.scope, info)
        raise
    finally:
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()
