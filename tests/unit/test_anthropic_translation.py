"""The Anthropic Messages adapter's pure pieces, on plain data: blocks as neutral messages,
the chat request, the reply and the stream back in Anthropic's shape, usage and errors."""

from __future__ import annotations

import json
from typing import Any

import pytest

from policies.identity import chain_hashes
from proxy.core.errors import BadRequest
from proxy.protocols.anthropic.chat_stream import ChatToMessagesStream
from proxy.protocols.anthropic.from_chat import (
    anthropic_usage,
    as_error_body,
    message_from_chat,
    stored_reply,
)
from proxy.protocols.anthropic.request import check_request, parse_messages
from proxy.protocols.anthropic.to_chat import chat_request
from proxy.upstream.anthropic_blocks import to_native
from proxy.upstream.anthropic_chat import DEFAULT_MAX_TOKENS, ChunksFromMessages, messages_request
from storage.records import KEPT_ITEMS

CACHED = {"type": "ephemeral"}


def request(messages: list[Any], **extra: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 10, "messages": messages, **extra}


def test_blocks_become_neutral_messages_with_tool_results_first() -> None:
    body = request(
        [
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "sig"},
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "t1", "name": "w", "input": {"b": 1, "a": 2}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "and hurry"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "content": [{"type": "text", "text": "Sunny"}],
                    },
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/png", "data": "QQ=="},
                    },
                ],
            },
        ],
        system=[{"type": "text", "text": "Be brief.", "cache_control": CACHED}],
    )
    parsed = parse_messages(body)
    assert parsed.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {
                    "id": "t1",
                    "type": "function",
                    "function": {"name": "w", "arguments": '{"a":2,"b":1}'},
                }
            ],
            KEPT_ITEMS: [{"type": "thinking", "thinking": "hmm", "signature": "sig"}],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "Sunny"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "and hurry"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,QQ=="}},
            ],
        },
    ]
    assert parsed.origin == [None, 0, 1, 2, 2]


def test_a_moved_cache_breakpoint_leaves_the_history_hash_alone() -> None:
    """Clients put `cache_control` on the newest message each turn: the history they resend
    must still continue the stored conversation."""
    first = request(
        [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": CACHED}]}]
    )
    later = request([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert chain_hashes(parse_messages(first).messages) == chain_hashes(
        parse_messages(later).messages
    )
    assert parse_messages(first).messages == [{"role": "user", "content": "hi"}]


def test_a_stored_tool_call_hashes_as_the_client_resends_it() -> None:
    reply = stored_reply(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c",
                    "type": "function",
                    "function": {"name": "w", "arguments": '{"city": "Oslo"}'},
                }
            ],
        }
    )
    completion = {"choices": [{"message": reply, "finish_reason": "tool_calls"}]}
    block = message_from_chat(completion, "m", "msg_1")["content"][0]
    resent = parse_messages(
        request([{"role": "user", "content": "x"}, {"role": "assistant", "content": [block]}])
    ).messages[1]
    assert chain_hashes([resent]) == chain_hashes([reply])  # type: ignore[list-item]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 5}, "model"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ({"model": "m", "max_tokens": 5, "messages": []}, "messages"),
        (request([{"role": "user", "content": "x"}], stream="yes"), "stream"),
        (request([{"role": "user", "content": "x"}], temperature=True), "temperature"),
        (request([{"role": "user", "content": "x"}], metadata={"user_id": 5}), "metadata.user_id"),
    ],
)
def test_wrong_types_are_a_400_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as refused:
        check_request(body)
    assert refused.value.param == param


def test_blocks_a_role_cannot_hold_are_refused() -> None:
    with pytest.raises(BadRequest) as refused:
        parse_messages(request([{"role": "user", "content": [{"type": "tool_use"}]}]))
    assert refused.value.param == "messages.0.content.0.type"


def test_the_chat_request_maps_tools_choice_and_sampling() -> None:
    tool = {"name": "w", "description": "d", "input_schema": {"type": "object"}}
    body = request(
        [{"role": "user", "content": "x"}],
        tools=[tool],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        stop_sequences=["END"],
        top_p=0.5,
        top_k=3,
        metadata={"user_id": "u"},
        thinking={"type": "enabled", "budget_tokens": 1024},
        stream=True,
    )
    chat = chat_request(body, parse_messages(body).messages)
    assert chat == {
        "model": "m",
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 10,
        "top_p": 0.5,
        "stop": ["END"],
        "tools": [
            {
                "type": "function",
                "function": {"name": "w", "description": "d", "parameters": {"type": "object"}},
            }
        ],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    named = chat_request({**body, "tool_choice": {"type": "tool", "name": "w"}}, [])
    assert named["tool_choice"] == {"type": "function", "function": {"name": "w"}}


def test_server_tools_cannot_be_translated() -> None:
    body = request([], tools=[{"type": "web_search_20250305", "name": "web_search"}])
    with pytest.raises(BadRequest):
        chat_request(body, [])


def test_a_completion_becomes_a_message_with_anthropics_usage() -> None:
    completion = {
        "choices": [
            {
                "message": {
                    "content": "Hi",
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "w", "arguments": '{"a":1}'},
                        }
                    ],
                },
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {
            "prompt_tokens": 100,
            "completion_tokens": 7,
            "prompt_tokens_details": {"cached_tokens": 60},
            "cache_creation_input_tokens": 30,
        },
    }
    message = message_from_chat(completion, "m", "msg_1")
    assert message["content"] == [
        {"type": "text", "text": "Hi"},
        {"type": "tool_use", "id": "c1", "name": "w", "input": {"a": 1}},
    ]
    assert message["stop_reason"] == "tool_use"
    assert message["usage"] == {
        "input_tokens": 10,
        "cache_creation_input_tokens": 30,
        "cache_read_input_tokens": 60,
        "output_tokens": 7,
    }
    assert anthropic_usage(None)["input_tokens"] == 0


