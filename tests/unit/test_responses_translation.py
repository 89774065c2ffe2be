"""Responses <-> Chat Completions, whole (proxy/protocols/responses/to_chat.py, from_chat.py,
usage.py): requests translated, replies valid for the spec AND the official SDK's types."""

from __future__ import annotations

from typing import Any

import pytest
from openai.types.responses import Response

from policies.pricing import parse_usage
from proxy.core.errors import BadRequest
from proxy.protocols.responses import (
    chat_request,
    chat_usage,
    parse_input,
    response_from_chat,
    responses_usage,
)
from tests.fakes.openai_upstream import chat_reply
from tests.openapi_check import assert_openai_shape

WEATHER = {
    "type": "function",
    "name": "weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "strict": False,
}


def translate(body: dict[str, Any]) -> dict[str, Any]:
    assert_openai_shape("CreateResponse", body)
    return chat_request(body, parse_input(body).messages).body


def test_every_mapped_field_reaches_its_chat_name() -> None:
    body = {
        "model": "gpt-4o-mini",
        "instructions": "Be brief.",
        "input": "hi",
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "weather"},
        "text": {
            "format": {
                "type": "json_schema",
                "name": "a",
                "schema": {"type": "object"},
                "strict": True,
            },
            "verbosity": "low",
        },
        "max_output_tokens": 50,
        "temperature": 0.2,
        "top_p": 0.9,
        "parallel_tool_calls": False,
        "reasoning": {"effort": "low"},
        "user": "u1",
        "safety_identifier": "s1",
        "prompt_cache_key": "k1",
        "service_tier": "flex",
        "top_logprobs": 2,
        "stream": True,
        "seed_of_a_new_field": 7,
    }
    assert translate(body) == {
        "model": "gpt-4o-mini",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hi"},
        ],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "weather",
                    "description": "The weather in a city.",
                    "parameters": WEATHER["parameters"],
                    "strict": False,
                },
            }
        ],
        "tool_choice": {"type": "function", "function": {"name": "weather"}},
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "a", "schema": {"type": "object"}, "strict": True},
        },
        "verbosity": "low",
        "max_completion_tokens": 50,
        "temperature": 0.2,
        "top_p": 0.9,
        "parallel_tool_calls": False,
        "reasoning_effort": "low",
        "user": "u1",
        "safety_identifier": "s1",
        "prompt_cache_key": "k1",
        "service_tier": "flex",
        "logprobs": True,
        "top_logprobs": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
        "seed_of_a_new_field": 7,
    }


@pytest.mark.parametrize(
    ("choice", "chat"),
    [
        ("auto", "auto"),
        ("none", "none"),
        ("required", "required"),
        (
            {
                "type": "allowed_tools",
                "mode": "required",
                "tools": [{"type": "function", "name": "weather"}],
            },
            {
                "type": "allowed_tools",
                "allowed_tools": {
                    "mode": "required",
                    "tools": [{"type": "function", "function": {"name": "weather"}}],
                },
            },
        ),
    ],
)
def test_tool_choices_translate(choice: Any, chat: Any) -> None:
    body = {"model": "m", "input": "hi", "tools": [WEATHER], "tool_choice": choice}
    assert translate(body)["tool_choice"] == chat


def test_json_object_format_and_plain_text() -> None:
    body = {"model": "m", "input": "hi", "text": {"format": {"type": "json_object"}}}
    assert translate(body)["response_format"] == {"type": "json_object"}
    assert "response_format" not in translate({**body, "text": {"format": {"type": "text"}}})


