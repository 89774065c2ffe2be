from __future__ import annotations

import json
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from policies.artifact_prompts import parse_plan, planner_request, summary_within
from policies.artifact_prompts import summary_request as document_summary_request
from policies.artifacts import Artifact
from policies.extraction import Known, extraction_request, parse_decisions
from policies.intent_keywords import KeywordClassifier
from policies.intent_llm import llm_request, parse_llm_reply
from policies.summaries import parse_summary, summary_request
from policies.tokens import count_messages
from proxy.core.config import UpstreamConfig
from proxy.upstream.echo import EchoUpstream
from proxy.upstream.echo_answers import third_person
from tests.fakes.openai_upstream import collect
from tests.openapi_check import assert_openai_shape

MESSAGES = [{"role": "system", "content": "be kind"}, {"role": "user", "content": "what is 2+2?"}]


def echo() -> EchoUpstream:
    return EchoUpstream("echo", UpstreamConfig(kind="echo"))


async def test_echo_describes_what_it_received_with_real_token_counts() -> None:
    reply = await echo().chat_completions({"model": "gpt-4o", "messages": MESSAGES}, stream=False)
    body = json.loads(reply.body or b"")
    content = body["choices"][0]["message"]["content"]
    tokens = count_messages(MESSAGES, "gpt-4o")
    assert content.startswith(
        f"echo: received 2 messages (system=1, user=1), {tokens} prompt tokens."
    )
    assert 'Last user message: "what is 2+2?"' in content
    assert body["usage"]["prompt_tokens"] == tokens


async def test_echo_is_deterministic_and_its_stream_says_the_same() -> None:
    request = {"model": "m", "messages": MESSAGES, "stream_options": {"include_usage": True}}
    first = json.loads((await echo().chat_completions(request, stream=False)).body or b"")
    second = json.loads((await echo().chat_completions(request, stream=False)).body or b"")
    assert first["choices"] == second["choices"] and first["id"] == second["id"]
    streamed = await echo().chat_completions(request, stream=True)
    assert streamed.chunks is not None
    events = (await collect(streamed.chunks)).decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == first["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == first["usage"]


async def test_echo_stream_has_no_usage_chunk_unless_asked() -> None:
    streamed = await echo().chat_completions({"model": "m", "messages": MESSAGES}, stream=True)
    assert streamed.chunks is not None
    assert b'"usage"' not in await collect(streamed.chunks)


# --- tools, structured outputs and memproxy's own calls ----------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 2},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "where": {
                    "type": "object",
                    "properties": {
                        "lat": {"type": "number"},
                        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2},
                    },
                    "required": ["lat", "tags"],
                },
                "note": {"type": "string"},
            },
            "required": ["city", "unit", "days", "where"],
            "additionalProperties": False,
        },
    },
}
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup_order",
        "parameters": {
            "type": "object",
            "properties": {
                "order_id": {"$ref": "#/$defs/id"},
                "express": {"anyOf": [{"type": "null"}, {"type": "boolean"}]},
            },
            "required": ["order_id", "express"],
            "$defs": {"id": {"type": "string", "pattern": "^[a-z]+$", "default": "abc"}},
        },
    },
}


async def reply_of(body: dict[str, Any]) -> dict[str, Any]:
    reply = await echo().chat_completions({"model": "m", **body}, stream=False)
    return dict(json.loads(reply.body or b""))


def assert_valid_call(call: dict[str, Any], tool: dict[str, Any]) -> None:
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == tool["function"]["name"]
    Draft202012Validator(tool["function"]["parameters"]).validate(
        json.loads(call["function"]["arguments"])
    )


@pytest.mark.parametrize(
    ("tool_choice", "expected"),
    [
        ({"type": "function", "function": {"name": "lookup_order"}}, LOOKUP),
        ("required", WEATHER),
    ],
)
async def test_a_forced_tool_is_called_with_arguments_valid_against_its_schema(
    tool_choice: Any, expected: dict[str, Any]
) -> None:
    body = await reply_of(
        {"messages": MESSAGES, "tools": [WEATHER, LOOKUP], "tool_choice": tool_choice}
    )
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert_valid_call(call, expected)
    assert_openai_shape("CreateChatCompletionResponse", body)


async def test_auto_calls_a_tool_only_when_the_user_names_it() -> None:
    named = [{"role": "user", "content": "Please use get weather for Lisbon"}]
    body = await reply_of({"messages": named, "tools": [LOOKUP, WEATHER]})
    assert_valid_call(body["choices"][0]["message"]["tool_calls"][0], WEATHER)
    unnamed = await reply_of({"messages": MESSAGES, "tools": [LOOKUP, WEATHER]})
    assert "tool_calls" not in unnamed["choices"][0]["message"]
    answered = [
        *named,
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "c",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": "{}"},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c", "content": "sunny"},
    ]
    after = await reply_of({"messages": answered, "tools": [WEATHER]})
    assert after["choices"][0]["message"]["content"].startswith("echo: received")
    none = await reply_of({"messages": named, "tools": [WEATHER], "tool_choice": "none"})
    assert "tool_calls" not in none["choices"][0]["message"]