def test_an_openai_error_body_is_reshaped() -> None:
    assert as_error_body(429, {"error": {"message": "slow down", "type": "x"}}) == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": "slow down"},
    }
    native = {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}
    assert as_error_body(529, native) is native
    assert as_error_body(502, None)["error"]["type"] == "api_error"


def events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in raw.decode().strip().split("\n\n"):
        name, data = block.split("\n")
        out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_a_chat_stream_becomes_anthropics_event_sequence() -> None:
    stream = ChatToMessagesStream("m", "msg_1")
    raw = stream.start()
    raw += stream.feed(
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hel"}}]}
    )
    raw += stream.feed({"choices": [{"index": 0, "delta": {"content": "lo"}}]})
    call = {"index": 0, "id": "c1", "function": {"name": "w", "arguments": '{"a"'}}
    raw += stream.feed({"choices": [{"index": 0, "delta": {"tool_calls": [call]}}]})
    more = {"index": 0, "function": {"arguments": ":1}"}}
    raw += stream.feed(
        {"choices": [{"index": 0, "delta": {"tool_calls": [more]}, "finish_reason": "tool_calls"}]}
    )
    raw += stream.feed({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}})
    raw += stream.finish()
    seen = events(raw)
    assert [name for name, _ in seen] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert seen[6][1]["content_block"] == {"type": "tool_use", "id": "c1", "name": "w", "input": {}}
    assert seen[7][1]["delta"] == {"type": "input_json_delta", "partial_json": '{"a"'}
    assert seen[10][1]["delta"]["stop_reason"] == "tool_use"
    assert seen[10][1]["usage"]["input_tokens"] == 9 and seen[10][1]["usage"]["output_tokens"] == 4
    assert stream.finish() == b""


def test_a_broken_stream_ends_with_an_error_event() -> None:
    stream = ChatToMessagesStream("m", "msg_1")
    name, data = events(stream.start() + stream.fail("upstream went away", 502))[-1]
    assert name == "error"
    assert data == {
        "type": "error",
        "error": {"type": "api_error", "message": "upstream went away"},
    }


def test_native_placement_keeps_the_clients_blocks_and_puts_context_after_tool_results() -> None:
    from proxy.protocols.anthropic.native import native_body

    newest = {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "Sunny"},
            {"type": "text", "text": "Thanks", "cache_control": CACHED},
        ],
    }
    body = request(
        [
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t1", "name": "w", "input": {}}],
            },
            newest,
        ],
        system=[{"type": "text", "text": "S", "cache_control": CACHED}],
    )
    parsed = parse_messages(body)
    stored = [
        {"role": "user", "content": "Earlier"},
        {"role": "assistant", "content": "Reply"},
    ]
    context = {"role": "system", "content": "Excerpts: the code is 4711"}
    assembled = [parsed.messages[0], *stored, *parsed.messages[1:-1], context, parsed.messages[-1]]
    sent = native_body(body, parsed, assembled)
    assert sent["system"] is body["system"]
    assert sent["messages"][:2] == [
        {"role": "user", "content": [{"type": "text", "text": "Earlier"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Reply"}]},
    ]
    assert sent["messages"][2:4] == body["messages"][:2]
    assert sent["messages"][4]["content"] == [
        newest["content"][0],
        {"type": "text", "text": "Excerpts: the code is 4711"},
        newest["content"][1],
    ]
    assert native_body(body, parsed, parsed.messages) is body


def test_a_native_stream_folds_into_the_reply_and_its_usage() -> None:
    from proxy.protocols.anthropic.native import MessageAssembler

    folded = MessageAssembler()
    for event in (
        {
            "type": "message_start",
            "message": {
                "usage": {"input_tokens": 5, "cache_read_input_tokens": 90, "output_tokens": 1}
            },
        },
        {
            "type": "content_block_start",
            "index": 0,
            "content_block": {"type": "thinking", "thinking": ""},
        },
        {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "thinking_delta", "thinking": "hm"},
        },
        {
            "type": "content_block_start",
            "index": 1,
            "content_block": {"type": "tool_use", "id": "t", "name": "w", "input": {}},
        },
        {
            "type": "content_block_delta",
            "index": 1,
            "delta": {"type": "input_json_delta", "partial_json": '{"a":'},
        },
        {
            "type": "content_block_delta",
            "index": 1,
            "delta": {"type": "input_json_delta", "partial_json": "1}"},
        },
        {
            "type": "message_delta",
            "delta": {"stop_reason": "tool_use"},
            "usage": {"output_tokens": 7},
        },
        {"type": "message_stop"},
    ):
        folded.add(json.dumps(event).encode())
    assert folded.stopped and folded.message() == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "t", "type": "function", "function": {"name": "w", "arguments": '{"a":1}'}}
        ],
        KEPT_ITEMS: [{"type": "thinking", "thinking": "hm"}],
    }
    assert folded.chat_usage() == {
        "prompt_tokens": 95,
        "completion_tokens": 7,
        "total_tokens": 102,
        "prompt_tokens_details": {"cached_tokens": 90},
    }