def test_what_has_no_chat_equivalent_is_dropped_and_listed() -> None:
    body = {
        "model": "m",
        "input": [
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"role": "user", "content": [{"type": "input_file", "file_url": "https://x/a.pdf"}]},
        ],
        "store": False,
        "metadata": {"a": "b"},
        "previous_response_id": "resp_1",
        "include": ["reasoning.encrypted_content"],
        "truncation": "auto",
        "reasoning": {"effort": "high", "summary": "auto"},
        "stream": True,
        "stream_options": {"include_obfuscation": False},
    }
    assert_openai_shape("CreateResponse", body)
    translated = chat_request(body, parse_input(body).messages)
    for key in ("store", "metadata", "previous_response_id", "include", "truncation"):
        assert key not in translated.body
    assert translated.body["messages"] == [{"role": "user", "content": []}]
    assert translated.body["stream_options"] == {"include_usage": True}
    assert set(translated.dropped) == {
        "store",
        "metadata",
        "previous_response_id",
        "include",
        "truncation",
        "reasoning.summary",
        "stream_options.include_obfuscation",
        "input items of type reasoning",
        "content parts without a chat equivalent",
    }


def test_function_calls_split_by_a_reasoning_item_join_again_for_the_chat_api() -> None:
    body = {
        "model": "m",
        "input": [
            {"role": "user", "content": "go"},
            {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "function_call", "call_id": "b", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "a", "output": "1"},
            {"type": "function_call_output", "call_id": "b", "output": "2"},
        ],
    }
    messages = translate(body)["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool"]
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["a", "b"]
    assert chat_reply({"messages": messages}).status == 200  # the fake's tool-call rules


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        ("tools", [{"type": "web_search"}], "tools[0].type"),
        ("tools", [WEATHER, {"type": "file_search", "vector_store_ids": ["v"]}], "tools[1].type"),
        ("tool_choice", {"type": "web_search_preview"}, "tool_choice"),
        ("background", True, "background"),
        ("prompt", {"id": "pmpt_1"}, "prompt"),
    ],
)
def test_what_translation_cannot_serve_is_a_400(field: str, value: Any, param: str) -> None:
    body = {"model": "m", "input": "hi", field: value}
    with pytest.raises(BadRequest) as refused:
        chat_request(body, parse_input(body).messages)
    assert refused.value.param == param
    assert "Responses API" in refused.value.message


# --- replies ------------------------------------------------------------------------------------


def completion(message: dict[str, Any], finish: str = "stop", **extra: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "gpt-4o-mini-2024-07-18",
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
        "usage": {
            "prompt_tokens": 20,
            "completion_tokens": 5,
            "total_tokens": 25,
            "prompt_tokens_details": {"cached_tokens": 8},
            "completion_tokens_details": {"reasoning_tokens": 2},
        },
        **extra,
    }


def check(response: dict[str, Any]) -> Response:
    assert_openai_shape("Response", response)
    return Response.model_validate(response)


REQUEST = {
    "model": "gpt-4o-mini",
    "instructions": "Be brief.",
    "input": "weather in Paris?",
    "tools": [WEATHER],
    "temperature": 0.5,
    "metadata": {"k": "v"},
    "previous_response_id": "resp_prev",
    "store": False,
    "user": "u1",
}


def test_a_text_reply_is_a_completed_response_echoing_the_request() -> None:
    reply = completion({"role": "assistant", "content": "Sunny.", "refusal": None})
    response = response_from_chat(reply, REQUEST, "resp_1", 1700000000)
    sdk = check(response)
    assert sdk.status == "completed" and sdk.output_text == "Sunny."
    assert (sdk.instructions, sdk.temperature, sdk.metadata) == ("Be brief.", 0.5, {"k": "v"})
    assert (sdk.previous_response_id, sdk.store, sdk.user) == ("resp_prev", False, "u1")
    assert sdk.model == "gpt-4o-mini-2024-07-18" and sdk.tools[0].name == "weather"
    assert sdk.usage is not None
    assert sdk.usage.input_tokens == 20 and sdk.usage.output_tokens == 5
    assert sdk.usage.input_tokens_details.cached_tokens == 8
    assert sdk.usage.output_tokens_details.reasoning_tokens == 2
    assert response["output"][0]["content"][0]["annotations"] == []


