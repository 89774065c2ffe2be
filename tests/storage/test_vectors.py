"""Stored messages' vectors and the nearest-neighbour search over them, on SQLite and
PostgreSQL: tenant- and user-scoped, erased with their user or conversation, and a deleted
message's vector never found again, however the in-process copy was loaded."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from sqlalchemy import Connection, delete

from policies.vectors import encode
from proxy.background.vector_index import VERIFY_SECONDS, Nearest, VectorIndex
from storage.database import Database
from storage.models import MESSAGES
from storage.records import ConversationRecord
from storage.repositories.conversations import Conversations
from storage.repositories.search import Hit
from storage.repositories.vectors import MessageVectors, NewVector
from tests.storage.test_repositories import chained, msg, new_conversation, partial

MODEL = "test-model"
NOW = datetime(2026, 5, 1, tzinfo=UTC)
# Unit vectors on the axes of a small space: a message "about" axis i is vector i.
AXES = 4


def axis(i: int, lean: float = 0.0) -> list[float]:
    values = [0.0] * AXES
    values[i] = 1.0
    values[(i + 1) % AXES] = lean
    return values


async def embed_all(
    db: Database,
    conversation: ConversationRecord,
    vectors: list[list[float]],
    *,
    model: str = MODEL,
) -> int:
    """Store `vectors` for the conversation's searchable messages, in order."""

    def work(conn: Connection) -> int:
        repo = MessageVectors(conn)
        pending = repo.unembedded(
            conversation.tenant_id,
            conversation.user_id,
            model,
            conversation_pk=conversation.pk,
        )
        rows = [NewVector(m.pk, encode(v), len(v)) for m, v in zip(pending, vectors, strict=False)]
        return repo.store(conversation.tenant_id, conversation.user_id, model, rows, now=NOW)

    return await db.write(work)


async def nearest(
    db: Database,
    index: VectorIndex,
    query: list[float],
    *,
    tenant: str = "t1",
    user: str = "alice",
    limit: int = 10,
    **options: object,
) -> list[Hit]:
    return await db.read(
        lambda conn: index.nearest(
            conn,
            tenant,
            user,
            MODEL,
            [v / sum(x * x for x in query) ** 0.5 for v in query],
            limit=limit,
            **options,  # type: ignore[arg-type]
        )
    )


async def test_only_complete_user_and_assistant_messages_wait_to_be_embedded(
    db: Database,
) -> None:
    conv = await new_conversation(
        db, "c1", [msg("system", "be brief"), msg("user", "hello there"), msg("assistant", "hi")]
    )
    await db.write(
        lambda conn: Conversations(conn).append(conv, "alice", [partial("cut off")], now=NOW)
    )

    def pending(conn: Connection) -> list[str]:
        found = MessageVectors(conn).unembedded("t1", "alice", MODEL, conversation_pk=conv.pk)
        return [m.text for m in found]

    assert await db.read(pending) == ["hello there", "hi"]
    assert await embed_all(db, conv, [axis(0), axis(1)]) == 2
    assert await db.read(pending) == []
    # Another model's vectors are separate: for it, everything still waits.
    assert await embed_all(db, conv, [axis(2), axis(3)], model="other") == 2
    assert await embed_all(db, conv, [axis(0), axis(1)]) == 0  # nothing left for MODEL


async def test_nearest_finds_the_users_messages_best_first(db: Database) -> None:
    conv = await new_conversation(
        db,
        "c1",
        [msg("user", "zero"), msg("assistant", "one"), msg("user", "two"), msg("assistant", "3")],
    )
    await embed_all(db, conv, [axis(0), axis(1, lean=0.5), axis(2), axis(3)])
    index = VectorIndex()
    hits = await nearest(db, index, axis(2))
    assert [h.seq for h in hits[:2]] == [3, 2]  # "two" itself, then "one" (its lean)
    assert hits[0].conversation_pk == conv.pk
    assert hits[0].score > hits[1].score
    assert [h.seq for h in await nearest(db, index, axis(2), limit=1)] == [3]
    # Below the threshold nothing counts.
    assert [h.seq for h in await nearest(db, index, axis(2), min_similarity=0.5)] == [3]


