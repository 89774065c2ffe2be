"""The jobs that embed stored turns (`embed_messages`), run by the job runner on SQLite and
PostgreSQL: with the local model, a turn's job embeds the user's turns queued behind it in the
same call, and each message gets its own vector once; a job that fails leaves the other turns
to their own jobs; an upstream's (paid) calls embed one turn each."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from sqlalchemy import Connection, update

from policies.jobs import RetryPolicy
from policies.pricing import PriceBook
from policies.vectors import EMBED_JOB_KIND, decode
from proxy.accounting.charges import MemoryCharges
from proxy.accounting.costs import Pricer
from proxy.accounting.limits import LimitKeeper
from proxy.accounting.metrics import Metrics
from proxy.background import local_model
from proxy.background.embedding_jobs import MessageEmbedder
from proxy.background.embeddings import LOCAL_MODEL_NAME, EmbeddingError, Embeddings
from proxy.background.jobs import JobRunner
from proxy.core.config import Config, MemorySettings, UpstreamConfig
from proxy.pipeline.memory import ConversationMemory
from proxy.pipeline.turn import Outcome, Turn
from proxy.upstream.echo import EchoUpstream
from storage.database import Database
from storage.models import JOBS
from storage.records import JobRecord
from storage.repositories.conversations import Conversations
from storage.repositories.jobs import Jobs
from storage.repositories.vectors import MessageVectors
from tests.conftest import make_config
from tests.storage.test_memory_service import assistant, begin, user


def config(**memory: Any) -> Config:
    return make_config(UpstreamConfig(kind="echo"), memory=MemorySettings(**memory))


def runner(db: Database, config: Config) -> tuple[JobRunner, Embeddings]:
    """A runner of one job at a time, with the handler of `embed_messages` as served."""
    metrics = Metrics()
    upstreams = {"main": EchoUpstream("main", UpstreamConfig(kind="echo"))}
    embeddings = Embeddings(config, upstreams, metrics)
    charges = MemoryCharges(
        db, Pricer(PriceBook({}, lambda model: None)), LimitKeeper(db, config), metrics
    )
    jobs = JobRunner(db, metrics, concurrency=1, retry=RetryPolicy(first_delay_s=3600))
    jobs.register(EMBED_JOB_KIND, MessageEmbedder(embeddings, db, metrics, charges))
    return jobs, embeddings


async def turns(db: Database, count: int, *, conversation: str = "c1") -> list[Turn]:
    """`count` answered turns of alice, each queueing its embedding job."""
    memory, done = ConversationMemory(db), []
    for i in range(count):
        turn = await begin(
            memory, [user(f"question {i} about the garden")], conversation_id=conversation
        )
        turn.embed = True
        reply = Outcome("complete", http_status=200, reply=assistant(f"reply {i}: plant roses"))
        await memory.finish(turn, reply)
        done.append(turn)
    return done


async def jobs_of(db: Database) -> dict[str, JobRecord]:
    found = await db.read(lambda conn: Jobs(conn).find("t1", limit=100))
    return {j.ref: j for j in found if j.kind == EMBED_JOB_KIND}


async def vectors(db: Database, model: str) -> dict[str, list[float]]:
    """Each of alice's messages with a `model` vector: its text -> the vector."""

    def read(conn: Connection) -> dict[str, list[float]]:
        repo, texts = Conversations(conn), {}
        for name in ("c1", "kept", "gone"):
            conv = repo.get("t1", name)
            if conv is not None:
                texts.update({m.pk: m.content for m in repo.messages("t1", conv.pk)})
        stored = MessageVectors(conn).load("t1", "alice", model)
        assert len({v.item_pk for v in stored}) == len(stored)  # one vector a message
        return {str(texts[v.item_pk]): decode(v.vector) for v in stored}

    return await db.read(read)


@pytest.fixture
def model() -> Iterator[local_model.MiniLM]:
    yield local_model.load()


async def test_a_turns_job_embeds_the_turns_queued_behind_it_in_one_call(
    db: Database, model: local_model.MiniLM
) -> None:
    jobs, embeddings = runner(db, config())
    calls: list[int] = []
    embedder = embeddings.embedder("t1")
    assert embedder is not None
    embed = embedder.embed

    async def counted(texts: Any) -> Any:
        calls.append(len(texts))
        return await embed(texts)

    embedder.embed = counted  # type: ignore[method-assign]
    first, *rest = await turns(db, 4)
    assert await jobs.run_once() == 1  # the first turn's job
    assert calls == [8]
    done = await vectors(db, LOCAL_MODEL_NAME)
    assert len(done) == 8
    for text, vector in done.items():  # each message its own text's vector
        assert np.allclose(vector, model.encode([text])[0], atol=1e-4), text
    assert (await jobs_of(db))[first.request_id].result == {
        "model": LOCAL_MODEL_NAME,
        "embedded": 8,
        "turns_queued_behind": 3,
    }
    # The others' jobs ended with it: never run, nothing embedded again.
    assert await jobs.run_once() == 0
    assert calls == [8]
    queued = await jobs_of(db)
    assert [(queued[t.request_id].status, queued[t.request_id].result) for t in rest] == [
        ("done", {"embedded": 0, "embedded_by": first.request_id})
    ] * 3
    assert await vectors(db, LOCAL_MODEL_NAME) == done


