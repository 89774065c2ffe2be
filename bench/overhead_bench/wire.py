"""Requests on the wire: the shapes measured, one timed request, and the two ways of sending
them (targets taking turns request by request, or in segments of concurrent clients)."""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from bench.fake_upstream import TAIL_MODEL
from bench.http1 import ProtocolError

CHAT_PATH = "/v1/chat/completions"
RESPONSES_PATH = "/v1/responses"
MESSAGES_PATH = "/v1/messages"
MODEL = "gpt-4o-mini"
# A Responses stream must end with its `response.completed` event (a whole response, about 2
# kB here): the last bytes of a stream are kept to look for it.
COMPLETED = b"event: response.completed"
# And a Messages stream with `message_stop`.
MESSAGE_STOP = b"event: message_stop"
TAIL_BYTES = 16384


class Reply(Protocol):
    status_code: int

    def aiter_raw(self) -> AsyncIterator[bytes]: ...


Post = Callable[[str, bytes, dict[str, str] | None], AbstractAsyncContextManager[Reply]]


@dataclass(frozen=True)
class Shape:
    """A wire protocol the targets are measured on: its route and its request bodies."""

    name: str
    path: str

    @property
    def label(self) -> str:
        return f"POST {self.path}"


SHAPES = {
    "chat": Shape("chat", CHAT_PATH),
    "responses": Shape("responses", RESPONSES_PATH),
    "messages": Shape("messages", MESSAGES_PATH),
}


@dataclass
class Target:
    """A server measured, through its own keep-alive client."""

    name: str
    post: Post
    close: Callable[[], Awaitable[None]]


@dataclass
class Lane:
    """One target on one shape: what the targets take turns between. `turns` counts each
    client's requests so far (a realistic client's conversation grows with them)."""

    target: Target
    shape: Shape
    turns: dict[int, int] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.target.name


@dataclass(frozen=True)
class Request:
    body: bytes
    headers: dict[str, str] | None = None


# What a lane sends as its client number `client`'s next request (stream or not).
Requests = Callable[[Lane, bool, int], Request]


@dataclass
class Sample:
    latency: float  # seconds, request sent to body complete
    ttft: float | None  # seconds to the first chunk with content (streams only)


@dataclass
class Samples:
    ok: list[Sample] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    busy: float = 0.0  # seconds this lane's concurrent segments took (for req/s)


def payload(
    stream: bool, text: str, model: str = MODEL, shape: str = "chat", user: str | None = None
) -> bytes:
    """A one-message turn: `messages` of a chat completion or of a Messages request (with its
    required `max_tokens`), or a Responses `input`."""
    message = {"role": "user", "content": text}
    body: dict[str, Any] = {"model": model}
    body["input" if shape == "responses" else "messages"] = [message]
    if shape == "messages":
        body["max_tokens"] = 100
    if stream:
        body["stream"] = True
    if user is not None:
        body["user"] = user
    return json.dumps(body).encode()


def sse_data(event: bytes) -> bytes | None:
    """The data of one SSE event (a Responses event has an `event:` line first)."""
    if event.startswith(b"data: "):
        return event[6:].split(b"\n", 1)[0]
    found = event.find(b"\ndata: ")
    return None if found < 0 else event[found + 7 :].split(b"\n", 1)[0]


def first_content(buffer: bytes, shape: str = "chat") -> tuple[bool, bytes]:
    """Whether a complete SSE event in `buffer` carries content (a chat chunk's `delta.content`,
    a Responses `response.output_text.delta`); the unparsed rest."""
    while b"\n\n" in buffer:
        event, buffer = buffer.split(b"\n\n", 1)
        if shape == "responses":
            if event.startswith(b"event: response.output_text.delta\n"):
                data = sse_data(event)
                if data is not None and json.loads(data).get("delta"):
                    return True, buffer
            continue
        if shape == "messages":
            if event.startswith(b"event: content_block_delta\n"):
                data = sse_data(event)
                if data is not None and json.loads(data).get("delta", {}).get("text"):
                    return True, buffer
            continue
        if not event.startswith(b"data: ") or event == b"data: [DONE]":
            continue
        choices = json.loads(event[6:]).get("choices") or [{}]
        if (choices[0].get("delta") or {}).get("content"):
            return True, buffer
    return False, buffer


