"""The OpenAI Agents SDK through memproxy, with its default model (`OpenAIResponsesModel`: the
Responses API) on an `AsyncOpenAI` client whose base URL is memproxy and whose default headers
name the user. Tracing is off and nothing leaves 127.0.0.1.

What the SDK sends, and what these tests pin memproxy to handle: each model call of a run
resends the run's whole input (the user's message, the function call, its output) with `include`
and the agent's `instructions`; `auto_previous_response_id` chains the calls instead (only the
new items, `previous_response_id`); `conversation_id` sends the `conversation` parameter and
only the new items; a reasoning model's `reasoning` items come back in the next input, with
`store: false` and `include: ["reasoning.encrypted_content"]`."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import agents
import httpx
import openai
import pytest
from agents import Agent, ModelSettings, RunConfig, Runner, SQLiteSession, function_tool
from agents.models.openai_provider import OpenAIProvider
from openai.types.shared import Reasoning

from proxy.core.config import Config, UpstreamConfig
from tests.conftest import KEY, make_config
from tests.fakes.openai_responses import FakeResponses
from tests.fakes.openai_upstream import FakeOpenAI
from tests.fakes.server import ServerThread

ServeProxy = Callable[[Config], str]
ALICE = {"X-Memory-User-Id": "alice"}
TOLD = "My locker code is 4711. Please lookup lockers."


@function_tool
def lookup(query: str) -> str:
    """Look something up."""
    return f"looked up: {query}"


@function_tool(name_override="lookup")
def lookup_q(q: str) -> str:
    """Look something up (the chat fake calls tools with `{"q": ...}`)."""
    return f"looked up: {q}"


@pytest.fixture(autouse=True)
def _no_tracing() -> None:
    agents.set_tracing_disabled(True)


@pytest.fixture
def responses_fake() -> Iterator[tuple[FakeResponses, str]]:
    app = FakeResponses()
    with ServerThread(app) as server:
        yield app, server.url + "/v1"


@pytest.fixture
def native(responses_fake: tuple[FakeResponses, str], serve_proxy: ServeProxy) -> str:
    """memproxy's URL, in front of the strict fake Responses API."""
    _, url = responses_fake
    return serve_proxy(make_config(UpstreamConfig(kind="openai", base_url=url, api_key="k")))


@pytest.fixture
def translated(fake_upstream: tuple[FakeOpenAI, str], serve_proxy: ServeProxy) -> str:
    """memproxy's URL, in front of a chat-only upstream (Responses by translation)."""
    _, url = fake_upstream
    return serve_proxy(make_config(UpstreamConfig(kind="litellm", base_url=url, api_key="k")))


@asynccontextmanager
async def sdk(base_url: str) -> AsyncIterator[tuple[openai.AsyncOpenAI, RunConfig]]:
    """The client an Agents SDK user points at memproxy, and a run config whose model provider
    uses it (the SDK's default: the Responses API)."""
    client = openai.AsyncOpenAI(
        base_url=base_url, api_key=KEY, max_retries=0, default_headers=ALICE
    )
    provider = OpenAIProvider(openai_client=client, use_responses=True)
    async with client:
        yield client, RunConfig(model_provider=provider, tracing_disabled=True)


def agent(tool: Any = lookup, **settings: Any) -> Agent[Any]:
    return Agent(
        name="Assistant",
        instructions="You help.",
        model="gpt-4o",
        tools=[tool],
        model_settings=ModelSettings(**settings),
    )


async def run(
    base_url: str, text: str, *, stream: bool = False, tool: Any = lookup, **options: Any
) -> Any:
    """One Agents SDK run of `text`, whole or streamed; its result."""
    async with sdk(base_url) as (_, config):
        if not stream:
            return await Runner.run(agent(tool), text, run_config=config, **options)
        result = Runner.run_streamed(agent(tool), text, run_config=config, **options)
        async for _ in result.stream_events():
            pass
        return result


async def conversations(base_url: str) -> list[list[tuple[str, str | None, int]]]:
    """Alice's stored conversations, oldest first: (role, text, tool calls) of each message."""
    async with httpx.AsyncClient(headers={"authorization": f"Bearer {KEY}"}) as http:
        listed = (await http.get(f"{base_url}/memory/conversations?user=alice")).json()["data"]
        out = []
        for conversation in reversed(listed):
            got = await http.get(f"{base_url}/memory/conversations/{conversation['id']}/messages")
            out.append(
                [
                    (m["role"], m["content"], len(m.get("tool_calls") or []))
                    for m in got.json()["data"]
                ]
            )
        return out


