"""The memories repository's reads for recall, on SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy import Connection

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
