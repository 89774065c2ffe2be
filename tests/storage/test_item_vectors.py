"""Memories' and attachment passages' vectors on SQLite and PostgreSQL: what waits to be
embedded, stored only for what is still there (a memory: still saying what was embedded), gone
with every delete, edit, retention pass and erasure, and found nearest by the index within the
user (and the attachments asked about) only."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

from sqlalchemy import Connection

from policies.vectors import encode
from proxy.background.vector_index import VectorIndex
from proxy.routes.users import erase_user
from storage.database import Database
from storage.records import AttachmentRecord, MemoryRecord
from storage.repositories.attachments import Attachments
from storage.repositories.chunk_vectors import ChunkVectors
from storage.repositories.conversations import Conversations
from storage.repositories.memories import Memories, new_memory_id
from storage.repositories.memory_vectors import MemoryVectors
from storage.repositories.vectors import NewVector
from tests.storage.test_attachments import HARBOUR, RECIPES, attach
from tests.storage.test_repositories import T0, new_conversation
from tests.storage.test_vectors import AXES, MODEL, NOW, axis

LATER = T0 + timedelta(days=30)


async def remember(db: Database, text: str, user: str = "alice") -> MemoryRecord:
    return await db.write(
        lambda conn: Memories(conn).create("t1", user, new_memory_id(), text, now=T0)
    )


async def embed_memories(db: Database, user: str = "alice", *, first_axis: int = 0) -> int:
    """Store a vector for each of the user's memories waiting for one (axes in turn)."""

    def work(conn: Connection) -> int:
        repo = MemoryVectors(conn)
        pending = repo.unembedded("t1", user, MODEL, limit=100)
        rows = [
            NewVector(m.pk, encode(axis((first_axis + i) % AXES)), AXES, m.text)
            for i, m in enumerate(pending)
        ]
        return repo.store("t1", user, MODEL, rows, now=NOW)

    return await db.write(work)


async def embed_passages(db: Database, attachment: AttachmentRecord, first_axis: int = 0) -> int:
    def work(conn: Connection) -> int:
        repo = ChunkVectors(conn)
        pending = repo.unembedded(
            "t1", attachment.user_id, attachment.id, MODEL, limit=100, first_seq=0
        )
        rows = [
            NewVector(c.pk, encode(axis((first_axis + i) % AXES)), AXES)
            for i, c in enumerate(pending)
        ]
        return repo.store("t1", attachment.user_id, MODEL, rows, now=NOW)

    return await db.write(work)


async def counts(db: Database, user: str = "alice") -> tuple[int, int]:
    """(memory vectors, passage vectors) of the user."""
    return await db.read(
        lambda c: (MemoryVectors(c).count("t1", user), ChunkVectors(c).count("t1", user))
    )


async def test_memories_wait_to_be_embedded_and_their_vectors_go_with_each_delete_and_edit(
    db: Database,
) -> None:
    kept = await remember(db, "Owns a beagle")
    edited = await remember(db, "Lives in Lisbon")
    deleted = await remember(db, "Plays the cello")
    await remember(db, "Likes jazz", user="bob")
    assert await embed_memories(db) == 3
    assert await embed_memories(db) == 0  # nothing waits any more
    assert await embed_memories(db, "bob") == 1

    def pending(conn: Connection) -> list[int]:
        return [m.pk for m in MemoryVectors(conn).unembedded("t1", "alice", MODEL, limit=10)]

    # Pinning keeps the vector (the text is the same); a new text takes it away.
    await db.write(lambda c: Memories(c).update("t1", kept.id, now=LATER, pinned=True))
    await db.write(lambda c: Memories(c).update("t1", edited.id, now=LATER, text="Lives in Porto"))
    assert await db.read(pending) == [edited.pk]
    assert await counts(db) == (2, 0)
    await db.write(lambda c: Memories(c).delete("t1", deleted.id))
    assert await counts(db) == (1, 0)
    # Retention: the tenant's unpinned memories unused since the cutoff go, with their vectors.
    assert await embed_memories(db) == 1
    assert await counts(db) == (2, 0)
    removed = await db.write(
        lambda c: Memories(c).delete_unused_since("t1", LATER + timedelta(days=1), limit=10)
    )
    assert removed == 2  # alice's edited one and bob's
    assert await counts(db) == (1, 0)  # the pinned one's
    assert await counts(db, "bob") == (0, 0)


async def test_a_vector_of_a_memorys_old_text_or_of_another_user_is_not_stored(
    db: Database,
) -> None:
    memory = await remember(db, "Owns a beagle")
    await db.write(lambda c: Memories(c).update("t1", memory.id, now=LATER, text="Owns a cat"))

    def store(text: str, user: str = "alice") -> Callable[[Connection], int]:
        row = NewVector(memory.pk, encode(axis(0)), AXES, text)
        return lambda conn: MemoryVectors(conn).store("t1", user, MODEL, [row], now=NOW)

    assert await db.write(store("Owns a beagle")) == 0  # embedded before the edit: stale
    assert await db.write(store("Owns a cat", "bob")) == 0  # not bob's
    assert await db.write(store("Owns a cat")) == 1
    assert await db.write(store("Owns a cat")) == 0  # it has its vector already


