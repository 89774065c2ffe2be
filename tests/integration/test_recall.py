"""Recall through the real server and the official SDK: what a user said in another
conversation reaches the model when it is relevant, for that user only, within the budget."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from policies.tokens import count_message
from proxy.core.config import Config, ContextSettings, UpstreamConfig
from proxy.pipeline import artifacts, recall_turn
from tests.conftest import KEY, make_config
from tests.fakes.openai_upstream import FakeOpenAI

MODEL = "gpt-4o-mini"


def ask(text: str) -> list[Any]:
    return [{"role": "user", "content": text}]


@pytest.fixture
def fake(fake_upstream: tuple[FakeOpenAI, str]) -> FakeOpenAI:
    return fake_upstream[0]


def start(fake_upstream: tuple[FakeOpenAI, str], serve_proxy: Any, **context: Any) -> str:
    upstream = UpstreamConfig(kind="openai", base_url=fake_upstream[1], api_key="k")
    config: Config = make_config(upstream, context=ContextSettings(**context))
    url: str = serve_proxy(config)
    return url


@pytest.fixture
async def clients(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: Any
) -> AsyncIterator[tuple[openai.AsyncOpenAI, httpx.AsyncClient]]:
    base = start(fake_upstream, serve_proxy, token_budget=300)
    async with (
        openai.AsyncOpenAI(base_url=base, api_key=KEY, max_retries=0) as sdk,
        httpx.AsyncClient(base_url=base, headers={"authorization": f"Bearer {KEY}"}) as http,
    ):
        yield sdk, http


async def seed(http: httpx.AsyncClient, user: str, conversation: str) -> None:
    messages = [
        {
            "role": "user",
            "content": "I adopted a beagle puppy last week",
            "created_at": "2026-03-02T10:00:00Z",
        },
        {"role": "assistant", "content": "Congratulations! What did you name the beagle?"},
        {"role": "user", "content": "We named the beagle Biscuit"},
        {"role": "assistant", "content": "Biscuit is a great name."},
        {"role": "user", "content": "Also my sister lives in Lisbon"},
    ]
    response = await http.post(
        "/memory/conversations", json={"id": conversation, "user": user, "messages": messages}
    )
    assert response.status_code == 201, response.text


def recall_section(request: dict[str, Any]) -> str | None:
    sections = [
        m["content"]
        for m in request["messages"]
        if m["role"] == "system" and str(m["content"]).startswith("Excerpts from")
    ]
    return sections[0] if sections else None


async def test_what_the_user_said_elsewhere_reaches_the_model(
    clients: tuple[openai.AsyncOpenAI, httpx.AsyncClient], fake: FakeOpenAI
) -> None:
    sdk, http = clients
    await seed(http, "alice", "pets")
    response = await http.post(
        "/memory/conversations",
        json={
            "id": "travel",
            "user": "alice",
            "messages": [
                {"role": "user", "content": "My brother moved to Oslo"},
                {"role": "assistant", "content": "Oslo is a lovely city."},
            ],
        },
    )
    assert response.status_code == 201, response.text
    raw = await sdk.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=ask("What is my beagle called again?"),
        extra_headers={"X-Memory-User-Id": "alice"},
    )
    sent = fake.chat_requests[-1]
    section = recall_section(sent)
    assert section is not None
    assert "> user: We named the beagle Biscuit" in section
    assert "[conversation of 2026-03-02" in section  # dated
    # Not relevant: nothing found there (what was said around a strong hit may come with it).
    assert "Oslo" not in section
    # Placed right before the newest user message, which is the client's, unaltered.
    assert sent["messages"][-2]["content"] == section
    assert sent["messages"][-1] == ask("What is my beagle called again?")[0]
    recalled = int(raw.headers["x-memory-memories"])
    assert recalled >= 1
    assert int(raw.headers["x-memory-context-tokens"]) <= 300
    record = (await http.get(f"/memory/exchanges/{raw.headers['x-request-id']}")).json()
    assert len(record["attached"]["recalled"]) == recalled
    assert record["attached"]["recall_ms"] >= 0


async def test_recall_never_crosses_users(
    clients: tuple[openai.AsyncOpenAI, httpx.AsyncClient], fake: FakeOpenAI
) -> None:
    sdk, http = clients
    await seed(http, "alice", "pets")
    for user in ("bob", "anonymous"):
        await sdk.chat.completions.create(
            model=MODEL,
            messages=ask("What is my beagle called?"),
            extra_headers={"X-Memory-User-Id": user},
        )
        assert recall_section(fake.chat_requests[-1]) is None


async def test_the_anonymous_user_recalls_only_within_the_conversation(
    clients: tuple[openai.AsyncOpenAI, httpx.AsyncClient], fake: FakeOpenAI
) -> None:
    sdk, http = clients
    await seed(http, "anonymous", "anon-pets")
    headers = {"X-Memory-User-Id": "anonymous"}
    await sdk.chat.completions.create(
        model=MODEL, messages=ask("What is my beagle called?"), extra_headers=headers
    )
    assert recall_section(fake.chat_requests[-1]) is None  # another conversation: not recalled
    # In its own conversation, what it said there is attached (as history).
    thin = {**headers, "X-Memory-Conversation-Id": "anon-pets"}
    await sdk.chat.completions.create(
        model=MODEL, messages=ask("What is my beagle called?"), extra_headers=thin
    )
    sent = fake.chat_requests[-1]["messages"]
    assert any("Biscuit" in str(m["content"]) for m in sent)


async def test_an_anonymous_turn_opening_its_conversation_reads_nothing_back(
    clients: tuple[openai.AsyncOpenAI, httpx.AsyncClient],
    fake: FakeOpenAI,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nothing is stored in a conversation an anonymous turn opens but the turn itself (in the
    prompt), so neither recall nor the stored attachments and tool results are read for it;
    the conversation's next turn reads both, and finds its first (what a one-shot call costs
    on PostgreSQL: a transaction each)."""
    read: list[str] = []

    def spy(name: str, original: Any) -> Any:
        def called(*args: Any, **kwargs: Any) -> Any:
            read.append(name)
            return original(*args, **kwargs)

        return called

    monkeypatch.setattr(recall_turn, "recall", spy("recall", recall_turn.recall))
    monkeypatch.setattr(artifacts, "read_sources", spy("attachments", artifacts.read_sources))
    sdk, _ = clients
    anonymous = {"X-Memory-User-Id": "anonymous", "X-Memory-Conversation-Id": "one-shot"}
    await sdk.chat.completions.create(
        model=MODEL, messages=ask("My beagle is called Biscuit"), extra_headers=anonymous
    )
    assert read == []
    await sdk.chat.completions.create(
        model=MODEL, messages=ask("Tell me about beagle puppies"), extra_headers=anonymous
    )
    assert read == ["recall"]
    assert "Biscuit" in str(fake.chat_requests[-1]["messages"])  # (as its history)
    # A named user's first turn in a new conversation still recalls (from the others).
    read.clear()
    await sdk.chat.completions.create(
        model=MODEL, messages=ask("Hello"), extra_headers={"X-Memory-User-Id": "alice"}
    )
    assert read == ["recall"]


