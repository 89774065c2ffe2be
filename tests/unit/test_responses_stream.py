"""Chat streams as Responses event streams (proxy/protocols/responses/chat_stream.py), and
native Responses replies observed (observe.py): every event checked against the spec, the
SDK's event types and the SDK's own stream accumulator (tests/responses_check.py)."""

from __future__ import annotations

import json
from typing import Any

from proxy.protocols.responses import (
    ChatToResponsesStream,
    ResponsesAssembler,
    chat_request,
    observe_body,
    parse_input,
)
from proxy.upstream.sse import SSEDecoder
from tests.fakes.openai_responses import FakeResponses
from tests.fakes.openai_upstream import Recorded, chat_reply
from tests.responses_check import check_stream

TOOL = {"type": "function", "name": "lookup", "parameters": {}, "strict": None}


def translate(request: dict[str, Any], chunks: list[bytes], *, end: bool = True) -> bytes:
    """The chat stream `chunks` through a translator, as a relay would run it."""
    stream = ChatToResponsesStream(request, "resp_t1", 1_700_000_000, clock=lambda: 1_700_000_001)
    decoder, out = SSEDecoder(), stream.start()
    for chunk in chunks:
        for payload in decoder.feed(chunk):
            if payload == b"[DONE]":
                out += stream.finish()
            else:
                out += stream.feed(json.loads(payload))
    return out + (stream.finish() if end else b"")


def chat_chunks(request: dict[str, Any]) -> list[bytes]:
    body = chat_request(request, parse_input(request).messages).body
    chunks = chat_reply(body).chunks
    assert chunks is not None
    return chunks


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None, **extra: Any) -> bytes:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    payload = {"id": "c", "object": "chat.completion.chunk", "model": "m", "choices": choices}
    return b"data: " + json.dumps({**payload, **extra}).encode() + b"\n\n"


def types(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in events]


def test_a_text_stream_is_the_full_event_sequence() -> None:
    request = {"model": "gpt-4o-mini", "input": "hello there", "stream": True}
    events = check_stream(translate(request, chat_chunks(request)))
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert types(events) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = events[-1]["response"]
    text = "".join(d["delta"] for d in deltas)
    assert final["output"][0]["content"][0]["text"] == text == events[-4]["text"]
    assert final["status"] == "completed" and final["usage"]["input_tokens"] > 0
    assert final["completed_at"] == 1_700_000_001


def test_a_tool_call_stream_is_a_function_call_item() -> None:
    request = {"model": "m", "input": "please lookup", "tools": [TOOL], "stream": True}
    events = check_stream(translate(request, chat_chunks(request)))
    assert types(events) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    item = events[-1]["response"]["output"][0]
    assert (item["type"], item["call_id"], item["name"]) == ("function_call", "call_1", "lookup")
    assert item["arguments"] == '{"q": "x"}' == events[5]["arguments"]


