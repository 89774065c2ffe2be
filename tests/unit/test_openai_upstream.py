"""The openai-kind upstream against respx-mocked HTTP: what passes through and how failures map."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
import respx

from proxy.core.config import TimeoutConfig, UpstreamConfig
from proxy.core.errors import UpstreamTimeout, UpstreamUnreachable
from proxy.upstream.openai import OpenAIUpstream
from tests.fakes.openai_upstream import collect

BASE = "http://upstream.test/v1"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "mystery": [1, 2]}


def upstream(client: httpx.AsyncClient) -> OpenAIUpstream:
    config = UpstreamConfig(
        kind="openai", base_url=BASE, api_key="sk-up", timeout=TimeoutConfig(read=1)
    )
    return OpenAIUpstream("u", config, client)


class ScriptedStream(httpx.AsyncByteStream):
    """Yields chunks, then optionally fails like a dropped connection; records closing."""

    def __init__(self, chunks: list[bytes], error: Exception | None = None) -> None:
        self.chunks, self.error, self.closed, self.sent = chunks, error, False, 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            self.sent += 1
            yield chunk
        if self.error:
            raise self.error

    async def aclose(self) -> None:
        self.closed = True


@respx.mock
async def test_request_is_forwarded_with_upstream_key_and_unknown_fields() -> None:
    route = respx.post(f"{BASE}/chat/completions").respond(200, json={"ok": True})
    async with httpx.AsyncClient() as client:
        reply = await upstream(client).chat_completions(BODY, stream=False)
    sent = route.calls.last.request
    assert sent.headers["authorization"] == "Bearer sk-up"
    assert httpx.Response(200, content=sent.content).json() == BODY
    assert reply.status == 200 and reply.body == b'{"ok":true}'
    # As the client would have built it: its default headers under ours, the upstream's
    # timeouts (read: 1 s, from the config).
    assert sent.headers["user-agent"] == client.headers["user-agent"]
    assert sent.headers["content-type"] == "application/json"
    assert sent.headers["host"] == "upstream.test"
    assert sent.extensions["timeout"] == {"connect": 5.0, "read": 1.0, "write": 1.0, "pool": 1.0}


@respx.mock
async def test_status_body_and_useful_headers_pass_through_hop_by_hop_do_not() -> None:
    headers = {
        "x-request-id": "up-1",
        "retry-after": "3",
        "retry-after-ms": "3000",
        "x-ratelimit-remaining-requests": "0",
        "connection": "keep-alive",
        "keep-alive": "timeout=5",
        "set-cookie": "a=b",
        "content-encoding": "gzip",
    }
    import gzip

    error = b'{"error":{"message":"slow down","type":"rate_limit_error","param":null,"code":null}}'
    respx.post(f"{BASE}/chat/completions").respond(
        429, content=gzip.compress(error), headers=headers
    )
    async with httpx.AsyncClient() as client:
        reply = await upstream(client).chat_completions(BODY, stream=True)
    assert reply.status == 429 and not reply.streamed  # an error status comes back whole
    assert reply.body == error  # decoded, so content-encoding must not pass
    assert reply.headers == {
        "x-upstream-request-id": "up-1",
        "retry-after": "3",
        "retry-after-ms": "3000",
        "x-ratelimit-remaining-requests": "0",
    }


@respx.mock
async def test_stream_is_relayed_chunk_by_chunk_and_closed() -> None:
    chunks = [b'data: {"a":1}\n\n', b'data: {"a":2}\n\n', b"data: [DONE]\n\n"]
    stream = ScriptedStream(chunks)
    respx.post(f"{BASE}/chat/completions").respond(
        200, stream=stream, headers={"content-type": "text/event-stream"}
    )
    async with httpx.AsyncClient() as client:
        reply = await upstream(client).chat_completions(BODY, stream=True)
        assert reply.chunks is not None and reply.media_type == "text/event-stream"
        assert stream.sent == 0  # nothing read before the client asks
        first = await anext(reply.chunks)
        assert first == chunks[0] and stream.sent == 1
        assert await collect(reply.chunks) == b"".join(chunks[1:])
    assert stream.closed


@respx.mock
async def test_stream_dying_midway_raises_unreachable_after_what_arrived() -> None:
    stream = ScriptedStream([b"data: {}\n\n"], httpx.RemoteProtocolError("peer closed connection"))
    respx.post(f"{BASE}/chat/completions").respond(200, stream=stream)
    async with httpx.AsyncClient() as client:
        reply = await upstream(client).chat_completions(BODY, stream=True)
        assert reply.chunks is not None
        assert await anext(reply.chunks) == b"data: {}\n\n"
        with pytest.raises(UpstreamUnreachable):
            await anext(reply.chunks)
    assert stream.closed


@respx.mock
async def test_closing_the_relay_early_closes_the_upstream_response() -> None:
    stream = ScriptedStream([b"data: 1\n\n", b"data: 2\n\n", b"data: 3\n\n"])
    respx.post(f"{BASE}/chat/completions").respond(200, stream=stream)
    async with httpx.AsyncClient() as client:
        reply = await upstream(client).chat_completions(BODY, stream=True)
        assert reply.chunks is not None
        await anext(reply.chunks)
        await reply.chunks.aclose()  # what happens when the client disconnects
    assert stream.closed and stream.sent == 1


@pytest.mark.parametrize(
    ("error", "expected", "status"),
    [
        (httpx.ConnectError("refused"), UpstreamUnreachable, 502),
        (httpx.ConnectTimeout("slow connect"), UpstreamTimeout, 504),
        (httpx.ReadTimeout("slow read"), UpstreamTimeout, 504),
        (httpx.RemoteProtocolError("garbage"), UpstreamUnreachable, 502),
    ],
)
@respx.mock
async def test_failures_before_the_first_byte_map_to_502_or_504(
    error: Exception, expected: type[Exception], status: int
) -> None:
    respx.post(f"{BASE}/chat/completions").mock(side_effect=error)
    async with httpx.AsyncClient() as client:
        for stream in (False, True):
            with pytest.raises(expected) as info:
                await upstream(client).chat_completions(BODY, stream=stream)
            assert info.value.status == status  # type: ignore[attr-defined]


@respx.mock
async def test_passthrough_keeps_method_path_query_and_body() -> None:
    route = respx.get(f"{BASE}/files").respond(200, json={"data": []})
    async with httpx.AsyncClient() as client:
        reply = await upstream(client).passthrough(
            "GET",
            "/files",
            b"purpose=batch&limit=2",
            {"authorization": "Bearer client", "accept": "x"},
            b"",
        )
        assert reply.chunks is not None
        assert await collect(reply.chunks) == b'{"data":[]}'
    sent = route.calls.last.request
    assert sent.url.query == b"purpose=batch&limit=2"
    assert sent.headers["authorization"] == "Bearer sk-up"  # the client's key never leaves
    assert sent.headers["accept"] == "x"


@respx.mock
async def test_a_connection_the_server_closed_before_answering_is_tried_once_more() -> None:
    dropped = httpx.RemoteProtocolError("Server disconnected without sending a response.")
    route = respx.post(f"{BASE}/chat/completions").mock(
        side_effect=[dropped, httpx.Response(200, json={"ok": True})]
    )
    async with httpx.AsyncClient() as client:
        reply = await upstream(client).chat_completions(BODY, stream=False)
    assert reply.status == 200 and route.call_count == 2
    assert route.calls[0].request.content == route.calls[1].request.content
