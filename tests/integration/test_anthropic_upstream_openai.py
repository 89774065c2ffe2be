"""The OpenAI shapes on an upstream of kind `anthropic`, through the official openai SDK: chat
completions (whole and streamed), the Responses API and memproxy's own model calls (the LLM
intent classifier) reach a fake Messages API that checks requests strictly
(tests/fakes/anthropic_upstream.py) as valid Messages requests, and come back in chat's shape."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import openai
import pytest

from proxy.core.config import Config, IntentSettings, TenantConfig, UpstreamConfig
from tests.conftest import KEY, make_config
from tests.fakes.anthropic_upstream import (
    API_KEY,
    TOOL_INPUT,
    FakeAnthropic,
    Reply,
    message_reply,
)
from tests.fakes.server import ServerThread

ServeProxy = Callable[[Config], str]
MODEL = "claude-fake-1"
WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"location": {"type": "string"}}},
    },
}


@pytest.fixture
def fake() -> Iterator[tuple[FakeAnthropic, str]]:
    app = FakeAnthropic()
    with ServerThread(app) as server:
        yield app, server.url


def on_anthropic(url: str) -> UpstreamConfig:
    return UpstreamConfig(kind="anthropic", base_url=url, api_key=API_KEY)


@pytest.fixture
async def client(
    fake: tuple[FakeAnthropic, str], serve_proxy: ServeProxy
) -> AsyncIterator[openai.AsyncOpenAI]:
    base = serve_proxy(make_config(on_anthropic(fake[1])))
    async with openai.AsyncOpenAI(base_url=base, api_key=KEY, max_retries=0) as c:
        yield c


def alice() -> dict[str, str]:
    return {"X-Memory-User-Id": "alice"}


async def test_a_chat_completion_is_asked_of_the_messages_api(
    fake: tuple[FakeAnthropic, str], client: openai.AsyncOpenAI
) -> None:
    app, _ = fake
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hello there"},
        ],
        stop="END",
        extra_headers=alice(),
    )
    completion = raw.parse()
    assert completion.object == "chat.completion"
    assert completion.choices[0].message.content == "fake claude reply to: hello there"
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None
    assert raw.headers["x-usage-prompt-tokens"] == str(completion.usage.prompt_tokens)
    received = app.requests[-1]
    assert received.path == "/v1/messages" and received.headers["x-api-key"] == API_KEY
    assert received.json() == {
        "model": MODEL,
        "system": "Be brief.",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hello there"}]}],
        "max_tokens": 4096,
        "stop_sequences": ["END"],
    }


async def test_cache_reads_and_writes_count_in_the_prompt_tokens(
    fake: tuple[FakeAnthropic, str], client: openai.AsyncOpenAI
) -> None:
    app, _ = fake
    body = message_reply({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    usage = {
        "input_tokens": 5,
        "cache_read_input_tokens": 90,
        "cache_creation_input_tokens": 20,
        "output_tokens": 7,
    }
    app.script.append(Reply(body={**body, "usage": usage}))
    completion = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}]
    )
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == 115 and completion.usage.completion_tokens == 7
    details = completion.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens == 90
    assert completion.usage.model_extra == {"cache_creation_input_tokens": 20}


async def test_a_streamed_tool_call_comes_back_as_chat_chunks(
    fake: tuple[FakeAnthropic, str], client: openai.AsyncOpenAI
) -> None:
    app, _ = fake
    history: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=history,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers=alice(),
    )
    text, arguments, finish, usage, call = "", "", None, None, None
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            for piece in choice.delta.tool_calls or []:
                call = call or piece
                arguments += piece.function.arguments or ""  # type: ignore[union-attr]
            finish = choice.finish_reason or finish
    assert text == "Let me check." and finish == "tool_calls"
    assert call is not None and call.function is not None
    assert call.function.name == "get_weather" and json.loads(arguments) == TOOL_INPUT
    assert usage is not None and usage.completion_tokens > 0
    sent = app.message_requests[-1]
    assert sent["stream"] is True
    assert sent["tools"] == [
        {
            "name": "get_weather",
            "description": "The weather in a city",
            "input_schema": WEATHER["function"]["parameters"],
        }
    ]
    assert sent["tool_choice"] == {"type": "any", "disable_parallel_tool_use": True}
    # The tool's result goes back as a tool_result block the fake checks against the call.
    history += [
        {"role": "assistant", "content": text, "tool_calls": [call.model_dump(exclude={"index"})]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny"},
    ]
    reply = await client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER], extra_headers=alice()
    )
    assert reply.choices[0].message.content == "fake claude reply to: "
    turns = app.message_requests[-1]["messages"]
    assert [t["role"] for t in turns] == ["user", "assistant", "user"]
    assert turns[2]["content"][0] == {
        "type": "tool_result",
        "tool_use_id": call.id,
        "content": [{"type": "text", "text": "Sunny"}],
    }


async def test_recalled_context_goes_at_the_head_of_the_newest_user_turn(
    fake: tuple[FakeAnthropic, str], client: openai.AsyncOpenAI
) -> None:
    app, _ = fake
    await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "We named the beagle Biscuit."}],
        extra_headers=alice(),
    )
    await client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is my beagle called?"},
        ],
        extra_headers=alice(),
    )
    sent = app.message_requests[-1]
    assert sent["system"] == "Be brief."  # (the client's, alone: its prefix as it was)
    (turn,) = sent["messages"]
    assert "Biscuit" in turn["content"][0]["text"]
    assert turn["content"][1] == {"type": "text", "text": "What is my beagle called?"}


async def test_the_responses_api_is_served_through_chat(
    fake: tuple[FakeAnthropic, str], client: openai.AsyncOpenAI
) -> None:
    app, _ = fake
    first = await client.responses.create(
        model=MODEL, instructions="Be brief.", input="hello", extra_headers=alice()
    )
    assert first.output_text == "fake claude reply to: hello"
    assert app.message_requests[-1]["system"] == "Be brief."
    second = await client.responses.create(
        model=MODEL, input="and again", previous_response_id=first.id, extra_headers=alice()
    )
    assert second.output_text == "fake claude reply to: and again"
    turns = app.message_requests[-1]["messages"]
    assert [t["role"] for t in turns] == ["user", "assistant", "user"]
    streamed = await client.responses.create(
        model=MODEL, input="stream it", stream=True, extra_headers=alice()
    )
    done = [e async for e in streamed if e.type == "response.completed"]
    assert done and done[0].response.output_text == "fake claude reply to: stream it"


async def test_the_llm_intent_classifier_asks_an_anthropic_upstream(
    fake: tuple[FakeAnthropic, str], serve_proxy: ServeProxy
) -> None:
    """memproxy's own model calls go through the upstream seam: on this kind, as Messages
    requests (here the classifier's, on an anthropic upstream of its own)."""
    app, url = fake
    judge = FakeAnthropic()
    with ServerThread(judge) as server:
        verdict = {"label": "question", "confidence": 0.9, "entities": {}}
        said = message_reply({"model": "judge", "messages": [{"role": "user", "content": "x"}]})
        said["content"] = [{"type": "text", "text": json.dumps(verdict)}]
        judge.script.append(Reply(body=said))
        intent = IntentSettings(mode="llm", model="judge", upstream="classifier")
        config = make_config(on_anthropic(url), intent=intent)
        tenants = {"t1": config.tenants["t1"].model_copy(update={"intent": intent})}
        upstreams = {**config.upstreams, "classifier": on_anthropic(server.url)}
        config = config.model_copy(update={"upstreams": upstreams, "tenants": tenants})
        assert isinstance(config.tenants["t1"], TenantConfig)
        base = serve_proxy(config)
        async with openai.AsyncOpenAI(base_url=base, api_key=KEY, max_retries=0) as sdk:
            raw = await sdk.chat.completions.with_raw_response.create(
                model=MODEL,
                messages=[{"role": "user", "content": "What time is it in Lima?"}],
                extra_headers=alice(),
            )
        assert raw.headers["x-memory-intent"] == "question;0.90;llm"
        (asked,) = judge.message_requests
        assert asked["model"] == "judge" and isinstance(asked["system"], str)
        assert asked["messages"][-1]["role"] == "user" and "max_tokens" in asked
    assert app.message_requests[-1]["model"] == MODEL
