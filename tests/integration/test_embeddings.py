"""Recall with embeddings through the real server: stored messages are embedded by a
background job, a question finds what it shares no word with when its vector is near, and an
embeddings endpoint that fails or is slow leaves recall full-text only, never failing the chat."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import httpx
import pytest

from proxy.background.embeddings import UPSTREAM_BATCH
from proxy.background.item_embedder import CHUNK
from proxy.core.config import Config, ContextSettings, MemorySettings, UpstreamConfig
from tests.conftest import KEY, make_config
from tests.fakes.openai_upstream import FakeOpenAI, Reply, concept_embedding, error_reply
from tests.integration.test_recall import recall_section
from tests.polling import eventually

MODEL = "gpt-4o-mini"
# What the fake embedding model knows: these words mean "dog".
CONCEPTS = {"beagle": "dog", "puppy": "dog", "hound": "dog", "pet": "dog"}
HISTORY = [
    {"role": "user", "content": "I adopted a beagle puppy last week"},
    {"role": "assistant", "content": "Congratulations on the new family member!"},
    {"role": "user", "content": "My sister moved to Lisbon in March"},
    {"role": "assistant", "content": "Lisbon is lovely in spring."},
]
# No word in common with the history (full-text search finds nothing), but near in meaning.
QUESTION = "Which hound breed belongs to me?"


def start(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: Any, embeddings: str, **memory: Any
) -> str:
    fake, url = fake_upstream
    fake.embed = partial(concept_embedding, concepts=CONCEPTS)
    upstream = UpstreamConfig(kind="openai", base_url=url, api_key="k")
    settings = MemorySettings(embeddings=embeddings, **memory)  # type: ignore[arg-type]
    config: Config = make_config(
        upstream, context=ContextSettings(token_budget=400), memory=settings
    )
    base: str = serve_proxy(config)
    return base


@pytest.fixture
def fake(fake_upstream: tuple[FakeOpenAI, str]) -> FakeOpenAI:
    return fake_upstream[0]


async def client(base: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=base, headers={"authorization": f"Bearer {KEY}"}, timeout=30)


async def jobs_done(http: httpx.AsyncClient, count: int) -> list[dict[str, Any]]:
    """Wait (bounded) until `count` embedding jobs are done; their records."""
    for _ in range(400):
        listed = (await http.get("/memory/jobs", params={"kind": "embed_messages"})).json()
        done = [j for j in listed["data"] if j["status"] == "done"]
        if len(done) >= count:
            return done
        await asyncio.sleep(0.05)
    raise AssertionError(f"embedding jobs not done: {listed}")


async def ask(http: httpx.AsyncClient, text: str, user: str = "alice") -> httpx.Response:
    response = await http.post(
        "/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": text}]},
        headers={"X-Memory-User-Id": user, "X-Memory-Mode": "read"},
    )
    assert response.status_code == 200, response.text
    return response


@pytest.fixture
async def seeded(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: Any
) -> AsyncIterator[httpx.AsyncClient]:
    """A proxy with embeddings from the (fake) upstream, and alice's imported history
    embedded."""
    base = start(fake_upstream, serve_proxy, "upstream", embedding_timeout_ms=10_000)
    async with await client(base) as http:
        created = await http.post(
            "/memory/conversations", json={"id": "pets", "user": "alice", "messages": HISTORY}
        )
        assert created.status_code == 201
        (job,) = await jobs_done(http, 1)
        assert job["result"]["embedded"] == 4
        assert job["result"]["model"] == "text-embedding-3-small"
        yield http


async def test_a_question_finds_what_it_means_with_embeddings_on(
    seeded: httpx.AsyncClient, fake: FakeOpenAI
) -> None:
    response = await ask(seeded, QUESTION)
    section = recall_section(fake.chat_requests[-1])
    assert section is not None
    assert "beagle puppy" in section
    assert int(response.headers["x-memory-memories"]) >= 1
    # The question was embedded with the tenant's model.
    asked = [r.json() for r in fake.requests if r.path.endswith("/embeddings")][-1]
    assert asked == {
        "model": "text-embedding-3-small",
        "input": [QUESTION],
        "encoding_format": "float",
    }
    # Nobody else's vectors: another user asking the same finds nothing.
    await ask(seeded, QUESTION, user="bob")
    assert recall_section(fake.chat_requests[-1]) is None


async def test_a_deleted_conversation_is_never_recalled_while_its_vectors_are_still_held(
    seeded: httpx.AsyncClient, fake: FakeOpenAI
) -> None:
    # The first question loads alice's vectors into the index; the conversation is deleted
    # right after, well within the time the index goes before counting them again, so the
    # next search still compares its vectors: what it finds is read back, and nothing is.
    await ask(seeded, QUESTION)
    assert "beagle puppy" in (recall_section(fake.chat_requests[-1]) or "")
    assert (await seeded.delete("/memory/conversations/pets")).status_code == 200
    response = await ask(seeded, QUESTION)
    assert recall_section(fake.chat_requests[-1]) is None
    assert response.headers["x-memory-memories"] == "0"


async def test_without_embeddings_the_same_question_finds_nothing(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: Any, fake: FakeOpenAI
) -> None:
    base = start(fake_upstream, serve_proxy, "off")
    async with await client(base) as http:
        await http.post(
            "/memory/conversations", json={"id": "pets", "user": "alice", "messages": HISTORY}
        )
        await ask(http, QUESTION)
        assert recall_section(fake.chat_requests[-1]) is None
        assert not [r for r in fake.requests if r.path.endswith("/embeddings")]
        listed = (await http.get("/memory/jobs", params={"kind": "embed_messages"})).json()
        assert listed["data"] == []


@pytest.mark.parametrize("embeddings", ["off", "upstream"])
async def test_with_embeddings_a_time_the_question_names_favours_what_was_said_then(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: Any, fake: FakeOpenAI, embeddings: str
) -> None:
    # Two trips told alike, months apart, and room for one. By words alone the newer one
    # comes (recency breaks the tie); with embeddings, the one told in the month asked about.
    trips = [("may", "2025-05-10T09:00:00Z", "Tahoe"), ("sept", "2025-09-20T09:00:00Z", "Como")]
    upstream = UpstreamConfig(kind="openai", base_url=fake_upstream[1], api_key="k")
    settings = MemorySettings(embeddings=embeddings, embedding_timeout_ms=10_000)  # type: ignore[arg-type]
    config = make_config(upstream, context=ContextSettings(token_budget=120), memory=settings)
    async with await client(serve_proxy(config)) as http:
        fake.embed = partial(concept_embedding, concepts={"tahoe": "lake", "como": "lake"})
        for name, when, lake in trips:
            message = {
                "role": "user",
                "content": f"We went hiking around {lake}",
                "created_at": when,
            }
            created = await http.post(
                "/memory/conversations", json={"id": name, "user": "alice", "messages": [message]}
            )
            assert created.status_code == 201, created.text
        if embeddings != "off":
            await jobs_done(http, 2)
        await ask(http, "Where did we go hiking in May 2025?")
        section = recall_section(fake.chat_requests[-1])
        assert section is not None
        assert ("Tahoe" in section, "Como" in section) == (
            (False, True) if embeddings == "off" else (True, False)
        )


async def metrics(http: httpx.AsyncClient) -> str:
    root = str(http.base_url).rstrip("/").removesuffix("/v1")
    return (await http.get(root + "/metrics")).text


async def test_a_failing_embeddings_endpoint_leaves_recall_full_text_only(
    seeded: httpx.AsyncClient, fake: FakeOpenAI
) -> None:
    # The next upstream request is the question's embedding (before the chat completion).
    fake.script = [error_reply(500, "embeddings are down", "server_error")]
    response = await ask(seeded, "What is my beagle called?")  # a word in common
    section = recall_section(fake.chat_requests[-1])
    assert section is not None and "beagle puppy" in section  # full-text recall still works
    assert response.json()["choices"][0]["message"]["content"].startswith("fake reply")
    assert 'memproxy_embedding_queries_total{outcome="error",tenant="t1"} 1.0' in (
        await metrics(seeded)
    )
    await ask(seeded, QUESTION)  # the endpoint works again: found by meaning again
    assert "beagle puppy" in (recall_section(fake.chat_requests[-1]) or "")


async def test_a_slow_embeddings_endpoint_is_not_waited_for(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: Any, fake: FakeOpenAI
) -> None:
    base = start(fake_upstream, serve_proxy, "upstream", embedding_timeout_ms=50)
    async with await client(base) as http:
        await http.post(
            "/memory/conversations", json={"id": "pets", "user": "alice", "messages": HISTORY}
        )
        await jobs_done(http, 1)
        fake.script = [Reply(body={"data": []}, delay=5.0)]
        await ask(http, "What is my beagle called?")
        section = recall_section(fake.chat_requests[-1])
        assert section is not None and "beagle puppy" in section
        assert 'memproxy_embedding_queries_total{outcome="timeout",tenant="t1"} 1.0' in (
            await metrics(http)
        )


async def test_chats_are_embedded_and_erasing_the_user_removes_the_vectors(
    seeded: httpx.AsyncClient, fake: FakeOpenAI
) -> None:
    response = await seeded.post(
        "/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "Walked the pet today"}]},
        headers={"X-Memory-User-Id": "alice"},
    )
    request_id = response.headers["x-request-id"]
    done = await jobs_done(seeded, 2)
    (job,) = [j for j in done if j["subject"] == request_id]
    assert job["result"]["embedded"] == 2  # the turn and its reply
    # The question was embedded once, on the request path: the job embedded only the reply.
    asked = [r.json()["input"] for r in fake.requests if r.path.endswith("/embeddings")]
    question, job_call = asked[-2:]
    assert question == ["Walked the pet today"]
    assert len(job_call) == 1 and job_call != question
    erased = (await seeded.delete("/memory/users/alice")).json()["deleted"]
    assert erased["vectors"] == 6
    await ask(seeded, QUESTION)
    assert recall_section(fake.chat_requests[-1]) is None


async def test_the_echo_upstream_serves_embeddings_to_the_default_install(
    serve_proxy: Any,
) -> None:
    config = make_config(UpstreamConfig(kind="echo"), memory=MemorySettings(embeddings="upstream"))
    base = serve_proxy(config)
    async with await client(base) as http:
        await http.post(
            "/memory/conversations", json={"id": "pets", "user": "alice", "messages": HISTORY}
        )
        (job,) = await jobs_done(http, 1)
        assert job["result"]["embedded"] == 4
        response = await ask(http, "Tell me about Lisbon")
        assert int(response.headers["x-memory-memories"]) >= 1
        # Clients still get the echo upstream's 404 for /v1/embeddings.
        public = await http.post("/embeddings", json={"model": "m", "input": "hi"})
        assert public.status_code == 404


async def test_messages_appended_after_an_import_of_one_whole_chunk_are_embedded(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: Any
) -> None:
    """The import's job embeds a whole chunk (`CHUNK` messages), so it looks for more from
    the next seq; an append starting there is a range of its own, not taken for that look
    (which found nothing, and the appended messages were never embedded)."""
    base = start(fake_upstream, serve_proxy, "upstream", embedding_timeout_ms=10_000)
    async with await client(base) as http:
        notes = [{"role": "user", "content": f"note number {n}"} for n in range(CHUNK)]
        created = await http.post(
            "/memory/conversations", json={"id": "notes", "user": "alice", "messages": notes}
        )
        assert created.status_code == 201, created.text
        (imported,) = await jobs_done(http, 1)
        assert imported["result"]["embedded"] == CHUNK
        late = [{"role": "user", "content": "a late note"}, {"role": "user", "content": "another"}]
        appended = await http.post("/memory/conversations/notes/messages", json={"messages": late})
        assert appended.status_code == 201, appended.text
        done = await jobs_done(http, 2)
        assert sorted(j["result"]["embedded"] for j in done) == [2, CHUNK]
        erased = (await http.delete("/memory/users/alice")).json()["deleted"]
        assert erased["vectors"] == CHUNK + 2


async def test_an_import_longer_than_a_chunk_is_embedded_in_steps(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: Any
) -> None:
    base = start(fake_upstream, serve_proxy, "upstream", embedding_timeout_ms=10_000)
    async with await client(base) as http:
        notes = [{"role": "user", "content": f"note number {n}"} for n in range(CHUNK + 3)]
        created = await http.post(
            "/memory/conversations", json={"id": "notes", "user": "alice", "messages": notes}
        )
        assert created.status_code == 201, created.text
        done = sorted(await jobs_done(http, 2), key=lambda j: j["result"]["embedded"])
        assert [j["result"]["embedded"] for j in done] == [3, CHUNK]
        assert done[1]["result"]["continued_from"] == CHUNK + 1
        assert "continued_from" not in done[0]["result"]


async def test_the_proxys_embedding_calls_are_charged_to_their_exchanges(
    seeded: httpx.AsyncClient,
) -> None:
    """Each is a paid call on the tenant's key: the question's (before the response: in its
    memory cost) and a stored chat's job's, as text-embedding-3-small at $0.02 per million
    tokens (the fake reports 2 tokens a call)."""
    question = await ask(seeded, QUESTION)  # mode read: nothing stored, nothing to embed
    assert question.headers["x-cost-memory-usd"] == "0.00000004"
    stored = await seeded.post(
        "/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "Walks at dawn"}]},
        headers={"X-Memory-User-Id": "alice"},
    )
    assert stored.status_code == 200
    await jobs_done(seeded, 2)  # the import's, and this chat's

    async def parts(response: httpx.Response) -> list[tuple[Any, ...]]:
        request_id = response.headers["x-request-id"]
        record = (await seeded.get(f"/memory/exchanges/{request_id}")).json()
        return [
            (p["kind"], p["model"], p["prompt_tokens"], p["cost_usd"])
            for p in record["cost"]["parts"]
        ]

    embedding = ("embedding", "text-embedding-3-small", 2, 4e-08)
    assert await parts(question) == [embedding]
    assert await parts(stored) == [embedding, embedding]  # its question's, then its job's

    # A request refused after its question's embedding began (an unknown document) still
    # paid for it: no exchange to charge, but the metrics (and the budgets) have it.
    tokens = 'memproxy_tokens_total{kind="prompt",model="text-embedding-3-small",tenant="t1"}'

    async def embedded_tokens() -> float:
        line = next(x for x in (await metrics(seeded)).splitlines() if x.startswith(tokens))
        return float(line.split()[-1])

    before = await embedded_tokens()
    refused = await seeded.post(
        "/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": QUESTION}],
            "attachments": [{"attachment_id": "att_nope"}],
        },
        headers={"X-Memory-User-Id": "alice"},
    )
    assert refused.status_code in (400, 404), refused.text

    async def charged() -> bool:
        return await embedded_tokens() == before + 2

    await eventually(charged, "the refused request's embedding counted")


async def test_an_embedding_job_whose_later_batch_fails_is_charged_the_batches_before(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: Any
) -> None:
    """The first batch was answered (and billed: the fake reports 2 tokens a call); the
    second fails, and so the attempt. What the first used still counts."""
    base = start(fake_upstream, serve_proxy, "upstream", embedding_timeout_ms=10_000)
    fake = fake_upstream[0]
    last = f"note number {UPSTREAM_BATCH}"

    def embed(text: str) -> list[float]:
        if text == last:
            raise RuntimeError("the second batch fails")  # (the fake answers 500)
        return [0.1, 0.2, 0.3]

    fake.embed = embed
    tokens = 'memproxy_tokens_total{kind="prompt",model="text-embedding-3-small",tenant="t1"}'
    async with await client(base) as http:
        notes = [{"role": "user", "content": f"note number {n}"} for n in range(UPSTREAM_BATCH + 1)]
        created = await http.post(
            "/memory/conversations", json={"id": "notes", "user": "alice", "messages": notes}
        )
        assert created.status_code == 201, created.text

        async def failed() -> list[dict[str, Any]]:
            listed = (await http.get("/memory/jobs", params={"kind": "embed_messages"})).json()
            return [j for j in listed["data"] if j["last_error"]]

        (job,) = await eventually(failed, "the attempt failed")
        assert "500" in job["last_error"]
        charged = [x for x in (await metrics(http)).splitlines() if x.startswith(tokens)]
        assert charged == [f"{tokens} 2.0"]


async def test_the_questions_embedding_starts_before_its_turn_is_stored(
    fake_upstream: tuple[FakeOpenAI, str], serve_proxy: Any, fake: FakeOpenAI
) -> None:
    """The question's embedding overlaps the turn's storage (which reads its conversation in
    the same transaction): with the database held by another writer, the embeddings call is
    made all the same, before the turn can be stored; recall waits for the vector only where
    it uses it. (Embedded after storing, this turn would wait for storage until it degraded.)"""
    base = start(fake_upstream, serve_proxy, "upstream", embedding_timeout_ms=60_000)
    vector = {"object": "embedding", "index": 0, "embedding": [0.1, 0.2, 0.3]}
    usage = {"prompt_tokens": 2, "total_tokens": 2}
    fake.script.append(Reply(body={"object": "list", "data": [vector], "usage": usage}, hold=True))
    writer = sqlite3.connect("memproxy.db", isolation_level=None)  # (the test's database)
    writer.execute("BEGIN IMMEDIATE")  # storage waits for it (within its timeout)
    try:
        async with await client(base) as http:
            chat = asyncio.ensure_future(
                http.post(
                    "/chat/completions",
                    json={"model": MODEL, "messages": [{"role": "user", "content": "Hi there"}]},
                    headers={"X-Memory-User-Id": "alice", "X-Memory-Conversation-Id": "overlap"},
                )
            )

            async def asked() -> bool:
                return any(r.path.endswith("/embeddings") for r in fake.requests)

            await eventually(asked, "the embeddings call, while storage waits")
            writer.execute("ROLLBACK")
            fake.release.set()
            response = await chat
    finally:
        writer.close()
        fake.release.set()
    assert response.status_code == 200, response.text
    assert response.headers["x-memory-status"] == "ok"  # stored, not degraded
    assert [r.path for r in fake.requests][:2] == ["/v1/embeddings", "/v1/chat/completions"]