async def test_passages_wait_to_be_embedded_and_go_with_their_attachment_and_conversation(
    db: Database,
) -> None:
    await new_conversation(db, "c1")
    harbour = await attach(db, "c1", HARBOUR)
    recipes = await attach(db, "c1", RECIPES)
    await new_conversation(db, "theirs", user="bob")
    bobs = await attach(db, "theirs", RECIPES, user="bob")

    def pending(conn: Connection) -> list[int]:
        found = ChunkVectors(conn).unembedded("t1", "alice", harbour.id, MODEL, limit=10)
        return [c.seq for c in found]

    assert await db.read(pending) == [1, 2, 3]
    assert await embed_passages(db, harbour) == 3
    assert await db.read(pending) == []
    assert await embed_passages(db, recipes) == 2
    assert await embed_passages(db, bobs) == 2
    # Another user's passages are not stored as alice's.
    assert await db.write(lambda c: _store_for(c, "alice", bobs)) == 0
    assert await counts(db) == (0, 5)
    await db.write(lambda c: Attachments(c).delete("t1", harbour.id))
    assert await counts(db) == (0, 2)
    await db.write(lambda c: Conversations(c).delete("t1", "c1"))
    assert await counts(db) == (0, 0)
    assert await counts(db, "bob") == (0, 2)


def _store_for(conn: Connection, user: str, attachment: AttachmentRecord) -> int:
    """Try to store vectors of `attachment`'s passages as `user`'s."""
    chunks = Attachments(conn).chunks("t1", [attachment.pk])
    rows = [NewVector(c.pk, encode(axis(0)), AXES) for c in chunks]
    return ChunkVectors(conn).store("t1", user, "other-model", rows, now=NOW)


async def test_erasing_a_user_removes_the_vectors_of_their_memories_and_passages(
    db: Database,
) -> None:
    for user in ("alice", "bob"):
        await remember(db, "Owns a beagle", user=user)
        await embed_memories(db, user)
        await new_conversation(db, f"c-{user}", user=user)
        await embed_passages(db, await attach(db, f"c-{user}", HARBOUR, user=user))
    assert await counts(db) == (1, 3)
    erased = await db.write(lambda c: erase_user(c, "t1", "alice"))
    assert erased["vectors"] == 4
    assert await counts(db) == (0, 0)
    assert await counts(db, "bob") == (1, 3)


async def test_the_nearest_memories_and_passages_are_the_users_and_a_deleted_one_is_gone(
    db: Database,
) -> None:
    memories = [await remember(db, text) for text in ("zero", "one", "two")]
    await remember(db, "bob's", user="bob")
    await embed_memories(db)
    await embed_memories(db, "bob", first_axis=2)
    index = VectorIndex()

    def nearest(
        kind: str, query: int, user: str = "alice", **options: object
    ) -> Callable[[Connection], list[int]]:
        def read(conn: Connection) -> list[int]:
            found = index.nearest_of(
                kind,
                conn,
                "t1",
                user,
                MODEL,
                axis(query),
                limit=10,
                min_similarity=0.5,
                **options,  # type: ignore[arg-type]
            )
            return [n.item_pk for n in found]

        return read

    assert await db.read(nearest("memories", 2)) == [memories[2].pk]
    await db.write(lambda c: Memories(c).delete("t1", memories[2].id))
    assert await db.read(nearest("memories", 2)) == []  # (the index noticed the delete)
    assert await db.read(nearest("memories", 2, user="carol")) == []
    # Passages: only those of the attachments asked about.
    await new_conversation(db, "c1")
    harbour = await attach(db, "c1", HARBOUR)
    recipes = await attach(db, "c1", RECIPES)
    await embed_passages(db, harbour)  # axes 0, 1, 2
    await embed_passages(db, recipes)  # axes 0, 1
    chunks = await db.read(lambda c: Attachments(c).chunks("t1", [harbour.pk, recipes.pk]))
    pk_of = {(c.attachment_pk, c.seq): c.pk for c in chunks}
    both = await db.read(nearest("passages", 0, groups=[harbour.pk, recipes.pk]))
    assert sorted(both) == sorted([pk_of[(harbour.pk, 1)], pk_of[(recipes.pk, 1)]])
    assert await db.read(nearest("passages", 0, groups=[recipes.pk])) == [pk_of[(recipes.pk, 1)]]
    assert await db.read(nearest("passages", 2, groups=[recipes.pk])) == []
