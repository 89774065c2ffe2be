"""Request ids and the one structured access line per request.

Runs as a Litestar `before_send` hook, so it sees every response: routed, unrouted (404/405)
and failed ones alike. Handlers record what they learn (tenant, model, upstream latency) in the
request's `RequestInfo`.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import structlog
from litestar.enums import ScopeType
from litestar.types import Message, Receive, Scope

log = structlog.get_logger("memproxy.access")
_STATE_KEY = "memproxy"
# Polled by orchestrators and scrapers every few seconds: their successful answers are logged
# at debug, so they do not drown the requests (a failing probe stays at info).
PROBES = frozenset({"/healthz", "/readyz", "/metrics"})
# The status of a request whose client left before its answer (nginx's 499): the access line
# and the metrics say so, not the server's 5xx.
CLIENT_CLOSED = 499


@dataclass(slots=True)
class RequestInfo:
    request_id: str = field(default_factory=lambda: "req_" + secrets.token_hex(12))
    started: float = field(default_factory=time.perf_counter)
    tenant: str | None = None
    model: str | None = None
    stream: bool = False
    upstream_ms: float | None = None
    first_byte_ms: float | None = None
    status: int = 0
    # ok, refused (a 4xx of the proxy's own), upstream_error (the upstream failed or answered
    # an error), error (the proxy failed, or a shutdown cut it off), client_disconnected
    outcome: str = "ok"
    code: str | None = None  # an error response's `code`
    logged: bool = False
    _ended: asyncio.Event | None = None  # set with `logged`, for `ended()`

    async def ended(self, at_most: float) -> None:
        """Until the response has gone out (its access line is written), at most `at_most`
        seconds."""
        if self.logged:
            return
        if self._ended is None:
            self._ended = asyncio.Event()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(at_most):
                await self._ended.wait()

    def failed(self, status: int, code: str | None, *, upstream: bool = False) -> None:
        """An error response: what the access line says of it."""
        self.code = code
        if status == CLIENT_CLOSED:
            self.outcome = "client_disconnected"
        elif upstream:
            self.outcome = "upstream_error"
        elif status >= 500:
            self.outcome = "error"
        elif status >= 400:
            self.outcome = "refused"


class ClientWatch:
    """Whether a client closed its connection while its reply was being prepared. A whole
    reply has nothing to send until it is ready (and sending to a closed connection fails
    silently), so its client leaving is seen only in what the connection says next, once the
    request's body has been read: the server's `http.disconnect`."""

    def __init__(self, receive: Receive) -> None:
        self._next = asyncio.ensure_future(receive())

    def end(self, info: RequestInfo) -> None:
        """Stop watching; a client gone by now is what the access line says."""
        if (
            self._next.done()
            and not self._next.cancelled()
            and self._next.exception() is None
            and self._next.result()["type"] == "http.disconnect"
        ):
            info.outcome = "client_disconnected"
        self._next.cancel()


def request_info(scope: Scope | dict[str, Any]) -> RequestInfo:
    """This request's info, created on first use."""
    state = scope.setdefault("state", {})
    info: RequestInfo | None = state.get(_STATE_KEY)
    if info is None:
        info = state[_STATE_KEY] = RequestInfo()
    return info


async def access_hook(message: Message, scope: Scope) -> None:
    if scope["type"] != ScopeType.HTTP:
        return
    info = request_info(scope)
    if message["type"] == "http.response.start":
        info.status = message["status"]
        info.first_byte_ms = (time.perf_counter() - info.started) * 1000
        headers = list(message.get("headers") or [])
        headers.append((b"x-request-id", info.request_id.encode()))
        message["headers"] = headers
    elif message["type"] == "http.response.body" and not message.get("more_body", False):
        # This hook runs before the message is sent: the line is written just after, so that
        # writing it never holds back the end of the response.
        asyncio.get_running_loop().call_soon(log_access, scope, info)


def log_access(scope: Scope | dict[str, Any], info: RequestInfo) -> None:
    """Write the request's access line, once (a stream cut short by its client never sends
    its last body message, so the relay calls this itself)."""
    if info.logged:
        return
    info.logged = True
    if info._ended is not None:
        info._ended.set()
    quiet = info.status < 400 and scope.get("path") in PROBES
    (log.debug if quiet else log.info)(
        "request",
        request_id=info.request_id,
        method=scope.get("method"),
        path=scope.get("path"),
        status=info.status,
        tenant=info.tenant,
        model=info.model,
        stream=info.stream,
        latency_ms=round((time.perf_counter() - info.started) * 1000, 2),
        first_byte_ms=round(info.first_byte_ms or 0.0, 2),
        upstream_ms=None if info.upstream_ms is None else round(info.upstream_ms, 2),
        outcome=info.outcome,
        code=info.code,
    )
