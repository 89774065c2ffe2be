"""The trace of an exchange through the real server: what the model saw and why, for every
protocol (chat completions, Responses, Anthropic Messages), read back through the management
API (`/v1/memory/exchanges/{id}/trace`, `/v1/memory/messages/{id}`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from policies.trace import MAX_BYTES
from proxy.core.config import ApiKeyConfig, Config, ContextSettings, UpstreamConfig
from tests.conftest import KEY, OTHER_TENANT_KEY, make_config
from tests.fakes.openai_upstream import FakeOpenAI
from tests.integration.test_degraded import OPEN, eventually, has, on_sqlite, say, sqlite_locked
from tests.integration.test_degraded import sdk as degraded_sdk

MODEL = "gpt-4o-mini"
BOB_KEY = "bob-key"
ServeProxy = Callable[[Config], str]
SEEDED = [
    {"role": "user", "content": "I adopted a beagle puppy last week"},
    {"role": "assistant", "content": "Congratulations! What did you name the beagle?"},
    {"role": "user", "content": "We named the beagle Biscuit"},
    {"role": "assistant", "content": "Biscuit is a great name."},
    {"role": "user", "content": "Also my sister lives in Lisbon"},
]
QUESTION = "What is the name of my beagle?"


def start(fake_upstream: tuple[FakeOpenAI, str], serve_proxy: ServeProxy, **tenant: Any) -> str:
    """memproxy (tenant t1, its keys plus one bound to bob) in front of the fake upstream,
    serving the Responses API by translation; its base URL without `/v1`."""
    upstream = UpstreamConfig(
        kind="openai", base_url=fake_upstream[1], api_key="k", responses="translate"
    )
    tenant.setdefault("context", ContextSettings(token_budget=300))
    config = make_config(upstream, **tenant)
    t1 = config.tenants["t1"]
    keys = [*t1.api_keys, ApiKeyConfig(key=BOB_KEY, user="bob")]
    tenants = {**config.tenants, "t1": t1.model_copy(update={"api_keys": keys})}
    return serve_proxy(config.model_copy(update={"tenants": tenants})).removesuffix("/v1")


def management(base: str, key: str = KEY) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=base + "/v1/memory", headers={"authorization": f"Bearer {key}"}
    )


async def seed(base: str, user: str = "alice", messages: list[Any] = SEEDED) -> None:
    async with management(base) as api:
        response = await api.post(
            "/conversations", json={"id": f"{user}-pets", "user": user, "messages": messages}
        )
        assert response.status_code == 201, response.text


async def ask(base: str, protocol: str, text: str = QUESTION, user: str = "alice") -> str:
    """One turn of `user` over `protocol`; the exchange's request id."""
    headers = {"X-Memory-User-Id": user}
    if protocol == "messages":
        async with anthropic.AsyncAnthropic(base_url=base, api_key=KEY, max_retries=0) as c:
            raw = await c.messages.with_raw_response.create(
                model=MODEL,
                max_tokens=50,
                messages=[{"role": "user", "content": text}],
                extra_headers=headers,
            )
            return raw.headers["x-request-id"]
    async with openai.AsyncOpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0) as c:
        if protocol == "responses":
            raw_response = await c.responses.with_raw_response.create(
                model=MODEL, input=text, extra_headers=headers
            )
            return raw_response.headers["x-request-id"]
        stream = protocol == "chat-stream"
        raw_chat = await c.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[{"role": "user", "content": text}],
            extra_headers=headers,
            stream=stream,
        )
        if stream:
            async for _ in raw_chat.parse():  # type: ignore[attr-defined]
                pass
        return raw_chat.headers["x-request-id"]


async def trace_of(base: str, request_id: str, key: str = KEY) -> httpx.Response:
    async with management(base, key) as api:
        return await api.get(f"/exchanges/{request_id}/trace")


