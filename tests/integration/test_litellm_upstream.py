"""The `litellm` upstream kind: OpenAI clients talking to Anthropic through memproxy.

Every test drives the real server over loopback: the official openai SDK (or raw httpx, to see
the exact bytes) -> memproxy (uvicorn thread) -> litellm -> the fake Anthropic Messages API
(another uvicorn thread). Bodies and every stream chunk are checked against OpenAI's schema.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from proxy.app import create_app
from proxy.core.config import Config, TimeoutConfig, UpstreamConfig
from proxy.pipeline import exchange
from proxy.upstream.litellm import LiteLLMUpstream
from tests.conftest import KEY, make_config
from tests.fakes.anthropic_upstream import (
    API_KEY,
    REQUEST_ID,
    TOOL_INPUT,
    TOOL_USE_ID,
    FakeAnthropic,
    Reply,
    error_reply,
    overloaded_event,
    stream_events,
)
from tests.fakes.server import ServerThread
from tests.openapi_check import assert_openai_shape

MODEL = "anthropic/claude-3-5-haiku-20241022"
PROVIDER_MODEL = "claude-3-5-haiku-20241022"
HELLO: list[Any] = [{"role": "user", "content": "hello"}]
WEATHER: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"location": {"type": "string"}},
                "required": ["location"],
            },
        },
    }
]

ServeProxy = Callable[[Config], str]


def litellm_upstream(base_url: str, **options: Any) -> UpstreamConfig:
    return UpstreamConfig(kind="litellm", base_url=base_url, api_key=API_KEY, **options)


@pytest.fixture(scope="module")
def anthropic() -> Iterator[tuple[FakeAnthropic, str]]:
    """One fake Anthropic API for the module: (app, base URL without a path)."""
    app = FakeAnthropic()
    with ServerThread(app) as server:
        yield app, server.url


@pytest.fixture(scope="module")
def shared_proxy_url(
    anthropic: tuple[FakeAnthropic, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """memproxy in front of the fake, shared by the module's tests: starting one takes a while."""
    database = tmp_path_factory.mktemp("litellm") / "memproxy.db"
    config = make_config(
        litellm_upstream(anthropic[1], models=[MODEL]),
        database_url=f"sqlite+aiosqlite:///{database}",
    )
    with ServerThread(create_app(config)) as server:
        yield server.url + "/v1"


@pytest.fixture
def fake(anthropic: tuple[FakeAnthropic, str]) -> FakeAnthropic:
    """The fake, with nothing recorded or scripted by earlier tests."""
    app = anthropic[0]
    app.requests.clear()
    app.script.clear()
    app.disconnects = 0
    return app


@pytest.fixture
def fake_url(anthropic: tuple[FakeAnthropic, str]) -> str:
    return anthropic[1]


@dataclass
class Proxy:
    """The shared memproxy, seen as this test's own memory user (so no test continues
    another's conversation), for raw HTTP."""

    url: str
    user: str

    @property
    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {KEY}", "x-memory-user-id": self.user}

    def sdk(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=self.url,
            api_key=KEY,
            max_retries=0,
            default_headers={"x-memory-user-id": self.user},
        )

    async def post(self, body: dict[str, Any]) -> httpx.Response:
        async with httpx.AsyncClient(timeout=10) as http:
            return await http.post(self.url + "/chat/completions", json=body, headers=self.headers)

    async def stream(self, body: dict[str, Any]) -> list[Any]:
        """Every `data:` payload of a streamed reply, decoded; `[DONE]` stays a string."""
        events: list[Any] = []
        async with (
            httpx.AsyncClient(timeout=10) as http,
            http.stream(
                "POST",
                self.url + "/chat/completions",
                json={**body, "stream": True},
                headers=self.headers,
            ) as response,
        ):
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    data = line.removeprefix("data: ")
                    events.append(data if data == "[DONE]" else json.loads(data))
                else:
                    assert line == "", f"unexpected SSE line {line!r}"
        return events


