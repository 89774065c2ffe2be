"""The access line: one per request, written once the response has gone out."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from litestar import Litestar, Request, get
from litestar.di import NamedDependency, Provide
from litestar.handlers import HTTPRouteHandler

from proxy.app import create_app
from proxy.core import access
from proxy.core.config import Config
from proxy.core.requests import before_handler


@get("/hello", sync_to_thread=False)
def hello() -> str:
    return "hi"


def http_scope(path: str) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }


async def receive_nothing() -> dict[str, Any]:
    return {"type": "http.request", "body": b"", "more_body": False}


class Lines:
    """Stands in for the access logger (the tests' logging config filters out info)."""

    def __init__(self) -> None:
        self.lines: list[dict[str, Any]] = []

    def info(self, event: str, **fields: Any) -> None:
        self.lines.append({"event": event, **fields})

    debug = info


async def test_the_access_line_is_written_after_the_last_body_message_is_sent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    log = Lines()
    monkeypatch.setattr(access, "log", log)
    app = Litestar([hello], before_send=[access.access_hook], logging_config=None)
    scope = http_scope("/hello")
    sent: list[tuple[str, int]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append((message["type"], len(log.lines)))  # with the lines written by then

    await app(scope, receive_nothing, send)  # type: ignore[arg-type]
    await asyncio.sleep(0)
    assert sent == [("http.response.start", 0), ("http.response.body", 0)]
    assert len(log.lines) == 1
    line = log.lines[0]
    assert (line["event"], line["path"], line["status"], line["outcome"]) == (
        "request",
        "/hello",
        200,
        "ok",
    )


async def test_ended_waits_for_the_access_line_and_no_longer_than_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(access, "log", Lines())
    scope: dict[str, Any] = {"type": "http", "path": "/v1/chat/completions", "state": {}}
    info = access.request_info(scope)
    waiting = asyncio.ensure_future(info.ended(60))
    await asyncio.sleep(0)
    assert not waiting.done()
    access.log_access(scope, info)
    await asyncio.wait_for(waiting, 5)  # (woken by the line, long before its 60 s)
    await info.ended(60)  # written already: at once
    # A response whose line never comes: the wait ends at its bound all the same.
    await access.request_info({"type": "http", "state": {}}).ended(0.01)


async def test_a_requests_clock_starts_before_its_dependencies_are_resolved(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What is timed from the request's info (the access line's latency, an exchange's
    `overhead_ms`) includes dependency injection: the info exists before the first
    dependency runs, not from the first one to ask for it."""
    monkeypatch.setattr(access, "log", Lines())
    seen: list[tuple[float, access.RequestInfo]] = []

    async def provide_probe(request: Request[Any, Any, Any]) -> None:
        at = time.perf_counter()
        seen.append((at, access.request_info(request.scope)))

    @get("/probed", sync_to_thread=False)
    def probed(probe: NamedDependency[None]) -> str:
        return "hi"

    app = Litestar(
        [probed],
        dependencies={"probe": Provide(provide_probe)},
        before_request=before_handler,
        before_send=[access.access_hook],
        logging_config=None,
    )
    scope = http_scope("/probed")
    statuses: list[int] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    await app(scope, receive_nothing, send)  # type: ignore[arg-type]
    assert statuses == [200]
    [(probed_at, info)] = seen
    assert info.started < probed_at
    assert access.request_info(scope) is info


def test_every_route_of_the_app_starts_the_clock_before_its_handler() -> None:
    app = create_app(Config())
    hooks = {
        getattr(hook, "func", hook)
        for route in app.routes
        for handler in getattr(route, "route_handlers", [])
        if isinstance(handler, HTTPRouteHandler)
        for hook in [handler.resolve_before_request()]
    }
    assert hooks == {before_handler}
