"""Memories and attachments' passages found by meaning, through the real server: they are
embedded by background jobs (the fake upstream's concept embeddings), and a memory or passage
that shares no word with the question reaches the model when its vector is near the question's,
and not with embeddings off. An edited memory is embedded again (its old vector goes), and
erasing the user takes every vector with it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from functools import partial
from typing import Any

import httpx
import pytest

from proxy.background.item_embedder import ItemEmbedder
from proxy.core.config import (
    Config,
    ContextSettings,
    MemorySettings,
    ServerConfig,
    TenantConfig,
    UpstreamConfig,
)
from tests.conftest import KEY, make_config
from tests.fakes.openai_upstream import FakeOpenAI, concept_embedding, model_said
from tests.fakes.server import ServerThread
from tests.polling import eventually

MODEL = "gpt-4o-mini"
# What the fake embedding model knows: these words mean "dog".
CONCEPTS = {"beagle": "dog", "puppy": "dog", "hound": "dog", "dog": "dog"}
# No word in common with the memories and passages below, but near the dog ones in meaning.
QUESTION = "Which hound breed is mine?"
DOG = "I adopted a beagle puppy last spring"
OTHERS = ["Lives in Lisbon, near the river", "Works as a nurse at night"]
FILLER = " ".join(
    [
        "The quarterly report covers regional sales figures, staffing changes in the northern "
        "office, and a long discussion of the new cafeteria menu, which nobody asked about."
    ]
    * 8
)
BISCUIT = (
    "Our family adopted a beagle puppy named Biscuit; the dog sleeps in a basket by the stove."
)
# Seven passages (each paragraph one), far over the attachments' share of the budget: the
# dog passage (the fifth) goes in only when it is found relevant.
DOCUMENT = "\n\n".join([FILLER] * 4 + [BISCUIT] + [FILLER] * 2)


def start(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: Any, embeddings: str = "upstream"
) -> str:
    fake, url = fake_upstream
    fake.embed = partial(concept_embedding, concepts=CONCEPTS)
    upstream = UpstreamConfig(kind="openai", base_url=url, api_key="k")
    settings = MemorySettings(embeddings=embeddings, embedding_timeout_ms=10_000)  # type: ignore[arg-type]
    config = make_config(upstream, context=ContextSettings(token_budget=400), memory=settings)
    url_: str = serve_proxy(config)
    return url_


@pytest.fixture
def fake(fake_upstream: tuple[FakeOpenAI, str]) -> FakeOpenAI:
    return fake_upstream[0]


@pytest.fixture
async def http(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: Any
) -> AsyncIterator[httpx.AsyncClient]:
    """A proxy with embeddings from the (fake) upstream."""
    async with client(start(fake_upstream, serve_proxy)) as c:
        yield c


def client(base: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=base, headers={"authorization": f"Bearer {KEY}"}, timeout=30)


async def embedded(http: httpx.AsyncClient, kind: str, count: int) -> list[dict[str, Any]]:
    """Wait until jobs of `kind` have embedded `count` items in all, and are all done."""

    async def done() -> list[dict[str, Any]] | None:
        jobs = (await http.get("/memory/jobs", params={"kind": kind})).json()["data"]
        finished = [j for j in jobs if j["status"] == "done"]
        total = sum(j["result"].get("embedded", 0) for j in finished)
        return jobs if jobs and len(finished) == len(jobs) and total >= count else None

    return await eventually(done, f"{count} items embedded by {kind} jobs")


async def remember(http: httpx.AsyncClient, text: str, user: str = "alice") -> dict[str, Any]:
    response = await http.post("/memory/memories", json={"user": user, "text": text})
    assert response.status_code == 201, response.text
    created: dict[str, Any] = response.json()
    return created


async def upload(http: httpx.AsyncClient, conversation: str, user: str = "alice") -> None:
    created = await http.post("/memory/conversations", json={"id": conversation, "user": user})
    assert created.status_code == 201, created.text
    path = f"/memory/conversations/{conversation}/attachments"
    uploaded = await http.post(path, json={"content": DOCUMENT, "title": "notes"})
    assert uploaded.status_code == 201, uploaded.text
    assert uploaded.json()["chunks"] == 7


async def ask(
    http: httpx.AsyncClient, fake: FakeOpenAI, *, user: str = "alice", **headers: str
) -> tuple[httpx.Response, str]:
    """The question in mode `read` (nothing of it is stored); the response and what the
    proxy added (its system messages)."""
    response = await http.post(
        "/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": QUESTION}]},
        headers={"X-Memory-User-Id": user, "X-Memory-Mode": "read", **headers},
    )
    assert response.status_code == 200, response.text
    sent = fake.chat_requests[-1]["messages"]
    return response, "\n".join(m["content"] for m in sent if m["role"] == "system")


async def test_a_memory_that_shares_no_word_with_the_question_is_found_by_meaning(
    http: httpx.AsyncClient, fake: FakeOpenAI
) -> None:
    dog = await remember(http, DOG)
    for text in OTHERS:
        await remember(http, text)
    await embedded(http, "embed_memories", 3)
    response, added = await ask(http, fake)
    assert f"> - {DOG}" in added
    assert not any(text in added for text in OTHERS)  # not near enough (nor sharing a word)
    assert response.headers["x-memory-memories"] == "1"
    record = (await http.get(f"/memory/exchanges/{response.headers['x-request-id']}")).json()
    assert record["attached"]["recalled"] == [{"memory": dog["id"], "pinned": False}]
    # One embedding of the question served the turn (memories and stored turns alike).
    questions = [r.json() for r in fake.requests if r.path.endswith("/embeddings")]
    assert [q["input"] for q in questions].count([QUESTION]) == 1
    # Another user's turn never finds alice's memories.
    _, added = await ask(http, fake, user="bob")
    assert DOG not in added


async def test_an_edited_memory_is_embedded_again_and_its_old_meaning_goes(
    http: httpx.AsyncClient, fake: FakeOpenAI
) -> None:
    memory = await remember(http, "Owns a beagle")
    await embedded(http, "embed_memories", 1)
    assert "> - Owns a beagle" in (await ask(http, fake))[1]
    edited = await http.patch(f"/memory/memories/{memory['id']}", json={"text": "Lives in Lisbon"})
    assert edited.status_code == 200
    jobs = await embedded(http, "embed_memories", 2)
    assert len(jobs) == 2  # the creation's and the edit's
    _, added = await ask(http, fake)
    assert "beagle" not in added and "Lisbon" not in added
    # Pinning (no new text) keeps its vector: no job.
    await http.patch(f"/memory/memories/{memory['id']}", json={"pinned": True})
    assert (
        len((await http.get("/memory/jobs", params={"kind": "embed_memories"})).json()["data"]) == 2
    )
    exported = (await http.get("/memory/users/alice/export")).json()
    assert exported["vectors"] == 1  # the new text's; the old one went with the edit


async def test_a_passage_that_shares_no_word_with_the_question_is_chosen_by_meaning(
    http: httpx.AsyncClient, fake: FakeOpenAI
) -> None:
    await upload(http, "docs")
    (job,) = await embedded(http, "embed_passages", 7)
    assert job["result"] == {"model": "text-embedding-3-small", "embedded": 7}
    response, added = await ask(http, fake, **{"X-Memory-Conversation-Id": "docs"})
    assert BISCUIT in added
    assert added.count("quarterly report") < 8  # a passage, not the whole document
    record = (await http.get(f"/memory/exchanges/{response.headers['x-request-id']}")).json()
    (item,) = record["attached"]["attachments"]["items"]
    assert item["strategy"] == "relevant_passages"


async def test_inline_documents_are_embedded_and_found_by_meaning_later(
    http: httpx.AsyncClient, fake: FakeOpenAI
) -> None:
    stored = await http.post(
        "/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "Keep these notes for later."}],
            "attachments": [{"content": DOCUMENT, "title": "notes"}],
        },
        headers={"X-Memory-User-Id": "alice", "X-Memory-Conversation-Id": "inline"},
    )
    assert stored.status_code == 200, stored.text
    (job,) = await embedded(http, "embed_passages", 7)
    assert job["subject"].startswith("att_")
    _, added = await ask(http, fake, **{"X-Memory-Conversation-Id": "inline"})
    assert BISCUIT in added


async def test_what_one_job_cannot_embed_at_once_is_left_to_the_next(
    http: httpx.AsyncClient, fake: FakeOpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ItemEmbedder, "chunk", 3)
    await upload(http, "docs")
    for text in [DOG, *OTHERS, "Prefers green tea"]:
        await remember(http, text)
    passages = await embedded(http, "embed_passages", 7)
    assert sorted(j["result"]["embedded"] for j in passages) == [1, 3, 3]
    memories = await embedded(http, "embed_memories", 4)
    assert sum(j["result"]["embedded"] for j in memories) == 4
    _, added = await ask(http, fake, **{"X-Memory-Conversation-Id": "docs"})
    assert BISCUIT in added and f"> - {DOG}" in added


async def test_with_embeddings_off_neither_is_found_and_nothing_is_embedded(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: Any, fake: FakeOpenAI
) -> None:
    async with client(start(fake_upstream, serve_proxy, "off")) as http:
        await remember(http, DOG)
        await upload(http, "docs")
        _, added = await ask(http, fake, **{"X-Memory-Conversation-Id": "docs"})
        assert DOG not in added and BISCUIT not in added
        assert not [r for r in fake.requests if r.path.endswith("/embeddings")]
        for kind in ("embed_memories", "embed_passages"):
            assert (await http.get("/memory/jobs", params={"kind": kind})).json()["data"] == []


async def test_erasing_the_user_removes_the_vectors_of_memories_and_passages(
    http: httpx.AsyncClient, fake: FakeOpenAI
) -> None:
    await remember(http, DOG)
    await upload(http, "docs")
    await embedded(http, "embed_memories", 1)
    await embedded(http, "embed_passages", 7)
    assert (await http.get("/memory/users/alice/export")).json()["vectors"] == 8
    erased = (await http.delete("/memory/users/alice")).json()["deleted"]
    assert erased["vectors"] == 8
    _, added = await ask(http, fake)
    assert DOG not in added


MEMORY_MODEL = "memory-model"


@pytest.fixture
def memory_model() -> Iterator[tuple[FakeOpenAI, str]]:
    """The memory model's own fake OpenAI API."""
    app = FakeOpenAI()
    with ServerThread(app) as server:
        yield app, server.url + "/v1"
        app.release.set()


