"""Conversation memory end to end: the official openai SDK -> memproxy (real server, SQLite file
in the test's directory) -> the fake OpenAI API.

What was stored is read only through the management API; what the model saw, only through the
fake upstream's recorded requests.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import openai
import pytest

from proxy.app import create_app
from proxy.core.config import Config, ContextSettings, TenantConfig, UpstreamConfig
from tests.conftest import KEY, OTHER_TENANT_KEY, make_config
from tests.fakes.openai_upstream import (
    FakeOpenAI,
    Reply,
    chat_reply,
    error_reply,
    model_said,
    sse,
)
from tests.fakes.server import ServerThread
from tests.polling import eventually

MODEL = "gpt-4o-mini"
ServeProxy = Callable[[Config], str]
Message = dict[str, Any]
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


def user(text: str) -> Message:
    return {"role": "user", "content": text}


def assistant(text: str | None) -> Message:
    return {"role": "assistant", "content": text}


def answer(text: str) -> Message:
    """What the fake upstream replies to a last message `text`."""
    return assistant(f"fake reply to: {text}")


def sdk(base_url: str, key: str = KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0)


def thin(conversation: str, user_id: str = "alice") -> dict[str, str]:
    return {"X-Memory-Conversation-Id": conversation, "X-Memory-User-Id": user_id}


def openai_upstream(base_url: str) -> UpstreamConfig:
    return UpstreamConfig(kind="openai", base_url=base_url, api_key="upstream-key")


async def chat(
    client: openai.AsyncOpenAI, messages: list[Message], headers: dict[str, str], **options: Any
) -> tuple[Message, httpx.Headers]:
    """One non-streamed completion: (the reply as the client would resend it, headers)."""
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, extra_headers=headers, **options
    )
    message = raw.parse().choices[0].message
    reply: Message = assistant(message.content)
    if message.tool_calls:
        reply["tool_calls"] = [call.model_dump() for call in message.tool_calls]
    return reply, raw.headers


class MemoryAPI:
    """The management API, as an operator would call it."""

    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http

    async def messages(self, conversation: str) -> list[Message]:
        response = await self.http.get(f"/conversations/{conversation}/messages")
        assert response.status_code == 200, response.text
        page = response.json()
        assert page["has_more"] is False
        return list(page["data"])

    async def conversations(self, user_id: str) -> list[Message]:
        response = await self.http.get("/conversations", params={"user": user_id})
        assert response.status_code == 200, response.text
        return list(response.json()["data"])


def sent(stored: list[Message]) -> list[Message]:
    """Stored messages in the shape a chat request carries them."""
    keys = ("role", "content", "name", "tool_calls", "tool_call_id")
    return [{k: m[k] for k in keys if k in m} for m in stored]


@pytest.fixture
def fake(fake_upstream: tuple[FakeOpenAI, str]) -> FakeOpenAI:
    return fake_upstream[0]


@pytest.fixture
async def client(proxy_url: str) -> AsyncIterator[openai.AsyncOpenAI]:
    async with sdk(proxy_url) as client:
        yield client


def memory_api_for(proxy_url: str, key: str = KEY) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=proxy_url + "/memory", headers={"authorization": f"Bearer {key}"}
    )


@pytest.fixture
async def api(proxy_url: str) -> AsyncIterator[MemoryAPI]:
    async with memory_api_for(proxy_url) as http:
        yield MemoryAPI(http)


# --- thin and full-history clients --------------------------------------------------------------


async def test_thin_client_third_turn_reaches_the_upstream_with_every_earlier_turn(
    client: openai.AsyncOpenAI, fake: FakeOpenAI, api: MemoryAPI
) -> None:
    system = {"role": "system", "content": "You are a travel agent."}
    headers = thin("trip-1")
    turns = [user("Plan a trip to Lisbon."), user("In May."), user("For two people.")]

    replies: list[Message] = []
    seen: list[httpx.Headers] = []
    for turn in turns:
        reply, response_headers = await chat(client, [system, turn], headers)
        replies.append(reply)
        seen.append(response_headers)

    # The model saw the client's system message once, then every earlier turn in order.
    assert fake.chat_requests[2]["messages"] == [
        system,
        turns[0],
        replies[0],
        turns[1],
        replies[1],
        turns[2],
    ]
    assert fake.chat_requests[1]["messages"] == [system, turns[0], replies[0], turns[1]]
    assert fake.chat_requests[0]["messages"] == [system, turns[0]]

    stored = await api.messages("trip-1")
    assert sent(stored) == [
        system,
        turns[0],
        replies[0],
        turns[1],
        replies[1],
        turns[2],
        replies[2],
    ]
    assert {m["status"] for m in stored} == {"complete"}
    tokens = [m["tokens"] for m in stored]
    assert all(t > 0 for t in tokens)
    assert [h["x-memory-conversation-id"] for h in seen] == ["trip-1"] * 3
    assert [h["x-memory-history-messages"] for h in seen] == ["0", "2", "4"]
    # What the proxy added: the stored user and assistant turns, never the system message.
    assert [int(h["x-memory-context-tokens"]) for h in seen] == [
        0,
        sum(tokens[1:3]),
        sum(tokens[1:5]),
    ]


async def test_full_history_client_is_stored_once_and_an_edit_starts_a_new_conversation(
    client: openai.AsyncOpenAI, fake: FakeOpenAI, api: MemoryAPI
) -> None:
    headers = {"X-Memory-User-Id": "alice"}
    history: list[Message] = [{"role": "system", "content": "Be brief."}]
    conversation_ids = []
    for text in ("What is SQLite?", "And PostgreSQL?", "Which is faster?"):
        history.append(user(text))
        reply, response_headers = await chat(client, history, headers)
        # Nothing attached: the client already sent everything.
        assert fake.chat_requests[-1]["messages"] == history
        assert response_headers["x-memory-history-messages"] == "0"
        assert response_headers["x-memory-context-tokens"] == "0"
        conversation_ids.append(response_headers["x-memory-conversation-id"])
        history.append(reply)

    [conversation] = set(conversation_ids)
    [listed] = await api.conversations("alice")
    assert listed["id"] == conversation
    assert listed["message_count"] == len(history) == 7
    assert sent(await api.messages(conversation)) == history

    # The client edits its first question and resends: that is another conversation, and the
    # upstream gets what the client sent, with no history of the first conversation attached
    # (recall may quote it, in its own system message, as reference material).
    edited = [history[0], user("What is DuckDB?"), *history[2:4]]
    _, branched = await chat(client, edited, headers)
    forwarded = fake.chat_requests[-1]["messages"]
    assert [m for m in forwarded if not str(m["content"]).startswith("Excerpts from")] == edited
    assert branched["x-memory-history-messages"] == "0"
    new_id = branched["x-memory-conversation-id"]
    assert new_id != conversation
    assert sent(await api.messages(new_id)) == [*edited, answer(edited[-1]["content"])]
    assert sent(await api.messages(conversation)) == history
    assert len(await api.conversations("alice")) == 2


async def test_a_named_conversation_a_client_regenerates_or_edits_in_is_stored_once(
    client: openai.AsyncOpenAI, fake: FakeOpenAI, api: MemoryAPI
) -> None:
    """A client that resends its history and names the conversation: a regenerated answer
    and an edited question continue the conversation from where the client went another way.
    The upstream gets what the client sent, nothing is stored twice, the messages the client
    left stay stored as `superseded` (never attached or quoted back), and the next turns
    continue the branch the client is on."""
    headers = thin("regen")
    history: list[Message] = [{"role": "system", "content": "Be brief."}]
    fake.script = [
        model_said("Tram 28 tickets cost 3 euros."),
        model_said("The castle opens at 9."),
    ]
    for text in ("What does a tram 28 ticket cost?", "When does the castle open?"):
        history.append(user(text))
        reply, _ = await chat(client, history, headers)
        history.append(reply)
    first = history

    fake.script = [model_said("The castle opens at 9:30.")]
    regenerated, seen = await chat(client, history[:-1], headers)
    assert fake.chat_requests[-1]["messages"] == history[:-1]
    assert seen["x-memory-history-messages"] == "0"
    history = [*history[:-1], regenerated]
    history.append(user("And when does the castle close?"))
    reply, seen = await chat(client, history, headers)
    # Nothing attached (all was sent), and the answer left is not quoted back by recall.
    assert fake.chat_requests[-1]["messages"] == history
    assert "opens at 9." not in str(fake.chat_requests[-1]["messages"])
    history.append(reply)

    edited = [*history[:-2], user("And when does the castle close on Sundays?")]
    reply, seen = await chat(client, edited, headers)
    assert fake.chat_requests[-1]["messages"] == edited
    assert seen["x-memory-history-messages"] == "0"
    stored = await api.messages("regen")
    assert [(m["content"], m["status"]) for m in stored] == [
        *[(m["content"], "complete") for m in first[:-1]],
        (first[-1]["content"], "superseded"),
        (regenerated["content"], "complete"),
        (history[-2]["content"], "superseded"),
        (history[-1]["content"], "superseded"),
        (edited[-1]["content"], "complete"),
        (reply["content"], "complete"),
    ]
    [listed] = [c for c in await api.conversations("alice") if c["id"] == "regen"]
    assert listed["message_count"] == len(edited) + 1  # the branch the client is on

    # A thin turn now gets the branch the client is on as its history.
    await chat(client, [history[0], user("Thanks!")], headers)
    assert fake.chat_requests[-1]["messages"] == [*edited, reply, user("Thanks!")]


async def test_a_regenerate_retried_under_its_idempotency_key_is_stored_once(
    client: openai.AsyncOpenAI, fake: FakeOpenAI, api: MemoryAPI
) -> None:
    """The regenerate fails upstream and is retried under the same key: the retry is
    answered against the branch the regenerate started, and its reply is stored once."""
    headers = thin("regen-retry")
    history: list[Message] = [{"role": "system", "content": "Be brief."}]
    for text in ("q1", "q2"):
        history.append(user(text))
        reply, _ = await chat(client, history, headers)
        history.append(reply)
    keyed = {**headers, "Idempotency-Key": "regen-1"}
    fake.script = [error_reply(503, "overloaded")]
    with pytest.raises(openai.APIStatusError):
        await chat(client, history[:-1], keyed)
    fake.script = [model_said("a2, again")]
    again, _ = await chat(client, history[:-1], keyed)
    assert fake.chat_requests[-1]["messages"] == history[:-1]
    stored = await api.messages("regen-retry")
    assert [(m["content"], m["status"]) for m in stored][-2:] == [
        (history[-1]["content"], "superseded"),
        (again["content"], "complete"),
    ]
    follow = [*history[:-1], again, user("q3")]
    await chat(client, follow, headers)
    assert fake.chat_requests[-1]["messages"] == follow
    assert [m["content"] for m in await api.messages("regen-retry")][-4:] == [
        history[-1]["content"],
        again["content"],
        "q3",
        answer("q3")["content"],
    ]


@pytest.mark.parametrize(
    "opening",
    [
        [assistant("Hi! How can I help?")],
        [user("Answer in one line.")],
        [{"role": "system", "content": "Classify."}, user("I love it"), assistant("positive")],
    ],
    ids=["greeting", "instructions_as_user", "few_shot"],
)
async def test_a_thin_client_that_opens_every_request_alike_keeps_its_history(
    client: openai.AsyncOpenAI, fake: FakeOpenAI, api: MemoryAPI, opening: list[Message]
) -> None:
    """A canned greeting, instructions sent as a first user message, or few-shot examples
    before each new message: resending what the conversation opened with is no fork, so the
    earlier turns are attached and none is set aside."""
    headers = thin("opening")
    for text in ("q1", "q2", "q3"):
        await chat(client, [*opening, user(text)], headers)
    sent = fake.chat_requests[-1]["messages"]
    said = [m["content"] for m in sent if m not in opening]
    assert said == ["q1", answer("q1")["content"], "q2", answer("q2")["content"], "q3"]
    assert {m["status"] for m in await api.messages("opening")} == {"complete"}


async def test_a_turn_of_the_branch_left_answered_after_the_fork_is_set_aside(
    client: openai.AsyncOpenAI, fake: FakeOpenAI, api: MemoryAPI
) -> None:
    """A turn on the old branch waits for its reply while the client regenerates the answer
    before it: that turn's reply is kept outside the chain, and the branch the client is on
    stays whole (its count, and what a thin turn gets)."""
    headers = thin("race")
    history: list[Message] = [{"role": "system", "content": "Be brief."}]
    for text in ("u1", "u2"):
        history.append(user(text))
        reply, _ = await chat(client, history, headers)
        history.append(reply)
    held = model_said("reply to u3")
    held.hold = True
    fake.script = [held, model_said("a2, regenerated")]
    old_branch = asyncio.ensure_future(chat(client, [*history, user("u3")], headers))
    await eventually(lambda: asyncio.sleep(0, result=len(fake.chat_requests) == 3))
    regenerated, _ = await chat(client, history[:-1], headers)
    fake.release.set()
    await old_branch
    stored = await api.messages("race")
    assert [(m["content"], m["status"]) for m in stored[-4:]] == [
        (history[-1]["content"], "superseded"),
        ("u3", "superseded"),
        (regenerated["content"], "complete"),
        ("reply to u3", "superseded"),
    ]
    [listed] = [c for c in await api.conversations("alice") if c["id"] == "race"]
    assert listed["message_count"] == 5
    await chat(client, [history[0], user("u4")], headers)
    assert fake.chat_requests[-1]["messages"] == [*history[:-1], regenerated, user("u4")]


async def test_history_resent_under_a_changing_system_prompt_is_stored_once(
    client: openai.AsyncOpenAI, fake: FakeOpenAI, api: MemoryAPI
) -> None:
    """A system prompt that changes on each request (today's date, say) and the conversation
    named: past the stored tail the proxy reads (28 messages here), each turn still stores
    only its new question and reply, and attaches nothing the client sent."""
    headers = thin("dated")
    history: list[Message] = []
    for day in range(16):
        history.append(user(f"question {day}"))
        system = {"role": "system", "content": f"Today is day {day}."}
        reply, seen = await chat(client, [system, *history], headers)
        assert fake.chat_requests[-1]["messages"] == [system, *history]
        assert seen["x-memory-history-messages"] == "0"
        history.append(reply)
    stored = sent(await api.messages("dated"))
    assert stored == [{"role": "system", "content": "Today is day 0."}, *history]


async def test_restart_loses_nothing(fake_upstream: tuple[FakeOpenAI, str]) -> None:
    fake, upstream_url = fake_upstream
    config = make_config(openai_upstream(upstream_url))  # ./memproxy.db, kept across restarts
    alice, bob = thin("before-restart"), {"X-Memory-User-Id": "bob"}
    bob_history: list[Message] = [user("Remember the number 7.")]

    first = ServerThread(create_app(config)).start()
    try:
        async with sdk(first.url + "/v1") as client:
            a1, _ = await chat(client, [user("My name is Alice.")], alice)
            a2, _ = await chat(client, [user("I live in Porto.")], alice)
            b1, before = await chat(client, bob_history, bob)
    finally:
        first.stop()
    bob_history.append(b1)

    second = ServerThread(create_app(config)).start()
    try:
        async with sdk(second.url + "/v1") as client:
            await chat(client, [user("Where do I live?")], alice)
            assert fake.chat_requests[-1]["messages"] == [
                user("My name is Alice."),
                a1,
                user("I live in Porto."),
                a2,
                user("Where do I live?"),
            ]
            bob_history.append(user("Which number?"))
            _, after = await chat(client, bob_history, bob)
            assert fake.chat_requests[-1]["messages"] == bob_history
        assert after["x-memory-conversation-id"] == before["x-memory-conversation-id"]
        async with memory_api_for(second.url + "/v1") as http:
            api = MemoryAPI(http)
            assert len(await api.messages("before-restart")) == 6
            assert sent(await api.messages(after["x-memory-conversation-id"])) == [
                *bob_history,
                answer("Which number?"),
            ]
    finally:
        second.stop()


# --- streams ------------------------------------------------------------------------------------


async def test_streamed_replies_are_stored_whole(
    client: openai.AsyncOpenAI, fake: FakeOpenAI, api: MemoryAPI
) -> None:
    stream = await client.chat.completions.create(
        model=MODEL, messages=[user("Tell me a story.")], stream=True, extra_headers=thin("s")
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == "fake reply to: Tell me a story. "

    stored = await api.messages("s")
    assert sent(stored) == [user("Tell me a story."), assistant(text)]
    assert stored[-1]["status"] == "complete"

    # A streamed tool call: its arguments arrive in pieces and are stored whole.
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[user("Search for x.")],
        tools=TOOLS,
        stream=True,
        extra_headers=thin("s"),
    )
    chunks = [c async for c in stream]
    argument_parts = [
        call.function.arguments
        for c in chunks
        if c.choices and c.choices[0].delta.tool_calls
        for call in c.choices[0].delta.tool_calls
        if call.function and call.function.arguments
    ]
    assert len(argument_parts) > 1
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "search", "arguments": '{"q": "x"}'},
    }
    calling = {"role": "assistant", "content": None, "tool_calls": [call]}
    stored = await api.messages("s")
    assert sent(stored[2:]) == [user("Search for x."), calling]

    # Both reassembled replies continue the conversation: a thin client answers the call, and
    # the upstream (which rejects a tool message without its call) accepts it.
    tool_reply = {"role": "tool", "tool_call_id": "call_1", "content": "x is 42"}
    reply, _ = await chat(client, [tool_reply], thin("s"), tools=TOOLS)
    assert reply == answer("x is 42")
    assert fake.chat_requests[-1]["messages"] == [
        user("Tell me a story."),
        assistant(text),
        user("Search for x."),
        calling,
        tool_reply,
    ]


async def test_client_disconnect_mid_stream_stores_the_reply_as_incomplete(
    client: openai.AsyncOpenAI, fake: FakeOpenAI, api: MemoryAPI
) -> None:
    await chat(client, [user("Hi.")], thin("cut"))
    fake.chunk_delay = 0.2
    stream = await client.chat.completions.create(
        model=MODEL, messages=[user("Tell me everything.")], stream=True, extra_headers=thin("cut")
    )
    await stream.__anext__()
    await stream.close()

    async def partial_reply() -> list[Message]:
        return [m for m in await api.messages("cut") if m["status"] == "incomplete"]

    [partial] = await eventually(partial_reply, "the partial reply is stored")
    assert partial["role"] == "assistant"
    assert (partial["content"] or "") in "fake reply to: Tell me everything. "
    fake.chunk_delay = 0.0

    # The client retries the turn: it is not stored twice, and the partial reply is not sent.
    reply, headers = await chat(client, [user("Tell me everything.")], thin("cut"))
    assert reply == answer("Tell me everything.")
    assert fake.chat_requests[-1]["messages"] == [
        user("Hi."),
        answer("Hi."),
        user("Tell me everything."),
    ]
    assert headers["x-memory-history-messages"] == "2"
    stored = await api.messages("cut")
    assert [(m["role"], m["status"]) for m in stored] == [
        ("user", "complete"),
        ("assistant", "complete"),
        ("user", "complete"),
        ("assistant", "incomplete"),
        ("assistant", "complete"),
    ]
    assert stored[-1]["content"] == reply["content"]


async def test_upstream_error_mid_stream_stores_the_reply_as_error(
    client: openai.AsyncOpenAI, fake: FakeOpenAI, api: MemoryAPI
) -> None:
    upstream = chat_reply({"model": MODEL, "messages": [user("Go on.")], "stream": True})
    fake.script.append(Reply(chunks=upstream.chunks, die_after=2))
    stream = await client.chat.completions.create(
        model=MODEL, messages=[user("Go on.")], stream=True, extra_headers=thin("broken")
    )
    with pytest.raises(openai.APIError):
        async for _ in stream:
            pass

    stored = await api.messages("broken")
    assert [(m["role"], m["content"], m["status"]) for m in stored] == [
        ("user", "Go on.", "complete"),
        ("assistant", "fake ", "error"),
    ]
    # The next turn does not carry the broken reply.
    await chat(client, [user("Hello?")], thin("broken"))
    assert fake.chat_requests[-1]["messages"] == [user("Go on."), user("Hello?")]


@pytest.mark.parametrize("then_done", [True, False])
async def test_an_error_event_mid_stream_stores_the_reply_as_error(
    client: openai.AsyncOpenAI, fake: FakeOpenAI, api: MemoryAPI, then_done: bool
) -> None:
    # vLLM and others report a failure mid-stream as an `error` event, then `[DONE]`.
    upstream = chat_reply({"model": MODEL, "messages": [user("Go on.")], "stream": True})
    chunks = [*upstream.chunks[:2], sse({"error": {"message": "model overloaded"}})]
    fake.script.append(Reply(chunks=[*chunks, b"data: [DONE]\n\n"] if then_done else chunks))
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[user("Go on.")], stream=True, extra_headers=thin("failed")
    )
    with pytest.raises(openai.APIError, match="model overloaded"):
        async for _ in raw.parse():
            pass

    stored = await api.messages("failed")
    assert [(m["role"], m["status"]) for m in stored] == [
        ("user", "complete"),
        ("assistant", "error"),
    ]
    exchange = (await api.http.get(f"/exchanges/{raw.headers['x-request-id']}")).json()
    assert exchange["status"] == "error"
    assert "model overloaded" in exchange["error"]
    # A retry of the turn stores it once, and the failed reply is not attached.
    await chat(client, [user("Go on.")], thin("failed"))
    assert fake.chat_requests[-1]["messages"] == [user("Go on.")]
    stored = await api.messages("failed")
    assert [(m["role"], m["status"]) for m in stored] == [
        ("user", "complete"),
        ("assistant", "error"),
        ("assistant", "complete"),
    ]


# --- tool calls under a tiny budget -------------------------------------------------------------


async def test_tool_calls_under_tiny_budgets_never_reach_the_upstream_orphaned(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: ServeProxy
) -> None:
    fake, upstream_url = fake_upstream
    budgets = [*range(0, 100, 10), 100_000]
    config = make_config(openai_upstream(upstream_url))
    for budget in budgets:  # one tenant per budget, all on one server
        config.tenants[f"budget-{budget}"] = TenantConfig(
            api_keys=[f"budget-key-{budget}"],
            upstream="main",
            context=ContextSettings(token_budget=budget, min_recent_messages=0),
        )
    url = serve_proxy(config)
    steps: list[Message] = [
        user("Find the weather in Paris."),
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 degrees."},
        user("And in Rome?"),
        {"role": "tool", "tool_call_id": "call_1", "content": "Cloudy, 19 degrees."},
        user("Which is warmer?"),
        user("Thanks!"),
    ]
    attached_at_the_end = set()
    for budget in budgets:
        async with sdk(url, f"budget-key-{budget}") as client:
            for step in steps:
                # The fake upstream answers 400, like OpenAI, to a tool message without its
                # call; the SDK would raise.
                _, headers = await chat(client, [step], thin("budget"), tools=TOOLS)
                if step["role"] == "user":
                    assert int(headers["x-memory-context-tokens"]) <= budget
                sent_messages = fake.chat_requests[-1]["messages"]
                assert sent_messages[-1] == step
                for i, message in enumerate(sent_messages):
                    if message["role"] == "tool":
                        opener = next(m for m in reversed(sent_messages[:i]) if m["role"] != "tool")
                        assert message["tool_call_id"] in {
                            c["id"] for c in opener.get("tool_calls") or []
                        }
            attached_at_the_end.add(headers["x-memory-history-messages"])
    # The budgets really cut the history in different places, down to nothing and up to all
    # but the call to "Which is warmer?", which the client never answered (the API rejects a
    # call left dangling, so it is left out).
    assert {"0", str(2 * len(steps) - 3)} < attached_at_the_end, attached_at_the_end
    assert len(fake.chat_requests) == len(steps) * len(budgets)


# --- retries ------------------------------------------------------------------------------------


async def test_turn_retried_after_an_upstream_failure_is_stored_once(
    client: openai.AsyncOpenAI, fake: FakeOpenAI, api: MemoryAPI
) -> None:
    # A thin client.
    first, _ = await chat(client, [user("Hi.")], thin("retry"))
    fake.script.append(error_reply(500, "The server had an error", "server_error"))
    with pytest.raises(openai.InternalServerError):
        await chat(client, [user("Still there?")], thin("retry"))
    reply, headers = await chat(client, [user("Still there?")], thin("retry"))
    assert fake.chat_requests[-1]["messages"] == [user("Hi."), first, user("Still there?")]
    assert headers["x-memory-history-messages"] == "2"
    assert sent(await api.messages("retry")) == [user("Hi."), first, user("Still there?"), reply]

    # A full-history client.
    bob = {"X-Memory-User-Id": "bob"}
    b1, before = await chat(client, [user("Hi.")], bob)
    history = [user("Hi."), b1, user("Still there?")]
    fake.script.append(error_reply(503, "Overloaded", "server_error"))
    with pytest.raises(openai.InternalServerError):
        await chat(client, history, bob)
    b2, after = await chat(client, history, bob)
    assert fake.chat_requests[-1]["messages"] == history
    conversation = after["x-memory-conversation-id"]
    assert conversation == before["x-memory-conversation-id"]
    assert sent(await api.messages(conversation)) == [*history, b2]


async def test_idempotency_key_replay_is_not_stored_twice(
    client: openai.AsyncOpenAI, fake: FakeOpenAI, api: MemoryAPI
) -> None:
    # A thin client replays its second turn (say its connection dropped after the answer).
    a1, _ = await chat(client, [user("Hi.")], {**thin("idem"), "Idempotency-Key": "k-1"})
    turn2 = {**thin("idem"), "Idempotency-Key": "k-2"}
    a2, original = await chat(client, [user("What's new?")], turn2)
    _, replayed = await chat(client, [user("What's new?")], turn2)
    # The replay gets the context its original got, and stores nothing new.
    assert fake.chat_requests[-1]["messages"] == fake.chat_requests[-2]["messages"]
    assert replayed["x-memory-history-messages"] == original["x-memory-history-messages"] == "2"
    assert replayed["x-memory-conversation-id"] == "idem"
    assert sent(await api.messages("idem")) == [user("Hi."), a1, user("What's new?"), a2]

    # A full-history client replays its second turn.
    bob = {"X-Memory-User-Id": "bob"}
    b1, _ = await chat(client, [user("Hi.")], {**bob, "Idempotency-Key": "k-3"})
    history = [user("Hi."), b1, user("What's new?")]
    b2, original = await chat(client, history, {**bob, "Idempotency-Key": "k-4"})
    _, replayed = await chat(client, history, {**bob, "Idempotency-Key": "k-4"})
    assert fake.chat_requests[-1]["messages"] == history
    assert replayed["x-memory-history-messages"] == "0"
    conversation = original["x-memory-conversation-id"]
    assert replayed["x-memory-conversation-id"] == conversation
    assert sent(await api.messages(conversation)) == [*history, b2]

    # In mode off nothing is stored, and a replay is an ordinary exchange (not a conflict).
    off = {"X-Memory-User-Id": "carol", "X-Memory-Mode": "off", "Idempotency-Key": "k-5"}
    _, first = await chat(client, [user("Hi.")], off)
    _, replayed = await chat(client, [user("Hi.")], off)
    assert first["x-memory-status"] == replayed["x-memory-status"] == "ok"
    assert await api.conversations("carol") == []


# --- X-Memory-Mode and the extension headers ----------------------------------------------------


async def test_read_mode_attaches_history_and_stores_nothing(
    client: openai.AsyncOpenAI, fake: FakeOpenAI, api: MemoryAPI
) -> None:
    a1, _ = await chat(client, [user("My dog is called Rex.")], thin("read"))
    read = {**thin("read"), "X-Memory-Mode": "read"}

    _, headers = await chat(client, [user("What is my dog called?")], read)
    assert fake.chat_requests[-1]["messages"] == [
        user("My dog is called Rex."),
        a1,
        user("What is my dog called?"),
    ]
    assert headers["x-memory-history-messages"] == "2"
    assert headers["x-memory-conversation-id"] == "read"
    assert sent(await api.messages("read")) == [user("My dog is called Rex."), a1]

    # A conversation that does not exist is not created, and neither is one for a full history.
    await chat(client, [user("Hello.")], {**thin("read-new"), "X-Memory-Mode": "read"})
    await chat(client, [user("Hello."), a1], {"X-Memory-User-Id": "alice", "X-Memory-Mode": "read"})
    assert [c["id"] for c in await api.conversations("alice")] == ["read"]


async def test_off_mode_forwards_the_body_untouched_and_stores_nothing(
    client: openai.AsyncOpenAI, fake: FakeOpenAI, api: MemoryAPI
) -> None:
    a1, _ = await chat(client, [user("Remember: blue.")], thin("off"))
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[user("Which colour?")],
        temperature=0.3,
        extra_body={"vendor_option": {"nested": [1, None]}},
        extra_headers={**thin("off"), "X-Memory-Mode": "OFF"},
    )
    raw.parse()
    assert fake.chat_requests[-1] == json.loads(raw.http_request.content)
    assert raw.headers["x-memory-history-messages"] == "0"
    assert raw.headers["x-memory-context-tokens"] == "0"
    assert sent(await api.messages("off")) == [user("Remember: blue."), a1]

    await chat(client, [user("Unrelated.")], {"X-Memory-User-Id": "alice", "X-Memory-Mode": "off"})
    assert [c["id"] for c in await api.conversations("alice")] == ["off"]


async def test_bad_extension_values_are_400s_naming_the_param(
    client: openai.AsyncOpenAI, fake: FakeOpenAI, api: MemoryAPI
) -> None:
    alice = {"X-Memory-User-Id": "alice"}
    cases: list[tuple[dict[str, str], dict[str, Any], str]] = [
        ({**alice, "X-Memory-Mode": "sometimes"}, {}, "X-Memory-Mode"),
        ({**alice, "X-Memory-Conversation-Id": "has space"}, {}, "X-Memory-Conversation-Id"),
        ({**alice, "X-Memory-Conversation-Id": "a/b"}, {}, "X-Memory-Conversation-Id"),
        ({**alice, "X-Memory-Conversation-Id": "c" * 129}, {}, "X-Memory-Conversation-Id"),
        ({**alice, "Idempotency-Key": "k" * 257}, {}, "Idempotency-Key"),
        ({"X-Memory-User-Id": "u" * 257}, {}, "X-Memory-User-Id"),
        # Without the header, the body's `user` names the user.
        ({}, {"user": 123}, "user"),
        ({}, {"user": "   "}, "user"),
    ]
    for headers, body, param in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(
                model=MODEL, messages=[user("Hello.")], extra_headers=headers, extra_body=body
            )
        assert caught.value.param == param, (headers, body)
        assert caught.value.type == "invalid_request_error"
    assert fake.requests == []
    assert await api.conversations("alice") == []


# --- tenants and users --------------------------------------------------------------------------


async def test_tenants_never_see_each_others_conversations(
    proxy_url: str, fake: FakeOpenAI
) -> None:
    async with sdk(proxy_url) as t1, sdk(proxy_url, OTHER_TENANT_KEY) as t2:
        secret, _ = await chat(t1, [user("The t1 password is swordfish.")], thin("shared"))
        hello, _ = await chat(t2, [user("Hello from t2.")], thin("shared"))
        assert fake.chat_requests[-1]["messages"] == [user("Hello from t2.")]
        await chat(t2, [user("What is the password?")], thin("shared"))
        assert fake.chat_requests[-1]["messages"] == [
            user("Hello from t2."),
            hello,
            user("What is the password?"),
        ]
        # The same full history in the other tenant does not continue t1's conversation.
        history = [user("The t1 password is swordfish."), secret, user("Repeat it.")]
        _, other = await chat(t2, history, {"X-Memory-User-Id": "alice"})
        assert other["x-memory-conversation-id"] != "shared"
        assert fake.chat_requests[-1]["messages"] == history
    async with memory_api_for(proxy_url) as h1, memory_api_for(proxy_url, OTHER_TENANT_KEY) as h2:
        assert sent(await MemoryAPI(h1).messages("shared")) == [
            user("The t1 password is swordfish."),
            secret,
        ]
        assert len(await MemoryAPI(h2).messages("shared")) == 4


async def test_users_never_see_each_others_conversations(
    client: openai.AsyncOpenAI, fake: FakeOpenAI, api: MemoryAPI
) -> None:
    key = {"Idempotency-Key": "alice-key"}
    a1, _ = await chat(client, [user("My PIN is 1234.")], {**thin("private", "alice"), **key})

    # Not by naming her conversation.
    with pytest.raises(openai.NotFoundError) as not_found:
        await chat(client, [user("What is my PIN?")], thin("private", "bob"))
    assert not_found.value.param == "X-Memory-Conversation-Id"
    assert len(fake.requests) == 1  # it never reached the model
    # Not by reusing her request's idempotency key: keys are the user's, so bob's request is
    # a turn of his own, not her answered one replayed.
    _, reused = await chat(client, [user("What is my PIN?")], {"X-Memory-User-Id": "bob", **key})
    assert reused["x-memory-conversation-id"] != "private"
    assert "1234" not in json.dumps(fake.chat_requests[-1])
    assert sent(await api.messages("private")) == [user("My PIN is 1234."), a1]
    [asked] = await api.conversations("bob")
    assert asked["id"] == reused["x-memory-conversation-id"]

    # Not by sending the same full history: that is two conversations.
    history = [user("My PIN is 1234."), a1, user("Thanks.")]
    _, alice_headers = await chat(client, history, {"X-Memory-User-Id": "alice"})
    _, bob_headers = await chat(client, history, {"X-Memory-User-Id": "bob"})
    assert alice_headers["x-memory-conversation-id"] == "private"
    assert bob_headers["x-memory-conversation-id"] != "private"
    assert fake.chat_requests[-1]["messages"] == history
    assert bob_headers["x-memory-conversation-id"] in {
        c["id"] for c in await api.conversations("bob")
    }


# --- streams the proxy must not misread ---------------------------------------------------------


async def test_a_reply_that_quotes_the_done_marker_is_stored_whole(
    client: openai.AsyncOpenAI, fake: FakeOpenAI, api: MemoryAPI
) -> None:
    text = "An SSE stream ends with data: [DONE] and then closes."
    fake.script.append(Reply(chunks=[*text_chunks(text), b"data: [DONE]\n\n"]))
    stream = await client.chat.completions.create(
        model=MODEL, messages=[user("How does SSE end?")], stream=True, extra_headers=thin("quote")
    )
    received = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert received == text
    stored = await api.messages("quote")
    assert sent(stored) == [user("How does SSE end?"), assistant(text)]
    assert stored[-1]["status"] == "complete"


async def test_chunks_the_proxy_cannot_parse_still_reach_the_client(
    client: openai.AsyncOpenAI, fake: FakeOpenAI, api: MemoryAPI, proxy_url: str
) -> None:
    odd = {
        "id": "x",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "delta": {"tool_calls": [{"index": None, "function": "f"}]}}],
    }
    chunks = [
        *text_chunks("fine so far"),
        b"data: " + json.dumps(odd).encode() + b"\n\n",
        b"data: [DONE]\n\n",
    ]
    fake.script.append(Reply(chunks=chunks))
    async with httpx.AsyncClient(base_url=proxy_url) as http:
        response = await http.post(
            "/chat/completions",
            json={"model": MODEL, "messages": [user("Go.")], "stream": True},
            headers={"authorization": f"Bearer {KEY}", **thin("odd")},
        )
    assert response.status_code == 200
    assert response.content == b"".join(chunks)  # relayed untouched, to the end
    stored = await api.messages("odd")
    assert [(m["role"], m["content"], m["status"]) for m in stored] == [
        ("user", "Go.", "complete"),
        ("assistant", "fine so far", "incomplete"),  # what came before the odd chunk
    ]
    exchange = (await api.http.get(f"/exchanges/{response.headers['x-request-id']}")).json()
    assert exchange["status"] == "incomplete"
    assert "not understood (a tool call's index is None, not a number)" in exchange["error"]


def completion(message: Message) -> dict[str, Any]:
    return {
        "id": "chatcmpl-m",
        "object": "chat.completion",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
    }


MALFORMED = {
    "content an object": ({"role": "assistant", "content": {"a": 1}}, "content is an object"),
    "content a number": ({"role": "assistant", "content": 12345}, "content is a number"),
    "a part not an object": (
        {"role": "assistant", "content": [{"type": "text", "text": "hi"}, 3]},
        "content[1] is a number",
    ),
    "tool_calls a string": (
        {"role": "assistant", "content": None, "tool_calls": "xyz"},
        "tool_calls must be an array",
    ),
    "a function that is a string": (
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": "f"}]},
        "tool_calls[0].function must be an object",
    ),
}


@pytest.mark.parametrize(("message", "problem"), MALFORMED.values(), ids=MALFORMED)
async def test_a_malformed_reply_reaches_the_client_and_is_kept_outside_the_conversation(
    client: openai.AsyncOpenAI,
    fake: FakeOpenAI,
    api: MemoryAPI,
    proxy_url: str,
    message: Message,
    problem: str,
) -> None:
    """A reply no client could send back (the upstream broke the format) is relayed as it
    came, stored as `malformed` (kept, not lost) with the record saying why, and never
    attached to a later turn, which a strict upstream would refuse."""
    fake.script.append(Reply(body=completion(message)))
    async with httpx.AsyncClient(base_url=proxy_url) as http:
        response = await http.post(
            "/chat/completions",
            json={"model": MODEL, "messages": [user("Go.")]},
            headers={"authorization": f"Bearer {KEY}", **thin("odd")},
        )
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"] == message
    stored = await api.messages("odd")
    assert [(m["role"], m["status"]) for m in stored] == [
        ("user", "complete"),
        ("assistant", "malformed"),
    ]
    exchange = (await api.http.get(f"/exchanges/{response.headers['x-request-id']}")).json()
    assert exchange["status"] == "complete"
    assert exchange["error"].startswith("the upstream's reply is malformed: the reply.")
    assert problem in exchange["error"]
    await chat(client, [user("Hello?")], thin("odd"))
    assert fake.chat_requests[-1]["messages"] == [user("Go."), user("Hello?")]


async def test_a_streamed_tool_call_without_an_id_is_kept_outside_the_conversation(
    client: openai.AsyncOpenAI, fake: FakeOpenAI, api: MemoryAPI
) -> None:
    """Its `tool` reply could name no call: sent back, the turn would be refused."""
    head = {"id": "chatcmpl-t", "object": "chat.completion.chunk", "created": 0, "model": MODEL}
    call = {"index": 0, "type": "function", "function": {"name": "search", "arguments": "{}"}}
    events = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "tool_calls": [call]}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
    ]
    fake.script.append(Reply(chunks=[*(sse({**head, **e}) for e in events), b"data: [DONE]\n\n"]))
    stream = await client.chat.completions.create(
        model=MODEL, messages=[user("Look it up.")], stream=True, extra_headers=thin("noid")
    )
    async for _ in stream:
        pass
    stored = await api.messages("noid")
    assert [(m["role"], m["status"]) for m in stored] == [
        ("user", "complete"),
        ("assistant", "malformed"),
    ]
    assert stored[1]["tool_calls"][0]["function"]["name"] == "search"  # kept as it came
    await chat(client, [user("Well?")], thin("noid"))
    assert fake.chat_requests[-1]["messages"] == [user("Look it up."), user("Well?")]


def text_chunks(text: str) -> list[bytes]:
    head = {"id": "chatcmpl-q", "object": "chat.completion.chunk", "created": 0, "model": MODEL}
    first = {
        **head,
        "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        ],
    }
    # All the text in one event: a marker quoted in it stands inside one JSON string.
    body = {**head, "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
    last = {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    return [b"data: " + json.dumps(c).encode() + b"\n\n" for c in (first, body, last)]
