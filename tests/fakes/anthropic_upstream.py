"""A fake Anthropic Messages API (`POST /v1/messages`) as a raw ASGI app, for the litellm upstream.

It answers the way the real API does, closely enough for litellm's Anthropic translation: a
whole `message`, or the real stream event sequence (`message_start`, `content_block_start`,
`ping`, `content_block_delta` with `text_delta` or `input_json_delta`, `content_block_stop`,
`message_delta` with `stop_reason` and usage, `message_stop`). When the request offers tools
and ends with a user turn, the model calls the first tool.

It records every request it receives (`requests`, `message_requests`) and checks what the real
API checks that a translation could get wrong: the `x-api-key` and `anthropic-version` headers,
`max_tokens`, roles limited to user/assistant (the system prompt is a top-level field), and
`tool_result` blocks answering a `tool_use` of the turn before. A test can script the next
replies (`script`): an error status with Anthropic's error body, a delay before the response
head, a stream that dies after some events or ends with an `error` event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

API_KEY = "fake-anthropic-key"
MESSAGE_ID = "msg_01FakeFakeFakeFakeFake"
TOOL_USE_ID = "toolu_01FakeFakeFakeFakeFake"
REQUEST_ID = "req_01FakeFakeFakeFakeFake"
TOOL_INPUT = {"location": "Paris"}  # what the model passes to any tool it calls
# Streamed, the input arrives in pieces that are not JSON on their own, as in the real API.
_TOOL_JSON = json.dumps(TOOL_INPUT)
TOOL_INPUT_PIECES = ("", _TOOL_JSON[:7], _TOOL_JSON[7:17], _TOOL_JSON[17:])

# Top-level request fields the real API accepts; any other is a 400 ("Extra inputs are not
# permitted"), so a translation that leaks an OpenAI-only field fails here as it would there.
REQUEST_FIELDS = frozenset(
    {
        "model",
        "messages",
        "max_tokens",
        "system",
        "metadata",
        "stop_sequences",
        "stream",
        "temperature",
        "top_k",
        "top_p",
        "tools",
        "tool_choice",
        "thinking",
        "service_tier",
    }
)

# Anthropic's error type for each status (https://docs.anthropic.com/en/api/errors).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Reply:
    """A scripted reply: a whole body, or SSE events `(name, data)`.

    `die_after` closes the connection after that many events; `delay` waits before the head,
    `event_delay` after each event.
    """

    status: int = 200
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    events: list[tuple[str, dict[str, Any]]] | None = None
    die_after: int | None = None
    delay: float = 0.0
    event_delay: float = 0.0


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error shape: `{"type": "error", "error": {"type", "message"}}`."""
    return {
        "type": "error",
        "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message},
    }


def error_reply(status: int, message: str, **headers: str) -> Reply:
    return Reply(status=status, body=error_body(status, message), headers=headers)


def sse(name: str, data: dict[str, Any]) -> bytes:
    """One event as the real API frames it: an `event:` line, then `data:`."""
    return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()


class FakeAnthropic:
    """The ASGI app. `requests` lists what arrived; `script` holds replies to use first;
    `disconnects` counts streams whose client left before the end."""

    def __init__(self) -> None:
        self.requests: list[Recorded] = []
        self.script: list[Reply] = []
        self.disconnects = 0
        self.replies_started = 0  # responses whose head went out (or is about to)

    @property
    def message_requests(self) -> list[dict[str, Any]]:
        return [r.json() for r in self.requests if r.path == "/v1/messages"]

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        recorded = Recorded(scope["method"], scope["path"], headers, body)
        self.requests.append(recorded)
        reply = self.script.pop(0) if self.script else answer(recorded)
        await self._send(reply, receive, send)

    async def _send(self, reply: Reply, receive: Receive, send: Send) -> None:
        if reply.delay:
            await asyncio.sleep(reply.delay)
        self.replies_started += 1
        headers = {
            "content-type": "application/json" if reply.events is None else "text/event-stream",
            "request-id": REQUEST_ID,
            **reply.headers,
        }
        await send(
            {
                "type": "http.response.start",
                "status": reply.status,
                "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
            }
        )
        if reply.events is None:
            await send({"type": "http.response.body", "body": json.dumps(reply.body).encode()})
            return
        disconnected = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            disconnected.set()

        watcher = asyncio.create_task(watch())
        try:
            for i, (name, data) in enumerate(reply.events):
                if reply.die_after is not None and i >= reply.die_after:
                    # uvicorn then closes the connection without the terminating chunk.
                    raise ConnectionAbortedError("scripted upstream death")
                if disconnected.is_set():
                    self.disconnects += 1
                    return
                chunk = sse(name, data)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                if reply.event_delay:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(disconnected.wait(), reply.event_delay)
            await send({"type": "http.response.body", "body": b""})
        finally:
            watcher.cancel()


