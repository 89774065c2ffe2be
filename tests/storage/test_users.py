"""The tenant's users as their stored data shows them, on SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Connection

from storage.database import Database
from storage.repositories.conversations import Conversations
from storage.repositories.memories import Memories
from storage.repositories.users import Users

T0 = datetime(2026, 1, 1, tzinfo=UTC)


async def test_users_are_whoever_has_a_conversation_or_a_memory_in_the_tenant(
    db: Database,
) -> None:
    def create(conn: Connection) -> None:
        conversations, memories = Conversations(conn), Memories(conn)
        conversations.create("t1", "alice", "c1", now=T0)
        conversations.create("t1", "alice", "c2", now=T0 + timedelta(hours=2))
        conversations.create("t1", "bob_1", "c3", now=T0)
        conversations.create("t2", "carol", "c4", now=T0 + timedelta(days=9))
        memories.create("t1", "alice", "mem_1", "Likes tea", now=T0 + timedelta(hours=1))
        memories.create("t1", "carol", "mem_2", "Lives in Lisbon", now=T0 + timedelta(hours=3))
        memories.create("t1", "bo%b", "mem_3", "A percent in the id", now=T0)

    await db.write(create)

    async def find(**options: Any) -> list[tuple[str, int, int, datetime]]:
        found = await db.read(lambda c: Users(c).find("t1", **options))
        return [(u.user_id, u.conversations, u.memories, u.last_active_at) for u in found]

    assert await find(limit=10) == [
        ("alice", 2, 1, T0 + timedelta(hours=2)),
        ("bo%b", 0, 1, T0),
        ("bob_1", 1, 0, T0),
        ("carol", 0, 1, T0 + timedelta(hours=3)),  # (not t2's carol's conversation)
    ]
    # Ids holding the text, in any case; LIKE's wildcards are taken as they are.
    assert [u[0] for u in await find(limit=10, contains="BO")] == ["bo%b", "bob_1"]
    assert [u[0] for u in await find(limit=10, contains="%")] == ["bo%b"]
    assert [u[0] for u in await find(limit=10, contains="_")] == ["bob_1"]
    # Pages in order of the ids, and one user only for a key bound to them.
    assert [u[0] for u in await find(limit=2, after="bo%b")] == ["bob_1", "carol"]
    assert [u[0] for u in await find(limit=10, only="carol")] == ["carol"]
    assert await db.read(lambda c: Users(c).find("t3", limit=10)) == []