async def test_what_extraction_remembers_is_embedded_and_charged_to_its_exchange(
    fake_upstream: tuple[FakeOpenAI, str],
    memory_model: tuple[FakeOpenAI, str],
    serve_proxy: Any,
    fake: FakeOpenAI,
) -> None:
    fake.embed = partial(concept_embedding, concepts=CONCEPTS)
    model, model_url = memory_model
    memory = MemorySettings(
        extract="llm", model=MEMORY_MODEL, upstream="memory", embeddings="upstream"
    )
    config = Config(
        server=ServerConfig(jobs_poll_seconds=0.05),
        upstreams={
            "main": UpstreamConfig(kind="openai", base_url=fake_upstream[1], api_key="k"),
            "memory": UpstreamConfig(kind="openai", base_url=model_url, api_key="k"),
        },
        tenants={"t1": TenantConfig(api_keys=[KEY], upstream="main", memory=memory)},
    )
    model.script = [
        model_said(json.dumps({"memories": [{"action": "add", "kind": "fact", "text": DOG}]}))
    ]
    async with client(serve_proxy(config)) as http:
        told = await http.post(
            "/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "Guess what I did."}]},
            headers={"X-Memory-User-Id": "alice"},
        )
        exchange = told.headers["x-request-id"]
        (job,) = await embedded(http, "embed_memories", 1)
        assert job["subject"] == exchange
        await embedded(http, "embed_messages", 2)
        record = (await http.get(f"/memory/exchanges/{exchange}")).json()
        kinds = sorted(part["kind"] for part in record["cost"]["parts"])
        # The question's, the turn's and reply's, and the new memory's embedding.
        assert kinds == ["embedding", "embedding", "embedding", "extraction"]
        _, added = await ask(http, fake)
        assert f"> - {DOG}" in added