async def test_a_search_knows_the_similarity_of_every_message_it_compared(db: Database) -> None:
    # Recall weighs the turns it reads around the hits by their own similarity too.
    conv = await new_conversation(
        db, "c1", [msg("user", "zero"), msg("assistant", "one"), msg("user", "two")]
    )
    other = await new_conversation(db, "c2", [msg("user", "elsewhere")])
    await embed_all(db, conv, [axis(0), axis(1, lean=0.5), axis(2)])
    await embed_all(db, other, [axis(2)])
    index = VectorIndex()
    query = [v / 1.25**0.5 for v in axis(1, lean=0.5)]

    def search(conn: Connection, conversation_pk: int | None = None) -> Nearest:
        groups = None if conversation_pk is None else (conversation_pk,)
        return index.search("messages", conn, "t1", "alice", MODEL, query, limit=1, groups=groups)

    found = await db.read(search)
    zero, one, two, elsewhere = [*await pks_of(db, conv), *await pks_of(db, other)]
    assert [h.item_pk for h in found.hits] == [one]
    similar = found.of([zero, one, two, elsewhere, 10_000])  # 10,000: no such message
    assert set(similar) == {zero, one, two, elsewhere}
    assert similar[one] == pytest.approx(1.0) and similar[zero] == pytest.approx(0.0)
    assert similar[two] == pytest.approx(similar[elsewhere]) == pytest.approx(0.5 / 1.25**0.5)
    # Kept to one conversation, the others' messages were not compared.
    within = await db.read(lambda conn: search(conn, conv.pk))
    assert set(within.of([zero, one, two, elsewhere])) == {zero, one, two}
    assert Nearest([]).of([one]) == {}


async def pks_of(db: Database, conv: ConversationRecord) -> list[int]:
    def work(conn: Connection) -> list[int]:
        return [m.pk for m in Conversations(conn).messages(conv.tenant_id, conv.pk)]

    return await db.read(work)


async def test_nearest_never_crosses_users_or_tenants(db: Database) -> None:
    mine = await new_conversation(db, "mine", [msg("user", "my secret")])
    bobs = await new_conversation(db, "bobs", [msg("user", "bob's secret")], user="bob")
    other = await new_conversation(db, "other", [msg("user", "t2's secret")], tenant="t2")
    for conv in (mine, bobs, other):
        await embed_all(db, conv, [axis(0)])
    index = VectorIndex()
    assert [h.pk for h in await nearest(db, index, axis(0))] == [await pk_of(db, mine)]
    assert [h.pk for h in await nearest(db, index, axis(0), user="bob")] == [await pk_of(db, bobs)]
    assert [h.pk for h in await nearest(db, index, axis(0), tenant="t2")] == [
        await pk_of(db, other)
    ]
    assert await nearest(db, index, axis(0), user="carol") == []
    # A vector for someone else's message is not stored.
    alices = await pk_of(db, mine)

    def steal(conn: Connection) -> int:
        row = [NewVector(alices, encode(axis(1)), AXES)]
        repo = MessageVectors(conn)
        return repo.store("t1", "bob", "m2", row, now=NOW) + repo.store(
            "t2", "alice", "m2", row, now=NOW
        )

    assert await db.write(steal) == 0


async def pk_of(db: Database, conv: ConversationRecord) -> int:
    def work(conn: Connection) -> int:
        return Conversations(conn).messages(conv.tenant_id, conv.pk)[0].pk

    return await db.read(work)


async def delete_seq(db: Database, conv: ConversationRecord, seq: int) -> None:
    await db.write(
        lambda conn: conn.execute(
            delete(MESSAGES).where(MESSAGES.c.conversation_pk == conv.pk, MESSAGES.c.seq == seq)
        )
    )


