"""`POST /v1/responses` with memory, through the official openai SDK: on a strict fake
Responses upstream (native: every request it gets is checked against the official schema) and
on upstreams without a Responses API (translated to chat completions: the chat fake, echo)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from typing import Any

import httpx
import openai
import pytest
from pydantic import BaseModel

from proxy.core.config import Config, UpstreamConfig
from tests.conftest import KEY, OTHER_TENANT_KEY, make_config
from tests.fakes.openai_responses import FakeResponses, response_object
from tests.fakes.openai_upstream import FakeOpenAI, Reply, model_said
from tests.fakes.server import ServerThread
from tests.openapi_check import assert_openai_shape
from tests.polling import eventually
from tests.responses_check import check_stream

ServeProxy = Callable[[Config], str]
ALICE = {"X-Memory-User-Id": "alice"}
LOOKUP: Any = {
    "type": "function",
    "name": "lookup",
    "description": "Look a word up",
    "parameters": {
        "type": "object",
        "properties": {"word": {"type": "string"}},
        "required": ["word"],
        "additionalProperties": False,
    },
    "strict": True,
}


@pytest.fixture
def responses_fake() -> Iterator[tuple[FakeResponses, str]]:
    app = FakeResponses()
    with ServerThread(app) as server:
        yield app, server.url + "/v1"


def sdk(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url, api_key=KEY, max_retries=0)


@pytest.fixture
async def native(
    responses_fake: tuple[FakeResponses, str], serve_proxy: ServeProxy
) -> AsyncIterator[tuple[FakeResponses, openai.AsyncOpenAI]]:
    app, url = responses_fake
    upstream = UpstreamConfig(kind="openai", base_url=url, api_key="upstream-key")
    async with sdk(serve_proxy(make_config(upstream))) as client:
        yield app, client


@pytest.fixture
async def translated(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: ServeProxy
) -> AsyncIterator[tuple[FakeOpenAI, openai.AsyncOpenAI]]:
    """An OpenAI-compatible upstream with no Responses API: memproxy translates."""
    app, url = fake_upstream
    upstream = UpstreamConfig(kind="litellm", base_url=url, api_key="upstream-key")
    async with sdk(serve_proxy(make_config(upstream))) as client:
        yield app, client


@pytest.fixture
async def echo(serve_proxy: ServeProxy) -> AsyncIterator[openai.AsyncOpenAI]:
    async with sdk(serve_proxy(make_config(UpstreamConfig(kind="echo")))) as client:
        yield client


def text_of(content: Any) -> str:
    """A chat message's text, whether a string or text parts."""
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content)


# --- native -------------------------------------------------------------------------------------


async def test_a_response_through_a_native_upstream_carries_memory_headers(
    native: tuple[FakeResponses, openai.AsyncOpenAI],
) -> None:
    app, client = native
    raw = await client.responses.with_raw_response.create(
        model="gpt-4o", instructions="Be brief.", input="hello there", extra_headers=ALICE
    )
    assert_openai_shape("Response", raw.http_response.json())
    response = raw.parse()
    assert response.output_text.startswith('fake response to: "hello there"')
    headers = raw.http_response.headers
    assert headers["x-memory-conversation-id"].startswith("conv_")
    assert headers["x-memory-status"] == "ok"
    assert int(headers["x-usage-prompt-tokens"]) > 0 and headers["x-cost-usd"] != ""
    assert app.responses_requests[-1]["input"] == "hello there"


async def test_a_native_stream_is_relayed_as_the_api_sends_it(
    native: tuple[FakeResponses, openai.AsyncOpenAI],
) -> None:
    _, client = native
    async with client.responses.with_streaming_response.create(
        model="gpt-4o", input="stream me", stream=True, extra_headers=ALICE
    ) as raw:
        body = b"".join([chunk async for chunk in raw.http_response.aiter_bytes()])
    check_stream(body)
    async with client.responses.stream(model="gpt-4o", input="again", extra_headers=ALICE) as s:
        final = await s.get_final_response()
    assert final.output_text.startswith('fake response to: "again"')


