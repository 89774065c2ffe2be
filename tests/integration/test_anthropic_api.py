"""`POST /v1/messages` with memory, through the official anthropic SDK, on upstreams that speak
the OpenAI shape (translated to chat completions: the strict chat fake, echo)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import anthropic
import httpx
import pytest

from proxy.core.config import (
    ApiKeyConfig,
    Config,
    ServerConfig,
    TenantConfig,
    UpstreamConfig,
)
from tests.conftest import KEY, make_config
from tests.fakes.openai_upstream import FakeOpenAI, error_reply

ServeProxy = Callable[[Config], str]
MODEL = "gpt-4o"
WEATHER: Any = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


def user(name: str) -> dict[str, str]:
    return {"X-Memory-User-Id": name}


@pytest.fixture
async def proxy(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: ServeProxy
) -> AsyncIterator[tuple[FakeOpenAI, str]]:
    app, url = fake_upstream
    upstream = UpstreamConfig(kind="openai", base_url=url, api_key="upstream-key")
    config = make_config(upstream)
    server = ServerConfig(max_body_bytes=200_000, max_request_messages=50)
    config = config.model_copy(update={"server": server})
    yield app, serve_proxy(config).removesuffix("/v1")


@pytest.fixture
async def client(proxy: tuple[FakeOpenAI, str]) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with anthropic.AsyncAnthropic(base_url=proxy[1], api_key=KEY, max_retries=0) as c:
        yield c


def request_of(turns: int) -> dict[str, Any]:
    messages = [{"role": ("user", "assistant")[i % 2], "content": "x"} for i in range(turns)]
    return {"model": MODEL, "max_tokens": 5, "messages": messages}


def chat_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content or [])


async def test_a_message_is_answered_in_anthropic_shape_with_memory_headers(
    proxy: tuple[FakeOpenAI, str], client: anthropic.AsyncAnthropic
) -> None:
    fake, _ = proxy
    raw = await client.messages.with_raw_response.create(
        model=MODEL,
        max_tokens=100,
        system="Be brief.",
        messages=[{"role": "user", "content": "hello there"}],
        extra_body={"temperature": 0.2},
        stop_sequences=["END"],
        extra_headers=user("alice"),
    )
    message = await raw.parse()
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "text"
    assert message.content[0].text == "fake reply to: hello there"
    assert message.stop_reason == "end_turn"
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0
    headers = raw.http_response.headers
    assert headers["x-memory-conversation-id"].startswith("conv_")
    assert int(headers["x-usage-prompt-tokens"]) > 0 and headers["x-cost-usd"] != ""
    sent = fake.chat_requests[-1]
    assert sent["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hello there"},
    ]
    assert sent["max_tokens"] == 100 and sent["stop"] == ["END"] and sent["temperature"] == 0.2


async def test_a_stream_has_anthropics_events_in_order(
    proxy: tuple[FakeOpenAI, str], client: anthropic.AsyncAnthropic
) -> None:
    _, base = proxy
    async with client.messages.stream(
        model=MODEL,
        max_tokens=50,
        messages=[{"role": "user", "content": "stream me"}],
        extra_headers=user("alice"),
    ) as stream:
        text = "".join([t async for t in stream.text_stream])
        final = await stream.get_final_message()
    assert text.strip() == "fake reply to: stream me"
    assert final.content[0].text == text  # type: ignore[union-attr]
    assert final.stop_reason == "end_turn" and final.usage.output_tokens > 0
    async with httpx.AsyncClient(base_url=base) as http:
        body = {
            "model": MODEL,
            "max_tokens": 50,
            "stream": True,
            "messages": [{"role": "user", "content": "raw events"}],
        }
        response = await http.post("/v1/messages", json=body, headers={"x-api-key": KEY})
    events = [line[7:] for line in response.text.splitlines() if line.startswith("event: ")]
    assert events[:2] == ["message_start", "ping"]
    assert events[2] == "content_block_start" and events[-3:] == [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert set(events[3:-3]) == {"content_block_delta"}
    assert response.headers["x-memory-conversation-id"].startswith("conv_")


async def test_a_tool_use_round_trip_continues_one_conversation(
    proxy: tuple[FakeOpenAI, str], client: anthropic.AsyncAnthropic
) -> None:
    fake, base = proxy
    history: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    first = await client.messages.with_raw_response.create(
        model=MODEL, max_tokens=100, tools=[WEATHER], messages=history, extra_headers=user("al")
    )
    reply = await first.parse()
    assert reply.stop_reason == "tool_use"
    call = reply.content[0]
    assert call.type == "tool_use" and call.name == "get_weather" and call.input == {"q": "x"}
    sent = fake.chat_requests[-1]
    assert sent["tools"][0]["function"]["parameters"] == WEATHER["input_schema"]
    history += [
        {"role": "assistant", "content": [c.model_dump(exclude_none=True) for c in reply.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny"}],
        },
    ]
    second = await client.messages.with_raw_response.create(
        model=MODEL,
        max_tokens=100,
        tools=[WEATHER],
        tool_choice={"type": "auto"},
        messages=history,
        extra_headers=user("al"),
    )
    assert (await second.parse()).content[0].text == "fake reply to: Sunny"  # type: ignore[union-attr]
    sent = fake.chat_requests[-1]
    assert sent["messages"][1]["tool_calls"][0]["id"] == call.id
    assert sent["messages"][2] == {"role": "tool", "tool_call_id": call.id, "content": "Sunny"}
    conversation = first.http_response.headers["x-memory-conversation-id"]
    assert second.http_response.headers["x-memory-conversation-id"] == conversation
    async with httpx.AsyncClient(base_url=base, headers={"authorization": f"Bearer {KEY}"}) as h:
        stored = (await h.get(f"/v1/memory/conversations/{conversation}/messages")).json()
    roles = [m["role"] for m in stored["data"]]
    assert roles == ["user", "assistant", "tool", "assistant"]
    assert stored["data"][1]["tool_calls"][0]["function"]["name"] == "get_weather"


async def test_a_failed_tool_result_reaches_the_chat_upstream_as_a_failure(
    proxy: tuple[FakeOpenAI, str], client: anthropic.AsyncAnthropic
) -> None:
    fake, _ = proxy
    history: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    reply = await client.messages.create(
        model=MODEL, max_tokens=100, tools=[WEATHER], messages=history, extra_headers=user("al")
    )
    call = reply.content[0]
    assert call.type == "tool_use"
    failed = {"type": "tool_result", "tool_use_id": call.id, "content": "timeout"}
    history += [
        {"role": "assistant", "content": [c.model_dump(exclude_none=True) for c in reply.content]},
        {"role": "user", "content": [{**failed, "is_error": True}]},
    ]
    await client.messages.create(
        model=MODEL, max_tokens=100, tools=[WEATHER], messages=history, extra_headers=user("al")
    )
    tool = fake.chat_requests[-1]["messages"][2]
    assert tool["role"] == "tool" and tool["tool_call_id"] == call.id
    assert tool["content"] == "[tool error]\ntimeout"


async def test_a_translated_streams_message_start_says_the_input_tokens(
    proxy: tuple[FakeOpenAI, str],
) -> None:
    _, base = proxy
    body = {
        "model": MODEL,
        "max_tokens": 50,
        "stream": True,
        "system": "Be brief. " * 20,
        "messages": [{"role": "user", "content": "count my prompt"}],
    }
    async with httpx.AsyncClient(base_url=base) as http:
        response = await http.post("/v1/messages", json=body, headers={"x-api-key": KEY})
    data = [json.loads(line[6:]) for line in response.text.splitlines() if line[:6] == "data: "]
    start = data[0]
    assert start["type"] == "message_start"
    input_tokens = start["message"]["usage"]["input_tokens"]
    assert input_tokens == int(response.headers["x-usage-prompt-tokens"]) > 40
    async with anthropic.AsyncAnthropic(base_url=base, api_key=KEY, max_retries=0) as sdk:
        events = await sdk.messages.create(
            model=MODEL,
            max_tokens=50,
            stream=True,
            system=body["system"],
            messages=body["messages"],
        )
        async for event in events:
            if event.type == "message_start":
                assert event.message.usage.input_tokens == input_tokens


async def test_a_streamed_tool_call_reaches_the_sdk_whole(
    proxy: tuple[FakeOpenAI, str], client: anthropic.AsyncAnthropic
) -> None:
    async with client.messages.stream(
        model=MODEL,
        max_tokens=50,
        tools=[WEATHER],
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        extra_headers=user("al"),
    ) as stream:
        final = await stream.get_final_message()
    assert final.stop_reason == "tool_use"
    call = final.content[-1]
    assert call.type == "tool_use" and call.name == "get_weather" and call.input == {"q": "x"}


async def test_what_a_user_said_in_one_conversation_reaches_the_next_but_no_other_user(
    proxy: tuple[FakeOpenAI, str], client: anthropic.AsyncAnthropic
) -> None:
    fake, base = proxy
    await client.messages.create(
        model=MODEL,
        max_tokens=100,
        messages=[{"role": "user", "content": "We named the beagle Biscuit."}],
        metadata={"user_id": "alice"},  # (the user, from Anthropic's own field)
    )
    question = [{"role": "user", "content": "What is my beagle called?"}]
    await client.messages.create(
        model=MODEL, max_tokens=100, messages=question, metadata={"user_id": "alice"}
    )
    sent = fake.chat_requests[-1]["messages"]
    assert "Biscuit" in chat_text(sent[-2]["content"]) and sent[-2]["role"] == "system"
    assert sent[-1] == {"role": "user", "content": "What is my beagle called?"}
    await client.messages.create(
        model=MODEL, max_tokens=100, messages=question, extra_headers=user("bob")
    )
    assert "Biscuit" not in json.dumps(fake.chat_requests[-1])
    # Stored as any other turn: the user's export holds it, and erasing the user forgets it.
    async with httpx.AsyncClient(base_url=base, headers={"authorization": f"Bearer {KEY}"}) as h:
        exported = (await h.get("/v1/memory/users/alice/export")).text
        assert "We named the beagle Biscuit." in exported
        assert (await h.delete("/v1/memory/users/alice")).status_code in (200, 204)
    await client.messages.create(
        model=MODEL, max_tokens=100, messages=question, metadata={"user_id": "alice"}
    )
    assert "Biscuit" not in json.dumps(fake.chat_requests[-1])


async def test_the_clients_prefix_reaches_the_upstream_as_without_memory(
    proxy: tuple[FakeOpenAI, str], client: anthropic.AsyncAnthropic
) -> None:
    """The proxy's context goes right before the newest user turn: all the client sent before
    it (system, tools, earlier turns) is what a request without memory sends, whatever
    `cache_control` the client placed (a moved breakpoint still continues the conversation)."""
    fake, _ = proxy
    await client.messages.create(
        model=MODEL,
        max_tokens=100,
        messages=[{"role": "user", "content": "My locker code is 4711."}],
        extra_headers=user("carol"),
    )
    system: Any = [
        {"type": "text", "text": "You are a careful assistant. " * 20},
        {"type": "text", "text": "Answer briefly.", "cache_control": {"type": "ephemeral"}},
    ]
    turns: Any = [
        {"role": "user", "content": "Hello, a new topic."},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello!"}]},
        {
            "role": "user",
            "content": [
                {
                    "type": "text",
                    "text": "What is my locker code?",
                    "cache_control": {"type": "ephemeral"},
                }
            ],
        },
    ]
    for mode in ("off", "full"):
        raw = await client.messages.with_raw_response.create(
            model=MODEL,
            max_tokens=100,
            system=system,
            tools=[WEATHER],
            messages=turns,
            extra_headers={**user("carol"), "X-Memory-Mode": mode},
        )
        assert raw.http_response.status_code == 200
    without, with_memory = fake.chat_requests[-2], fake.chat_requests[-1]
    context = with_memory["messages"][-2]
    assert context["role"] == "system" and "4711" in chat_text(context["content"])
    assert with_memory["messages"][:-2] == without["messages"][:-1]
    assert with_memory["messages"][-1] == without["messages"][-1]
    assert json.dumps(with_memory["tools"]) == json.dumps(without["tools"])
    assert "cache_control" not in json.dumps(with_memory)  # (a chat upstream refuses it)


async def test_count_tokens_counts_what_would_be_sent(
    proxy: tuple[FakeOpenAI, str], client: anthropic.AsyncAnthropic
) -> None:
    messages: Any = [{"role": "user", "content": "How many tokens is this?"}]
    plain = await client.messages.count_tokens(model=MODEL, messages=messages)
    more = await client.messages.count_tokens(
        model=MODEL, messages=messages, system="Be brief.", tools=[WEATHER]
    )
    assert 0 < plain.input_tokens < more.input_tokens


async def test_count_tokens_counts_the_proxys_context_and_stores_nothing(
    proxy: tuple[FakeOpenAI, str], client: anthropic.AsyncAnthropic
) -> None:
    fake, base = proxy
    told: Any = [{"role": "user", "content": "We named the beagle Biscuit."}]
    reply = await client.messages.create(
        model=MODEL, max_tokens=100, messages=told, extra_headers=user("alice")
    )
    told.append({"role": "assistant", "content": reply.content[0].text})  # type: ignore[union-attr]
    question: Any = [{"role": "user", "content": "What is my beagle called?"}]
    asked = len(fake.chat_requests)
    async with httpx.AsyncClient(base_url=base, headers={"authorization": f"Bearer {KEY}"}) as h:

        async def stored() -> list[Any]:
            listed = (await h.get("/v1/memory/conversations", params={"user": "alice"})).json()
            return [
                (await h.get(f"/v1/memory/conversations/{c['id']}/messages")).json()["data"]
                for c in listed["data"]
            ]

        before = await stored()
        recalled = await client.messages.count_tokens(
            model=MODEL, messages=question, extra_headers=user("alice")
        )
        off = await client.messages.count_tokens(
            model=MODEL, messages=question, extra_headers={**user("alice"), "X-Memory-Mode": "off"}
        )
        # (the stored conversation continued: its history is counted, nothing appended)
        continued = await client.messages.count_tokens(
            model=MODEL, messages=[*told, *question], extra_headers=user("alice")
        )
        plain = await client.messages.count_tokens(
            model=MODEL,
            messages=[*told, *question],
            extra_headers={**user("alice"), "X-Memory-Mode": "off"},
        )
        assert recalled.input_tokens > off.input_tokens + 10
        assert continued.input_tokens >= plain.input_tokens
        assert await stored() == before and len(before) == 1
        exchanges = (await h.get("/v1/memory/usage", params={"group_by": "user"})).json()
    assert [row["requests"] for row in exchanges["data"]] == [1]
    assert len(fake.chat_requests) == asked  # (no model was called)


async def test_errors_come_in_anthropics_shape(
    proxy: tuple[FakeOpenAI, str], client: anthropic.AsyncAnthropic
) -> None:
    fake, base = proxy
    with pytest.raises(anthropic.BadRequestError) as bad:
        await client.messages.create(
            model=MODEL,
            max_tokens=10,
            messages=[{"role": "system", "content": "no"}],  # type: ignore[list-item]
        )
    assert bad.value.body == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "messages.0.role: expected 'user' or 'assistant', got 'system'.",
        },
    }
    async with anthropic.AsyncAnthropic(base_url=base, api_key="wrong", max_retries=0) as wrong:
        with pytest.raises(anthropic.AuthenticationError) as denied:
            await wrong.messages.create(
                model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "hi"}]
            )
    assert denied.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    async with httpx.AsyncClient(base_url=base, headers={"x-api-key": KEY}) as http:
        cases = [
            (b"{not json", 400, "invalid_request_error"),
            (b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}', 400, None),
            (b'{"model": "m", "max_tokens": "9", "messages": []}', 400, None),
            (b'{"model": "m", "max_tokens": 9, "stream": "yes", "messages": []}', 400, None),
            (b'{"pad": "' + b"x" * 300_000 + b'"}', 413, "request_too_large"),
            (json.dumps(request_of(51)).encode(), 413, "request_too_large"),
        ]
        for body, status, kind in cases:
            response = await http.post(
                "/v1/messages", content=body, headers={"content-type": "application/json"}
            )
            assert response.status_code == status, response.text
            error = response.json()
            assert error["type"] == "error" and error["error"]["message"]
            assert error["error"]["type"] == (kind or "invalid_request_error")
    assert fake.chat_requests == []  # nothing reached the upstream
    fake.script.append(error_reply(429, "Slow down."))
    with pytest.raises(anthropic.RateLimitError) as limited:
        await client.messages.create(
            model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "hi"}]
        )
    assert limited.value.body == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": "Slow down."},
    }


async def test_the_echo_upstream_serves_messages_without_any_provider(
    serve_proxy: ServeProxy,
) -> None:
    base = serve_proxy(make_config(UpstreamConfig(kind="echo"))).removesuffix("/v1")
    async with anthropic.AsyncAnthropic(base_url=base, api_key=KEY, max_retries=0) as client:
        message = await client.messages.create(
            model="echo", max_tokens=50, messages=[{"role": "user", "content": "ping"}]
        )
        assert message.content and message.content[0].type == "text"
        async with client.messages.stream(
            model="echo", max_tokens=50, messages=[{"role": "user", "content": "ping"}]
        ) as stream:
            final = await stream.get_final_message()
        assert final.content[0].type == "text" and final.stop_reason is not None


async def test_a_key_bound_to_a_user_decides_over_metadata_user_id(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: ServeProxy
) -> None:
    fake, url = fake_upstream
    upstream = UpstreamConfig(kind="openai", base_url=url, api_key="upstream-key")
    config = make_config(upstream)
    tenant = config.tenants["t1"]
    bound = TenantConfig(
        api_keys=[KEY, ApiKeyConfig(key="alice-key", user="alice")],
        upstream="main",
        memory=tenant.memory,
    )
    config = config.model_copy(update={"tenants": {**config.tenants, "t1": bound}})
    base = serve_proxy(config).removesuffix("/v1")
    async with anthropic.AsyncAnthropic(base_url=base, api_key="alice-key", max_retries=0) as c:
        raw = await c.messages.with_raw_response.create(
            model=MODEL,
            max_tokens=10,
            messages=[{"role": "user", "content": "I am alice."}],
            metadata={"user_id": "bob"},  # (decides nothing: the key is alice's)
        )
        with pytest.raises(anthropic.PermissionDeniedError) as refused:
            await c.messages.create(
                model=MODEL,
                max_tokens=10,
                messages=[{"role": "user", "content": "hi"}],
                extra_headers=user("bob"),
            )
    assert refused.value.body["error"]["type"] == "permission_error"  # type: ignore[index]
    conversation = raw.http_response.headers["x-memory-conversation-id"]
    async with httpx.AsyncClient(base_url=base, headers={"authorization": f"Bearer {KEY}"}) as h:
        found = (await h.get(f"/v1/memory/conversations/{conversation}")).json()
    assert found["user"] == "alice"
    assert "metadata" not in fake.chat_requests[-1]