@pytest.mark.parametrize("protocol", ["chat", "chat-stream", "responses", "messages"])
async def test_the_trace_shows_what_recall_found_ranked_and_packed(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: ServeProxy, protocol: str
) -> None:
    base = start(fake_upstream, serve_proxy)
    await seed(base)
    request_id = await ask(base, protocol)
    sent = json.dumps(fake_upstream[0].chat_requests[-1]["messages"])
    assert "Biscuit" in sent  # (recall found it: the trace says how)

    response = await trace_of(base, request_id)
    assert response.status_code == 200, response.text
    trace = response.json()
    assert trace["object"] == "memory.exchange.trace" and trace["id"] == request_id
    assert trace["level"] == "summary" and trace["truncated"] is False
    assert 0 < trace["bytes"] < 16_000
    assert trace["user"] == "alice" and trace["status"] == "complete"
    recall = trace["recall"]
    assert "beagle" in recall["terms"] and recall["hits"]["full_text"] > 0
    candidates = recall["candidates"]
    assert candidates and all(c["message"].startswith("msg_") for c in candidates)
    assert [c["score"] for c in candidates] == sorted(
        (c["score"] for c in candidates), reverse=True
    )
    packed = {c["message"] for c in candidates if c["packed"]}
    assert packed and len(packed) <= recall["packed"]
    sections = trace["sections"]
    assert sections["recall"]["chosen"] >= 1 and sections["recall"]["tokens"] > 0
    assert (
        sections["recall"]["considered"]
        == sections["recall"]["chosen"] + sections["recall"]["left_out"]
    )
    assert trace["budget"]["token_budget"] == 300
    total = sum(s["tokens"] for s in sections.values())
    assert 0 < total <= 300 and trace["context"]["tokens"] == total
    # The recall part of the added context, by reference: the messages its excerpts quote.
    (part,) = [p for p in trace["context"]["parts"] if p["section"] == "recall"]
    quoted = {m for e in part["excerpts"]["items"] for m in e["messages"]}
    assert packed <= quoted and len(quoted) == recall["packed"]
    assert "messages" not in trace["context"]  # (summary: no text)
    assert trace["intent"]["decided_by"] == "keyword" and trace["intent"]["label"]
    assert trace["timings"]["load_ms"] >= 0 and trace["timings"]["recall_ms"] >= 0
    assert trace["degraded"] == [] and trace["usage"]["prompt_tokens"] > 0
    # Each quoted message can be read by its id, and names the exchange that stored it.
    async with management(base) as api:
        texts = []
        for message_id in quoted:
            message = (await api.get(f"/messages/{message_id}")).json()
            assert message["id"] == message_id and message["conversation_id"] == "alice-pets"
            assert "request_id" in message
            texts.append(message["content"])
    assert "We named the beagle Biscuit" in texts


async def test_history_is_traced_by_message_with_its_tokens(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: ServeProxy
) -> None:
    base = start(fake_upstream, serve_proxy)
    headers = {"X-Memory-User-Id": "carol", "X-Memory-Conversation-Id": "c1"}
    async with openai.AsyncOpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0) as c:
        for text in ("Plan a trip to Lisbon.", "In May."):
            raw = await c.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": text}], extra_headers=headers
            )
    trace = (await trace_of(base, raw.headers["x-request-id"])).json()
    history = trace["sections"]["history"]
    assert history["chosen"] == 2 and history["left_out"] == 0
    assert history["tokens"] == int(raw.headers["x-memory-context-tokens"])
    (part,) = [p for p in trace["context"]["parts"] if p["section"] == "history"]
    async with management(base) as api:
        listed = (await api.get("/conversations/c1/messages")).json()["data"]
    assert part["messages"]["items"] == [m["id"] for m in listed[:2]]
    # Each listed message names the exchange that stored it.
    assert [m["request_id"] is not None for m in listed] == [True] * len(listed)


async def test_full_keeps_the_added_context_as_sent_and_summary_only_references(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: ServeProxy
) -> None:
    base = start(fake_upstream, serve_proxy, trace="full")
    await seed(base)
    trace = (await trace_of(base, await ask(base, "chat"))).json()
    assert trace["level"] == "full"
    (added,) = trace["context"]["messages"]
    assert added["section"] == "recall" and added["role"] == "system"
    sent = fake_upstream[0].chat_requests[-1]["messages"]
    assert sent[added["position"]]["content"] == added["content"]
    assert "Biscuit" in added["content"]


async def test_a_summary_trace_holds_no_stored_text(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: ServeProxy
) -> None:
    base = start(fake_upstream, serve_proxy)
    await seed(base)
    trace = (await trace_of(base, await ask(base, "chat"))).json()
    assert "Biscuit" not in json.dumps(trace) and "Lisbon" not in json.dumps(trace)


async def test_trace_off_records_nothing(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: ServeProxy
) -> None:
    base = start(fake_upstream, serve_proxy, trace="off")
    await seed(base)
    request_id = await ask(base, "chat")
    response = await trace_of(base, request_id)
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "trace_not_found"
    async with management(base) as api:  # (the exchange itself is recorded as ever)
        assert (await api.get(f"/exchanges/{request_id}")).status_code == 200