async def test_no_recall_in_mode_off_or_when_turned_off(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: Any, fake: FakeOpenAI
) -> None:
    on = start(fake_upstream, serve_proxy)
    off = start(fake_upstream, serve_proxy, recall=False)
    for base, mode, expected in ((on, "off", None), (off, "full", None), (on, "read", "x")):
        async with (
            openai.AsyncOpenAI(base_url=base, api_key=KEY, max_retries=0) as sdk,
            httpx.AsyncClient(base_url=base, headers={"authorization": f"Bearer {KEY}"}) as http,
        ):
            if base == on and mode == "off":
                await seed(http, "alice", "pets")
            if base == off:
                await seed(http, "alice", "pets-2")
            await sdk.chat.completions.create(
                model=MODEL,
                messages=ask("What is my beagle called?"),
                extra_headers={"X-Memory-User-Id": "alice", "X-Memory-Mode": mode},
            )
        found = recall_section(fake.chat_requests[-1])
        assert (found is not None) == (expected is not None), (base, mode)


async def test_recall_and_history_share_the_budget(
    clients: tuple[openai.AsyncOpenAI, httpx.AsyncClient], fake: FakeOpenAI
) -> None:
    sdk, http = clients
    await seed(http, "alice", "pets")
    thin = {"X-Memory-User-Id": "alice", "X-Memory-Conversation-Id": "chat-2"}
    for text in ("tell me about beagles " * 8, "how much exercise does a beagle need? " * 5):
        raw = await sdk.chat.completions.with_raw_response.create(
            model=MODEL, messages=ask(text), extra_headers=thin
        )
        # History plus recall never exceed the tenant's budget (300 tokens here).
        assert int(raw.headers["x-memory-context-tokens"]) <= 300
    assert int(raw.headers["x-memory-history-messages"]) >= 1