def answer(request: Recorded) -> Reply:
    """What a cooperative Claude would say to `request`, or the error the real API would give."""
    if request.method != "POST" or request.path != "/v1/messages":
        return error_reply(404, f"Not found: {request.method} {request.path}")
    if request.headers.get("x-api-key") != API_KEY:
        return error_reply(401, "invalid x-api-key")
    if "anthropic-version" not in request.headers:
        return error_reply(400, "anthropic-version: header is required")
    body = request.json()
    problem = _invalid(body)
    if problem:
        return error_reply(400, problem)
    return stream_reply(body) if body.get("stream") else Reply(body=message_reply(body))


def _invalid(body: dict[str, Any]) -> str | None:
    extra = sorted(set(body) - REQUEST_FIELDS)
    if extra:
        return f"{extra[0]}: Extra inputs are not permitted"
    if not isinstance(body.get("max_tokens"), int):
        return "max_tokens: Field required"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return "messages: at least one message is required"
    open_calls: set[str] = set()
    for i, message in enumerate(messages):
        if message.get("role") not in ("user", "assistant"):
            return f"messages.{i}.role: Input should be 'user' or 'assistant'"
        blocks = message["content"] if isinstance(message["content"], list) else []
        for block in blocks:
            if block.get("type") == "tool_result" and block.get("tool_use_id") not in open_calls:
                return (
                    f"messages.{i}.content: unexpected `tool_use_id` found in `tool_result` "
                    "blocks. Each `tool_result` block must have a corresponding `tool_use` "
                    "block in the previous message."
                )
        open_calls = {b["id"] for b in blocks if b.get("type") == "tool_use"}
    return None


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return " ".join(b.get("text", "") for b in content if b.get("type") == "text")


def _usage(body: dict[str, Any], text: str) -> dict[str, int]:
    system = body.get("system") or ""
    words = len(_text(system).split()) + sum(
        len(_text(m["content"]).split()) for m in body["messages"]
    )
    return {
        "input_tokens": words + 3,
        "output_tokens": len(text.split()) + 1,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def _plan(body: dict[str, Any]) -> tuple[str, dict[str, Any] | None]:
    """The reply text and the tool it calls, if any."""
    last = body["messages"][-1]
    tools = body.get("tools") or []
    wants_tool = (
        tools
        and last["role"] == "user"
        and not any(
            isinstance(b, dict) and b.get("type") == "tool_result"
            for b in (last["content"] if isinstance(last["content"], list) else [])
        )
    )
    if wants_tool:
        return "Let me check.", tools[0]
    return f"fake claude reply to: {_text(last['content'])}", None


def message_reply(body: dict[str, Any]) -> dict[str, Any]:
    text, tool = _plan(body)
    content: list[dict[str, Any]] = [{"type": "text", "text": text}]
    if tool:
        content.append(
            {
                "type": "tool_use",
                "id": TOOL_USE_ID,
                "name": tool["name"],
                "input": TOOL_INPUT,
            }
        )
    return {
        "id": MESSAGE_ID,
        "type": "message",
        "role": "assistant",
        "model": body["model"],
        "content": content,
        "stop_reason": "tool_use" if tool else "end_turn",
        "stop_sequence": None,
        "usage": _usage(body, text),
    }


def _event(kind: str, **fields: Any) -> tuple[str, dict[str, Any]]:
    return kind, {"type": kind, **fields}


def stream_events(body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The event sequence the real API sends for `message_reply(body)`."""
    text, tool = _plan(body)
    usage = _usage(body, text)
    start = {
        "id": MESSAGE_ID,
        "type": "message",
        "role": "assistant",
        "model": body["model"],
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {**usage, "output_tokens": 1},
    }
    events = [
        _event("message_start", message=start),
        _event("content_block_start", index=0, content_block={"type": "text", "text": ""}),
        _event("ping"),
    ]
    words = text.split(" ")
    for i, word in enumerate(words):
        piece = word if i == len(words) - 1 else word + " "
        delta = {"type": "text_delta", "text": piece}
        events.append(_event("content_block_delta", index=0, delta=delta))
    events.append(_event("content_block_stop", index=0))
    if tool:
        block = {"type": "tool_use", "id": TOOL_USE_ID, "name": tool["name"], "input": {}}
        events.append(_event("content_block_start", index=1, content_block=block))
        for piece in TOOL_INPUT_PIECES:
            delta = {"type": "input_json_delta", "partial_json": piece}
            events.append(_event("content_block_delta", index=1, delta=delta))
        events.append(_event("content_block_stop", index=1))
    stop = {"stop_reason": "tool_use" if tool else "end_turn", "stop_sequence": None}
    events.append(
        _event("message_delta", delta=stop, usage={"output_tokens": usage["output_tokens"]})
    )
    events.append(_event("message_stop"))
    return events


def stream_reply(body: dict[str, Any], **options: Any) -> Reply:
    return Reply(events=stream_events(body), **options)


def overloaded_event() -> tuple[str, dict[str, Any]]:
    """The `error` event the real API may send in place of the rest of a stream."""
    return _event("error", error={"type": "overloaded_error", "message": "Overloaded"})