def test_tool_calls_become_function_call_items() -> None:
    calls = [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
        },
        {
            "id": "call_2",
            "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Rome"}'},
        },
    ]
    reply = completion({"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls")
    sdk = check(response_from_chat(reply, REQUEST, "resp_1", 1))
    assert [(o.type, o.call_id, o.status) for o in sdk.output] == [  # type: ignore[union-attr]
        ("function_call", "call_1", "completed"),
        ("function_call", "call_2", "completed"),
    ]
    assert len({o.id for o in sdk.output}) == 2


@pytest.mark.parametrize(
    ("finish", "reason"), [("length", "max_output_tokens"), ("content_filter", "content_filter")]
)
def test_a_cut_reply_is_incomplete_with_its_reason(finish: str, reason: str) -> None:
    reply = completion({"role": "assistant", "content": "Sun"}, finish)
    sdk = check(response_from_chat(reply, REQUEST, "resp_1", 1))
    assert sdk.status == "incomplete" and sdk.incomplete_details is not None
    assert sdk.incomplete_details.reason == reason
    assert sdk.output[0].status == "incomplete"  # type: ignore[union-attr]


def test_a_refusal_is_a_refusal_part_and_logprobs_are_carried() -> None:
    reply = completion({"role": "assistant", "content": None, "refusal": "I can't."})
    sdk = check(response_from_chat(reply, {"model": "m", "input": "x"}, "resp_1", 1))
    assert sdk.output[0].content[0].type == "refusal"  # type: ignore[union-attr]
    logprobs = {
        "content": [
            {
                "token": "Hi",
                "logprob": -0.1,
                "bytes": [72, 105],
                "top_logprobs": [{"token": "Hi", "logprob": -0.1, "bytes": None}],
            }
        ]
    }
    reply = completion({"role": "assistant", "content": "Hi"})
    reply["choices"][0]["logprobs"] = logprobs
    sdk = check(
        response_from_chat(reply, {"model": "m", "input": "x", "top_logprobs": 1}, "resp_1", 1)
    )
    assert sdk.output[0].content[0].logprobs[0].token == "Hi"  # type: ignore[union-attr]


def test_the_chat_fake_and_echo_shaped_replies_translate_too() -> None:
    body = {"model": "m", "input": "use weather please", "tools": [WEATHER]}
    translated = chat_request(body, parse_input(body).messages).body
    for reply in (chat_reply(translated).body, chat_reply({**translated, "tools": []}).body):
        check(response_from_chat(reply, body, "resp_x", 1))
    bare = {"id": "c", "object": "chat.completion", "created": 1, "model": "m", "choices": []}
    response = response_from_chat(bare, body, "resp_x", 1)
    assert check(response).output == [] and "usage" not in response


def test_usage_maps_both_ways_and_prices_the_same() -> None:
    chat = {
        "prompt_tokens": 100,
        "completion_tokens": 40,
        "total_tokens": 140,
        "prompt_tokens_details": {"cached_tokens": 30},
        "completion_tokens_details": {"reasoning_tokens": 10},
    }
    responses = responses_usage(chat)
    assert responses == {
        "input_tokens": 100,
        "input_tokens_details": {"cached_tokens": 30, "cache_write_tokens": 0},
        "output_tokens": 40,
        "output_tokens_details": {"reasoning_tokens": 10},
        "total_tokens": 140,
    }
    assert parse_usage(chat_usage(responses)) == parse_usage(chat)
    written = {**responses, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 7}}
    parsed = parse_usage(chat_usage(written))
    assert parsed is not None and parsed.cache_write_tokens == 7
    assert chat_usage(None) is None and responses_usage("x") is None


def test_a_stored_refusal_goes_to_the_chat_api_with_content() -> None:
    messages = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "refusal": "No."},
        {"role": "user", "content": "y"},
    ]
    sent = chat_request({"model": "m"}, messages).body["messages"]
    assert sent[1] == {"role": "assistant", "content": "No.", "refusal": "No."}