async def test_a_fact_from_another_conversation_reaches_a_native_upstream(
    native: tuple[FakeResponses, openai.AsyncOpenAI],
) -> None:
    app, client = native
    await client.responses.create(
        model="gpt-4o", input="My locker code is 4711, remember it.", extra_headers=ALICE
    )
    await client.responses.create(
        model="gpt-4o", input="What is my locker code?", extra_headers=ALICE
    )
    sent = app.responses_requests[-1]
    # The recalled turn is memproxy's context: in `instructions`, since the upstream stores
    # the response (it must not pile up in the upstream's state).
    assert "4711" in sent["instructions"]
    assert sent["input"] == [{"role": "user", "content": "What is my locker code?"}]


async def test_a_client_that_stores_nothing_resends_its_input_and_is_one_conversation(
    native: tuple[FakeResponses, openai.AsyncOpenAI],
) -> None:
    app, client = native
    items: list[Any] = [{"role": "user", "content": "first question"}]
    first = await client.responses.with_raw_response.create(
        model="gpt-4o", input=items, store=False, extra_headers=ALICE
    )
    reply = first.parse()
    items += [o.model_dump(exclude_none=True) for o in reply.output]
    items.append({"role": "user", "content": "second question"})
    second = await client.responses.with_raw_response.create(
        model="gpt-4o", input=items, store=False, extra_headers=ALICE
    )
    conversation = first.http_response.headers["x-memory-conversation-id"]
    assert second.http_response.headers["x-memory-conversation-id"] == conversation
    assert second.http_response.headers["x-memory-history-messages"] == "0"
    assert app.responses_requests[-1]["store"] is False


# --- translated ----------------------------------------------------------------------------------


async def test_a_chat_only_upstream_answers_the_responses_api_by_translation(
    translated: tuple[FakeOpenAI, openai.AsyncOpenAI],
) -> None:
    app, client = translated
    raw = await client.responses.with_raw_response.create(
        model="gpt-4o-mini", instructions="Be brief.", input="hello", extra_headers=ALICE
    )
    assert_openai_shape("Response", raw.http_response.json())
    assert raw.parse().output_text == "fake reply to: hello"
    sent = app.requests[-1]
    assert sent.path == "/v1/chat/completions"
    assert sent.json()["messages"][0] == {"role": "system", "content": "Be brief."}


async def test_a_translated_stream_is_the_full_responses_event_sequence(
    echo: openai.AsyncOpenAI,
) -> None:
    async with echo.responses.with_streaming_response.create(
        model="gpt-4o-mini", input="stream me", stream=True, extra_headers=ALICE
    ) as raw:
        body = b"".join([chunk async for chunk in raw.http_response.aiter_bytes()])
    types = [event["type"] for event in check_stream(body)]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert "response.output_text.delta" in types and types[-1] == "response.completed"
    async with echo.responses.stream(model="gpt-4o-mini", input="hi", extra_headers=ALICE) as s:
        final = await s.get_final_response()
    assert "echo: received" in final.output_text
    assert final.usage is not None and final.usage.input_tokens > 0


async def test_a_function_call_round_trip_by_translation(echo: openai.AsyncOpenAI) -> None:
    first = await echo.responses.create(
        model="gpt-4o-mini",
        input="Please lookup the word ephemeral.",
        tools=[LOOKUP],
        tool_choice={"type": "function", "name": "lookup"},
        extra_headers=ALICE,
    )
    (call,) = [o for o in first.output if o.type == "function_call"]
    assert call.name == "lookup"
    followup: list[Any] = [
        {"role": "user", "content": "Please lookup the word ephemeral."},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "short-lived"},
    ]
    second = await echo.responses.create(
        model="gpt-4o-mini", input=followup, tools=[LOOKUP], extra_headers=ALICE
    )
    assert second.output_text.startswith("echo: received")


async def test_structured_output_by_translation(echo: openai.AsyncOpenAI) -> None:
    class Word(BaseModel):
        word: str
        letters: int

    parsed = await echo.responses.parse(
        model="gpt-4o-mini", input="Give me a word.", text_format=Word, extra_headers=ALICE
    )
    assert isinstance(parsed.output_parsed, Word)


async def test_bad_responses_requests_are_400s_naming_the_param(echo: openai.AsyncOpenAI) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"input": 5}, "input"),
        ({"input": []}, "input"),
        ({"instructions": "Be brief."}, "input"),
        ({"input": [{"role": "wizard", "content": "x"}]}, "input[0].role"),
        ({"input": "x", "stream": "yes"}, "stream"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ]
    for body, param in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            await echo.responses.create(model="gpt-4o-mini", **body)
        assert caught.value.param == param, body