async def test_a_deleted_message_leaves_the_kept_copy_when_it_is_next_counted(
    db: Database,
) -> None:
    conv = await new_conversation(
        db, "c1", [msg("user", "keep"), msg("assistant", "drop"), msg("user", "also keep")]
    )
    await embed_all(db, conv, [axis(0), axis(1), axis(2)])
    clock = [0.0]
    index = VectorIndex(clock=lambda: clock[0])
    assert {h.seq for h in await nearest(db, index, axis(1))} == {1, 2, 3}
    assert index.loads == 1
    await delete_seq(db, conv, 2)
    # The vector went with its message (the foreign key). Until the kept copy is counted
    # again it may still be compared (recall reads every hit back, so it is never used:
    # tests/integration/test_embeddings.py); from then on it is gone.
    clock[0] += VERIFY_SECONDS
    assert {h.seq for h in await nearest(db, index, axis(1))} == {1, 3}
    assert index.loads == 2


async def test_the_newest_vector_deleted_is_noticed_at_once(db: Database) -> None:
    conv = await new_conversation(db, "c1", [msg("user", "keep"), msg("assistant", "drop")])
    await embed_all(db, conv, [axis(0), axis(1)])
    index = VectorIndex(clock=lambda: 0.0)  # never due to be counted again
    assert {h.seq for h in await nearest(db, index, axis(1))} == {1, 2}
    await delete_seq(db, conv, 2)
    assert {h.seq for h in await nearest(db, index, axis(1))} == {1}
    assert index.loads == 2


async def test_new_vectors_are_read_incrementally(db: Database) -> None:
    conv = await new_conversation(db, "c1", [msg("user", "first")])
    await embed_all(db, conv, [axis(0)])
    index = VectorIndex()
    assert len(await nearest(db, index, axis(0))) == 1

    def more(conn: Connection) -> ConversationRecord:
        repo = Conversations(conn)
        fresh = repo.get("t1", "c1")
        assert fresh is not None
        return repo.append(fresh, "alice", chained(fresh, [msg("assistant", "second")]), now=NOW)

    await db.write(more)
    await embed_all(db, conv, [axis(1)])
    hits = await nearest(db, index, axis(1))
    assert [h.seq for h in hits] == [2, 1]
    assert index.loads == 1  # appended, not reloaded


async def test_erasing_a_user_or_deleting_a_conversation_removes_their_vectors(
    db: Database,
) -> None:
    a1 = await new_conversation(db, "a1", [msg("user", "one"), msg("assistant", "two")])
    a2 = await new_conversation(db, "a2", [msg("user", "three")])
    bob = await new_conversation(db, "b1", [msg("user", "bob")], user="bob")
    other = await new_conversation(db, "x1", [msg("user", "other tenant")], tenant="t2")
    for conv in (a1, a2, bob, other):
        await embed_all(db, conv, [axis(0), axis(1)])
    index = VectorIndex(verify_seconds=0)  # counted on every search: what the database holds
    assert len(await nearest(db, index, axis(0))) == 3

    assert await db.write(lambda conn: Conversations(conn).delete("t1", "a1"))
    assert await db.read(lambda conn: MessageVectors(conn).count("t1", "alice")) == 1
    assert [h.conversation_pk for h in await nearest(db, index, axis(0))] == [a2.pk]

    def erase(conn: Connection) -> int:
        erased = MessageVectors(conn).delete_user("t1", "alice")
        Conversations(conn).delete_user("t1", "alice")
        return erased

    assert await db.write(erase) == 1
    assert await db.read(lambda conn: MessageVectors(conn).count("t1", "alice")) == 0
    assert await nearest(db, index, axis(0)) == []
    # Nobody else's went with them.
    assert await db.read(lambda conn: MessageVectors(conn).count("t1", "bob")) == 1
    assert await db.read(lambda conn: MessageVectors(conn).count("t2")) == 1


async def test_the_kept_copies_stay_within_their_memory_bound(db: Database) -> None:
    for user in ("alice", "bob", "carol"):
        conv = await new_conversation(db, f"c-{user}", [msg("user", user)], user=user)
        await embed_all(db, conv, [axis(0)])
    # Room for about one user's buffer (16 rows of 4 float32 + 3 int64 columns).
    index = VectorIndex(max_bytes=16 * (AXES * 4 + 3 * 8))
    for user in ("alice", "bob", "carol"):
        assert len(await nearest(db, index, axis(0), user=user)) == 1
    assert len(index._users) == 1
    assert index._bytes <= index.max_bytes
    # A user whose copy was let go is read again, with the same answer.
    assert len(await nearest(db, index, axis(0), user="alice")) == 1