async def test_what_recall_adds_is_counted_as_sent_and_never_eats_the_newest_messages(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: Any, fake: FakeOpenAI
) -> None:
    base = start(fake_upstream, serve_proxy, token_budget=300, min_recent_messages=4)
    thin = {"X-Memory-User-Id": "alice", "X-Memory-Conversation-Id": "long"}
    async with (
        openai.AsyncOpenAI(base_url=base, api_key=KEY, max_retries=0) as sdk,
        httpx.AsyncClient(base_url=base, headers={"authorization": f"Bearer {KEY}"}) as http,
    ):
        await seed(http, "alice", "pets")
        # Four stored messages of about 90 tokens each: they are kept whatever the budget,
        # and they alone take more than it, so nothing is left for recall.
        long = [
            {"role": "user" if i % 2 == 0 else "assistant", "content": f"beagle {i} " + "la " * 85}
            for i in range(4)
        ]
        created = await http.post(
            "/memory/conversations", json={"id": "long", "user": "alice", "messages": long}
        )
        assert created.status_code == 201
        raw = await sdk.chat.completions.with_raw_response.create(
            model=MODEL, messages=ask("what is my beagle called?"), extra_headers=thin
        )
        sent = fake.chat_requests[-1]
        assert recall_section(sent) is None
        assert raw.headers["x-memory-history-messages"] == "4"
        # With room to spare, the recall section as sent (tiktoken's count) fits the budget.
        raw = await sdk.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=ask("what is my beagle called?"),
            extra_headers={"X-Memory-User-Id": "alice"},
        )
        section = recall_section(fake.chat_requests[-1])
        assert section is not None
        assert count_message({"role": "system", "content": section}) <= 300
        assert int(raw.headers["x-memory-context-tokens"]) == count_message(
            {"role": "system", "content": section}
        )


async def test_keep_shown_keeps_each_turns_context_where_it_was(
    fake: FakeOpenAI, fake_upstream: tuple[FakeOpenAI, str], serve_proxy: Any
) -> None:
    """`context.keep_shown`: a client resending its history gets the context its earlier turn
    was shown again, in the same place, so the previous request is a prefix of the next; the
    new turn's context leaves out what that one shows."""
    base = start(fake_upstream, serve_proxy, token_budget=2000, keep_shown=True)
    async with (
        openai.AsyncOpenAI(base_url=base, api_key=KEY, max_retries=0) as sdk,
        httpx.AsyncClient(base_url=base, headers={"authorization": f"Bearer {KEY}"}) as http,
    ):
        await seed(http, "alice", "earlier")
        history: list[Any] = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What did we name the beagle?"},
        ]
        reply = await sdk.chat.completions.create(model="gpt-4o", messages=history, user="alice")
        first = fake.chat_requests[-1]["messages"]
        assert "Biscuit" in json.dumps(first[1]) and first[1]["role"] == "system"
        history += [
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "user", "content": [{"type": "text", "text": "Where does my sister live?"}]},
        ]
        await sdk.chat.completions.create(model="gpt-4o", messages=history, user="alice")
        second = fake.chat_requests[-1]["messages"]
    assert second[: len(first)] == first  # (byte for byte: the same JSON values, in order)
    assert second[-1] == history[-1]
    # (the earlier conversation's turns are shown already, above: not again)
    assert sum("Biscuit" in json.dumps(m) for m in second if m["role"] == "system") == 1
    assert "Lisbon" in json.dumps(first[1])