async def test_a_malformed_body_is_a_400_in_openais_shape(serve_proxy: ServeProxy) -> None:
    url = serve_proxy(make_config(UpstreamConfig(kind="echo")))
    async with httpx.AsyncClient(headers={"authorization": f"Bearer {KEY}"}) as http:
        response = await http.post(url + "/responses", content=b'{"model": "m", "input": ')
    assert response.status_code == 400
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


# --- state ---------------------------------------------------------------------------------------


async def test_a_chain_of_three_by_translation_is_served_from_memproxys_store(
    translated: tuple[FakeOpenAI, openai.AsyncOpenAI],
) -> None:
    app, client = translated
    first = await client.responses.with_raw_response.create(
        model="gpt-4o-mini", instructions="Be brief.", input="one", extra_headers=ALICE
    )
    one = first.parse()
    two = await client.responses.create(
        model="gpt-4o-mini", previous_response_id=one.id, input="two", extra_headers=ALICE
    )
    three = await client.responses.with_raw_response.create(
        model="gpt-4o-mini", previous_response_id=two.id, input="three", extra_headers=ALICE
    )
    # The upstream saw the whole chain, as OpenAI would have kept it (the first request's
    # instructions are not carried over), and the turns are one conversation.
    sent = app.requests[-1].json()["messages"]
    assert [(m["role"], text_of(m["content"])) for m in sent] == [
        ("user", "one"),
        ("assistant", "fake reply to: one"),
        ("user", "two"),
        ("assistant", "fake reply to: two"),
        ("user", "three"),
    ]
    conversation = first.http_response.headers["x-memory-conversation-id"]
    assert three.http_response.headers["x-memory-conversation-id"] == conversation
    assert three.http_response.headers["x-memory-history-messages"] == "0"
    kept = await client.responses.retrieve(three.parse().id, extra_headers=ALICE)
    assert kept.previous_response_id == two.id and kept.output_text == "fake reply to: three"
    items = await client.responses.input_items.list(one.id, extra_headers=ALICE)
    assert [i.type for i in items.data] == ["message"]


async def test_an_unknown_or_unstored_previous_response_is_a_400(
    echo: openai.AsyncOpenAI,
) -> None:
    hidden = await echo.responses.create(
        model="gpt-4o-mini", input="not kept", store=False, extra_headers=ALICE
    )
    for previous in ("resp_unknown", hidden.id):
        with pytest.raises(openai.BadRequestError) as caught:
            await echo.responses.create(
                model="gpt-4o-mini", previous_response_id=previous, input="x", extra_headers=ALICE
            )
        assert caught.value.param == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        await echo.responses.retrieve(hidden.id, extra_headers=ALICE)


async def test_another_users_response_cannot_be_continued(echo: openai.AsyncOpenAI) -> None:
    mine = await echo.responses.create(model="gpt-4o-mini", input="mine", extra_headers=ALICE)
    with pytest.raises(openai.BadRequestError):
        await echo.responses.create(
            model="gpt-4o-mini",
            previous_response_id=mine.id,
            input="yours?",
            extra_headers={"X-Memory-User-Id": "mallory"},
        )


async def test_a_native_chain_is_the_upstreams_and_the_proxy_sends_no_history_again(
    native: tuple[FakeResponses, openai.AsyncOpenAI],
) -> None:
    app, client = native
    first = await client.responses.with_raw_response.create(
        model="gpt-4o", input="My badge number is 9981.", extra_headers=ALICE
    )
    one = first.parse()
    second = await client.responses.with_raw_response.create(
        model="gpt-4o",
        previous_response_id=one.id,
        input="What was my badge number?",
        extra_headers=ALICE,
    )
    sent = app.responses_requests[-1]
    assert sent["previous_response_id"] == one.id
    assert sent["input"] == "What was my badge number?"
    # Nothing recalled: the chain the upstream keeps holds the first turn already.
    assert "instructions" not in sent
    headers = second.http_response.headers
    assert (
        headers["x-memory-conversation-id"]
        == first.http_response.headers["x-memory-conversation-id"]
    )
    assert headers["x-memory-history-messages"] == "0"


# --- the same on both kinds of upstream ---------------------------------------------------------