def test_text_then_two_interleaved_tool_calls_and_a_late_name() -> None:
    chunks = [
        chunk({"role": "assistant", "content": "Let me check."}),
        chunk(
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "call_a",
                        "function": {"name": "lookup", "arguments": '{"a"'},
                    }
                ]
            }
        ),
        chunk({"tool_calls": [{"index": 1, "id": "call_b", "function": {"arguments": "{}"}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}),
        chunk({"tool_calls": [{"index": 1, "function": {"name": "lookup"}}]}),
        chunk({}, "tool_calls"),
        chunk(usage={"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}),
        b"data: [DONE]\n\n",
    ]
    events = check_stream(translate({"model": "m", "input": "x", "tools": [TOOL]}, chunks))
    output = events[-1]["response"]["output"]
    assert [o["type"] for o in output] == ["message", "function_call", "function_call"]
    assert [(o["call_id"], o["arguments"]) for o in output[1:]] == [
        ("call_a", '{"a": 1}'),
        ("call_b", "{}"),
    ]
    assert events[-1]["response"]["usage"]["total_tokens"] == 13
    assert types(events).count("response.completed") == 1  # not again at [DONE]


def test_a_refusal_streams_as_refusal_events() -> None:
    chunks = [chunk({"refusal": "I can't "}), chunk({"refusal": "help."}, "stop"), chunk(usage={})]
    events = check_stream(translate({"model": "m", "input": "x"}, chunks))
    assert "response.refusal.delta" in types(events) and "response.refusal.done" in types(events)
    part = events[-1]["response"]["output"][0]["content"][0]
    assert part == {"type": "refusal", "refusal": "I can't help."}


def test_a_length_finish_is_response_incomplete() -> None:
    chunks = [chunk({"content": "Once upon"}), chunk({}, "length"), b"data: [DONE]\n\n"]
    events = check_stream(translate({"model": "m", "input": "x", "max_output_tokens": 2}, chunks))
    final = events[-1]
    assert final["type"] == "response.incomplete"
    assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["response"]["output"][0]["status"] == "incomplete"


def test_a_broken_stream_fails_with_what_arrived() -> None:
    stream = ChatToResponsesStream({"model": "m", "input": "x"}, "resp_b", 1)
    out = stream.start() + stream.feed(json.loads(chunk({"content": "Half a"})[6:]))
    out += stream.fail("The upstream closed the connection.")
    assert stream.fail("again") == b"" and stream.finish() == b""
    events = check_stream(out)
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.failed" and stream.status == "failed"
    assert final["error"] == {
        "code": "server_error",
        "message": "The upstream closed the connection.",
    }
    assert final["output"][0]["content"][0]["text"] == "Half a"


def test_an_error_chunk_fails_the_response() -> None:
    chunks = [chunk({"content": "a"}), b'data: {"error": {"message": "overloaded"}}\n\n']
    events = check_stream(translate({"model": "m", "input": "x"}, chunks, end=False))
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"]["message"] == "overloaded"


def test_an_empty_stream_still_completes() -> None:
    events = check_stream(translate({"model": "m", "input": "x"}, [b"data: [DONE]\n\n"]))
    assert types(events) == ["response.created", "response.in_progress", "response.completed"]


# --- observing native replies -----------------------------------------------------------------


def native(body: dict[str, Any]) -> tuple[FakeResponses, list[bytes]]:
    """The strict fake's streamed reply to `body`."""
    fake = FakeResponses()
    recorded = Recorded(
        "POST", "/v1/responses", "", {}, json.dumps({**body, "stream": True}).encode()
    )
    reply = fake._default(recorded)
    assert reply.status == 200 and reply.chunks is not None, reply.body
    return fake, reply.chunks


def observe(chunks: list[bytes]) -> ResponsesAssembler:
    assembler, decoder = ResponsesAssembler(), SSEDecoder()
    for piece in chunks:
        for payload in decoder.feed(piece):
            assembler.add(payload)
    return assembler


def test_a_native_stream_is_observed_into_reply_usage_and_status() -> None:
    _, chunks = native({"model": "gpt-4o", "input": "hi there"})
    check_stream(b"".join(chunks))
    seen = observe(chunks)
    assert seen.status == "complete" and seen.response_id == "resp_fake0001"
    reply = seen.reply()
    assert reply is not None and reply["content"].startswith('fake response to: "hi there"')
    assert seen.usage is not None
    assert seen.usage["prompt_tokens"] > 0 and seen.usage["completion_tokens"] > 0


def test_a_native_function_call_is_observed_as_tool_calls() -> None:
    _, chunks = native({"model": "gpt-4o", "input": "please lookup", "tools": [TOOL]})
    reply = observe(chunks).reply()
    assert reply is not None and reply["content"] is None
    assert reply["tool_calls"] == [
        {
            "id": "call_fake0001",
            "type": "function",
            "function": {"name": "lookup", "arguments": '{"query": "please lookup"}'},
        }
    ]


def test_a_broken_native_stream_keeps_what_arrived_as_incomplete() -> None:
    _, chunks = native({"model": "gpt-4o", "input": "tell me a long story"})
    cut = next(i for i, c in enumerate(chunks) if b"output_text.delta" in c) + 2
    seen = observe(chunks[:cut])
    assert seen.status == "incomplete" and seen.response is None and seen.usage is None
    reply = seen.reply()
    assert reply is not None and reply["content"] == "fake response "
    _, calls = native({"model": "gpt-4o", "input": "lookup", "tools": [TOOL]})
    cut = next(i for i, c in enumerate(calls) if b"arguments.delta" in c) + 1
    half = observe(calls[:cut]).reply()
    assert half is not None
    arguments = half["tool_calls"][0]["function"]["arguments"]
    assert (
        arguments
        and '{"query": "lookup"}'.startswith(arguments)
        and arguments != '{"query": "lookup"}'
    )


def test_error_events_and_failed_responses_are_errors() -> None:
    seen = ResponsesAssembler()
    seen.add(
        b'{"type": "error", "code": "server_error", "message": "boom", "param": null, "sequence_number": 3}'
    )
    assert seen.status == "error" and seen.error_text == "boom"
    failed = ChatToResponsesStream({"model": "m", "input": "x"}, "resp_f", 1)
    raw = failed.start() + failed.fail("upstream died")
    seen = observe([raw])
    assert seen.status == "error" and seen.error_text == "upstream died"
    assert seen.reply() is None


def test_a_translated_stream_observes_to_the_same_reply_as_its_chat_stream() -> None:
    request = {"model": "m", "input": "please lookup", "tools": [TOOL], "stream": True}
    seen = observe([translate(request, chat_chunks(request))])
    assert seen.status == "complete"
    assert seen.reply() == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "lookup", "arguments": '{"q": "x"}'},
            }
        ],
    }


def test_a_whole_native_body_is_observed() -> None:
    fake = FakeResponses()
    body = json.dumps({"model": "gpt-4o", "input": "hi", "store": False}).encode()
    reply = fake._default(Recorded("POST", "/v1/responses", "", {}, body))
    seen = observe_body(json.dumps(reply.body).encode())
    assert seen.status == "complete" and seen.response_id == "resp_fake0001"
    assert seen.messages() == [{"role": "assistant", "content": seen.reply()["content"]}]  # type: ignore[index]
    error = observe_body(b'{"error": {"message": "bad", "type": "invalid_request_error"}}')
    assert error.status == "error" and error.error_text == "bad"
    assert observe_body(b"not json").status == "incomplete"