@pytest.fixture
def proxy(shared_proxy_url: str, request: pytest.FixtureRequest) -> Proxy:
    return Proxy(shared_proxy_url, request.node.nodeid)


@pytest.fixture
async def client(proxy: Proxy) -> AsyncIterator[openai.AsyncOpenAI]:
    async with proxy.sdk() as client:
        yield client


def assert_valid_chunks(events: list[Any]) -> list[dict[str, Any]]:
    """The chunks of a complete stream, each valid by OpenAI's schema, ending with [DONE]."""
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    for chunk in chunks:
        assert_openai_shape("CreateChatCompletionStreamResponse", chunk)
        assert chunk["object"] == "chat.completion.chunk"
    assert len({c["id"] for c in chunks}) == 1
    return chunks


def text_of(chunks: list[dict[str, Any]]) -> str:
    return "".join(c["delta"].get("content") or "" for ch in chunks for c in ch["choices"])


async def wait_until(condition: Callable[[], bool], seconds: float = 5.0) -> None:
    """Poll `condition` (state another thread changes) until true; fail after `seconds`."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {seconds} s")
        await asyncio.sleep(0.01)


# Requests: what reaches Anthropic


async def test_plain_completion_is_translated_to_anthropic_and_back(
    client: openai.AsyncOpenAI, fake: FakeAnthropic
) -> None:
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hello"},
        ],
        max_tokens=50,
        temperature=0.2,
        user="end-user-1",
    )
    reply = raw.parse()
    assert reply.choices[0].message.content == "fake claude reply to: hello"
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (6, 6)
    assert reply.usage.total_tokens == 12
    assert raw.headers["x-upstream-request-id"] == REQUEST_ID
    assert_openai_shape("CreateChatCompletionResponse", json.loads(raw.content))

    sent = fake.requests[-1]
    assert sent.path == "/v1/messages"
    assert sent.headers["x-api-key"] == API_KEY
    assert "authorization" not in sent.headers
    body = sent.json()
    assert body["model"] == PROVIDER_MODEL
    assert body["system"] in ("Be brief.", [{"type": "text", "text": "Be brief."}])
    assert [m["role"] for m in body["messages"]] == ["user"]
    assert body["max_tokens"] == 50
    assert body["temperature"] == 0.2
    assert body["metadata"] == {"user_id": "end-user-1"}


async def test_max_tokens_is_supplied_when_the_client_sends_none(
    client: openai.AsyncOpenAI, fake: FakeAnthropic
) -> None:
    await client.chat.completions.create(model=MODEL, messages=HELLO)
    assert isinstance(fake.message_requests[-1]["max_tokens"], int)


async def test_openai_parameters_anthropic_lacks_are_dropped(
    client: openai.AsyncOpenAI, fake: FakeAnthropic
) -> None:
    # The fake, like Anthropic, answers 400 to any top-level field it does not know.
    reply = await client.chat.completions.create(
        model=MODEL,
        messages=HELLO,
        seed=7,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={"50256": -100},
        store=False,
    )
    assert reply.choices[0].message.content == "fake claude reply to: hello"
    assert len(fake.requests) == 1


async def test_body_fields_cannot_steer_litellm(
    client: openai.AsyncOpenAI, fake: FakeAnthropic
) -> None:
    """Fields outside OpenAI's request never reach litellm as its own arguments."""
    reply = await client.chat.completions.create(
        model=MODEL,
        messages=HELLO,
        extra_body={
            "api_base": "http://127.0.0.2:1",
            "api_key": "attacker-key",
            "mock_response": "not from the model",
            "custom_llm_provider": "openai",
            "metadata": {"a": "b"},
            "custom_field": 7,
            "top_k": 5,  # a provider parameter litellm passes on
        },
    )
    assert reply.choices[0].message.content == "fake claude reply to: hello"
    sent = fake.requests[-1]
    assert sent.headers["x-api-key"] == API_KEY
    assert sent.json()["top_k"] == 5