@pytest.fixture(params=["native", "translated"])
async def both(
    request: pytest.FixtureRequest,
    responses_fake: tuple[FakeResponses, str],
    serve_proxy: ServeProxy,
) -> AsyncIterator[openai.AsyncOpenAI]:
    """memproxy in front of the strict fake Responses API, or of echo (translated)."""
    if request.param == "native":
        _, url = responses_fake
        upstream = UpstreamConfig(kind="openai", base_url=url, api_key="upstream-key")
    else:
        upstream = UpstreamConfig(kind="echo")
    async with sdk(serve_proxy(make_config(upstream))) as client:
        yield client


async def test_a_function_call_round_trip_stores_calls_and_outputs_as_tool_messages(
    both: openai.AsyncOpenAI, serve_proxy: ServeProxy
) -> None:
    first = await both.responses.with_raw_response.create(
        model="gpt-4o-mini",
        input="Please lookup the word ephemeral.",
        tools=[LOOKUP],
        tool_choice={"type": "function", "name": "lookup"},
        extra_headers=ALICE,
    )
    (call,) = [o for o in first.parse().output if o.type == "function_call"]
    followup: list[Any] = [
        {"role": "user", "content": "Please lookup the word ephemeral."},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "short-lived"},
    ]
    second = await both.responses.with_raw_response.create(
        model="gpt-4o-mini", input=followup, tools=[LOOKUP], extra_headers=ALICE
    )
    assert second.parse().output_text
    conversation = first.http_response.headers["x-memory-conversation-id"]
    assert second.http_response.headers["x-memory-conversation-id"] == conversation
    base = str(both.base_url).rstrip("/")
    async with httpx.AsyncClient(headers={"authorization": f"Bearer {KEY}"}) as http:
        listed = await http.get(f"{base}/memory/conversations/{conversation}/messages")
    roles = [(m["role"], bool(m.get("tool_calls"))) for m in listed.json()["data"]]
    assert roles == [
        ("user", False),
        ("assistant", True),
        ("tool", False),
        ("assistant", False),
    ]


async def test_text_format_reaches_a_native_upstream_as_the_client_sent_it(
    native: tuple[FakeResponses, openai.AsyncOpenAI],
) -> None:
    app, client = native
    text = {
        "format": {
            "type": "json_schema",
            "name": "word",
            "schema": {
                "type": "object",
                "properties": {"word": {"type": "string"}},
                "required": ["word"],
                "additionalProperties": False,
            },
            "strict": True,
        }
    }
    await client.responses.create(
        model="gpt-4o",
        input="Give me a word.",
        text=text,
        extra_headers=ALICE,  # type: ignore[arg-type]
    )
    assert app.responses_requests[-1]["text"] == text


async def test_an_openai_conversation_is_the_upstreams_and_gets_no_history_again(
    native: tuple[FakeResponses, openai.AsyncOpenAI],
) -> None:
    app, client = native
    shared = (await client.conversations.create()).id  # (passed through to the upstream)
    for text in ("My badge number is 9981.", "What was my badge number?"):
        raw = await client.responses.with_raw_response.create(
            model="gpt-4o", conversation=shared, input=text, extra_headers=ALICE
        )
        assert raw.http_response.headers["x-memory-conversation-id"] == shared
        assert raw.http_response.headers["x-memory-history-messages"] == "0"
    sent = app.responses_requests[-1]
    assert sent["conversation"] == shared and sent["input"] == "What was my badge number?"
    assert "instructions" not in sent


async def test_previous_response_id_names_the_conversation_before_the_parameter(
    echo: openai.AsyncOpenAI,
) -> None:
    first = await echo.responses.with_raw_response.create(
        model="gpt-4o-mini", input="one", extra_headers=ALICE
    )
    second = await echo.responses.with_raw_response.create(
        model="gpt-4o-mini",
        previous_response_id=first.parse().id,
        conversation="elsewhere",
        input="two",
        extra_headers=ALICE,
    )
    conversation = first.http_response.headers["x-memory-conversation-id"]
    assert second.http_response.headers["x-memory-conversation-id"] == conversation


async def test_mode_off_keeps_no_response_even_with_an_idempotency_key(
    echo: openai.AsyncOpenAI,
) -> None:
    off = await echo.responses.create(
        model="gpt-4o-mini",
        input="not kept",
        extra_headers={**ALICE, "X-Memory-Mode": "off", "Idempotency-Key": "k-1"},
    )
    with pytest.raises(openai.NotFoundError):
        await echo.responses.retrieve(off.id, extra_headers=ALICE)