async def measure(lane: Lane, stream: bool, request: Request) -> Sample:
    """One request; raises on anything but a complete 200 reply with content (a Responses
    stream: ending with `response.completed`)."""
    shape = lane.shape.name
    responses = shape == "responses"
    ending = {"responses": COMPLETED, "messages": MESSAGE_STOP}.get(shape)
    ttft: float | None = None
    buffer = b""
    tail = b""
    started = time.perf_counter()
    async with lane.target.post(lane.shape.path, request.body, request.headers) as response:
        async for chunk in response.aiter_raw():
            if ttft is None:
                buffer += chunk
                if stream and response.status_code == 200:
                    found, buffer = first_content(buffer, shape)
                    if found:
                        ttft = time.perf_counter() - started
            elif ending is not None:
                tail = (tail + chunk)[-TAIL_BYTES:]
    latency = time.perf_counter() - started
    if response.status_code != 200:
        raise RuntimeError(f"{response.status_code} {buffer[:200]!r}")
    if stream and ttft is None:
        raise RuntimeError("stream ended without a content chunk")
    if stream and ending is not None and ending not in buffer + tail:
        raise RuntimeError(f"stream ended without {ending!r}: {(buffer + tail)[-200:]!r}")
    if not stream and (b'"output_text"' if responses else b'"content"') not in buffer:
        raise RuntimeError(f"reply without content: {buffer[:200]!r}")
    return Sample(latency, ttft)


async def record(
    lane: Lane, stream: bool, client: int, requests: Requests, into: dict[str, Samples]
) -> None:
    try:
        into[lane.name].ok.append(await measure(lane, stream, requests(lane, stream, client)))
    except (OSError, httpx.HTTPError, ProtocolError, RuntimeError, ValueError) as exc:
        into[lane.name].errors.append(f"{type(exc).__name__}: {exc}")


def rotated(targets: list[Any], i: int) -> list[Any]:
    """The targets in turn, each round starting with the next one, so none always goes first."""
    k = i % len(targets)
    return targets[k:] + targets[:k]


def split(n: int, parts: int) -> list[int]:
    """`n` in `parts` near-equal sizes (none empty)."""
    parts = max(1, min(n, parts))
    return [n // parts + (i < n % parts) for i in range(parts)]


async def sequential(
    lanes: list[Lane],
    n: int,
    stream: bool,
    requests: Requests,
    clients: int,
    start: int = 0,
    into: dict[str, Samples] | None = None,
) -> dict[str, Samples]:
    """`n` rounds, one request to each lane per round (the first round starting at `start`),
    round `i` as client `i % clients`; samples added to `into`, if given."""
    out = into if into is not None else {lane.name: Samples() for lane in lanes}
    for i in range(start, start + n):
        for lane in rotated(lanes, i):
            await record(lane, stream, i % clients, requests, out)
    return out


async def concurrent(
    lanes: list[Lane],
    n: int,
    stream: bool,
    requests: Requests,
    clients: int,
    segment: int,
    start: int = 0,
    into: dict[str, Samples] | None = None,
) -> dict[str, Samples]:
    """`clients` concurrent clients per lane, lanes taking turns every `segment` requests
    per client; about `n` requests per lane (`start`, `into`: as `sequential`)."""
    out = into if into is not None else {lane.name: Samples() for lane in lanes}

    async def client_loop(lane: Lane, client: int) -> None:
        for _ in range(segment):
            await record(lane, stream, client, requests, out)

    rounds = max(1, math.ceil(n / (clients * segment)))
    for r in range(start, start + rounds):
        for lane in rotated(lanes, r):
            began = time.perf_counter()
            await asyncio.gather(*(client_loop(lane, c) for c in range(clients)))
            out[lane.name].busy += time.perf_counter() - began
    return out


async def no_buffering(lane: Lane, headers: dict[str, str] | None = None) -> dict[str, Any]:
    """Stream a reply whose upstream waits `--tail` s before its end: the first chunk must
    reach the client before the upstream's end, not with it."""
    first_ns: int | None = None
    end_ns: int | None = None
    buffer = b""
    body = payload(True, "say hi please now", TAIL_MODEL, lane.shape.name)
    async with lane.target.post(lane.shape.path, body, headers) as response:
        async for chunk in response.aiter_raw():
            if first_ns is None:
                first_ns = time.monotonic_ns()
            buffer += chunk
    for event in buffer.split(b"\n\n"):
        data = sse_data(event) if b"upstream_end_ns" in event else None
        if data is not None:
            decoded = json.loads(data)
            # (a stream memproxy translated carries it in the text: TAIL_END in fake_upstream)
            found = re.search(r"upstream_end_ns=(\d+)", json.dumps(decoded))
            end_ns = decoded.get("upstream_end_ns") or (int(found[1]) if found else None)
    if first_ns is None or end_ns is None:
        return {"pass": False, "first_chunk_before_end_ms": None, "detail": buffer[:200].decode()}
    lead = (end_ns - first_ns) / 1e6
    return {"pass": lead > 0, "first_chunk_before_end_ms": round(lead, 1)}