async def test_a_large_full_trace_is_cut_to_its_bound_and_says_so(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: ServeProxy
) -> None:
    base = start(
        fake_upstream, serve_proxy, trace="full", context=ContextSettings(token_budget=60_000)
    )
    long = [
        {"role": ("user", "assistant")[i % 2], "content": f"beagle note {i}: " + "woof " * 2_000}
        for i in range(20)
    ]
    await seed(base, messages=long)
    response = await trace_of(base, await ask(base, "chat", "Tell me about the beagle notes"))
    trace = response.json()
    assert trace["truncated"] and "context.messages.content" in trace["truncated"]
    assert trace["bytes"] <= MAX_BYTES["full"]
    assert len(response.content) < 2 * MAX_BYTES["full"]


async def test_erasing_the_user_erases_their_traces(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: ServeProxy
) -> None:
    base = start(fake_upstream, serve_proxy)
    await seed(base)
    request_id = await ask(base, "chat")
    assert (await trace_of(base, request_id)).status_code == 200
    async with management(base) as api:
        assert (await api.delete("/users/alice")).status_code == 200
    assert (await trace_of(base, request_id)).status_code == 404


async def test_another_user_or_tenant_cannot_read_a_trace_or_message(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: ServeProxy
) -> None:
    base = start(fake_upstream, serve_proxy)
    await seed(base)
    request_id = await ask(base, "chat")
    trace = (await trace_of(base, request_id)).json()
    message_id = trace["recall"]["candidates"][0]["message"]
    for key in (BOB_KEY, OTHER_TENANT_KEY):
        response = await trace_of(base, request_id, key)
        assert response.status_code == 404, key
        assert response.json()["error"]["code"] == "exchange_not_found"
        async with management(base, key) as api:
            message = await api.get(f"/messages/{message_id}")
            assert message.status_code == 404 and "Biscuit" not in message.text
    async with management(base) as api:
        for unknown in ("msg_bbbbbbbbbbbbbbb", "msg_x", "42"):
            assert (await api.get(f"/messages/{unknown}")).status_code == 404
        assert (await api.get("/exchanges/nope/trace")).status_code == 404


async def test_a_turn_answered_while_storage_was_away_keeps_its_trace_through_the_spill(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: ServeProxy, tmp_path: Path
) -> None:
    settings, spill, db = on_sqlite(fake_upstream[1], tmp_path)
    base = serve_proxy(settings)
    async with degraded_sdk(base) as client:
        await say(client, "before")
        await eventually(lambda: has(base, 2))  # (its reply is written after the response)
        with sqlite_locked(db):
            _, headers = await say(client, "slow")
            assert headers["x-memory-status"] == "degraded"
        await eventually(lambda: has(base, 4, spill))
    response = await trace_of(base.removesuffix("/v1"), headers["x-request-id"], OPEN)
    assert response.status_code == 200, response.text
    (degraded,) = response.json()["degraded"]
    assert degraded["part"] == "storage" and degraded["reason"].startswith("timeout")


async def test_a_mode_off_turn_is_traced_with_nothing_added(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: ServeProxy
) -> None:
    base = start(fake_upstream, serve_proxy)
    await seed(base)
    async with openai.AsyncOpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0) as c:
        raw = await c.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[{"role": "user", "content": QUESTION}],
            extra_headers={"X-Memory-User-Id": "alice", "X-Memory-Mode": "off"},
        )
    trace = (await trace_of(base, raw.headers["x-request-id"])).json()
    assert trace["mode"] == "off" and trace["context"]["parts"] == []
    assert trace["recall"] is None and trace["intent"]["label"] == "question"


async def test_deleting_a_conversation_deletes_the_traces_of_its_exchanges(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: ServeProxy
) -> None:
    """Its exchange records keep their figures; their traces (at `full`, its text as sent)
    go with the conversation."""
    base = start(fake_upstream, serve_proxy, trace="full")
    headers = {"authorization": f"Bearer {KEY}", "X-Memory-User-Id": "alice"}
    headers["X-Memory-Conversation-Id"] = "trip"
    async with httpx.AsyncClient(base_url=base + "/v1", headers=headers) as chat:
        for text in ("My passport number is X1234567", "When does my flight leave?"):
            turn = {"model": MODEL, "messages": [{"role": "user", "content": text}]}
            response = await chat.post("/chat/completions", json=turn)
            assert response.status_code == 200, response.text
    request_id = response.headers["x-request-id"]
    kept = await trace_of(base, request_id)
    assert kept.status_code == 200 and "X1234567" in kept.text  # (the history, as sent)
    async with management(base) as api:
        assert (await api.delete("/conversations/trip")).status_code == 200
        assert (await api.get(f"/exchanges/{request_id}")).status_code == 200
    gone = await trace_of(base, request_id)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "trace_not_found"