async def test_an_upstream_giving_one_response_id_twice_still_gets_both_turns_stored(
    native: tuple[FakeResponses, openai.AsyncOpenAI],
) -> None:
    """The second response is not kept under the id (the first is); its turn and reply are
    stored all the same, not spilled as a failed write."""
    app, client = native
    output = [
        {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "same", "annotations": []}],
        }
    ]
    usage = {"input_tokens": 3, "output_tokens": 1, "total_tokens": 4}
    for _ in range(2):
        body = response_object({"model": "gpt-4o"}, "resp_same", output, usage)
        app.script.append(Reply(body=body))
    headers = {**ALICE, "X-Memory-Conversation-Id": "twice"}
    for text in ("first", "second"):
        raw = await client.responses.with_raw_response.create(
            model="gpt-4o", input=text, extra_headers=headers
        )
        assert raw.http_response.headers["x-memory-status"] == "ok"
    base = str(client.base_url).rstrip("/")
    async with httpx.AsyncClient(headers={"authorization": f"Bearer {KEY}"}) as http:
        listed = await http.get(f"{base}/memory/conversations/twice/messages")
    assert [m["content"] for m in listed.json()["data"]] == ["first", "same", "second", "same"]


# --- whose responses ----------------------------------------------------------------------------


async def test_another_users_response_is_not_continued_on_a_native_upstream(
    native: tuple[FakeResponses, openai.AsyncOpenAI],
) -> None:
    """The native upstream would continue any chain its key can see: memproxy forwards only a
    response it saw made for the same tenant and user."""
    app, client = native
    one = await client.responses.create(
        model="gpt-4o", input="My secret is 4242.", extra_headers=ALICE
    )
    sent = len(app.responses_requests)
    with pytest.raises(openai.BadRequestError) as caught:
        await client.responses.create(
            model="gpt-4o",
            previous_response_id=one.id,
            input="What is my secret?",
            extra_headers={"X-Memory-User-Id": "mallory"},
        )
    assert caught.value.code == "previous_response_not_found"
    assert len(app.responses_requests) == sent


async def test_another_tenants_response_is_404_on_a_native_upstream(
    responses_fake: tuple[FakeResponses, str], serve_proxy: ServeProxy
) -> None:
    _, url = responses_fake
    upstream = UpstreamConfig(kind="openai", base_url=url, api_key="upstream-key")
    base = serve_proxy(make_config(upstream))
    async with (
        sdk(base) as first,
        openai.AsyncOpenAI(base_url=base, api_key=OTHER_TENANT_KEY, max_retries=0) as second,
    ):
        one = await first.responses.create(model="gpt-4o", input="tenant one's secret")
        assert (await first.responses.retrieve(one.id)).id == one.id
        with pytest.raises(openai.NotFoundError):
            await second.responses.retrieve(one.id)
        with pytest.raises(openai.NotFoundError):
            await second.responses.delete(one.id)
        with pytest.raises(openai.NotFoundError):
            await second.responses.input_items.list(one.id)
        with pytest.raises(openai.BadRequestError):
            await second.responses.create(
                model="gpt-4o", previous_response_id=one.id, input="what was it?"
            )


async def test_a_user_erased_while_their_turn_runs_leaves_no_response_behind(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: ServeProxy
) -> None:
    app, url = fake_upstream
    base = serve_proxy(make_config(UpstreamConfig(kind="litellm", base_url=url, api_key="k")))
    app.script = [replace(model_said("the reply"), hold=True)]
    auth = {"authorization": f"Bearer {KEY}"}
    async with sdk(base) as client, httpx.AsyncClient(headers=auth) as http:
        turn = asyncio.create_task(
            client.responses.create(model="gpt-4o-mini", input="my ssn is 123", extra_headers=ALICE)
        )

        async def started() -> bool:
            return bool(app.requests)  # (its reply held until released)

        await eventually(started, "the upstream's reply")
        assert (await http.delete(base + "/memory/users/alice")).status_code == 200
        app.release.set()
        response = await turn
        exported = await http.get(base + "/memory/users/alice/export")
        assert exported.json()["responses"] == []
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(response.id, extra_headers=ALICE)
