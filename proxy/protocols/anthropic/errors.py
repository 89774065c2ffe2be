"""Errors on the Anthropic route in Anthropic's own shape: `{"type": "error", "error": {"type",
"message"}}`, with the status the rest of the proxy would answer. The proxy's one error
mapping (proxy/core/errors.py) decides the status, records the failure and adds the headers;
this only re-shapes its body."""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Request, Response
from litestar.types import ExceptionHandlersMap

from proxy.core.errors import EXCEPTION_HANDLERS, UpstreamStatusError
from proxy.protocols.anthropic.from_chat import as_error_body, error_body


def anthropic_error(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    """The response the proxy's own handler gives `exc`, its body in Anthropic's shape."""
    handler = next(
        h for t, h in EXCEPTION_HANDLERS.items() if isinstance(t, type) and isinstance(exc, t)
    )
    response: Response[Any] = handler(request, exc)
    try:
        payload = msgspec.json.decode(response.content)
    except (ValueError, TypeError):
        payload = None
    status = response.status_code or 500
    if isinstance(exc, UpstreamStatusError):
        body = as_error_body(status, exc.payload)
    else:
        error = payload.get("error") if isinstance(payload, dict) else None
        message = error.get("message") if isinstance(error, dict) else None
        body = error_body(status, message if isinstance(message, str) else "Request failed.")
    return Response(
        content=msgspec.json.encode(body),
        status_code=status,
        headers=dict(response.headers),
        media_type="application/json",
    )


# Every type the proxy's own map names (a handler is found by the exception's closest type,
# whichever layer names it): each answered in Anthropic's shape on this route.
ANTHROPIC_ERRORS: ExceptionHandlersMap = {kind: anthropic_error for kind in EXCEPTION_HANDLERS}
