"""The proxy's exceptions, and the one place that turns any failure into OpenAI's error shape.

    ProxyError                      500 server_error (internal details never leave the process)
    ├── BadRequest                  400 invalid_request_error, with `param` when one field is wrong
    ├── AuthenticationFailed        401 invalid_api_key
    ├── PermissionDenied            403 insufficient_scope
    ├── NotFound                    404
    ├── RequestTimeout              408 (a request body that stopped arriving)
    ├── Conflict                    409
    ├── PayloadTooLarge             413
    ├── UnsupportedMediaType        415 (e.g. an attachment of a kind the proxy cannot read)
    ├── Unprocessable               422 (e.g. an Idempotency-Key reused for another request)
    ├── RateLimited                 429, with retry-after
    ├── ClientDisconnected          499 (nginx's): the client left before its body was whole
    ├── ServiceUnavailable          503
    └── UpstreamError               the upstream failed us
        ├── UpstreamUnreachable     502 (connect failure, connection dropped)
        ├── UpstreamRedirect        502 upstream_redirect (memproxy follows none)
        ├── UpstreamTimeout         504
        └── UpstreamStatusError     the upstream's own status and error body, passed through

Every response, errors included, carries `x-request-id` (added by the access middleware).
"""

from __future__ import annotations

from typing import Any

import msgspec
import structlog
from litestar import Request, Response
from litestar.exceptions import HTTPException
from litestar.types import ExceptionHandlersMap

from proxy.core.access import request_info
from proxy.core.json_responses import json_response
from storage.errors import ConflictError, StorageError

log = structlog.get_logger("memproxy.errors")


class ProxyError(Exception):
    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


class BadRequest(ProxyError):
    status, type = 400, "invalid_request_error"


class AuthenticationFailed(ProxyError):
    status, type, code = 401, "invalid_request_error", "invalid_api_key"


class PermissionDenied(ProxyError):
    status, type, code = 403, "permission_error", "insufficient_scope"


class NotFound(ProxyError):
    status, type, code = 404, "invalid_request_error", "not_found"


class Conflict(ProxyError):
    status, type, code = 409, "invalid_request_error", "conflict"


class RequestTimeout(ProxyError):
    status, type, code = 408, "invalid_request_error", "request_timeout"


class ClientDisconnected(ProxyError):
    """The client closed its connection before the whole request body arrived: nothing to
    answer (the response goes nowhere), and not the server's error."""

    status, type, code = 499, "invalid_request_error", "client_disconnected"


class PayloadTooLarge(ProxyError):
    status, type, code = 413, "invalid_request_error", "request_too_large"


class UnsupportedMediaType(ProxyError):
    status, type, code = 415, "invalid_request_error", "unsupported_media_type"


class Unprocessable(ProxyError):
    status, type, code = 422, "invalid_request_error", "unprocessable_entity"


class RateLimited(ProxyError):
    status, type, code = 429, "rate_limit_error", "rate_limit_exceeded"


class ServiceUnavailable(ProxyError):
    status, type, code = 503, "server_error", "service_unavailable"


class UpstreamError(ProxyError):
    status, type, code = 502, "upstream_error", "upstream_error"


class UpstreamUnreachable(UpstreamError):
    code = "upstream_unreachable"


class UpstreamRedirect(UpstreamError):
    """An upstream answered a chat completion or the model list with a redirect."""

    code = "upstream_redirect"


class UpstreamTimeout(UpstreamError):
    status, code = 504, "upstream_timeout"


class UpstreamStatusError(UpstreamError):
    """An upstream answered with an error status; its status and body are passed on as they are."""

    def __init__(self, status: int, payload: dict[str, Any], headers: dict[str, str]) -> None:
        error = payload.get("error") if isinstance(payload.get("error"), dict) else {}
        super().__init__(str((error or {}).get("message") or f"upstream answered {status}"))
        self.status = status
        self.payload = payload
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return self.payload


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def sse_error_event(exc: ProxyError) -> bytes:
    """The last event of a stream that broke after its first byte."""
    return b"data: " + msgspec.json.encode(exc.body()) + b"\n\n"


# Litestar's own exceptions (router 404/405, body limit 413, ...) by status.
_HTTP_TYPES = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    409: ("invalid_request_error", "conflict"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
}


def handle_proxy_error(request: Request[Any, Any, Any], exc: ProxyError) -> Response[Any]:
    upstream = isinstance(exc, UpstreamError)
    request_info(request.scope).failed(exc.status, exc.code, upstream=upstream)
    return json_response(exc.body(), exc.status, exc.headers)


def handle_client_disconnect(
    request: Request[Any, Any, Any], exc: ClientDisconnected
) -> Response[Any]:
    """Counted (`memproxy_request_body_disconnects`) and logged as the client's leaving; the
    response is sent to no one."""
    info = request_info(request.scope)
    info.failed(exc.status, exc.code)
    state = getattr(request.app.state, "memproxy", None)
    if state is not None:
        state.metrics.body_disconnects.labels(info.tenant or "").inc()
    return json_response(exc.body(), exc.status)


def handle_http_exception(request: Request[Any, Any, Any], exc: HTTPException) -> Response[Any]:
    type_, code = _HTTP_TYPES.get(exc.status_code, ("invalid_request_error", None))
    message = exc.detail
    if exc.status_code == 404:
        message = f"Unknown request URL: {request.method} {request.url.path}."
    elif exc.status_code == 405:
        message = f"Method {request.method} is not allowed on {request.url.path}."
    elif exc.status_code == 413:
        message = "Request body is larger than this server accepts (server.max_body_bytes)."
    elif exc.status_code >= 500:
        type_, message = "server_error", "The server had an error processing your request."
    request_info(request.scope).failed(exc.status_code, code)
    return json_response(error_body(message, type_, None, code), exc.status_code, exc.headers)


def handle_unexpected(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    info = request_info(request.scope)
    info.failed(500, None)
    request_id = info.request_id
    log.exception("unhandled_error", path=request.url.path, request_id=request_id)
    message = f"The server had an error processing your request (request id {request_id})."
    return json_response(error_body(message, "server_error"), 500)


def handle_storage_error(request: Request[Any, Any, Any], exc: StorageError) -> Response[Any]:
    """Storage failures that reach the edge (the management API; a fail-closed chat)."""
    if isinstance(exc, ConflictError):
        error: ProxyError = Conflict("The request conflicts with stored data; retry it.")
    else:
        log.error("storage_unavailable", error=str(exc))
        error = ServiceUnavailable("Storage is unavailable; retry shortly.")
    request_info(request.scope).failed(error.status, error.code)
    return json_response(
        error.body(), error.status, {"retry-after": "1"} if error.status == 503 else None
    )


EXCEPTION_HANDLERS: ExceptionHandlersMap = {
    ClientDisconnected: handle_client_disconnect,
    ProxyError: handle_proxy_error,
    StorageError: handle_storage_error,
    HTTPException: handle_http_exception,
    Exception: handle_unexpected,
}
