"""The benchmark's fake upstream (bench/fake_upstream.py) answers `POST /v1/responses` with a
valid response and event stream, in as many chunks as the chat completion it stands beside."""

from __future__ import annotations

from bench.fake_upstream import responses_reply
from tests.fakes.openai_upstream import chat_reply
from tests.openapi_check import assert_openai_shape
from tests.responses_check import check_stream

MESSAGE = {"role": "user", "content": "say hi please now"}


def test_a_whole_response_is_valid_and_says_what_the_chat_fake_says() -> None:
    reply = responses_reply({"model": "gpt-4o-mini", "input": [MESSAGE]})
    assert_openai_shape("Response", reply.body)
    chat = chat_reply({"model": "gpt-4o-mini", "messages": [MESSAGE]}).body
    text = reply.body["output"][0]["content"][0]["text"]
    assert text == chat["choices"][0]["message"]["content"]
    assert reply.body["usage"]["output_tokens"] == len(text.split())


def test_a_stream_is_a_valid_event_sequence_in_as_many_chunks_as_the_chat_one() -> None:
    reply = responses_reply({"model": "gpt-4o-mini", "input": [MESSAGE], "stream": True})
    assert reply.chunks is not None
    events = check_stream(b"".join(reply.chunks))
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["usage"]["total_tokens"] > 0
    chat = chat_reply(
        {
            "model": "gpt-4o-mini",
            "messages": [MESSAGE],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    assert chat.chunks is not None
    assert len(reply.chunks) == len(chat.chunks)
    # The first chunk has no text (as the chat role chunk), each of the next one word.
    assert b"output_text.delta" not in reply.chunks[0]
    assert all(c.count(b"event: response.output_text.delta") == 1 for c in reply.chunks[1:-2])


def test_every_response_has_an_id_of_its_own() -> None:
    ids = {responses_reply({"model": "m", "input": "hi"}).body["id"] for _ in range(3)}
    assert len(ids) == 3
