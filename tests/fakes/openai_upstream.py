"""A fake OpenAI-compatible API as a raw ASGI app, for tests and benchmarks.

It behaves like the real API closely enough for the official SDK: chat completions (plain,
streamed with `stream_options.include_usage`, tool calls, `n`, logprobs, json response formats),
models, embeddings, and anything else echoed back. It records every request it receives, and a
test can script the next replies (`script`) or slow the stream (`chunk_delay`).

Like the real API, it rejects (400) a `tool` message that does not answer a preceding assistant
`tool_calls` entry, and a call left unanswered before the next message, so tests notice both.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import re
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass
class Recorded:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes
    raw_path: bytes = b""  # as sent (`path` is decoded)
    client: tuple[str, int] | None = None  # the connection it came on (address, port)

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Reply:
    """A scripted reply: a whole body, or SSE chunks (optionally dying after `die_after`)."""

    status: int = 200
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    chunks: list[bytes] | None = None
    die_after: int | None = None  # close the connection after this many chunks
    delay: float = 0.0  # before the response head
    hold: bool = False  # no response head until the test sets `FakeOpenAI.release`


def sse(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def model_said(
    content: str,
    *,
    model: str = "fake-model",
    usage: tuple[int, int] | None = (1000, 100),
    delay: float = 0.0,
) -> Reply:
    """A whole chat completion whose message is `content`: the scripted answer of one of the
    proxy's own models (intent, extraction, summaries, planner). `usage`: (prompt,
    completion) tokens, or None for a reply without usage."""
    body: dict[str, Any] = {
        "id": "chatcmpl-scripted",
        "object": "chat.completion",
        "created": 1,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "finish_reason": "stop",
            }
        ],
    }
    if usage is not None:
        prompt, completion = usage
        body["usage"] = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
    return Reply(body=body, delay=delay)


def error_reply(
    status: int, message: str, type_: str = "invalid_request_error", **headers: str
) -> Reply:
    body = {"error": {"message": message, "type": type_, "param": None, "code": None}}
    return Reply(status=status, body=body, headers=headers)


class FakeOpenAI:
    """The ASGI app. `requests` lists what arrived; `script` holds replies to use first."""

    def __init__(self, *, chunk_delay: float = 0.0, latency: float = 0.0) -> None:
        self.requests: list[Recorded] = []
        self.script: list[Reply] = []
        self.chunk_delay = chunk_delay
        self.latency = latency
        self.disconnects = 0  # streams whose client went away before the end
        self.streams_started = 0
        self.replies_started = 0  # responses whose head went out (or is about to)
        self.release = threading.Event()  # lets held replies go (`Reply.hold`)
        self.streams_finished = 0
        # When set, /embeddings answers with this function of each input (else fixed vectors).
        self.embed: Callable[[str], list[float]] | None = None

    @property
    def chat_requests(self) -> list[dict[str, Any]]:
        return [r.json() for r in self.requests if r.path.endswith("/chat/completions")]

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
        recorded = Recorded(
            scope["method"],
            scope["path"],
            scope["query_string"].decode(),
            headers,
            body,
            scope.get("raw_path") or b"",
            tuple(scope["client"]) if scope.get("client") else None,
        )
        self.requests.append(recorded)
        reply = self.script.pop(0) if self.script else self._default(recorded)
        if self.latency:
            await asyncio.sleep(self.latency)
        await self._send(reply, receive, send)

    async def _send(self, reply: Reply, receive: Receive, send: Send) -> None:
        if reply.delay:
            await asyncio.sleep(reply.delay)
        if reply.hold:  # (a threading.Event: the test sets it from its own thread)
            await asyncio.to_thread(self.release.wait)
        self.replies_started += 1
        if reply.chunks is None:
            payload = (
                reply.body if isinstance(reply.body, bytes) else json.dumps(reply.body).encode()
            )
            headers = {
                "content-type": "application/json",
                "x-request-id": "upstream-req-1",
                **reply.headers,
            }
            await send(
                {
                    "type": "http.response.start",
                    "status": reply.status,
                    "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
                }
            )
            await send({"type": "http.response.body", "body": payload})
            return
        headers = {
            "content-type": "text/event-stream",
            "x-request-id": "upstream-req-1",
            **reply.headers,
        }
        await send(
            {
                "type": "http.response.start",
                "status": reply.status,
                "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
            }
        )
        self.streams_started += 1
        disconnected = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            disconnected.set()

        watcher = asyncio.create_task(watch())
        try:
            for i, chunk in enumerate(reply.chunks):
                if reply.die_after is not None and i >= reply.die_after:
                    raise ConnectionAbortedError("scripted upstream death")
                if disconnected.is_set():
                    self.disconnects += 1
                    return
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                if self.chunk_delay:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(disconnected.wait(), self.chunk_delay)
            await send({"type": "http.response.body", "body": b""})
            self.streams_finished += 1
        finally:
            watcher.cancel()

    def _default(self, request: Recorded) -> Reply:
        path = request.path.removeprefix("/v1")
        if path == "/chat/completions" and request.method == "POST":
            return chat_reply(request.json())
        if path == "/responses" or path.startswith("/responses/"):
            # A chat-only server (vLLM, Ollama, most gateways): no Responses API, as OpenAI
            # answers an unknown route (tests/fakes/openai_responses.py speaks it).
            return error_reply(404, f"Invalid URL ({request.method} {request.path})")
        if path == "/models":
            data = [
                {"id": m, "object": "model", "created": 0, "owned_by": "fake"}
                for m in ("gpt-4o-mini", "gpt-4o")
            ]
            return Reply(body={"object": "list", "data": data})
        if path == "/embeddings" and request.method == "POST":
            inputs = request.json().get("input")
            inputs = inputs if isinstance(inputs, list) else [inputs]
            data = [
                {
                    "object": "embedding",
                    "index": i,
                    "embedding": self.embed(str(text)) if self.embed else [0.1, 0.2, 0.3],
                }
                for i, text in enumerate(inputs)
            ]
            return Reply(
                body={
                    "object": "list",
                    "data": data,
                    "model": request.json().get("model"),
                    "usage": {"prompt_tokens": 2, "total_tokens": 2},
                }
            )
        return Reply(
            body={
                "method": request.method,
                "path": request.path,
                "query": request.query,
                "content_type": request.headers.get("content-type"),
                "size": len(request.body),
            }
        )


def concept_embedding(text: str, concepts: dict[str, str], dims: int = 64) -> list[float]:
    """A deterministic stand-in for a real embedding model: a hashed bag of words in which
    the words of `concepts` count as their concept (e.g. "puppy" and "beagle" as "dog"), so
    texts with no word in common can still be near each other."""
    vector = [0.0] * dims
    for word in re.findall(r"[a-z0-9]+", text.lower()):
        word = concepts.get(word, word)
        digest = hashlib.sha256(word.encode()).digest()
        vector[int.from_bytes(digest[:4], "little") % dims] += 1.0
    return vector if any(vector) else [1.0] + [0.0] * (dims - 1)


def _tool_message_error(messages: list[dict[str, Any]]) -> str | None:
    """The real API's two tool-call rules: every `tool` message answers a call of the
    assistant message before it, and every call is answered before the next other message."""
    open_calls: set[str] = set()
    for i, message in enumerate(messages):
        role = message.get("role")
        if role == "tool":
            if message.get("tool_call_id") not in open_calls:
                return (
                    "Invalid parameter: messages with role 'tool' must be a response to a "
                    f"preceeding message with 'tool_calls'. (messages[{i}])"
                )
            open_calls.discard(message["tool_call_id"])
            continue
        if open_calls:
            return (
                "An assistant message with 'tool_calls' must be followed by tool messages "
                f"responding to each 'tool_call_id'. The following tool_call_ids did not have "
                f"response messages: {', '.join(sorted(open_calls))} (messages[{i}])"
            )
        open_calls = (
            {c["id"] for c in message.get("tool_calls") or []} if role == "assistant" else set()
        )
    return None


def chat_reply(body: dict[str, Any]) -> Reply:
    """What a cooperative model would say to `body`."""
    messages = body.get("messages") or []
    problem = _tool_message_error(messages)
    if problem is not None:
        return error_reply(400, problem)
    last = messages[-1] if messages else {}
    content = last.get("content")
    if isinstance(content, list):
        content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    text = f"fake reply to: {content}"
    tools = body.get("tools")
    tool_calls = None
    if tools and last.get("role") == "user":
        name = tools[0]["function"]["name"]
        tool_calls = [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": name, "arguments": '{"q": "x"}'},
            }
        ]
    fmt = (body.get("response_format") or {}).get("type")
    if fmt in ("json_object", "json_schema"):
        text = json.dumps({"answer": text})
    n = body.get("n") or 1
    prompt_tokens = sum(len(str(m.get("content") or "").split()) + 3 for m in messages)
    completion_tokens = len(text.split())
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens * n,
        "total_tokens": prompt_tokens + completion_tokens * n,
    }
    head = {
        "id": "chatcmpl-fake",
        "created": int(time.time()),
        "model": body.get("model", "fake"),
        "system_fingerprint": "fp_fake",
    }
    logprobs = None
    if body.get("logprobs"):
        logprobs = {
            "content": [
                {"token": w, "logprob": -0.1, "bytes": list(w.encode()), "top_logprobs": []}
                for w in text.split()
            ],
            "refusal": None,
        }
    if not body.get("stream"):
        message: dict[str, Any] = {
            "role": "assistant",
            "content": None if tool_calls else text,
            "refusal": None,
        }
        if tool_calls:
            message["tool_calls"] = tool_calls
        choices = [
            {
                "index": i,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": "tool_calls" if tool_calls else "stop",
            }
            for i in range(n)
        ]
        return Reply(body={**head, "object": "chat.completion", "choices": choices, "usage": usage})
    include_usage = (body.get("stream_options") or {}).get("include_usage") is True

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return sse({**head, "object": "chat.completion.chunk", "choices": choices, **extra})

    chunks: list[bytes] = []
    for i in range(n):
        chunks.append(
            chunk(
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "finish_reason": None,
                        "logprobs": None,
                    }
                ]
            )
        )
        if tool_calls:
            call = tool_calls[0]
            chunks.append(
                chunk(
                    [
                        {
                            "index": i,
                            "delta": {
                                "tool_calls": [
                                    {
                                        "index": 0,
                                        "id": call["id"],
                                        "type": "function",
                                        "function": {
                                            "name": call["function"]["name"],
                                            "arguments": "",
                                        },
                                    }
                                ]
                            },
                            "finish_reason": None,
                            "logprobs": None,
                        }
                    ]
                )
            )
            for part in ('{"q": ', '"x"}'):
                chunks.append(
                    chunk(
                        [
                            {
                                "index": i,
                                "delta": {
                                    "tool_calls": [{"index": 0, "function": {"arguments": part}}]
                                },
                                "finish_reason": None,
                                "logprobs": None,
                            }
                        ]
                    )
                )
        else:
            for word in text.split(" "):
                chunks.append(
                    chunk(
                        [
                            {
                                "index": i,
                                "delta": {"content": word + " "},
                                "finish_reason": None,
                                "logprobs": None,
                            }
                        ]
                    )
                )
        chunks.append(
            chunk(
                [
                    {
                        "index": i,
                        "delta": {},
                        "finish_reason": "tool_calls" if tool_calls else "stop",
                        "logprobs": None,
                    }
                ]
            )
        )
    # Like OpenAI's, the usage chunk follows the last one at once, with `[DONE]`: it costs no
    # generation time (`chunk_delay`).
    end = b"data: [DONE]\n\n"
    chunks.append(chunk([], usage=usage) + end if include_usage else end)
    return Reply(chunks=chunks)


async def collect(chunks: AsyncIterator[bytes]) -> bytes:
    return b"".join([c async for c in chunks])