async def kept_items(base_url: str) -> list[dict[str, Any]]:
    """The items with no chat equivalent kept with Alice's stored messages, in order."""
    async with httpx.AsyncClient(headers={"authorization": f"Bearer {KEY}"}) as http:
        listed = (await http.get(f"{base_url}/memory/conversations?user=alice")).json()["data"]
        items: list[dict[str, Any]] = []
        for conversation in reversed(listed):
            got = await http.get(f"{base_url}/memory/conversations/{conversation['id']}/messages")
            for message in got.json()["data"]:
                items += (message.get("metadata") or {}).get("memproxy_items", [])
        return items


def tool_round_trip(answer: str) -> list[tuple[str, str | None, int]]:
    """A run's stored messages: the function call as an assistant `tool_calls` message and
    its output as a `tool` message, then the final answer."""
    return [
        ("system", "You help.", 0),
        ("user", TOLD, 0),
        ("assistant", None, 1),
        ("tool", f"looked up: {TOLD}", 0),
        ("assistant", answer, 0),
    ]


# --- native --------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_an_agent_run_with_a_function_tool_round_trips_through_a_native_upstream(
    responses_fake: tuple[FakeResponses, str], native: str, stream: bool
) -> None:
    app, _ = responses_fake
    result = await run(native, TOLD, stream=stream, session=SQLiteSession("first"))
    assert result.final_output.startswith(
        f'fake response to the output of call_fake0001: "looked up: {TOLD}"'
    )
    # The SDK sent the run's whole input again with the tool's output; memproxy forwarded it
    # as it came (the fake checks each request against the spec), and the two model calls
    # are one conversation.
    first, second = app.responses_requests
    assert first["include"] == [] and first["instructions"] == "You help."
    assert [i.get("type", "message") for i in second["input"]] == [
        "message",
        "function_call",
        "function_call_output",
    ]
    assert await conversations(native) == [tool_round_trip(result.final_output)]


async def test_a_fact_told_in_one_agent_session_is_recalled_in_a_new_one(
    responses_fake: tuple[FakeResponses, str], native: str
) -> None:
    app, _ = responses_fake
    await run(native, TOLD, session=SQLiteSession("first"))
    result = await run(native, "What is my locker code?", session=SQLiteSession("second"))
    sent = app.responses_requests[-1]
    # Nothing of the first run in the new session's input: the fact came from memproxy, in
    # `instructions` (the upstream stores responses: context must not pile up in its state).
    assert sent["input"] == [{"role": "user", "content": "What is my locker code?"}]
    assert sent["instructions"].startswith("You help.\n\n")
    assert "4711" in sent["instructions"]
    assert result.final_output.startswith('fake response to: "What is my locker code?"')
    assert len(await conversations(native)) == 2


async def test_an_agent_chaining_by_previous_response_id_sends_nothing_twice(
    responses_fake: tuple[FakeResponses, str], native: str
) -> None:
    """`auto_previous_response_id`: the upstream holds the chain, so memproxy adds neither
    stored history nor the chain's own tool results to it."""
    app, _ = responses_fake
    first = await run(native, TOLD, auto_previous_response_id=True)
    await run(native, "And my desk?", previous_response_id=first.last_response_id)
    one, two, three = app.responses_requests
    assert "previous_response_id" not in one
    assert two["previous_response_id"] == "resp_fake0001"
    assert [i["type"] for i in two["input"]] == ["function_call_output"]
    assert three["previous_response_id"] == "resp_fake0002"
    assert three["input"] == [{"content": "And my desk?", "role": "user"}]
    assert all(sent["instructions"] == "You help." for sent in (one, two, three))
    stored = await conversations(native)
    assert stored == [
        [
            *tool_round_trip(first.final_output),
            ("user", "And my desk?", 0),
            ("assistant", stored[0][-1][1], 0),
        ]
    ]


