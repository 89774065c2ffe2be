"""Responses items <-> neutral messages (proxy/protocols/responses/items.py)."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.core.errors import BadRequest
from proxy.protocols.responses import (
    is_opaque,
    messages_to_items,
    output_to_messages,
    parse_input,
)
from tests.openapi_check import assert_openai_shape

REASONING = {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAA"}


def test_a_string_input_is_one_user_message_after_the_instructions() -> None:
    parsed = parse_input({"instructions": "Be brief.", "input": "hello"})
    assert parsed.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hello"},
    ]
    assert parsed.origin == [None, 0]


def test_a_string_and_one_text_part_are_the_same_message() -> None:
    """As the API lists a string's content (one `input_text` part): one form, so that a chain
    memproxy sends again holds each message as the client sent it, with its chain hash."""
    typed = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}]
    assert parse_input({"input": typed}).messages == parse_input({"input": "hi"}).messages
    two = [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]
    assert parse_input({"input": [{"role": "user", "content": two}]}).messages == [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]


def test_message_items_typed_and_easy_with_every_role_and_part() -> None:
    parsed = parse_input(
        {
            "input": [
                {"role": "developer", "content": "rules"},
                {
                    "type": "message",
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "look"},
                        {"type": "input_image", "image_url": "https://x/a.png", "detail": "low"},
                        {"type": "input_file", "file_id": "file-1"},
                        {"type": "input_image", "file_id": "file-2", "detail": "auto"},
                    ],
                },
                {"role": "system", "content": [{"type": "input_text", "text": "sys"}]},
            ]
        }
    )
    assert parsed.messages == [
        {"role": "developer", "content": "rules"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look"},
                {"type": "image_url", "image_url": {"url": "https://x/a.png", "detail": "low"}},
                {"type": "file", "file": {"file_id": "file-1"}},
                # no chat equivalent: kept as it came
                {"type": "input_image", "file_id": "file-2", "detail": "auto"},
            ],
        },
        {"role": "system", "content": "sys"},  # (one text part: the message its text is)
    ]
    assert parsed.origin == [0, 1, 2]


def test_a_run_of_function_calls_is_one_assistant_message_with_its_text() -> None:
    items = [
        {"role": "user", "content": "weather?"},
        {
            "type": "message",
            "role": "assistant",
            "id": "msg_1",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Checking.", "annotations": []}],
        },
        {"type": "function_call", "call_id": "call_a", "name": "weather", "arguments": "{}"},
        {"type": "function_call", "call_id": "call_b", "name": "time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_a", "output": "sunny"},
        {
            "type": "function_call_output",
            "call_id": "call_b",
            "output": [{"type": "input_text", "text": "noon"}],
        },
    ]
    parsed = parse_input({"input": items})
    assert parsed.messages == [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "call_a",
                    "type": "function",
                    "function": {"name": "weather", "arguments": "{}"},
                },
                {
                    "id": "call_b",
                    "type": "function",
                    "function": {"name": "time", "arguments": "{}"},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_b", "content": [{"type": "text", "text": "noon"}]},
    ]
    assert parsed.origin == [0, 1, 4, 5]


def test_reasoning_and_unknown_items_are_kept_opaque_and_never_read_as_text() -> None:
    shell = {"type": "local_shell_call", "id": "ls_1", "call_id": "c", "action": {}, "status": "x"}
    parsed = parse_input({"input": [REASONING, {"id": "msg_9"}, shell]})
    assert [m["opaque_item"] for m in parsed.messages] == [
        REASONING,
        {"id": "msg_9"},
        shell,
    ]
    assert all(is_opaque(m) and m["content"] is None for m in parsed.messages)
    assert all(m["role"] == "assistant" for m in parsed.messages)


@pytest.mark.parametrize(
    ("item", "param"),
    [
        ("hello", "input[1]"),
        ({"content": "no role"}, "input[1].type"),
        ({"role": "tool", "content": "x"}, "input[1].role"),
        ({"role": "user", "content": 3}, "input[1].content"),
        ({"role": "user", "content": [{"text": "no type"}]}, "input[1].content[0].type"),
        ({"role": "user", "content": [{"type": "input_text"}]}, "input[1].content[0].text"),
        ({"role": "user", "content": [{"type": "input_image"}]}, "input[1].content[0].image_url"),
        ({"type": "function_call", "name": "f", "arguments": "{}"}, "input[1].call_id"),
        ({"type": "function_call", "call_id": "c", "arguments": "{}"}, "input[1].name"),
        (
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": {}},
            "input[1].arguments",
        ),
        ({"type": "function_call_output", "call_id": "c"}, "input[1].output"),
        ({"type": "function_call_output", "output": "x"}, "input[1].call_id"),
        ({"type": "item_reference", "id": ""}, "input[1].id"),
        ({"type": 7}, "input[1].type"),
    ],
)
def test_a_malformed_item_is_a_400_naming_its_field(item: Any, param: str) -> None:
    with pytest.raises(BadRequest) as refused:
        parse_input({"input": [{"role": "user", "content": "ok"}, item]})
    assert refused.value.param == param


def test_input_and_instructions_of_the_wrong_type_are_refused() -> None:
    with pytest.raises(BadRequest) as refused:
        parse_input({"input": {"role": "user"}})
    assert refused.value.param == "input"
    with pytest.raises(BadRequest) as refused:
        parse_input({"instructions": ["x"], "input": "hi"})
    assert refused.value.param == "instructions"


STORED: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "developer", "content": [{"type": "text", "text": "dev"}]},
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "look"},
            {"type": "image_url", "image_url": {"url": "https://x/a.png", "detail": "auto"}},
        ],
    },
    {"role": "assistant", "content": None, "opaque_item": REASONING},
    {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
    {"role": "assistant", "content": "It is sunny."},
    {"role": "assistant", "content": None, "refusal": "I cannot."},
]


def test_stored_messages_go_back_as_items_that_parse_to_the_same_messages() -> None:
    items = messages_to_items(STORED)
    assert_openai_shape("CreateResponse", {"model": "gpt-4o", "input": items})
    # (a message of one text part comes back as its text: the same message to the API)
    expected = [
        STORED[0],
        {"role": "developer", "content": "dev"},
        *STORED[2:-1],
        {"role": "assistant", "content": "I cannot."},
    ]
    assert parse_input({"input": items}).messages == expected
    assert items[3] == REASONING
    assert [i["type"] for i in items[4:6]] == ["message", "function_call"]
    assert items[5] == {
        "type": "function_call",
        "call_id": "call_a",
        "name": "f",
        "arguments": "{}",
    }


def test_reasoning_items_can_be_left_out_for_an_upstream_that_keeps_no_state() -> None:
    items = messages_to_items(STORED, keep_reasoning=False)
    assert REASONING not in items and len(items) == len(messages_to_items(STORED)) - 1


def test_output_items_sent_back_as_input_give_the_messages_stored_for_them() -> None:
    """A `store: false` client resends the last output as input: the prefix rule needs the
    very messages stored for that output."""
    output = [
        {**REASONING, "status": "completed"},
        {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": [
                {"type": "output_text", "text": "Hi ", "annotations": [], "logprobs": []},
                {"type": "output_text", "text": "there.", "annotations": [], "logprobs": []},
            ],
        },
        {
            "id": "fc_1",
            "type": "function_call",
            "status": "completed",
            "call_id": "call_1",
            "name": "f",
            "arguments": '{"a": 1}',
        },
    ]
    stored = output_to_messages(output)
    assert stored == parse_input({"input": output}).messages
    assert stored[1] == {
        "role": "assistant",
        "content": "Hi there.",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
        ],
    }


def test_a_refusal_is_kept_beside_the_text_and_a_malformed_output_item_is_kept_opaque() -> None:
    output = [
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "refusal", "refusal": "No."}],
        },
        {"type": "function_call", "name": "no call id"},
        "not an object",
    ]
    stored = output_to_messages(output)
    assert stored[0] == {"role": "assistant", "content": None, "refusal": "No."}
    assert stored[1]["opaque_item"] == {"type": "function_call", "name": "no call id"}
    assert stored[2]["opaque_item"] == {"type": "unknown", "value": "not an object"}
