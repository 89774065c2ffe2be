from __future__ import annotations

from typing import Any

import pytest

from proxy.core.errors import BadRequest
from proxy.core.requests import check_chat_request, parse_json_object

GOOD: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("raw", [b"", b"   ", b"{", b"[1]", b'"s"', b"\xff\xfe", b"null"])
def test_bodies_that_are_not_json_objects_are_400(raw: bytes) -> None:
    with pytest.raises(BadRequest) as info:
        parse_json_object(raw)
    assert info.value.status == 400


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"model": None}, "model"),
        ({"model": ""}, "model"),
        ({"model": 3}, "model"),
        ({"messages": None}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": ["hi"]}, "messages[0]"),
        ({"messages": [{"content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"stream": "yes"}, "stream"),
        ({"model": "m" * 257}, "model"),
        ({"model": "gpt\x00"}, "model"),
        ({"messages": [{"role": "user", "content": "x", "name": "a\x00b"}]}, "messages[0].name"),
        (
            {"messages": [{"role": "assistant", "tool_calls": {"id": "c"}}]},
            "messages[0].tool_calls",
        ),
        ({"messages": [{"role": "assistant", "tool_calls": ["c"]}]}, "messages[0].tool_calls[0]"),
        (
            {
                "messages": [
                    {"role": "assistant", "tool_calls": [{"id": ["c"], "function": {"name": "f"}}]}
                ]
            },
            "messages[0].tool_calls[0].id",
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": "f"}]}]},
            "messages[0].tool_calls[0].function",
        ),
        (
            {
                "messages": [
                    {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": 3}}]}
                ]
            },
            "messages[0].tool_calls[0].function.name",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {}}}],
                    }
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
        ({"stream_options": []}, "stream_options"),
        ({"messages": [{"role": "user", "content": ["hi"]}]}, "messages[0].content[0]"),
        (
            {"messages": [{"role": "user", "content": [{"text": "hi"}]}]},
            "messages[0].content[0].type",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": 1, "text": "hi"}]}]},
            "messages[0].content[0].type",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
            "messages[0].content[0].text",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "messages[0].content[0].text",
        ),
        (
            {"messages": [{"role": "assistant", "content": [{"type": "refusal", "refusal": {}}]}]},
            "messages[0].content[0].refusal",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": 5}]}]},
            "messages[0].content[0].image_url",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": 5}}]}
                ]
            },
            "messages[0].content[0].image_url.url",
        ),
    ],
)
def test_wrong_fields_are_400_naming_the_param(patch: dict[str, Any], param: str) -> None:
    body = {**GOOD, **patch}
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(BadRequest) as info:
        check_chat_request(body, 10_000)
    assert info.value.param == param


def test_valid_requests_pass_including_parts_tools_and_unknown_fields() -> None:
    check_chat_request(GOOD, 10_000)
    check_chat_request(
        {
            "model": "m",
            "stream": True,
            "some_future_field": {"x": 1},
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}},
                        {"type": "image_url", "image_url": "https://example.com/cat.png"},
                        {"type": "input_audio", "input_audio": {"data": "AA", "format": "wav"}},
                        {"type": "some_future_part", "whatever": [1]},
                    ],
                },
                {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}"},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c", "content": "42"},
            ],
        },
        10_000,
    )