async def test_an_agent_on_an_upstream_conversation_sends_nothing_twice(
    responses_fake: tuple[FakeResponses, str], native: str
) -> None:
    """`conversation_id` names a conversation the upstream keeps (made through memproxy's
    pass-through): it holds the items, so memproxy sends none of them again, and stores the
    turns under the same id."""
    app, _ = responses_fake
    async with sdk(native) as (client, _):
        conversation = (await client.conversations.create()).id
    first = await run(native, TOLD, conversation_id=conversation)
    second = await run(native, "And my desk?", conversation_id=conversation)
    one, two, three = app.responses_requests
    assert [i["type"] for i in two["input"]] == ["function_call_output"]
    assert three["input"] == [{"content": "And my desk?", "role": "user"}]
    assert all(sent["conversation"] == conversation for sent in (one, two, three))
    # The upstream's conversation holds each item once.
    kinds = [i["type"] for i in app.conversations[conversation]]
    assert kinds == ["message", "function_call", "function_call_output"] + ["message"] * 3
    async with httpx.AsyncClient(headers={"authorization": f"Bearer {KEY}"}) as http:
        got = await http.get(f"{native}/memory/conversations/{conversation}/messages")
    assert [(m["role"], m["content"]) for m in got.json()["data"]][-2:] == [
        ("user", "And my desk?"),
        ("assistant", second.final_output),
    ]
    assert first.final_output.startswith("fake response to the output of call_fake")


async def test_a_reasoning_agent_that_stores_nothing_gets_its_reasoning_items_back(
    responses_fake: tuple[FakeResponses, str], native: str
) -> None:
    """`store: false` with encrypted reasoning: the SDK sends the reasoning item back with
    the tool's output. memproxy forwards it as it came, and stores the turn once in one
    conversation (reasoning items are not stored: the stored reply has none either)."""
    app, _ = responses_fake
    settings = ModelSettings(
        store=False,
        reasoning=Reasoning(effort="low"),
        response_include=["reasoning.encrypted_content"],
    )
    async with sdk(native) as (_, config):
        thinking = agent().clone(model_settings=settings)
        result = await Runner.run(thinking, TOLD, run_config=config)
    first, second = app.responses_requests
    assert first["store"] is False and first["include"] == ["reasoning.encrypted_content"]
    reasoning = [i for i in second["input"] if i.get("type") == "reasoning"]
    assert reasoning == [
        {
            "id": "rs_fake0001",
            "type": "reasoning",
            "summary": [],
            "encrypted_content": "encrypted-thoughts-1",
        }
    ]
    stored = await conversations(native)
    assert stored == [tool_round_trip(result.final_output)]
    # Each reply's reasoning item is kept whole with it, never as text, and once (the first,
    # sent back with the tool's output, is not stored again).
    kept = await kept_items(native)
    assert [item["id"] for item in kept] == ["rs_fake0001", "rs_fake0002"]


# --- translated ----------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_an_agent_run_with_a_function_tool_round_trips_by_translation(
    fake_upstream: tuple[FakeOpenAI, str], translated: str, stream: bool
) -> None:
    app, _ = fake_upstream
    result = await run(
        translated, TOLD, stream=stream, tool=lookup_q, session=SQLiteSession("first")
    )
    answer = result.final_output  # (the chat fake streams each word with a space after it)
    assert answer.rstrip() == "fake reply to: looked up: x"
    first, second = app.chat_requests
    assert [m["role"] for m in first["messages"]] == ["system", "user"]
    assert [m["role"] for m in second["messages"]] == ["system", "user", "assistant", "tool"]
    assert second["messages"][2]["tool_calls"][0]["id"] == "call_1"
    assert await conversations(translated) == [
        [
            ("system", "You help.", 0),
            ("user", TOLD, 0),
            ("assistant", None, 1),
            ("tool", "looked up: x", 0),
            ("assistant", answer, 0),
        ]
    ]


async def test_an_agents_chain_and_conversation_are_served_from_memproxys_store(
    fake_upstream: tuple[FakeOpenAI, str], translated: str
) -> None:
    """On an upstream that keeps no state, memproxy serves what the SDK leaves to the server:
    the chain of `previous_response_id` and the items of a `conversation`."""
    app, _ = fake_upstream
    chained = await run(translated, TOLD, tool=lookup_q, auto_previous_response_id=True)
    roles = [m["role"] for m in app.chat_requests[-1]["messages"]]
    assert roles == ["system", "user", "assistant", "tool"]
    # (The chat fake calls the tool at every user message: each run is a round trip.)
    again = ["assistant", "user", "assistant", "tool"]
    await run(
        translated, "And my desk?", tool=lookup_q, previous_response_id=chained.last_response_id
    )
    sent = app.chat_requests[-1]["messages"]
    assert [m["role"] for m in sent] == [*roles, *again]

    await run(translated, TOLD, tool=lookup_q, conversation_id="agents-conv")
    await run(translated, "And my desk?", tool=lookup_q, conversation_id="agents-conv")
    sent = app.chat_requests[-1]["messages"]
    assert [m["role"] for m in sent] == [*roles, *again]
    assert all("conversation" not in body for body in app.chat_requests)
