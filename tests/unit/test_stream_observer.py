"""Watching a relayed stream: the reply and usage are read whatever the network does to the
bytes, and the usage-only chunk is left out for a client that did not ask for it."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from proxy.pipeline.observe import StreamEnd, StreamWatch
from proxy.protocols.chat import ChatReader
from proxy.upstream.sse import MAX_EVENT_BYTES, EventTooLarge, SSEDecoder

USAGE = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}


def event(payload: Any, newline: bytes = b"\n") -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return b"data: " + data.encode() + newline + newline


def chunk(choices: list[Any], **extra: Any) -> dict[str, Any]:
    return {"id": "c1", "object": "chat.completion.chunk", "choices": choices, **extra}


def stream(newline: bytes = b"\n", usage_chunk: dict[str, Any] | None = None) -> bytes:
    parts = [
        chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}}]),
        chunk([{"index": 0, "delta": {"content": "hi"}}]),
        chunk([{"index": 0, "delta": {"content": " there"}, "finish_reason": "stop"}]),
        usage_chunk or chunk([], usage=USAGE),
    ]
    return b"".join(event(p, newline) for p in parts) + event("[DONE]", newline)


def watch(*, drop: bool) -> StreamWatch:
    """A chat stream's watch, as a turn has it; nothing settles while feeding."""
    return StreamWatch(
        ChatReader(drop_usage_chunk=drop),
        request_id="req_test",
        settle=settle_nothing,
        spawn=asyncio.ensure_future,
    )


async def settle_nothing(end: StreamEnd) -> None:
    pass


def observe(pieces: list[bytes], *, drop: bool) -> tuple[StreamWatch, bytes]:
    observer = watch(drop=drop)
    out = b"".join(observer.feed(p) for p in pieces) + observer.flush()
    return observer, out


def client_events(out: bytes) -> list[bytes]:
    decoder = SSEDecoder()
    return decoder.feed(out) + ([decoder.pending()] if decoder.pending() else [])


@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"])
def test_every_cut_of_the_stream_reads_the_same_reply_and_drops_the_usage_chunk(
    newline: bytes,
) -> None:
    whole = stream(newline)
    for cut in range(1, len(whole)):
        observer, out = observe([whole[:cut], whole[cut:]], drop=True)
        assert observer.reader.reply.message()["content"] == "hi there", cut
        assert observer.reader.reply.usage == USAGE, cut
        assert observer.reader.reply.done, cut
        payloads = client_events(out)
        assert len(payloads) == 4, cut  # three chunks and [DONE], no usage chunk
        assert all(b'"usage"' not in p for p in payloads), cut


def test_a_client_that_asked_for_usage_gets_every_event_whole_as_it_completes() -> None:
    """Each event once it is whole (its line ends as LF), none split across what the client
    reads: a stream that breaks mid-event ends with an error event of its own."""
    whole = stream(b"\r\n")
    pieces = [whole[i : i + 7] for i in range(0, len(whole), 7)]
    observer = watch(drop=False)
    out = [observer.feed(p) for p in pieces]
    assert all(o == b"" or o.endswith(b"\n\n") for o in out)
    assert b"".join(out) + observer.flush() == whole.replace(b"\r\n", b"\n")
    assert observer.reader.reply.usage == USAGE


def test_a_large_event_cut_into_many_reads_is_one_event_and_an_endless_one_is_refused() -> None:
    """(A blank line may straddle two reads.) Past MAX_EVENT_BYTES without one, the upstream
    is not sending chat chunks, and holding more would only grow the proxy's memory."""
    decoder, big = SSEDecoder(), b"data: " + b"x" * 100_000 + b"\n\n"
    events: list[bytes] = []
    for i in range(0, len(big), 3):
        events += decoder.split(big[i : i + 3])
    assert events == [big] and decoder.pending() == b""
    with pytest.raises(EventTooLarge):
        decoder.split(b"data: " + b"x" * MAX_EVENT_BYTES)


@pytest.mark.parametrize(
    "usage_chunk",
    [
        {"id": "c1", "object": "chat.completion.chunk", "usage": USAGE},
        {"id": "c1", "object": "chat.completion.chunk", "choices": None, "usage": USAGE},
    ],
)
def test_a_usage_chunk_without_choices_is_dropped_too(usage_chunk: dict[str, Any]) -> None:
    observer, out = observe([stream(usage_chunk=usage_chunk)], drop=True)
    assert b'"usage"' not in out
    assert observer.reader.reply.usage == USAGE


def test_a_usage_chunk_with_choices_is_not_the_usage_only_chunk() -> None:
    # Some servers put usage on the last content chunk: it carries content, so it stays.
    last = chunk([{"index": 0, "delta": {"content": "!"}}], usage=USAGE)
    observer, out = observe([stream(usage_chunk=last)], drop=True)
    assert b'"usage"' in out
    assert observer.reader.reply.message()["content"] == "hi there!"


def test_a_last_event_without_its_blank_line_is_still_read() -> None:
    body = stream().removesuffix(event("[DONE]"))  # ends with the usage chunk...
    body = body.removesuffix(b"\n\n")  # ...cut short of its blank line
    observer, out = observe([body], drop=True)
    assert observer.reader.reply.usage == USAGE
    assert b'"usage"' not in out
    kept, seen = observe([body], drop=False)
    assert seen == body and kept.reader.reply.usage == USAGE


def test_a_chunk_that_breaks_reassembly_still_reaches_the_client() -> None:
    bad = event(chunk([{"index": 0, "delta": {"tool_calls": [{"index": "x"}]}}]))
    observer, out = observe([bad + stream()], drop=True)
    assert observer.broken
    assert out.startswith(bad)


def test_after_a_chunk_not_understood_the_usage_is_still_read_and_left_out() -> None:
    parts = [
        chunk([{"index": 0, "delta": {"role": "assistant", "content": "hi"}}]),
        chunk([{"index": 0, "delta": "??"}]),  # not understood: reassembly stops here
        chunk([{"index": 0, "delta": {"content": " there"}, "finish_reason": "stop"}]),
        chunk([], usage=USAGE),
    ]
    body = b"".join(event(p) for p in parts) + event("[DONE]")
    observer, out = observe([body], drop=True)
    assert observer.broken and observer.reader.reply.message()["content"] == "hi"
    # Billed by what the upstream reported, not our count of the text before the break; and
    # the usage chunk the client did not ask for is still left out.
    assert observer.reader.reply.usage == USAGE and observer.reader.reply.done
    assert b'"usage"' not in out and out.endswith(event("[DONE]"))
