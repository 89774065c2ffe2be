"""A streamed response whose body never starts (its client left between the response head
and the first byte) still releases the upstream response and settles its exchange."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import httpx
from litestar import Request

from proxy.core.errors import ProxyError, sse_error_event
from proxy.protocols import relay
from proxy.protocols.relay import to_response
from proxy.upstream.base import UpstreamReply
from proxy.upstream.openai import ResponseChunks
from proxy.upstream.sse import DONE
from tests.polling import eventually


class Chunks:
    def __init__(self, *parts: bytes) -> None:
        self.parts, self.closed = list(parts), 0

    def __aiter__(self) -> Chunks:
        return self

    async def __anext__(self) -> bytes:
        if not self.parts:
            raise StopAsyncIteration
        return self.parts.pop(0)

    async def aclose(self) -> None:
        self.closed += 1


class Observer:
    """A chat stream's observer: it ends at `data: [DONE]`, and a break ends it with OpenAI's
    error event."""

    end_markers = (DONE,)

    def __init__(self) -> None:
        self.events: list[str] = []

    def failed(self, error: ProxyError) -> bytes:
        return sse_error_event(error)

    def feed(self, chunk: bytes) -> bytes:
        return chunk

    def flush(self) -> bytes:
        return b""

    async def finish(self, status: str, error: str | None) -> None:
        self.events.append(f"finish:{status}")

    def abandon(self) -> None:
        self.events.append("abandon")


def request() -> Request[Any, Any, Any]:
    scope: Any = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "state": {}}
    return Request(scope)


def streamed(chunks: Chunks) -> UpstreamReply:
    return UpstreamReply(200, {}, chunks=chunks, media_type="text/event-stream")


async def settle() -> None:
    gc.collect()
    for _ in range(3):
        await asyncio.sleep(0)


async def test_a_stream_dropped_before_its_body_closes_the_upstream_and_settles() -> None:
    chunks, observer = Chunks(b"data: {}\n\n"), Observer()
    response = to_response(request(), streamed(chunks), observer=observer)
    del response
    await settle()
    assert chunks.closed == 1
    assert observer.events == ["abandon"]


async def test_a_stream_relayed_to_the_end_is_settled_once_by_the_relay() -> None:
    chunks, observer = Chunks(b"data: {}\n\n", b"data: [DONE]\n\n"), Observer()
    response = to_response(request(), streamed(chunks), observer=observer)
    body = [part async for part in response.iterator]  # type: ignore[attr-defined]
    assert b"".join(body) == b"data: {}\n\ndata: [DONE]\n\n"
    del response
    await settle()
    assert observer.events == ["finish:complete"]
    assert chunks.closed == 1


async def test_an_upstream_response_never_read_is_released_by_aclose() -> None:
    async def body() -> Any:
        yield b"data: {}\n\n"

    transport = httpx.MockTransport(lambda _: httpx.Response(200, content=body()))
    async with httpx.AsyncClient(transport=transport) as client:
        response = await client.send(client.build_request("POST", "http://up/x"), stream=True)
        chunks = ResponseChunks(response, "up")
        assert not response.is_closed
        await chunks.aclose()
        assert response.is_closed


class Endless(Chunks):
    """An upstream whose body never ends: after its parts, it sends nothing more."""

    def __init__(self, *parts: bytes) -> None:
        super().__init__(*parts)
        self.reads = 0

    async def __anext__(self) -> bytes:
        if not self.parts:
            await asyncio.Event().wait()  # (until cancelled)
        self.reads += 1
        return self.parts.pop(0)


async def body_of(response: Any) -> bytes:
    return b"".join([part async for part in response.iterator])


async def closed(chunks: Chunks) -> None:
    async def check() -> int:
        return chunks.closed

    await eventually(check, "the upstream response closed")


async def test_after_done_the_rest_of_the_upstream_body_is_read_then_closed() -> None:
    # The client's stream ends at `[DONE]`; what the upstream still sends (its body's end) is
    # read afterwards, so its connection can be used again, and never reaches the client.
    chunks = Chunks(b"data: {}\n\n", b"data: [DONE]\n\n", b"", b": the end\n\n")
    body = await body_of(to_response(request(), streamed(chunks), observer=Observer()))
    assert body == b"data: {}\n\ndata: [DONE]\n\n"
    await closed(chunks)
    assert chunks.parts == [] and chunks.closed == 1


async def test_an_upstream_that_goes_on_after_done_is_read_no_further_than_the_bound(
    monkeypatch: Any,
) -> None:
    monkeypatch.setattr(relay, "DRAIN_BYTES", 100)
    chunks = Endless(b"data: [DONE]\n\n", *[b"x" * 60] * 5)
    body = await body_of(to_response(request(), streamed(chunks), observer=Observer()))
    assert body == b"data: [DONE]\n\n"
    await closed(chunks)
    assert chunks.reads == 3  # `[DONE]`, then 120 bytes: over the bound, so closed
    assert len(chunks.parts) == 3


async def test_an_upstream_silent_after_done_is_closed_after_the_wait(monkeypatch: Any) -> None:
    monkeypatch.setattr(relay, "DRAIN_SECONDS", 0.01)
    chunks = Endless(b"data: {}\n\n", b"data: [DONE]\n\n")
    body = await body_of(to_response(request(), streamed(chunks), observer=Observer()))
    assert body == b"data: {}\n\ndata: [DONE]\n\n"
    assert chunks.closed == 0  # (the client has its whole stream before the wait ends)
    await closed(chunks)
    assert chunks.closed == 1
