"""The drop-in promise: the official openai SDK, pointed at memproxy, behaves as against OpenAI.

Every test drives the real server over loopback: the SDK -> memproxy (uvicorn thread) -> the
fake OpenAI API (another uvicorn thread) or the built-in echo upstream.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import openai
import pytest
from pydantic import BaseModel

from proxy import app as app_module
from proxy.accounting.metrics import Metrics
from proxy.core.config import Config, ServerConfig, TimeoutConfig, UpstreamConfig
from proxy.pipeline.memory import ConversationMemory
from proxy.upstream.http_shards import SHARDS
from tests.conftest import CHAT_ONLY_KEY, KEY, make_config
from tests.fakes.openai_upstream import FakeOpenAI, Reply, chat_reply, sse

USER_HELLO: list[Any] = [{"role": "user", "content": "hello"}]
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
]

ServeProxy = Callable[[Config], str]


def sdk(base_url: str, key: str = KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0)


def openai_upstream(base_url: str, **options: Any) -> UpstreamConfig:
    return UpstreamConfig(kind="openai", base_url=base_url, api_key="upstream-key", **options)


@pytest.fixture
def fake(fake_upstream: tuple[FakeOpenAI, str]) -> FakeOpenAI:
    return fake_upstream[0]


@pytest.fixture
async def client(proxy_url: str) -> AsyncIterator[openai.AsyncOpenAI]:
    async with sdk(proxy_url) as client:
        yield client


@pytest.fixture
async def echo_client(serve_proxy: ServeProxy) -> AsyncIterator[openai.AsyncOpenAI]:
    async with sdk(serve_proxy(make_config(UpstreamConfig(kind="echo")))) as client:
        yield client


async def wait_until(condition: Callable[[], bool]) -> None:
    """Poll `condition` (state another thread changes) until it holds, for at most ~10 s."""
    for _ in range(1_000):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met within 10 s")


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


def scripted_chat(**headers: str) -> Reply:
    reply = chat_reply({"model": "gpt-4o-mini", "messages": USER_HELLO})
    reply.headers = headers
    return reply


def sse_data(raw: str) -> list[str]:
    """The `data:` payloads of a raw SSE body, in order."""
    return [
        line.removeprefix("data:").strip()
        for event in raw.split("\n\n")
        for line in event.splitlines()
        if line.startswith("data:")
    ]


# --- completions -------------------------------------------------------------------------------


async def test_plain_completion_reaches_upstream_with_its_key(
    client: openai.AsyncOpenAI, fake: FakeOpenAI
) -> None:
    reply = await client.chat.completions.create(model="gpt-4o-mini", messages=USER_HELLO)
    assert reply.choices[0].message.content == "fake reply to: hello"
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage is not None and reply.usage.total_tokens > 0
    sent = fake.requests[-1]
    assert (sent.method, sent.path) == ("POST", "/v1/chat/completions")
    # The upstream sees the upstream's key, never the client's.
    assert sent.headers["authorization"] == "Bearer upstream-key"


async def test_chat_only_key_can_chat(proxy_url: str) -> None:
    async with sdk(proxy_url, CHAT_ONLY_KEY) as client:
        reply = await client.chat.completions.create(model="gpt-4o-mini", messages=USER_HELLO)
    assert reply.choices[0].message.content == "fake reply to: hello"


async def test_streamed_completion_arrives_as_chunks(client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model="gpt-4o-mini", messages=USER_HELLO, stream=True
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "fake reply to: hello "
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "stop"
    # Not asked for: no usage-only chunk.
    assert all(c.choices and c.usage is None for c in chunks)


async def test_streams_leave_their_upstream_connection_open_for_the_next_request(
    client: openai.AsyncOpenAI, fake: FakeOpenAI
) -> None:
    # The relay ends the client's stream at `[DONE]` and reads the upstream's body to its end
    # after that, so the connection goes back to the pool: the upstream sees a few
    # connections (one per pool the proxy spreads its requests over), not one per stream.
    for _ in range(2 * SHARDS):
        stream = await client.chat.completions.create(
            model="gpt-4o-mini", messages=USER_HELLO, stream=True
        )
        assert [c async for c in stream]
    connections = {r.client for r in fake.requests}
    assert None not in connections
    assert len(connections) <= SHARDS


def note_sends(monkeypatch: pytest.MonkeyPatch, events: list[str]) -> None:
    """Appends "sent" to `events` as a chat completion's last body message goes out (in the
    apps started after this)."""
    hook = app_module.access_hook

    async def watched(message: Any, scope: Any) -> None:
        last = message["type"] == "http.response.body" and not message.get("more_body")
        if last and scope.get("path") == "/v1/chat/completions":
            events.append("sent")  # (the hook runs just before the message is sent)
        await hook(message, scope)

    monkeypatch.setattr(app_module, "access_hook", watched)


async def test_in_mode_off_a_whole_reply_is_sent_before_the_exchange_is_counted(
    fake_upstream: tuple[FakeOpenAI, str],
    serve_proxy: ServeProxy,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Mode off records the exchange later, in a batch: its counting (metrics, the tenant's
    # limits) waits for the response to be on its way too. A stored turn's reply on SQLite is
    # counted first, as before.
    events: list[str] = []
    observe = Metrics.observe_chat

    def counted(self: Metrics, *args: Any, **kwargs: Any) -> None:
        events.append("counted")
        observe(self, *args, **kwargs)

    note_sends(monkeypatch, events)
    monkeypatch.setattr(Metrics, "observe_chat", counted)
    url = serve_proxy(make_config(openai_upstream(fake_upstream[1])))
    async with sdk(url) as client:
        for mode in ("off", "full"):
            await client.chat.completions.create(
                model="gpt-4o-mini", messages=USER_HELLO, extra_headers={"X-Memory-Mode": mode}
            )
            await wait_until(lambda: len(events) in (2, 4))
    assert events == ["sent", "counted", "counted", "sent"]


async def test_on_sqlite_a_streamed_reply_is_written_once_its_response_has_gone_out(
    fake_upstream: tuple[FakeOpenAI, str],
    serve_proxy: ServeProxy,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The write's work in its thread would hold the interpreter while the stream's end
    # waits: it starts once that has gone (and the user's next turn still sees it). (A whole
    # reply's write is started after its response is built, so it came after it before too.)
    events: list[str] = []
    finish = ConversationMemory.finish

    async def written(self: ConversationMemory, *args: Any, **kwargs: Any) -> Any:
        events.append("write")
        return await finish(self, *args, **kwargs)

    note_sends(monkeypatch, events)
    monkeypatch.setattr(ConversationMemory, "finish", written)
    url = serve_proxy(make_config(openai_upstream(fake_upstream[1])))
    thin = {"X-Memory-Conversation-Id": "c1", "X-Memory-User-Id": "u1"}
    async with sdk(url) as client:
        for turn in ("hello", "again"):
            answer = await client.chat.completions.with_raw_response.create(
                model="gpt-4o-mini",
                messages=[{"role": "user", "content": turn}],
                stream=True,
                extra_headers=thin,
            )
            assert [chunk async for chunk in answer.parse()]  # type: ignore[union-attr]
            await wait_until(lambda: events.count("write") == events.count("sent"))
    assert events == ["sent", "write", "sent", "write"]
    assert answer.headers["x-memory-history-messages"] == "2"  # the first reply was there


async def test_stream_include_usage_adds_a_final_usage_chunk(
    client: openai.AsyncOpenAI, fake: FakeOpenAI
) -> None:
    stream = await client.chat.completions.create(
        model="gpt-4o-mini",
        messages=USER_HELLO,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens > 0
    assert fake.chat_requests[-1]["stream_options"] == {"include_usage": True}


async def test_tool_call_is_returned_whole(client: openai.AsyncOpenAI, fake: FakeOpenAI) -> None:
    reply = await client.chat.completions.create(
        model="gpt-4o-mini", messages=USER_HELLO, tools=TOOLS, tool_choice="auto"
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.tool_calls is not None
    call = choice.message.tool_calls[0]
    assert call.type == "function"
    assert (call.id, call.function.name, call.function.arguments) == (
        "call_1",
        "search",
        '{"q": "x"}',
    )
    assert fake.chat_requests[-1]["tools"] == TOOLS
    assert fake.chat_requests[-1]["tool_choice"] == "auto"


class Search(BaseModel):
    q: str


async def test_tool_call_streamed_is_accumulated_by_the_sdk(client: openai.AsyncOpenAI) -> None:
    async with client.chat.completions.stream(
        model="gpt-4o-mini",
        messages=USER_HELLO,
        tools=[openai.pydantic_function_tool(Search, name="search")],
    ) as stream:
        final = await stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls is not None
    call = choice.message.tool_calls[0]
    assert (call.id, call.function.name, call.function.arguments) == (
        "call_1",
        "search",
        '{"q": "x"}',
    )
    assert call.function.parsed_arguments == Search(q="x")


async def test_tool_call_deltas_are_relayed_in_order(client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model="gpt-4o-mini", messages=USER_HELLO, tools=TOOLS, stream=True
    )
    deltas = [c.choices[0].delta async for c in stream]
    calls = [call for d in deltas for call in d.tool_calls or []]
    assert calls[0].id == "call_1"
    assert calls[0].function is not None and calls[0].function.name == "search"
    assert "".join((c.function.arguments or "") for c in calls if c.function) == '{"q": "x"}'


async def test_tool_result_round_trip_is_accepted(
    client: openai.AsyncOpenAI, fake: FakeOpenAI
) -> None:
    messages: list[Any] = [
        *USER_HELLO,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "search", "arguments": '{"q": "x"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "result"},
    ]
    reply = await client.chat.completions.create(
        model="gpt-4o-mini", messages=messages, tools=TOOLS
    )
    assert reply.choices[0].message.content == "fake reply to: result"
    assert fake.chat_requests[-1]["messages"] == messages


async def test_list_content_parts_pass_through_unchanged(
    client: openai.AsyncOpenAI, fake: FakeOpenAI
) -> None:
    messages: list[Any] = [
        {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "hello"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                {"type": "text", "text": "world"},
            ],
        },
    ]
    reply = await client.chat.completions.create(model="gpt-4o-mini", messages=messages)
    assert reply.choices[0].message.content == "fake reply to: hello  world"
    assert fake.chat_requests[-1]["messages"] == messages


class Answer(BaseModel):
    answer: str


async def test_json_schema_response_format_parses_in_the_sdk(
    client: openai.AsyncOpenAI, fake: FakeOpenAI
) -> None:
    completion = await client.chat.completions.parse(
        model="gpt-4o-mini", messages=USER_HELLO, response_format=Answer
    )
    parsed = completion.choices[0].message.parsed
    assert parsed == Answer(answer="fake reply to: hello")
    sent_format = fake.chat_requests[-1]["response_format"]
    assert sent_format["type"] == "json_schema"
    assert sent_format["json_schema"]["name"] == "Answer"
    assert sent_format["json_schema"]["strict"] is True


async def test_n_2_returns_two_choices(client: openai.AsyncOpenAI, fake: FakeOpenAI) -> None:
    reply = await client.chat.completions.create(model="gpt-4o-mini", messages=USER_HELLO, n=2)
    assert [c.index for c in reply.choices] == [0, 1]
    assert {c.message.content for c in reply.choices} == {"fake reply to: hello"}
    assert fake.chat_requests[-1]["n"] == 2


async def test_logprobs_are_returned(client: openai.AsyncOpenAI, fake: FakeOpenAI) -> None:
    reply = await client.chat.completions.create(
        model="gpt-4o-mini", messages=USER_HELLO, logprobs=True, top_logprobs=2
    )
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert [t.token for t in logprobs.content] == ["fake", "reply", "to:", "hello"]
    assert logprobs.content[0].bytes == list(b"fake")
    assert fake.chat_requests[-1]["top_logprobs"] == 2


async def test_unknown_fields_reach_the_upstream_untouched(
    client: openai.AsyncOpenAI, fake: FakeOpenAI
) -> None:
    extra = {
        "custom_field": 7,
        "vendor_options": {"nested": [1, None, {"deep": "✓ héllo"}], "flag": False},
        "null_field": None,
        "big": 2**60,
        "tiny": 1e-7,
    }
    raw = await client.chat.completions.with_raw_response.create(
        model="gpt-4o-mini",
        messages=USER_HELLO,
        temperature=0.7,
        seed=42,
        metadata={"k": "v"},
        extra_body=extra,
    )
    raw.parse()
    sent = json.loads(raw.http_request.content)
    forwarded = fake.chat_requests[-1]
    for key, value in extra.items():
        assert key in forwarded and forwarded[key] == value, key
    # Every field the client sent arrives as sent (the proxy adds to messages at most).
    assert {k: v for k, v in forwarded.items() if k != "messages"} == {
        k: v for k, v in sent.items() if k != "messages"
    }


# --- response headers --------------------------------------------------------------------------


async def test_every_completion_has_a_proxy_request_id_and_the_upstream_one(
    client: openai.AsyncOpenAI,
) -> None:
    raw = await client.chat.completions.with_raw_response.create(
        model="gpt-4o-mini", messages=USER_HELLO
    )
    assert raw.headers["x-request-id"].startswith("req_")
    assert raw.headers["x-upstream-request-id"] == "upstream-req-1"
    assert raw.parse().choices[0].message.content == "fake reply to: hello"

    again = await client.chat.completions.with_raw_response.create(
        model="gpt-4o-mini", messages=USER_HELLO
    )
    assert again.headers["x-request-id"] != raw.headers["x-request-id"]


async def test_streamed_completion_has_request_ids_in_its_headers(
    client: openai.AsyncOpenAI,
) -> None:
    raw = await client.chat.completions.with_raw_response.create(
        model="gpt-4o-mini", messages=USER_HELLO, stream=True
    )
    assert raw.headers["x-request-id"].startswith("req_")
    assert raw.headers["x-upstream-request-id"] == "upstream-req-1"
    assert raw.headers["content-type"].startswith("text/event-stream")
    chunks = [chunk async for chunk in raw.parse()]
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_rate_limit_headers_pass_through(
    client: openai.AsyncOpenAI, fake: FakeOpenAI
) -> None:
    ratelimit = {
        "retry-after": "7",
        "retry-after-ms": "7000",
        "x-ratelimit-limit-requests": "500",
        "x-ratelimit-remaining-requests": "499",
        "x-ratelimit-reset-requests": "120ms",
        "x-ratelimit-limit-tokens": "30000",
        "x-ratelimit-remaining-tokens": "29990",
        "x-ratelimit-reset-tokens": "20ms",
        "openai-processing-ms": "12",
    }
    fake.script.append(scripted_chat(**ratelimit))
    raw = await client.chat.completions.with_raw_response.create(
        model="gpt-4o-mini", messages=USER_HELLO
    )
    for name, value in ratelimit.items():
        assert raw.headers.get(name) == value, name


async def test_hop_by_hop_headers_do_not_pass_through(
    client: openai.AsyncOpenAI, fake: FakeOpenAI
) -> None:
    fake.script.append(
        scripted_chat(
            **{
                "connection": "keep-alive, x-hop-secret",
                "x-hop-secret": "for the proxy only",
                "keep-alive": "timeout=99",
                "proxy-authenticate": 'Basic realm="upstream"',
                "upgrade": "h2c",
                "x-end-to-end": "kept",
            }
        )
    )
    raw = await client.chat.completions.with_raw_response.create(
        model="gpt-4o-mini", messages=USER_HELLO
    )
    assert raw.headers["x-end-to-end"] == "kept"
    for name in ("x-hop-secret", "keep-alive", "proxy-authenticate", "upgrade"):
        assert name not in raw.headers, name
    assert "timeout=99" not in raw.headers.get("connection", "")
    assert raw.parse().choices[0].message.content == "fake reply to: hello"


# --- errors as the SDK's typed exceptions ------------------------------------------------------


async def test_bad_key_raises_authentication_error(proxy_url: str, fake: FakeOpenAI) -> None:
    async with sdk(proxy_url, "wrong-key") as client:
        with pytest.raises(openai.AuthenticationError) as caught:
            await client.chat.completions.create(model="gpt-4o-mini", messages=USER_HELLO)
    assert caught.value.status_code == 401
    assert caught.value.code == "invalid_api_key"
    assert caught.value.response.headers["x-request-id"].startswith("req_")
    assert fake.requests == []


async def test_chat_only_key_on_the_management_api_raises_permission_denied(
    proxy_url: str,
) -> None:
    async with sdk(proxy_url, CHAT_ONLY_KEY) as client:
        with pytest.raises(openai.PermissionDeniedError) as caught:
            await client.get(
                "/memory/conversations", cast_to=object, options={"params": {"user": "u1"}}
            )
    assert caught.value.status_code == 403
    assert caught.value.code == "insufficient_scope"


async def test_missing_messages_raises_bad_request_naming_the_param(
    client: openai.AsyncOpenAI, fake: FakeOpenAI
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        # `omit` gets past the SDK's own required-argument check and leaves the field out.
        await client.chat.completions.create(
            model="gpt-4o-mini",
            messages=openai.omit,  # type: ignore[call-overload]
        )
    assert caught.value.status_code == 400
    assert caught.value.param == "messages"
    assert caught.value.type == "invalid_request_error"
    assert fake.requests == []


async def test_malformed_json_is_a_400_in_openai_shape(proxy_url: str, fake: FakeOpenAI) -> None:
    async with httpx.AsyncClient() as http:
        response = await http.post(
            proxy_url + "/chat/completions",
            headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"},
            content=b'{"model": "gpt-4o-mini", "messages": [',
        )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert set(error) == {"message", "type", "param", "code"}
    assert "JSON" in error["message"]
    assert fake.requests == []


async def test_upstream_429_raises_rate_limit_error_with_upstream_body_and_headers(
    client: openai.AsyncOpenAI, fake: FakeOpenAI
) -> None:
    error = {
        "message": "Rate limit reached for gpt-4o-mini on requests per min (RPM).",
        "type": "requests",
        "param": None,
        "code": "rate_limit_exceeded",
    }
    fake.script.append(
        Reply(
            status=429,
            body={"error": error},
            headers={"retry-after": "3", "x-ratelimit-remaining-requests": "0"},
        )
    )
    with pytest.raises(openai.RateLimitError) as caught:
        await client.chat.completions.create(model="gpt-4o-mini", messages=USER_HELLO)
    exc = caught.value
    assert exc.status_code == 429
    assert exc.body == error
    assert exc.code == "rate_limit_exceeded"
    assert exc.response.headers["retry-after"] == "3"
    assert exc.response.headers["x-ratelimit-remaining-requests"] == "0"
    assert exc.response.headers["x-request-id"].startswith("req_")
    assert exc.response.headers["x-upstream-request-id"] == "upstream-req-1"


async def test_upstream_429_on_a_stream_request_raises_before_any_chunk(
    client: openai.AsyncOpenAI, fake: FakeOpenAI
) -> None:
    fake.script.append(
        Reply(
            status=429,
            body={
                "error": {"message": "slow down", "type": "requests", "param": None, "code": None}
            },
            headers={"retry-after": "1"},
        )
    )
    with pytest.raises(openai.RateLimitError) as caught:
        await client.chat.completions.create(model="gpt-4o-mini", messages=USER_HELLO, stream=True)
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["message"] == "slow down"
    assert caught.value.response.headers["retry-after"] == "1"


async def test_upstream_500_passes_through_as_internal_server_error(
    client: openai.AsyncOpenAI, fake: FakeOpenAI
) -> None:
    error = {"message": "The server had an error", "type": "server_error", "param": None}
    fake.script.append(Reply(status=500, body={"error": {**error, "code": None}}))
    with pytest.raises(openai.InternalServerError) as caught:
        await client.chat.completions.create(model="gpt-4o-mini", messages=USER_HELLO)
    assert caught.value.status_code == 500
    assert caught.value.body == {**error, "code": None}
    assert len(fake.requests) == 1  # the proxy does not retry on the client's behalf


async def test_unreachable_upstream_is_a_502(serve_proxy: ServeProxy) -> None:
    url = serve_proxy(make_config(openai_upstream(closed_port_url())))
    async with sdk(url) as client:
        with pytest.raises(openai.InternalServerError) as caught:
            await client.chat.completions.create(model="gpt-4o-mini", messages=USER_HELLO)
    assert caught.value.status_code == 502
    assert caught.value.code == "upstream_unreachable"
    assert caught.value.type == "upstream_error"
    # The turn was stored before the upstream was asked: the headers say where, as a reply's do.
    headers = caught.value.response.headers
    assert headers["x-memory-status"] == "ok"
    assert headers["x-memory-conversation-id"].startswith("conv_")
    assert headers["x-memory-context-tokens"] == "0"


async def test_upstream_timeout_is_a_504(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: ServeProxy
) -> None:
    fake, upstream_url = fake_upstream
    url = serve_proxy(make_config(openai_upstream(upstream_url, timeout=TimeoutConfig(read=0.2))))
    # The upstream answers, but only long after the proxy's read timeout.
    fake.script.append(Reply(body={"never": "seen"}, delay=1.0))
    async with sdk(url) as client:
        with pytest.raises(openai.InternalServerError) as caught:
            await client.chat.completions.create(model="gpt-4o-mini", messages=USER_HELLO)
    assert caught.value.status_code == 504
    assert caught.value.code == "upstream_timeout"
    assert caught.value.response.headers["x-memory-status"] == "ok"
    assert "x-memory-conversation-id" in caught.value.response.headers


async def test_unknown_route_is_a_404(proxy_url: str) -> None:
    async with sdk(proxy_url.removesuffix("/v1")) as root:
        with pytest.raises(openai.NotFoundError) as caught:
            await root.get("/no/such/route", cast_to=object)
    assert caught.value.status_code == 404
    assert caught.value.code == "not_found"


async def test_other_endpoint_on_the_echo_upstream_is_a_404(
    echo_client: openai.AsyncOpenAI,
) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        await echo_client.embeddings.create(model="text-embedding-3-small", input="hi")
    assert caught.value.code == "unsupported_endpoint"


async def test_wrong_method_is_a_405(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.APIStatusError) as caught:
        await client.get("/chat/completions", cast_to=object)
    assert caught.value.status_code == 405
    assert caught.value.code == "method_not_allowed"
    assert "POST" in caught.value.response.headers["allow"]


async def test_body_over_max_body_bytes_is_a_413(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: ServeProxy
) -> None:
    fake, upstream_url = fake_upstream
    config = make_config(openai_upstream(upstream_url)).model_copy(
        update={"server": ServerConfig(max_body_bytes=2_000)}
    )
    async with sdk(serve_proxy(config)) as client:
        fits = await client.chat.completions.create(model="gpt-4o-mini", messages=USER_HELLO)
        assert fits.choices[0].message.content == "fake reply to: hello"
        with pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(
                model="gpt-4o-mini", messages=[{"role": "user", "content": "x" * 5_000}]
            )
    assert caught.value.status_code == 413
    assert caught.value.code == "request_too_large"
    assert len(fake.requests) == 1


async def test_model_outside_the_allow_list_is_model_not_found(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: ServeProxy
) -> None:
    fake, upstream_url = fake_upstream
    url = serve_proxy(make_config(openai_upstream(upstream_url), models=["gpt-4o-mini"]))
    async with sdk(url) as client:
        allowed = await client.chat.completions.create(model="gpt-4o-mini", messages=USER_HELLO)
        assert allowed.choices[0].message.content == "fake reply to: hello"
        with pytest.raises(openai.NotFoundError) as caught:
            await client.chat.completions.create(model="gpt-4o", messages=USER_HELLO)
    assert caught.value.code == "model_not_found"
    assert caught.value.param == "model"
    assert len(fake.requests) == 1


# --- streaming relay ---------------------------------------------------------------------------


async def test_stream_is_relayed_before_the_upstream_finishes(
    client: openai.AsyncOpenAI, fake: FakeOpenAI
) -> None:
    fake.chunk_delay = 0.1
    stream = await client.chat.completions.create(
        model="gpt-4o-mini", messages=USER_HELLO, stream=True
    )
    first = await stream.__anext__()
    # The first chunk is here while the upstream is still sending: nothing was buffered.
    assert (fake.streams_started, fake.streams_finished) == (1, 0)
    assert first.choices[0].delta.role == "assistant"
    rest = [chunk async for chunk in stream]
    assert rest[-1].choices[0].finish_reason == "stop"
    await wait_until(lambda: fake.streams_finished == 1)


async def stream_hello(proxy_url: str) -> str:
    """The body of a streamed chat request, as sent, read to its end (a 200 head)."""
    async with (
        httpx.AsyncClient() as http,
        http.stream(
            "POST",
            proxy_url + "/chat/completions",
            headers={"authorization": f"Bearer {KEY}"},
            json={"model": "gpt-4o-mini", "messages": USER_HELLO, "stream": True},
        ) as response,
    ):
        assert response.status_code == 200
        return (await response.aread()).decode()


async def test_upstream_dying_mid_stream_ends_with_an_error_event(
    proxy_url: str, fake: FakeOpenAI
) -> None:
    upstream = chat_reply({"model": "gpt-4o-mini", "messages": USER_HELLO, "stream": True})
    assert upstream.chunks is not None
    fake.script.append(Reply(chunks=upstream.chunks, die_after=2))
    raw = await stream_hello(proxy_url)  # returns: the proxy closed the stream
    events = sse_data(raw)
    expected = [json.loads(c.removeprefix(b"data: ")) for c in upstream.chunks[:2]]
    assert [json.loads(e) for e in events[:2]] == expected
    assert len(events) == 3
    error = json.loads(events[2])["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "upstream_unreachable"
    assert "[DONE]" not in raw


async def test_nothing_is_relayed_after_done(proxy_url: str, fake: FakeOpenAI) -> None:
    # What an upstream sends after `[DONE]` (here an error event) is not waited for, nor sent.
    upstream = chat_reply({"model": "gpt-4o-mini", "messages": USER_HELLO, "stream": True})
    assert upstream.chunks is not None and upstream.chunks[-1] == b"data: [DONE]\n\n"
    late = sse({"error": {"message": "late", "type": "server_error"}})
    fake.script.append(Reply(chunks=[*upstream.chunks, late]))
    raw = await stream_hello(proxy_url)
    assert raw.endswith("data: [DONE]\n\n")
    assert "late" not in raw


@pytest.mark.parametrize("asks_usage", [False, True], ids=["plain", "include_usage"])
@pytest.mark.parametrize("mid_event", [False, True], ids=["between_events", "mid_event"])
async def test_upstream_dying_mid_stream_raises_api_error_in_the_sdk(
    client: openai.AsyncOpenAI, fake: FakeOpenAI, asks_usage: bool, mid_event: bool
) -> None:
    """Also when the upstream dies inside an event (half of it sent) and the client asked for
    the usage chunk: the error event is not glued onto the half event, which the SDK read as
    broken JSON."""
    upstream = chat_reply({"model": "gpt-4o-mini", "messages": USER_HELLO, "stream": True})
    assert upstream.chunks is not None
    chunks = list(upstream.chunks)
    if mid_event:
        chunks[2:3] = [chunks[2][:30], chunks[2][30:]]
    fake.script.append(Reply(chunks=chunks, die_after=3 if mid_event else 2))
    options: dict[str, Any] = {"stream_options": {"include_usage": True}} if asks_usage else {}
    stream = await client.chat.completions.create(
        model="gpt-4o-mini", messages=USER_HELLO, stream=True, **options
    )
    received = []
    with pytest.raises(openai.APIError) as caught:
        async for chunk in stream:
            received.append(chunk)
    assert len(received) == 2
    assert not isinstance(caught.value, openai.APIStatusError)  # the status was already 200
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["code"] == "upstream_unreachable"


async def test_upstream_stalling_mid_stream_ends_with_a_timeout_event(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: ServeProxy
) -> None:
    fake, upstream_url = fake_upstream
    url = serve_proxy(make_config(openai_upstream(upstream_url, timeout=TimeoutConfig(read=0.2))))
    fake.chunk_delay = 5.0  # the fake stops waiting as soon as the proxy hangs up
    async with sdk(url) as client:
        stream = await client.chat.completions.create(
            model="gpt-4o-mini", messages=USER_HELLO, stream=True
        )
        received = []
        with pytest.raises(openai.APIError) as caught:
            async for chunk in stream:
                received.append(chunk)
    assert len(received) == 1
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["code"] == "upstream_timeout"
    await wait_until(lambda: fake.disconnects == 1)
    assert fake.streams_finished == 0


async def test_client_disconnect_cancels_the_upstream_stream(
    client: openai.AsyncOpenAI, fake: FakeOpenAI
) -> None:
    fake.chunk_delay = 0.2
    stream = await client.chat.completions.create(
        model="gpt-4o-mini", messages=USER_HELLO, stream=True
    )
    await stream.__anext__()
    await stream.close()
    # Either the upstream notices the cancellation or, if the proxy failed to cancel, the
    # stream runs to its end; wait for whichever happens, then check it was the first.
    await wait_until(lambda: fake.disconnects + fake.streams_finished > 0)
    assert (fake.disconnects, fake.streams_finished) == (1, 0)


# --- other endpoints pass through --------------------------------------------------------------


async def test_embeddings_pass_through(client: openai.AsyncOpenAI, fake: FakeOpenAI) -> None:
    result = await client.embeddings.create(
        model="text-embedding-3-small", input=["a", "b"], encoding_format="float"
    )
    assert [e.embedding for e in result.data] == [[0.1, 0.2, 0.3]] * 2
    assert result.model == "text-embedding-3-small"
    sent = fake.requests[-1]
    assert (sent.method, sent.path) == ("POST", "/v1/embeddings")
    assert sent.headers["authorization"] == "Bearer upstream-key"
    assert sent.json() == {
        "model": "text-embedding-3-small",
        "input": ["a", "b"],
        "encoding_format": "float",
    }


def raw_get(proxy_url: str, path: bytes, key: str = KEY) -> bytes:
    """A GET sent as written: clients resolve `..` and `%2e%2e` before sending."""
    address = httpx.URL(proxy_url)
    with socket.create_connection((address.host, address.port or 80)) as sock:
        sock.sendall(
            b"GET "
            + path
            + b" HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            + key.encode()
            + b"\r\nConnection: close\r\n\r\n"
        )
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    return reply


@pytest.mark.parametrize(
    "path",
    [
        b"/v1/../admin",
        b"/v1/%2e%2e/admin",
        b"/v1/..%2F..%2Fadmin",
        b"/v1/files/..%2F..%2Fsecret",
        b"/v1/files/%2E",
        b"/v1/files%3Fpurpose=x",
        b"/v1/files%23x",
        b"/v1/files%5C..%5Cx",
    ],
)
async def test_a_passthrough_path_that_could_leave_the_upstream_base_is_refused(
    proxy_url: str, fake: FakeOpenAI, path: bytes
) -> None:
    # The proxy's own upstream key goes with a passthrough: a path that joined to the base
    # URL resolves outside it (or moves into its query) would spend it anywhere on that host.
    reply = await asyncio.to_thread(raw_get, proxy_url, path, CHAT_ONLY_KEY)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 404"), head
    assert json.loads(body)["error"]["code"] == "invalid_url"
    assert fake.requests == []


async def test_a_passthrough_path_is_sent_on_encoded_as_it_came(
    proxy_url: str, fake: FakeOpenAI
) -> None:
    reply = await asyncio.to_thread(raw_get, proxy_url, b"/v1/files/a%25b%20c/content?x=1")
    assert reply.startswith(b"HTTP/1.1 "), reply[:80]
    sent = fake.requests[-1]
    assert (sent.path, sent.raw_path, sent.query) == (
        "/v1/files/a%b c/content",
        b"/v1/files/a%25b%20c/content",
        "x=1",
    )


async def test_a_passed_through_file_the_upstream_breaks_off_reaches_the_client_cut_off(
    proxy_url: str, fake: FakeOpenAI
) -> None:
    """Audio (any body that is not an event stream) whose upstream dies mid-way: the client's
    read fails as the body is incomplete, rather than ending as if whole with an SSE error
    event glued to the audio."""
    audio = [b"ID3" + b"\x00" * 500, b"\x01" * 500]
    fake.script.append(Reply(chunks=audio, die_after=1, headers={"content-type": "audio/mpeg"}))
    got = b""
    async with httpx.AsyncClient(headers={"authorization": f"Bearer {KEY}"}) as http:
        with pytest.raises(httpx.RemoteProtocolError):
            async with http.stream("POST", proxy_url + "/audio/speech", json={}) as response:
                assert response.headers["content-type"] == "audio/mpeg"
                async for piece in response.aiter_bytes():
                    got += piece
    assert got == audio[0]


async def test_a_passed_through_event_stream_that_breaks_mid_event_ends_with_a_whole_error(
    proxy_url: str, fake: FakeOpenAI
) -> None:
    """A passed-through event stream (an Assistants run), the upstream dying inside its second
    event: the client gets the first event, then the error event, never half of the second
    glued to it."""
    first, second = sse({"type": "thread.run.created"}), sse({"type": "thread.message.delta"})
    fake.script.append(Reply(chunks=[first, second[:12], second[12:]], die_after=2))
    async with httpx.AsyncClient(headers={"authorization": f"Bearer {KEY}"}) as http:
        response = await http.post(
            proxy_url + "/threads/runs", json={"assistant_id": "asst_1", "stream": True}
        )
    events = sse_data(response.text)
    assert [json.loads(e).get("type") for e in events[:1]] == ["thread.run.created"]
    assert len(events) == 2 and json.loads(events[1])["error"]["code"] == "upstream_unreachable"


async def test_models_list_is_the_upstreams_without_an_allow_list(
    client: openai.AsyncOpenAI, fake: FakeOpenAI
) -> None:
    models = [m.id async for m in client.models.list()]
    assert models == ["gpt-4o-mini", "gpt-4o"]
    assert fake.requests[-1].path == "/v1/models"


async def test_models_list_is_the_allow_list_when_set(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: ServeProxy
) -> None:
    fake, upstream_url = fake_upstream
    url = serve_proxy(make_config(openai_upstream(upstream_url), models=["gpt-4o-mini", "o3"]))
    async with sdk(url) as client:
        models = [m async for m in client.models.list()]
    assert [m.id for m in models] == ["gpt-4o-mini", "o3"]
    assert all(m.object == "model" for m in models)
    assert fake.requests == []


async def test_the_allow_list_holds_for_passed_through_endpoints_too(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: ServeProxy
) -> None:
    """A tenant limited to some models cannot reach others through `/v1/embeddings`,
    `/v1/responses` or a transcription's form: 404 `model_not_found`, nothing sent upstream;
    allowed models, and requests naming none, pass through as before."""
    fake, upstream_url = fake_upstream
    url = serve_proxy(make_config(openai_upstream(upstream_url), models=["gpt-4o-mini"]))
    async with sdk(url) as client:
        for call in (
            client.embeddings.create(model="text-embedding-3-large", input="hi"),
            client.responses.create(model="o1-pro", input="hi"),
            client.audio.transcriptions.create(model="whisper-1", file=("a.mp3", b"ID3")),
        ):
            with pytest.raises(openai.NotFoundError) as refused:
                await call
            assert refused.value.code == "model_not_found"
        assert fake.requests == []
        fake.script.append(Reply(body={"object": "list", "data": []}))
        await client.embeddings.with_raw_response.create(model="gpt-4o-mini", input="hi")
        fake.script.append(Reply(body={"object": "list", "data": [], "has_more": False}))
        await client.files.with_raw_response.list()
    assert [r.path for r in fake.requests] == ["/v1/embeddings", "/v1/files"]


async def test_multipart_upload_reaches_the_upstream_unchanged(
    client: openai.AsyncOpenAI, fake: FakeOpenAI
) -> None:
    content = b'{"messages": [{"role": "user", "content": "hi"}]}\n' * 50
    raw = await client.files.with_raw_response.create(
        file=("train.jsonl", content, "application/jsonl"), purpose="fine-tune"
    )
    echoed = raw.http_response.json()
    sent_type = raw.http_request.headers["content-type"]
    assert sent_type.startswith("multipart/form-data; boundary=")
    assert echoed == {
        "method": "POST",
        "path": "/v1/files",
        "query": "",
        "content_type": sent_type,
        "size": int(raw.http_request.headers["content-length"]),
    }
    body = fake.requests[-1].body
    assert content in body
    assert b'name="purpose"\r\n\r\nfine-tune' in body
    assert fake.requests[-1].headers["authorization"] == "Bearer upstream-key"


async def test_get_with_query_string_reaches_the_upstream_unchanged(
    client: openai.AsyncOpenAI, fake: FakeOpenAI
) -> None:
    raw = await client.files.with_raw_response.list(purpose="batch", limit=2, order="asc")
    echoed = raw.http_response.json()
    assert echoed["method"] == "GET"
    assert echoed["path"] == "/v1/files"
    assert echoed["query"] == raw.http_request.url.query.decode()
    assert "purpose=batch" in echoed["query"]

    # Escapes and repeated keys are not re-encoded or merged on the way.
    async with httpx.AsyncClient() as http:
        response = await http.get(
            # (a string: openai 3 builds its URLs with httpx2, not httpx)
            str(client.base_url.join("batches?after=a%2Fb&x=1&x=2&q=%C3%A9+z")),
            headers={"authorization": f"Bearer {KEY}"},
        )
    assert response.json()["query"] == "after=a%2Fb&x=1&x=2&q=%C3%A9+z"
    assert fake.requests[-1].query == "after=a%2Fb&x=1&x=2&q=%C3%A9+z"


# --- the echo upstream -------------------------------------------------------------------------


async def test_echo_upstream_answers_plain(echo_client: openai.AsyncOpenAI) -> None:
    raw = await echo_client.chat.completions.with_raw_response.create(
        model="echo", messages=[{"role": "system", "content": "be brief"}, *USER_HELLO]
    )
    reply = raw.parse()
    content = reply.choices[0].message.content
    assert content is not None
    assert content.startswith("echo: received 2 messages (system=1, user=1)")
    assert content.endswith('Last user message: "hello"')
    assert reply.usage is not None and reply.usage.prompt_tokens > 0
    assert raw.headers["x-request-id"].startswith("req_")
    assert raw.headers["x-upstream-request-id"].startswith("echo-")


async def test_echo_upstream_answers_streamed(echo_client: openai.AsyncOpenAI) -> None:
    whole = await echo_client.chat.completions.create(model="echo", messages=USER_HELLO)
    stream = await echo_client.chat.completions.create(
        model="echo",
        messages=USER_HELLO,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == []
    assert chunks[-1].usage == whole.usage
