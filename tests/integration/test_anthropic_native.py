"""`POST /v1/messages` on an upstream of kind `anthropic`, through the official anthropic SDK,
against a fake Messages API that checks requests strictly (tests/fakes/anthropic_upstream.py):
the request goes natively, the client's prefix byte for byte, the proxy's context as a text
block at the head of the newest user turn."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator
from decimal import Decimal
from typing import Any

import anthropic
import pytest

from proxy.core.config import Config, ContextSettings, PriceConfig, UpstreamConfig
from tests.conftest import KEY, make_config
from tests.fakes.anthropic_upstream import (
    API_KEY,
    TOOL_INPUT,
    FakeAnthropic,
    Reply,
    error_reply,
    message_reply,
)
from tests.fakes.server import ServerThread

ServeProxy = Callable[[Config], str]
MODEL = "claude-fake-1"
CACHED = {"type": "ephemeral"}
WEATHER: Any = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"location": {"type": "string"}}},
    "cache_control": CACHED,
}


@pytest.fixture
def fake() -> Iterator[tuple[FakeAnthropic, str]]:
    app = FakeAnthropic()
    with ServerThread(app) as server:
        yield app, server.url


@pytest.fixture
async def client(
    fake: tuple[FakeAnthropic, str], serve_proxy: ServeProxy
) -> AsyncIterator[anthropic.AsyncAnthropic]:
    upstream = UpstreamConfig(kind="anthropic", base_url=fake[1], api_key=API_KEY)
    base = serve_proxy(make_config(upstream)).removesuffix("/v1")
    async with anthropic.AsyncAnthropic(base_url=base, api_key=KEY, max_retries=0) as c:
        yield c


def alice(**more: str) -> dict[str, str]:
    return {"X-Memory-User-Id": "alice", **more}


async def test_a_message_goes_natively_and_comes_back_as_the_api_sent_it(
    fake: tuple[FakeAnthropic, str], client: anthropic.AsyncAnthropic
) -> None:
    app, _ = fake
    raw = await client.messages.with_raw_response.create(
        model=MODEL,
        max_tokens=100,
        system="Be brief.",
        messages=[{"role": "user", "content": "hello there"}],
        extra_headers=alice(
            **{"anthropic-version": "2023-06-01", "anthropic-beta": "prompt-caching-2024-07-31"}
        ),
    )
    message = await raw.parse()
    assert message.content[0].text == "fake claude reply to: hello there"  # type: ignore[union-attr]
    headers = raw.http_response.headers
    assert headers["x-memory-conversation-id"].startswith("conv_")
    assert int(headers["x-usage-prompt-tokens"]) == message.usage.input_tokens
    received = app.requests[-1]
    assert received.headers["x-api-key"] == API_KEY  # (the upstream's key, not the client's)
    assert received.headers["anthropic-version"] == "2023-06-01"
    assert received.headers["anthropic-beta"] == "prompt-caching-2024-07-31"
    assert received.json() == {
        "max_tokens": 100,
        "messages": [{"role": "user", "content": "hello there"}],
        "model": MODEL,
        "system": "Be brief.",
    }


async def test_a_native_stream_is_relayed_and_stored(
    fake: tuple[FakeAnthropic, str], client: anthropic.AsyncAnthropic
) -> None:
    history: Any = [{"role": "user", "content": "stream me"}]
    async with client.messages.stream(
        model=MODEL, max_tokens=50, messages=history, extra_headers=alice()
    ) as stream:
        final = await stream.get_final_message()
    assert final.content[0].text == "fake claude reply to: stream me"  # type: ignore[union-attr]
    assert final.stop_reason == "end_turn"
    history += [
        {"role": "assistant", "content": [c.model_dump(exclude_none=True) for c in final.content]},
        {"role": "user", "content": "and again"},
    ]
    raw = await client.messages.with_raw_response.create(
        model=MODEL, max_tokens=50, messages=history, extra_headers=alice()
    )
    # The stored reply is what the client resends: the conversation goes on.
    assert raw.http_response.headers["x-memory-history-messages"] == "0"
    first = stream.response.headers["x-memory-conversation-id"]
    assert raw.http_response.headers["x-memory-conversation-id"] == first


async def test_a_tool_use_round_trip(
    fake: tuple[FakeAnthropic, str], client: anthropic.AsyncAnthropic
) -> None:
    app, _ = fake
    history: Any = [{"role": "user", "content": "Weather in Paris?"}]
    reply = await client.messages.create(
        model=MODEL, max_tokens=100, tools=[WEATHER], messages=history, extra_headers=alice()
    )
    call = reply.content[1]
    assert call.type == "tool_use" and call.input == TOOL_INPUT
    history += [
        {"role": "assistant", "content": [c.model_dump(exclude_none=True) for c in reply.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny"}],
        },
    ]
    done = await client.messages.create(
        model=MODEL, max_tokens=100, tools=[WEATHER], messages=history, extra_headers=alice()
    )
    assert done.content[0].text == "fake claude reply to: "  # type: ignore[union-attr]
    assert app.message_requests[-1]["messages"] == history


async def test_the_clients_prefix_reaches_the_upstream_byte_for_byte(
    fake: tuple[FakeAnthropic, str], client: anthropic.AsyncAnthropic
) -> None:
    """Tools, system, earlier turns and every cache_control arrive as the client sent them;
    the recalled context is a text block at the head of the newest user turn."""
    app, _ = fake
    await client.messages.create(
        model=MODEL,
        max_tokens=100,
        messages=[{"role": "user", "content": "My locker code is 4711."}],
        extra_headers=alice(),
    )
    system: Any = [
        {"type": "text", "text": "You are a careful assistant. " * 20},
        {"type": "text", "text": "Answer briefly.", "cache_control": CACHED},
    ]
    newest: Any = {
        "role": "user",
        "content": [{"type": "text", "text": "What is my locker code?", "cache_control": CACHED}],
    }
    sent: Any = {
        "model": MODEL,
        "max_tokens": 100,
        "system": system,
        "tools": [WEATHER],
        "messages": [
            {"role": "user", "content": "Hello, a new topic."},
            {
                "role": "assistant",
                "content": [{"type": "text", "text": "Hello!", "cache_control": CACHED}],
            },
            newest,
        ],
    }
    await client.messages.create(**sent, extra_headers=alice())
    received = app.message_requests[-1]
    for field in ("system", "tools"):
        assert json.dumps(received[field]) == json.dumps(sent[field])
    assert json.dumps(received["messages"][:-1]) == json.dumps(sent["messages"][:-1])
    last = received["messages"][-1]
    context, *own = last["content"]
    assert context["type"] == "text" and "4711" in context["text"]
    assert "cache_control" not in context
    assert json.dumps(own) == json.dumps(newest["content"])


async def test_a_thin_clients_history_goes_as_messages_api_turns(
    fake: tuple[FakeAnthropic, str], client: anthropic.AsyncAnthropic
) -> None:
    app, _ = fake
    thread = alice(**{"X-Memory-Conversation-Id": "thin-1"})
    await client.messages.create(
        model=MODEL,
        max_tokens=100,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        extra_headers=thread,
    )
    raw = await client.messages.with_raw_response.create(
        model=MODEL,
        max_tokens=100,
        messages=[{"role": "user", "content": "Thanks. Anything else?"}],
        extra_headers=thread,
    )
    assert raw.http_response.status_code == 200  # (the strict fake took the history)
    assert raw.http_response.headers["x-memory-history-messages"] == "2"
    messages = app.message_requests[-1]["messages"]
    assert messages == [
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "fake claude reply to: Weather in Paris?"}],
        },
        {"role": "user", "content": "Thanks. Anything else?"},
    ]


async def test_an_upstream_error_passes_through_in_anthropics_shape(
    fake: tuple[FakeAnthropic, str], client: anthropic.AsyncAnthropic
) -> None:
    app, _ = fake
    app.script.append(error_reply(529, "Overloaded"))
    with pytest.raises(anthropic.APIStatusError) as failed:
        await client.messages.create(
            model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "hi"}]
        )
    assert failed.value.status_code == 529
    assert failed.value.body == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "Overloaded"},
    }


async def test_cache_reads_count_in_the_prompt_at_their_own_price(
    fake: tuple[FakeAnthropic, str], serve_proxy: ServeProxy
) -> None:
    app, url = fake
    upstream = UpstreamConfig(kind="anthropic", base_url=url, api_key=API_KEY)
    config = make_config(upstream).model_copy(
        update={
            "pricing": {
                MODEL: PriceConfig(input_per_mtok=3, output_per_mtok=15, cached_input_per_mtok=0.3)
            }
        }
    )
    body = {"model": MODEL, "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}
    reply = message_reply(body)
    reply["usage"] = {
        "input_tokens": 10,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 1000,
        "output_tokens": 20,
    }
    app.script.append(Reply(body=reply))
    base = serve_proxy(config).removesuffix("/v1")
    async with anthropic.AsyncAnthropic(base_url=base, api_key=KEY, max_retries=0) as client:
        raw = await client.messages.with_raw_response.create(**body, extra_headers=alice())
    assert (await raw.parse()).usage.cache_read_input_tokens == 1000
    headers = raw.http_response.headers
    assert headers["x-usage-prompt-tokens"] == "1010"
    assert headers["x-usage-completion-tokens"] == "20"
    # 10 x 3 + 1000 x 0.3 + 20 x 15 per million tokens
    assert Decimal(headers["x-cost-usd"]) == Decimal("0.00063")


async def test_count_tokens_counts_the_context_on_an_anthropic_upstream(
    fake: tuple[FakeAnthropic, str], client: anthropic.AsyncAnthropic
) -> None:
    app, _ = fake
    told: Any = [{"role": "user", "content": "My locker code is 4711."}]
    await client.messages.create(model=MODEL, max_tokens=50, messages=told, extra_headers=alice())
    asked = len(app.requests)
    question: Any = [{"role": "user", "content": "What is my locker code?"}]
    recalled = await client.messages.count_tokens(
        model=MODEL, messages=question, extra_headers=alice()
    )
    off = await client.messages.count_tokens(
        model=MODEL, messages=question, extra_headers=alice(**{"X-Memory-Mode": "off"})
    )
    assert recalled.input_tokens > off.input_tokens
    assert len(app.requests) == asked  # (counted by memproxy: the upstream is not asked)


async def test_keep_shown_sends_earlier_context_back_at_the_head_of_its_user_turn(
    fake: tuple[FakeAnthropic, str], serve_proxy: ServeProxy
) -> None:
    app, url = fake
    upstream = UpstreamConfig(kind="anthropic", base_url=url, api_key=API_KEY)
    config = make_config(upstream, context=ContextSettings(keep_shown=True))
    base = serve_proxy(config).removesuffix("/v1")
    async with anthropic.AsyncAnthropic(base_url=base, api_key=KEY, max_retries=0) as sdk:
        await sdk.messages.create(
            model=MODEL,
            max_tokens=50,
            messages=[{"role": "user", "content": "My locker code is 4711."}],
            extra_headers=alice(),
        )
        history: Any = [{"role": "user", "content": "What is my locker code?"}]
        reply = await sdk.messages.create(
            model=MODEL, max_tokens=50, system="Be brief.", messages=history, extra_headers=alice()
        )
        first = app.message_requests[-1]
        history += [
            {
                "role": "assistant",
                "content": [c.model_dump(exclude_none=True) for c in reply.content],
            },
            {"role": "user", "content": "Thanks, and the weather?"},
        ]
        await sdk.messages.create(
            model=MODEL, max_tokens=50, system="Be brief.", messages=history, extra_headers=alice()
        )
    second = app.message_requests[-1]
    assert "4711" in first["messages"][0]["content"][0]["text"]
    assert second["messages"][0] == first["messages"][0]  # (its context, where it was)
    assert second["messages"][2]["content"] == "Thanks, and the weather?"  # (nothing new)
