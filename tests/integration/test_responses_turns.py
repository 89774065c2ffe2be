"""What every turn gets applies to `POST /v1/responses` too, Responses-shaped: idempotency,
`X-Memory-Mode`, rate limits, fail-open with the spill, upstream errors, broken streams, the
exchange record with usage and cost, and the stored messages of a function-call round trip."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from proxy.core.config import Config, Limits, PriceConfig, UpstreamConfig
from tests.conftest import KEY, make_config
from tests.fakes.openai_responses import (
    FakeResponses,
    response_object,
    stream_events,
    usage_of,
)
from tests.fakes.openai_upstream import FakeOpenAI, Reply, chat_reply, error_reply
from tests.fakes.server import ServerThread
from tests.integration.test_degraded import OPEN, eventually, has, on_sqlite, sqlite_locked
from tests.integration.test_degraded import stored as stored_in
from tests.integration.test_limits import assert_rate_limited, wait_for_a_fresh_minute
from tests.responses_check import check_stream

ServeProxy = Callable[[Config], str]
ALICE = {"X-Memory-User-Id": "alice"}
LOOKUP: Any = {
    "type": "function",
    "name": "lookup",
    "description": "Look something up",
    "parameters": {
        "type": "object",
        "properties": {"query": {"type": "string"}},
        "required": ["query"],
        "additionalProperties": False,
    },
    "strict": True,
}


@pytest.fixture
def responses_fake() -> Iterator[tuple[FakeResponses, str]]:
    app = FakeResponses()
    with ServerThread(app) as server:
        yield app, server.url + "/v1"


def native_upstream(url: str) -> UpstreamConfig:
    return UpstreamConfig(kind="openai", base_url=url, api_key="upstream-key")


def sdk(url: str, key: str = KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0)


@pytest.fixture
async def native(
    responses_fake: tuple[FakeResponses, str], serve_proxy: ServeProxy
) -> AsyncIterator[tuple[FakeResponses, str, openai.AsyncOpenAI]]:
    """(the fake, memproxy's URL, a client) for memproxy in front of the native fake."""
    app, url = responses_fake
    base = serve_proxy(make_config(native_upstream(url)))
    async with sdk(base) as client:
        yield app, base, client


async def manage(base_url: str, path: str, key: str = KEY) -> httpx.Response:
    async with httpx.AsyncClient(headers={"authorization": f"Bearer {key}"}) as http:
        return await http.get(base_url + path)


async def messages(base_url: str, conversation: str) -> list[dict[str, Any]]:
    got = await manage(base_url, f"/memory/conversations/{conversation}/messages")
    assert got.status_code == 200, got.text
    data: list[dict[str, Any]] = got.json()["data"]
    return data


async def exchange(base_url: str, request_id: str) -> dict[str, Any]:
    got = await manage(base_url, f"/memory/exchanges/{request_id}")
    assert got.status_code == 200, got.text
    record: dict[str, Any] = got.json()
    return record


async def test_a_retried_response_with_an_idempotency_key_is_stored_once(
    native: tuple[FakeResponses, str, openai.AsyncOpenAI],
) -> None:
    _, base, client = native
    headers = {**ALICE, "X-Memory-Conversation-Id": "idem", "Idempotency-Key": "k-1"}
    first = await client.responses.create(model="gpt-4o", input="Book it.", extra_headers=headers)
    again = await client.responses.create(model="gpt-4o", input="Book it.", extra_headers=headers)
    assert again.output_text == first.output_text
    stored = await messages(base, "idem")
    assert [(m["role"], m["content"]) for m in stored] == [
        ("user", "Book it."),
        ("assistant", first.output_text),
    ]


async def test_memory_modes_off_and_read_store_no_responses_turn(
    native: tuple[FakeResponses, str, openai.AsyncOpenAI],
) -> None:
    app, base, client = native
    await client.responses.create(
        model="gpt-4o", input="My locker code is 4711.", extra_headers=ALICE
    )
    question = "What is my locker code?"
    ids = {}
    for mode in ("read", "off"):
        raw = await client.responses.with_raw_response.create(
            model="gpt-4o", input=question, extra_headers={**ALICE, "X-Memory-Mode": mode}
        )
        ids[mode] = raw.http_response.headers["x-request-id"]
        sent = app.responses_requests[-1]
        if mode == "read":  # attached: the fact, from the first conversation
            assert "4711" in sent["instructions"]
            assert sent["input"] == [{"role": "user", "content": question}]
        else:  # nothing attached: the request as it came
            assert "instructions" not in sent and sent["input"] == question
    listed = (await manage(base, "/memory/conversations?user=alice")).json()["data"]
    assert len(listed) == 1  # the first turn's: neither mode stored the question
    kept = await messages(base, listed[0]["id"])
    assert [m["content"] for m in kept if m["role"] == "user"] == ["My locker code is 4711."]
    for mode, request_id in ids.items():  # the exchange record is kept in every mode
        assert (await exchange(base, request_id))["status"] == "complete", mode


async def test_over_the_tenants_rpm_a_response_is_a_429_in_openais_shape(
    responses_fake: tuple[FakeResponses, str], serve_proxy: ServeProxy
) -> None:
    app, url = responses_fake
    base = serve_proxy(make_config(native_upstream(url), limits=Limits(rpm=2)))
    await wait_for_a_fresh_minute()
    async with sdk(base) as client:
        for _ in range(2):
            await client.responses.create(model="gpt-4o", input="hello", extra_headers=ALICE)
        with pytest.raises(openai.RateLimitError) as caught:
            await client.responses.create(model="gpt-4o", input="hello", extra_headers=ALICE)
        assert_rate_limited(caught.value, "requests", "rate_limit_exceeded")
        with pytest.raises(openai.RateLimitError):  # a stream is refused the same way
            await client.responses.create(
                model="gpt-4o", input="hello", stream=True, extra_headers=ALICE
            )
    assert len(app.responses_requests) == 2


async def test_a_response_while_the_database_is_away_is_degraded_and_stored_from_the_spill(
    responses_fake: tuple[FakeResponses, str], serve_proxy: ServeProxy, tmp_path: Path
) -> None:
    app, url = responses_fake
    settings, spill, db = on_sqlite(url, tmp_path)
    base = serve_proxy(settings)
    headers = {"X-Memory-User-Id": "u1", "X-Memory-Conversation-Id": "c1"}
    async with sdk(base, OPEN) as client:
        with sqlite_locked(db):
            raw = await client.responses.with_raw_response.create(
                model="gpt-4o", input="said while storage is away", extra_headers=headers
            )
        assert raw.http_response.headers["x-memory-status"] == "degraded"
        answer = raw.parse().output_text
        assert answer.startswith('fake response to: "said while storage is away"')
        await eventually(lambda: has(base, 2, spill))
    assert await stored_in(base) == [
        ("user", "said while storage is away", "complete"),
        ("assistant", answer, "complete"),
    ]
    assert len(app.responses_requests) == 1
    # The response was kept with its reply from the spill: it can be continued (memproxy saw
    # it made for this user) and the next turn goes on in its conversation.
    async with sdk(base, OPEN) as client:
        later = await client.responses.with_raw_response.create(
            model="gpt-4o",
            previous_response_id=raw.parse().id,
            input="and now?",
            extra_headers={"X-Memory-User-Id": "u1"},
        )
    assert later.http_response.headers["x-memory-conversation-id"] == "c1"


async def test_an_upstream_error_passes_through_with_its_status(
    native: tuple[FakeResponses, str, openai.AsyncOpenAI],
) -> None:
    app, _, client = native
    app.script.append(error_reply(422, "That model cannot do this.", "invalid_request_error"))
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        await client.responses.create(model="gpt-4o", input="hello", extra_headers=ALICE)
    assert caught.value.status_code == 422
    assert caught.value.response.json()["error"]["message"] == "That model cannot do this."


async def read_stream(client: openai.AsyncOpenAI) -> tuple[list[dict[str, Any]], str]:
    """A streamed response read to its end, raw: its checked events and its request id."""
    async with client.responses.with_streaming_response.create(
        model="gpt-4o", input="Tell me a story.", stream=True, extra_headers=ALICE
    ) as raw:
        body = b"".join([chunk async for chunk in raw.http_response.aiter_bytes()])
        request_id = raw.http_response.headers["x-request-id"]
    return check_stream(body, complete=False), request_id


async def test_a_broken_native_stream_ends_with_an_error_event_and_is_recorded(
    native: tuple[FakeResponses, str, openai.AsyncOpenAI],
) -> None:
    app, base, client = native
    body = {"model": "gpt-4o", "input": "Tell me a story."}
    text = "Once upon a time there was a proxy."
    output = [
        {
            "id": "msg_broken",
            "type": "message",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
        }
    ]
    whole = stream_events(response_object(body, "resp_broken", output, usage_of([], output)))
    # The connection drops after: created, in_progress, the item and its part added, two words.
    app.script.append(Reply(chunks=whole, die_after=6))
    events, request_id = await read_stream(client)
    assert events[-1]["type"] == "error"
    assert [e["sequence_number"] for e in events] == list(range(7))
    assert "".join(e.get("delta", "") for e in events) == "Once upon "
    record = await exchange(base, request_id)
    assert record["status"] in ("incomplete", "error"), record


async def test_a_broken_translated_stream_ends_with_response_failed_and_is_recorded(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: ServeProxy
) -> None:
    app, url = fake_upstream
    base = serve_proxy(
        make_config(UpstreamConfig(kind="openai", base_url=url, responses="translate"))
    )
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}], "stream": True}
    app.script.append(Reply(chunks=chat_reply(body).chunks, die_after=2))
    async with sdk(base) as client:
        events, request_id = await read_stream(client)
    assert events[0]["type"] == "response.created"
    assert events[-1]["type"] == "response.failed"
    record = await exchange(base, request_id)
    assert record["status"] in ("incomplete", "error"), record