async def test_json_schema_response_format_comes_back_as_content(
    client: openai.AsyncOpenAI, fake: FakeAnthropic
) -> None:
    """Anthropic has no JSON mode: litellm forces a tool call and turns its input into content."""
    schema = {"type": "object", "properties": {"location": {"type": "string"}}}
    reply = await client.chat.completions.create(
        model=MODEL,
        messages=HELLO,
        response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": schema}},
    )
    choice = reply.choices[0]
    assert choice.message.content is not None
    assert json.loads(choice.message.content) == TOOL_INPUT
    assert not choice.message.tool_calls
    assert choice.finish_reason == "stop"
    sent = fake.message_requests[-1]
    assert sent["tool_choice"]["type"] == "tool"
    assert sent["tools"][0]["input_schema"] == schema


# Streaming


async def test_streamed_completion_arrives_as_openai_chunks(
    client: openai.AsyncOpenAI, fake: FakeAnthropic
) -> None:
    stream = await client.chat.completions.create(model=MODEL, messages=HELLO, stream=True)
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        "fake claude reply to: hello"
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert fake.message_requests[-1]["stream"] is True


async def test_a_streams_prompt_is_counted_while_litellm_works(
    client: openai.AsyncOpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    # litellm does not say when its request has gone out: the count for the stream's headers
    # starts with the call, not after it has returned.
    events: list[str] = []
    call = LiteLLMUpstream.chat_completions

    async def calling(self: LiteLLMUpstream, *args: Any, **kwargs: Any) -> Any:
        reply = await call(self, *args, **kwargs)
        events.append("returned")
        return reply

    count = exchange.count_prompt

    async def counting(*args: Any, **kwargs: Any) -> int:
        events.append("counting")
        return await count(*args, **kwargs)

    monkeypatch.setattr(LiteLLMUpstream, "chat_completions", calling)
    monkeypatch.setattr(exchange, "count_prompt", counting)
    stream = await client.chat.completions.create(model=MODEL, messages=HELLO, stream=True)
    assert [chunk async for chunk in stream]
    assert events == ["counting", "returned"]


async def test_every_streamed_chunk_matches_openai_schema(
    proxy: Proxy, fake: FakeAnthropic
) -> None:
    events = await proxy.stream({"model": MODEL, "messages": HELLO})
    chunks = assert_valid_chunks(events)
    assert text_of(chunks) == "fake claude reply to: hello"
    assert all(len(c["choices"]) == 1 and c["choices"][0]["index"] == 0 for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "stop"
    assert not any(c.get("usage") for c in chunks), "usage only when the client asks"
    assert all("provider_specific_fields" not in json.dumps(c) for c in chunks)


async def test_include_usage_ends_the_stream_with_a_usage_chunk(
    proxy: Proxy, fake: FakeAnthropic
) -> None:
    events = await proxy.stream(
        {"model": MODEL, "messages": HELLO, "stream_options": {"include_usage": True}},
    )
    chunks = assert_valid_chunks(events)
    *content, last = chunks
    assert last["choices"] == []
    assert last["usage"]["prompt_tokens"] == 4
    assert last["usage"]["completion_tokens"] == 6
    assert last["usage"]["total_tokens"] == 10
    assert not any(c.get("usage") for c in content)
    assert content[-1]["choices"][0]["finish_reason"] == "stop"


async def test_include_usage_through_the_sdk(client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model=MODEL, messages=HELLO, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 6


# Tool calls


async def test_tool_call_is_translated_both_ways(
    client: openai.AsyncOpenAI, fake: FakeAnthropic, proxy: Proxy
) -> None:
    reply = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=WEATHER,
        tool_choice="auto",
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls is not None
    [call] = choice.message.tool_calls
    assert call.type == "function"
    assert call.id == TOOL_USE_ID
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == TOOL_INPUT

    [tool] = fake.message_requests[-1]["tools"]
    assert tool["name"] == "get_weather"
    assert tool["description"] == "Current weather for a city"
    assert tool["input_schema"]["properties"] == {"location": {"type": "string"}}
    assert fake.message_requests[-1]["tool_choice"] == {"type": "auto"}

    raw = await proxy.post(
        {"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}], "tools": WEATHER},
    )
    assert_openai_shape("CreateChatCompletionResponse", raw.json())
    assert "index" not in raw.json()["choices"][0]["message"]["tool_calls"][0]


async def test_tool_call_streams_as_openai_tool_call_deltas(
    proxy: Proxy, client: openai.AsyncOpenAI
) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}], "tools": WEATHER}
    chunks = assert_valid_chunks(await proxy.stream(body))
    deltas = [
        call
        for chunk in chunks
        for choice in chunk["choices"]
        for call in choice["delta"].get("tool_calls") or []
    ]
    assert deltas[0]["id"] == TOOL_USE_ID
    assert deltas[0]["function"]["name"] == "get_weather"
    assert {d["index"] for d in deltas} == {0}
    arguments = "".join(d["function"].get("arguments", "") for d in deltas)
    assert json.loads(arguments) == TOOL_INPUT
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"

    # The same through the SDK's typed chunks.
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=WEATHER,
        stream=True,
    )
    calls = [
        call
        async for chunk in stream
        for choice in chunk.choices
        for call in choice.delta.tool_calls or []
    ]
    assert (calls[0].id, calls[0].function and calls[0].function.name) == (
        TOOL_USE_ID,
        "get_weather",
    )
    assert "".join(c.function.arguments or "" for c in calls if c.function) == arguments


