"""The access line: one per request, written once the response has gone out."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from litestar import Litestar, get

from proxy import access


@get("/hello", sync_to_thread=False)
def hello() -> str:
    return "hi"


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
    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": "/hello",
        "raw_path": b"/hello",
        "query_string": b"",
        "root_path": "",
        "headers": [],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    sent: list[tuple[str, int]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append((message["type"], len(log.lines)))  # with the lines written by then

    await app(scope, receive, send)  # type: ignore[arg-type]
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