async def test_a_responses_turn_has_its_usage_and_cost_in_the_record_and_the_usage_report(
    responses_fake: tuple[FakeResponses, str], serve_proxy: ServeProxy
) -> None:
    _, url = responses_fake
    config = make_config(native_upstream(url))
    config = config.model_copy(
        update={"pricing": {"gpt-4o": PriceConfig(input_per_mtok=1.0, output_per_mtok=2.0)}}
    )
    base = serve_proxy(config)
    async with sdk(base) as client:
        raw = await client.responses.with_raw_response.create(
            model="gpt-4o", input="What does it cost?", extra_headers=ALICE
        )
    usage = raw.parse().usage
    assert usage is not None
    cost = (usage.input_tokens * 1.0 + usage.output_tokens * 2.0) / 1e6
    headers = raw.http_response.headers
    assert headers["x-usage-prompt-tokens"] == str(usage.input_tokens)
    assert headers["x-usage-completion-tokens"] == str(usage.output_tokens)
    assert float(headers["x-cost-usd"]) == pytest.approx(cost)
    record = await exchange(base, headers["x-request-id"])
    assert record["usage"]["prompt_tokens"] == usage.input_tokens
    assert record["usage"]["completion_tokens"] == usage.output_tokens
    assert record["cost"]["usd"] == pytest.approx(cost) and record["cost"]["priced"] is True
    total = (await manage(base, "/memory/usage")).json()["total"]
    assert total["requests"] == 1
    assert (total["prompt_tokens"], total["completion_tokens"]) == (
        usage.input_tokens,
        usage.output_tokens,
    )
    assert total["cost_usd"] == pytest.approx(cost)


async def test_a_function_call_round_trip_is_listed_as_tool_calls_and_tool_messages(
    native: tuple[FakeResponses, str, openai.AsyncOpenAI],
) -> None:
    _, base, client = native
    headers = {**ALICE, "X-Memory-Conversation-Id": "tools"}
    asked = "Please lookup the word ephemeral."
    first = await client.responses.create(
        model="gpt-4o", input=asked, tools=[LOOKUP], extra_headers=headers
    )
    (call,) = [o for o in first.output if o.type == "function_call"]
    followup: list[Any] = [
        {"role": "user", "content": asked},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "short-lived"},
    ]
    second = await client.responses.create(
        model="gpt-4o", input=followup, tools=[LOOKUP], extra_headers=headers
    )
    stored = await messages(base, "tools")
    assert [m["role"] for m in stored] == ["user", "assistant", "tool", "assistant"]
    assert stored[1]["content"] is None
    assert stored[1]["tool_calls"] == [
        {
            "id": call.call_id,
            "type": "function",
            "function": {"name": "lookup", "arguments": call.arguments},
        }
    ]
    assert (stored[2]["tool_call_id"], stored[2]["content"]) == (call.call_id, "short-lived")
    assert stored[3]["content"] == second.output_text
