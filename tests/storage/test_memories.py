"""The memories repository's reads for recall, on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

from sqlalchemy import Connection
from sqlalchemy import text as sql
from sqlalchemy.ext.asyncio import create_async_engine

from storage import migrate
from storage.database import Database
from storage.repositories.memories import Memories

T0 = datetime(2026, 1, 1, tzinfo=UTC)


async def test_relevant_memories_are_the_unpinned_ones_holding_a_term(db: Database) -> None:
    def create(conn: Connection) -> None:
        memories = Memories(conn)
        texts = ["Likes HIKING in spring", "100% vegan", "snake_case fan", "plays oboe"]
        for i, text in enumerate(texts):
            memories.create("t1", "alice", f"mem_{i}", text, now=T0 + timedelta(seconds=i))
        memories.create("t1", "alice", "mem_pinned", "hiking boots", now=T0, pinned=True)
        memories.create("t1", "bob", "mem_bob", "hiking with bob", now=T0)
        memories.create("t2", "alice", "mem_t2", "hiking elsewhere", now=T0)

    await db.write(create)
    terms = ["hik", "%", "_case", "OBOE"]

    def read(conn: Connection) -> tuple[list[str], list[str]]:
        memories = Memories(conn)
        relevant = memories.relevant("t1", "alice", terms, limit=10)
        found = memories.find("t1", "alice", limit=10, pinned=False, terms=terms)
        return [m.id for m in relevant], [m.id for m in found]

    relevant, found = await db.read(read)
    # Case-insensitive, LIKE's wildcards taken literally, newest first, only this tenant's
    # user's unpinned memories: what `find` gives.
    assert relevant == found == ["mem_3", "mem_2", "mem_1", "mem_0"]
    assert await db.read(lambda c: Memories(c).relevant("t1", "alice", ["oboe"], limit=10)) == (
        await db.read(lambda c: Memories(c).find("t1", "alice", limit=10, terms=["oboe"]))
    )
    assert await db.read(lambda c: Memories(c).relevant("t1", "alice", [], limit=10)) == []
    assert [
        m.id for m in await db.read(lambda c: Memories(c).relevant("t1", "alice", ["n"], limit=2))
    ] == ["mem_2", "mem_1"]


async def test_recalls_read_of_memories_is_what_pinned_and_relevant_read_apart(
    db: Database,
) -> None:
    def create(conn: Connection) -> None:
        memories = Memories(conn)
        for i in range(4):
            at = T0 + timedelta(seconds=i)
            memories.create("t1", "alice", f"mem_p{i}", f"pinned oboe {i}", now=at, pinned=True)
            memories.create("t1", "alice", f"mem_{i}", f"plays oboe {i}", now=at)
        memories.create("t1", "alice", "mem_other", "likes tea", now=T0)
        memories.create("t1", "bob", "mem_bob", "plays oboe too", now=T0, pinned=True)
        memories.create("t2", "alice", "mem_t2", "oboe elsewhere", now=T0)

    await db.write(create)

    def read(conn: Connection, terms: list[str]) -> tuple[object, object]:
        memories = Memories(conn)
        apart = (
            memories.pinned("t1", "alice", limit=3),
            memories.relevant("t1", "alice", terms, limit=2),
        )
        return apart, memories.pinned_and_relevant("t1", "alice", terms, pinned=3, limit=2)

    for terms in (["oboe"], ["tea"], ["nothing"], []):
        apart, together = await db.read(lambda c, terms=terms: read(c, terms))
        assert together == apart
    _, (pinned, relevant) = await db.read(lambda c: read(c, ["oboe"]))
    assert [m.id for m in pinned] == ["mem_p0", "mem_p1", "mem_p2"]  # oldest first
    assert [m.id for m in relevant] == ["mem_3", "mem_2"]  # newest first


async def test_a_repeat_is_found_by_its_folded_text_within_the_tenants_user(db: Database) -> None:
    def create(conn: Connection) -> None:
        memories = Memories(conn)
        memories.create("t1", "alice", "mem_a", "Ähnlich: The user is VEGETARIAN.", now=T0)
        memories.create("t1", "bob", "mem_b", "ähnlich: the user is vegetarian.", now=T0)
        memories.create("t2", "alice", "mem_c", "ähnlich: the user is vegetarian.", now=T0)

    await db.write(create)
    spellings = ["ähnlich: the user is vegetarian", "ähnlich: the user is vegetarian."]
    assert await db.read(lambda c: Memories(c).with_text("t1", "alice", spellings)) == ["mem_a"]
    assert await db.read(lambda c: Memories(c).with_text("t1", "carol", spellings)) == []
    assert await db.read(lambda c: Memories(c).with_text("t1", "alice", ["the user"])) == []


async def test_case_is_folded_beyond_ascii(db: Database) -> None:
    """On SQLite too (its own lower() folds ASCII only): "études" finds "Études à Paris"."""
    await db.write(lambda c: Memories(c).create("t1", "alice", "mem_fr", "Études à Paris", now=T0))

    def read(conn: Connection) -> tuple[list[str], list[str]]:
        memories = Memories(conn)
        relevant = memories.relevant("t1", "alice", ["études"], limit=10)
        found = memories.find("t1", "alice", limit=10, terms=["ÉTUDES"])
        return [m.id for m in relevant], [m.id for m in found]

    assert await db.read(read) == (["mem_fr"], ["mem_fr"])


async def test_migration_0014_folds_the_memories_already_there(database_url: str) -> None:
    await asyncio.to_thread(migrate.upgrade, database_url, "0013")
    insert = sql(
        "INSERT INTO memories (id, tenant_id, user_id, kind, text, pinned, access_count, "
        "created_at, updated_at) VALUES (:id, 't1', 'alice', 'fact', :text, false, 0, :at, :at)"
    )
    rows = [{"id": f"mem_{i}", "text": f"Études {i}", "at": T0} for i in range(3)]
    db = Database(database_url)
    try:
        await db.write(lambda c: c.execute(insert, rows))
    finally:
        await db.dispose()
    await asyncio.to_thread(migrate.upgrade, database_url)
    db = Database(database_url)  # (a new one: PostgreSQL's cached plans predate the column)
    try:
        found = await db.read(lambda c: Memories(c).find("t1", "alice", limit=10, terms=["études"]))
    finally:
        await db.dispose()
    assert sorted(m.id for m in found) == ["mem_0", "mem_1", "mem_2"]


async def test_a_users_memories_stay_locked_until_the_holder_ends(db: Database) -> None:
    """Extraction checks a new memory is not held already, then adds it: a second transaction
    of the same user doing so waits for the first to end, and then sees what it added (on
    PostgreSQL it read past the uncommitted row and added the memory twice)."""
    vegetarian, ids = ["the user is vegetarian."], iter(["mem_first", "mem_second"])

    def add_unless_held(conn: Connection) -> list[str]:
        memories = Memories(conn)
        memories.lock_user("t1", "alice")
        held = memories.with_text("t1", "alice", vegetarian)
        if not held:
            memories.create("t1", "alice", next(ids), "The user is vegetarian.", now=T0)
        return held

    other = create_async_engine(db.url)
    try:
        async with other.begin() as first:
            await first.run_sync(lambda conn: add_unless_held(conn) or None)
            second = asyncio.create_task(db.write(add_unless_held))
            await asyncio.sleep(0.3)
            assert not second.done()  # it waits for the first to end
            if not db.is_sqlite:  # (SQLite's one writer waits whatever it locks)
                # Another user's memories are not held by it.
                await db.write(lambda conn: Memories(conn).lock_user("t1", "bob"))
    finally:
        await other.dispose()
    assert await second == ["mem_first"]  # the first's, committed
    found = await db.read(lambda c: Memories(c).with_text("t1", "alice", vegetarian))
    assert found == ["mem_first"]