async def test_tool_result_turn_reaches_anthropic_as_tool_result_block(
    client: openai.AsyncOpenAI, fake: FakeAnthropic
) -> None:
    # The fake answers 400 unless each tool_result answers a tool_use of the turn before.
    reply = await client.chat.completions.create(
        model=MODEL,
        tools=WEATHER,
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": TOOL_USE_ID,
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"location": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": TOOL_USE_ID, "content": "18 C, sunny"},
        ],
    )
    assert reply.choices[0].finish_reason == "stop"
    assistant, result = fake.message_requests[-1]["messages"][1:]
    assert {"type": "tool_use", "id": TOOL_USE_ID, "name": "get_weather"}.items() <= next(
        b for b in assistant["content"] if b["type"] == "tool_use"
    ).items()
    block = next(b for b in result["content"] if b["type"] == "tool_result")
    assert block["tool_use_id"] == TOOL_USE_ID
    assert "18 C, sunny" in json.dumps(block["content"])


# Errors


@pytest.mark.parametrize(
    ("status", "error_class", "anthropic_type"),
    [
        (400, openai.BadRequestError, "invalid_request_error"),
        (401, openai.AuthenticationError, "authentication_error"),
        (429, openai.RateLimitError, "rate_limit_error"),
        (500, openai.InternalServerError, "api_error"),
        (529, openai.InternalServerError, "overloaded_error"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
async def test_upstream_error_keeps_its_status_in_openai_shape(
    client: openai.AsyncOpenAI,
    fake: FakeAnthropic,
    status: int,
    error_class: type[openai.APIStatusError],
    anthropic_type: str,
    stream: bool,
) -> None:
    fake.script.append(error_reply(status, f"scripted {status}", **{"retry-after": "7"}))
    with pytest.raises(error_class) as caught:
        await client.chat.completions.create(model=MODEL, messages=HELLO, stream=stream)
    response = caught.value.response
    assert response.status_code == status
    assert response.json() == {
        "error": {
            "message": f"scripted {status}",
            "type": anthropic_type,
            "param": None,
            "code": None,
        }
    }
    assert response.headers["retry-after"] == "7"
    assert response.headers["x-upstream-request-id"] == REQUEST_ID
    assert len(fake.requests) == 1, "the proxy does not retry; the client decides"


async def test_unknown_provider_prefix_is_a_400(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model="no-such-provider-model", messages=HELLO)
    assert set(caught.value.response.json()["error"]) == {"message", "type", "param", "code"}


async def test_unreachable_upstream_is_a_502(serve_proxy: ServeProxy) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    url = serve_proxy(make_config(litellm_upstream(closed)))
    async with openai.AsyncOpenAI(base_url=url, api_key=KEY, max_retries=0) as client:
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError) as caught:
                await client.chat.completions.create(model=MODEL, messages=HELLO, stream=stream)
            assert caught.value.response.status_code == 502
            assert caught.value.response.json()["error"]["code"] == "upstream_unreachable"


async def test_slow_upstream_is_a_504(
    fake: FakeAnthropic, fake_url: str, serve_proxy: ServeProxy
) -> None:
    url = serve_proxy(make_config(litellm_upstream(fake_url, timeout=TimeoutConfig(read=0.2))))
    fake.script.append(Reply(body={}, delay=1.0))
    asked, replied = len(fake.message_requests), fake.replies_started  # (a shared fake)
    async with openai.AsyncOpenAI(base_url=url, api_key=KEY, max_retries=0) as client:
        with pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(model=MODEL, messages=HELLO)
    # The proxy gave up before the upstream answered (an order of events, not a time).
    assert (len(fake.message_requests), fake.replies_started) == (asked + 1, replied)
    assert caught.value.response.status_code == 504
    assert caught.value.response.json()["error"]["code"] == "upstream_timeout"


async def test_upstream_dying_mid_stream_ends_with_an_error_event(
    proxy: Proxy, fake: FakeAnthropic, client: openai.AsyncOpenAI
) -> None:
    body = {"model": PROVIDER_MODEL, "messages": HELLO}
    fake.script.append(Reply(events=stream_events(body), die_after=5))
    events = await proxy.stream({"model": MODEL, "messages": HELLO})
    *chunks, last = events
    assert "[DONE]" not in events
    for chunk in chunks:
        assert_openai_shape("CreateChatCompletionStreamResponse", chunk)
    assert text_of(chunks) == "fake claude "
    assert last["error"]["code"] == "upstream_unreachable"
    assert set(last["error"]) == {"message", "type", "param", "code"}

    fake.script.append(Reply(events=stream_events(body), die_after=5))
    stream = await client.chat.completions.create(model=MODEL, messages=HELLO, stream=True)
    with pytest.raises(openai.APIError):
        async for _ in stream:
            pass


async def test_anthropic_error_event_mid_stream_ends_with_an_error_event(
    proxy: Proxy, fake: FakeAnthropic
) -> None:
    body = {"model": PROVIDER_MODEL, "messages": HELLO}
    fake.script.append(Reply(events=[*stream_events(body)[:5], overloaded_event()]))
    events = await proxy.stream({"model": MODEL, "messages": HELLO})
    *chunks, last = events
    assert text_of(chunks) == "fake claude "
    assert "Overloaded" in last["error"]["message"]
    assert set(last["error"]) == {"message", "type", "param", "code"}


async def test_client_leaving_mid_stream_closes_the_anthropic_stream(
    client: openai.AsyncOpenAI, fake: FakeAnthropic
) -> None:
    long_question = [{"role": "user", "content": " ".join(["word"] * 200)}]
    body = {"model": PROVIDER_MODEL, "messages": long_question}
    fake.script.append(Reply(events=stream_events(body), event_delay=0.05))  # ten seconds
    stream = await client.chat.completions.create(model=MODEL, messages=long_question, stream=True)
    async for _ in stream:
        break
    await stream.close()
    await wait_until(lambda: fake.disconnects == 1)


# The rest of the surface


async def test_models_come_from_the_upstream_config(client: openai.AsyncOpenAI) -> None:
    assert [m.id async for m in client.models.list()] == [MODEL]


async def test_other_endpoints_are_404_in_openai_shape(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        await client.embeddings.create(model=MODEL, input="hello")
    assert caught.value.response.json()["error"]["code"] == "unsupported_endpoint"