async def test_keep_shown_lets_go_of_an_erased_users_sections(
    fake: FakeOpenAI, fake_upstream: tuple[FakeOpenAI, str], serve_proxy: Any
) -> None:
    """The sections kept for a conversation go with its user: after an erasure, a client that
    names the same conversation id (its own) and resends the same history is not shown what
    the erased user's recall found."""
    base = start(fake_upstream, serve_proxy, token_budget=2000, keep_shown=True)
    async with (
        openai.AsyncOpenAI(base_url=base, api_key=KEY, max_retries=0) as sdk,
        httpx.AsyncClient(base_url=base, headers={"authorization": f"Bearer {KEY}"}) as http,
    ):
        history: list[Any] = [{"role": "user", "content": "What did we name the beagle?"}]

        async def turn(user: str) -> list[dict[str, Any]]:
            headers = {"X-Memory-User-Id": user, "X-Memory-Conversation-Id": "chat-1"}
            await sdk.chat.completions.create(
                model="gpt-4o", messages=history, extra_headers=headers
            )
            sent: list[dict[str, Any]] = fake.chat_requests[-1]["messages"]
            return sent

        await seed(http, "alice", "earlier")
        assert "Biscuit" in json.dumps(await turn("alice"))
        history += [
            {"role": "assistant", "content": "fake reply"},
            {"role": "user", "content": "And where does my sister live?"},
        ]
        assert (await http.delete("/memory/users/alice")).status_code == 200
        for user in ("alice", "bob"):  # (the id is free again for either)
            sent = json.dumps(await turn(user))
            assert "Biscuit" not in sent and "Lisbon" not in sent, user
            assert (await http.delete(f"/memory/users/{user}")).status_code == 200


async def test_keep_shown_keeps_each_turns_context_in_a_translated_responses_chain(
    fake: FakeOpenAI, fake_upstream: tuple[FakeOpenAI, str], serve_proxy: Any
) -> None:
    """`context.keep_shown` with a `previous_response_id` chain memproxy sends again itself (a
    chat-only upstream): each turn's context goes back where it sat, inside the chain, so the
    upstream's previous prompt (instructions, chain, new input) is a prefix of the next."""
    upstream = UpstreamConfig(kind="litellm", base_url=fake_upstream[1], api_key="k")
    context = ContextSettings(token_budget=2000, keep_shown=True)
    base = serve_proxy(make_config(upstream, context=context))
    alice = {"X-Memory-User-Id": "alice"}
    async with (
        openai.AsyncOpenAI(base_url=base, api_key=KEY, max_retries=0) as sdk,
        httpx.AsyncClient(base_url=base, headers={"authorization": f"Bearer {KEY}"}) as http,
    ):
        await seed(http, "alice", "earlier")
        previous: str | None = None
        prompts: list[list[dict[str, Any]]] = []
        for question in (
            "What did we name the beagle?",
            "Where does my sister live?",
            "And when did I adopt the puppy?",
        ):
            response = await sdk.responses.create(
                model="gpt-4o",
                instructions="Be brief.",
                input=question,
                extra_headers=alice,
                **({"previous_response_id": previous} if previous else {}),
            )
            previous = response.id
            prompts.append(fake.chat_requests[-1]["messages"])
    first, second, third = prompts
    assert first[0] == {"role": "system", "content": "Be brief."}
    assert first[1]["role"] == "system" and "Biscuit" in json.dumps(first[1])
    for earlier, later in ((first, second), (second, third)):
        # (byte for byte: the same JSON, keys in the same order, the kept section in place)
        assert json.dumps(later[: len(earlier)]) == json.dumps(earlier)
        assert later[len(earlier)]["role"] == "assistant"  # (the chain's reply, then the next)
    assert text_of(third[-1]["content"]) == "And when did I adopt the puppy?"
    # (what the first turn's section shows is not shown again)
    assert sum("Biscuit" in json.dumps(m) for m in third if m["role"] == "system") == 1


def text_of(content: Any) -> str:
    return content if isinstance(content, str) else "".join(p["text"] for p in content)