def test_a_failed_tool_result_is_marked_in_its_tool_message_and_again_natively() -> None:
    body = {
        "model": "m",
        "max_tokens": 5,
        "messages": [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f"}]},
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "content": "boom",
                        "is_error": True,
                    },
                    {"type": "tool_result", "tool_use_id": "t2", "content": "fine"},
                ],
            },
        ],
    }
    messages = parse_messages(body).messages
    assert messages[2] == {"role": "tool", "tool_call_id": "t1", "content": "[tool error]\nboom"}
    assert messages[3] == {"role": "tool", "tool_call_id": "t2", "content": "fine"}
    turns = to_native(messages)
    results = turns[-1]["content"]
    assert results[0]["is_error"] is True and results[0]["content"] == [
        {"type": "text", "text": "boom"}
    ]
    assert "is_error" not in results[1]


def test_a_chat_request_becomes_a_messages_request_with_the_context_in_the_user_turn() -> None:
    chat = {
        "model": "claude",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "t1", "type": "function", "function": {"name": "w", "arguments": "{}"}}
                ],
            },
            {"role": "system", "content": "CONTEXT"},
            {"role": "tool", "tool_call_id": "t1", "content": "[tool error]\nboom"},
            {"role": "user", "content": "And now?"},
        ],
        "response_format": {"type": "json_object"},
        "stream_options": {"include_usage": True},
        "tool_choice": "none",
        "tools": [{"type": "function", "function": {"name": "w", "parameters": {}}}],
    }
    body = messages_request(chat)
    assert body["system"] == "Be brief." and body["max_tokens"] == DEFAULT_MAX_TOKENS
    assert [t["role"] for t in body["messages"]] == ["user", "assistant", "user"]
    assert body["messages"][2]["content"] == [
        {
            "type": "tool_result",
            "tool_use_id": "t1",
            "content": [{"type": "text", "text": "boom"}],
            "is_error": True,
        },
        {"type": "text", "text": "CONTEXT"},
        {"type": "text", "text": "And now?"},
    ]
    assert body["tool_choice"] == {"type": "none"}
    assert body["tools"] == [{"name": "w", "input_schema": {}}]
    assert "response_format" not in body and "stream_options" not in body
    # The context right before the only user message stays out of `system`.
    first = messages_request(
        {"model": "m", "messages": [chat["messages"][0], chat["messages"][3], chat["messages"][1]]}
    )
    assert first["system"] == "Be brief."
    assert first["messages"][0]["content"][0] == {"type": "text", "text": "CONTEXT"}


def test_a_messages_stream_error_becomes_a_chat_error_chunk() -> None:
    chunks = ChunksFromMessages("m", include_usage=True)
    start = {"type": "message_start", "message": {"id": "msg_1", "usage": {"input_tokens": 3}}}
    assert b'"role":"assistant"' in chunks.feed(json.dumps(start).encode())
    failed = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    out = chunks.feed(json.dumps(failed).encode())
    assert json.loads(out[6:])["error"]["message"] == "Overloaded"
    assert chunks.finish() == b""


def test_native_placement_puts_each_kept_section_at_the_head_of_its_user_turn() -> None:
    from proxy.protocols.anthropic.native import native_body

    body = request(
        [
            {"role": "user", "content": "First?"},
            {"role": "assistant", "content": "One."},
            {"role": "user", "content": "Second?"},
        ]
    )
    parsed = parse_messages(body)
    first, answer, second = parsed.messages
    kept = {"role": "system", "content": "Shown before the first"}
    new = {"role": "system", "content": "Shown before the second"}
    sent = native_body(body, parsed, [kept, first, answer, new, second])
    assert [m["content"] for m in sent["messages"]] == [
        [{"type": "text", "text": "Shown before the first"}, {"type": "text", "text": "First?"}],
        "One.",
        [{"type": "text", "text": "Shown before the second"}, {"type": "text", "text": "Second?"}],
    ]