async def test_a_streamed_tool_call_arrives_in_chat_completion_deltas() -> None:
    request = {"model": "m", "messages": MESSAGES, "tools": [WEATHER], "tool_choice": "required"}
    whole = await reply_of(request)
    streamed = await echo().chat_completions(request, stream=True)
    assert streamed.chunks is not None
    events = (await collect(streamed.chunks)).decode().split("\n\n")
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    for chunk in chunks:
        assert_openai_shape("CreateChatCompletionStreamResponse", chunk)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["id"] == whole["choices"][0]["message"]["tool_calls"][0]["id"]
    assert calls[0]["function"]["name"] == "get_weather" and len(calls) > 2
    arguments = "".join(c["function"]["arguments"] for c in calls)
    assert arguments == whole["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_json_schema_and_json_object_replies_are_valid_json() -> None:
    schema = {
        "type": "object",
        "properties": {
            "answer": {"type": "string"},
            "score": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
            "kind": {"enum": ["a", "b"]},
            "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1},
        },
        "required": ["answer", "score", "kind", "items"],
        "additionalProperties": False,
        "$defs": {
            "item": {
                "type": "object",
                "properties": {"n": {"type": "integer", "multipleOf": 5, "minimum": 3}},
                "required": ["n"],
                "additionalProperties": False,
            }
        },
    }
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "out", "strict": True, "schema": schema},
    }
    for stream in (False, True):
        request = {"model": "m", "messages": MESSAGES, "response_format": response_format}
        reply = await echo().chat_completions(request, stream=stream)
        if stream:
            assert reply.chunks is not None
            events = (await collect(reply.chunks)).decode().split("\n\n")[:-2]
            content = "".join(
                json.loads(e.removeprefix("data: "))["choices"][0]["delta"].get("content") or ""
                for e in events
            )
        else:
            content = json.loads(reply.body or b"")["choices"][0]["message"]["content"]
        Draft202012Validator(schema).validate(json.loads(content))
    body = await reply_of({"messages": MESSAGES, "response_format": {"type": "json_object"}})
    assert json.loads(body["choices"][0]["message"]["content"])["echo"].startswith("echo: received")


async def content_for(request: dict[str, Any]) -> str:
    body = await reply_of(request)
    return str(body["choices"][0]["message"]["content"])


async def test_echo_classifies_intent_as_the_llm_classifier_asks() -> None:
    classifier = KeywordClassifier()
    request = llm_request("m", "Can you translate this into French?", [], classifier.labels)
    intent = parse_llm_reply(await content_for(request), classifier.labels)
    assert intent is not None and intent.method == "llm"
    assert intent.label == classifier.classify("Can you translate this into French?").label


async def test_echo_extracts_the_users_first_person_statements_as_memories() -> None:
    exchange = [
        {
            "role": "user",
            "content": "Hi! I live in Lisbon. My dog is called Rex.\nI really like green tea. What should I do today?",
        },
        {"role": "assistant", "content": "I think you should walk Rex."},
    ]
    known = [Known("mem_1", "fact", "The user's dog is called Rex.", False)]
    content = await content_for(extraction_request("m", exchange, known))
    accepted, rejected = parse_decisions(content, known)
    assert [(d.action, d.kind, d.text) for d in accepted] == [
        ("add", "fact", "The user lives in Lisbon."),
        ("add", "preference", "The user really likes green tea."),
    ]
    assert rejected == []


async def test_echo_summarises_history_and_plans_documents_as_their_callers_parse() -> None:
    turns = [
        {"role": "user", "content": "I plan a trip to Japan"},
        {"role": "assistant", "content": "Nice"},
    ]
    summary = parse_summary(
        await content_for(summary_request("m", "The user likes trains.", turns, max_tokens=100))
    )
    assert summary.splitlines() == [
        "The user likes trains.",
        "- user: I plan a trip to Japan",
        "- assistant: Nice",
    ]
    artifacts = [
        Artifact.of_text("att_1", "attachment", "A", [("short " * 10, 10)], "h1"),
        Artifact.of_text("att_2", "attachment", None, [("long " * 900, 900)], "h2"),
    ]
    plan = parse_plan(await content_for(planner_request("m", "what?", artifacts, 100)), artifacts)
    assert plan is not None
    assert [(c.key, c.strategy) for c in plan] == [
        ("att_1", "include_full"),
        ("att_2", "relevant_passages"),
    ]
    focused = await content_for(
        document_summary_request("m", "what?", "A", "alpha beta gamma " * 500, 50)
    )
    assert summary_within(focused, 50) is not None and focused.startswith("alpha beta gamma")


@pytest.mark.parametrize(
    ("sentence", "fact"),
    [
        ("I live in Lisbon", "The user lives in Lisbon"),
        ("I'm allergic to peanuts", "The user is allergic to peanuts"),
        ("I am a nurse", "The user is a nurse"),
        ("My sister is called Ana", "The user's sister is called Ana"),
        ("I have two cats and I love my cats", "The user has two cats and they love their cats"),
        ("I study physics", "The user studies physics"),
        ("I don't eat meat", "The user doesn't eat meat"),
        ("I moved to Porto in 2020", "The user moved to Porto in 2020"),
    ],
)
def test_first_person_statements_read_in_the_third_person(sentence: str, fact: str) -> None:
    assert third_person(sentence) == fact