async def test_a_turn_taken_in_part_when_the_chunk_is_full_keeps_its_job(
    db: Database, model: local_model.MiniLM
) -> None:
    jobs, _ = runner(db, config())
    embedder = jobs.handlers[EMBED_JOB_KIND]
    assert isinstance(embedder, MessageEmbedder)
    embedder.chunk = 4  # a turn's two messages and one of the next turn's
    first, second, third = await turns(db, 3)
    while await jobs.run_once():
        pass
    queued = await jobs_of(db)
    results = [(queued[t.request_id].result or {}).get("embedded") for t in (first, second, third)]
    assert results == [3, 3, 0]  # (the second's own reply, and the third turn's two)
    assert len(await vectors(db, LOCAL_MODEL_NAME)) == 6


async def test_two_turns_answered_at_once_each_get_every_message_embedded(
    db: Database, model: local_model.MiniLM
) -> None:
    """Alice's turns A and B open before either ends: their messages interleave (A's
    question, B's question, A's reply, B's reply). A's job takes B's reply, which comes after
    its own, but not B's question: B's job stays to embed it."""
    jobs, _ = runner(db, config())
    memory = ConversationMemory(db)
    a = await begin(memory, [user("question A about the garden")], conversation_id="c1")
    b = await begin(memory, [user("question B about boats")], conversation_id="kept")
    for turn, reply in ((a, "reply A: roses"), (b, "reply B: a sloop")):
        turn.embed = True
        await memory.finish(turn, Outcome("complete", http_status=200, reply=assistant(reply)))
    while await jobs.run_once():
        pass
    assert sorted(await vectors(db, LOCAL_MODEL_NAME)) == sorted(
        [
            "question A about the garden",
            "question B about boats",
            "reply A: roses",
            "reply B: a sloop",
        ]
    )
    queued = await jobs_of(db)
    assert (queued[b.request_id].status, queued[b.request_id].result) == (
        "done",
        {"model": LOCAL_MODEL_NAME, "embedded": 1},  # its question, by itself
    )


async def test_a_job_waiting_to_retry_is_not_ended_by_another_and_keeps_its_errors(
    db: Database, model: local_model.MiniLM
) -> None:
    jobs, _ = runner(db, config())
    _, second = await turns(db, 2)
    waiting = (await jobs_of(db))[second.request_id]
    failed = {"errors": [{"attempt": 1, "error": "the model failed (as a test)"}]}
    await db.write(  # (as a failed attempt leaves it: queued, its backoff not over)
        lambda conn: conn.execute(
            update(JOBS)
            .where(JOBS.c.pk == waiting.pk)
            .values(attempts=1, result=failed, run_after=waiting.created_at.replace(year=2999))
        )
    )
    assert await jobs.run_once() == 1  # the first turn's, which embeds the second's too
    assert len(await vectors(db, LOCAL_MODEL_NAME)) == 4
    after = (await jobs_of(db))[second.request_id]
    assert (after.status, after.attempts, after.result) == ("queued", 1, failed)


async def test_a_failed_job_leaves_the_other_turns_to_their_own_jobs(
    db: Database, model: local_model.MiniLM
) -> None:
    jobs, embeddings = runner(db, config())
    embedder = embeddings.embedder("t1")
    assert embedder is not None
    embed = embedder.embed
    failing = [True]

    async def fails_once(texts: Any) -> Any:
        if failing.pop() if failing else False:
            raise EmbeddingError("the local embedding model failed (as a test)")
        return await embed(texts)

    embedder.embed = fails_once  # type: ignore[method-assign]
    first, second, third = await turns(db, 3)
    await jobs.run_once()  # the first: fails, and waits for its retry
    assert (await jobs_of(db))[first.request_id].status == "queued"
    assert await vectors(db, LOCAL_MODEL_NAME) == {}
    while await jobs.run_once():  # the second's job embeds the second and third turns
        pass
    queued = await jobs_of(db)
    assert queued[second.request_id].result == {
        "model": LOCAL_MODEL_NAME,
        "embedded": 4,
        "turns_queued_behind": 1,
    }
    assert queued[third.request_id].result == {"embedded": 0, "embedded_by": second.request_id}
    assert sorted(await vectors(db, LOCAL_MODEL_NAME)) == sorted(
        [f"question {i} about the garden" for i in (1, 2)]
        + [f"reply {i}: plant roses" for i in (1, 2)]
    )
    # Its retry embeds the first turn's own.
    retry = queued[first.request_id]
    await db.write(  # (its backoff over)
        lambda conn: conn.execute(
            update(JOBS).where(JOBS.c.pk == retry.pk).values(run_after=retry.created_at)
        )
    )
    assert await jobs.run_once() == 1
    result = (await jobs_of(db))[first.request_id].result or {}
    assert result["embedded"] == 2
    assert [e["error"] for e in result["errors"]] == [
        "the local embedding model failed (as a test)"
    ]
    assert len(await vectors(db, LOCAL_MODEL_NAME)) == 6


async def test_a_deleted_turn_queued_behind_is_not_embedded(
    db: Database, model: local_model.MiniLM
) -> None:
    jobs, _ = runner(db, config())
    await turns(db, 1, conversation="kept")
    await turns(db, 1, conversation="gone")
    await db.write(lambda conn: Conversations(conn).delete("t1", "gone"))
    while await jobs.run_once():
        pass
    assert sorted(await vectors(db, LOCAL_MODEL_NAME)) == [
        "question 0 about the garden",
        "reply 0: plant roses",
    ]


async def test_an_upstreams_paid_calls_embed_one_turn_each(db: Database) -> None:
    jobs, _ = runner(db, config(embeddings="upstream", embedding_model="text-embedding-3-small"))
    await turns(db, 3)
    assert await jobs.run_once() == 1
    assert len(await vectors(db, "text-embedding-3-small")) == 2  # the first turn's only
    while await jobs.run_once():
        pass
    assert len(await vectors(db, "text-embedding-3-small")) == 6
