"""Erasure records on both databases: a user is named by a hash, never by the id, and
migration 0011 converts the records 0010 kept with ids in clear."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from alembic import command
from sqlalchemy import Connection

from storage import migrate
from storage.database import Database
from storage.repositories.erasures import Erasures

T0 = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)
ERASURES_0010 = sa.table(
    "erasures",
    sa.column("tenant_id", sa.String),
    sa.column("user_id", sa.String),
    sa.column("erased_at", sa.DateTime(timezone=True)),
)


def stored(conn: Connection) -> tuple[list[str], list[tuple[Any, ...]]]:
    """The erasures table's columns and rows, as the database has them."""
    result = conn.execute(sa.text("SELECT * FROM erasures"))
    return list(result.keys()), [tuple(row) for row in result]


async def test_an_erasure_is_recorded_by_hash_and_found_by_id(db: Database) -> None:
    def erase(conn: Connection) -> None:
        Erasures(conn).record("t1", "alice@example.com", T0)
        Erasures(conn).record("t1", "alice@example.com", T0 + timedelta(hours=1))  # again

    await db.write(erase)

    def check(conn: Connection) -> tuple[list[str], list[tuple[Any, ...]]]:
        erasures = Erasures(conn)
        assert erasures.erased_since("t1", "alice@example.com", T0 + timedelta(hours=1))
        assert not erasures.erased_since("t1", "alice@example.com", T0 + timedelta(hours=2))
        assert not erasures.erased_since("t2", "alice@example.com", T0)  # another tenant's
        assert not erasures.erased_since("t1", "bob", T0)
        return stored(conn)

    columns, rows = await db.read(check)
    assert columns == ["tenant_id", "user_hash", "erased_at"]
    ((tenant, user_hash, _),) = rows
    assert tenant == "t1" and len(user_hash) == 64 and "alice" not in user_hash


async def run(url: str, work: Any) -> Any:
    """`work` in a write transaction of a database opened for it: the schema changes between
    steps, and PostgreSQL's cached statement plans would not survive that."""
    db = Database(url)
    try:
        return await db.write(work)
    finally:
        await db.dispose()


async def test_migration_0011_converts_the_erasures_kept_with_ids(database_url: str) -> None:
    await asyncio.to_thread(migrate.upgrade, database_url, "0010")
    kept = [
        {"tenant_id": "t1", "user_id": "alice", "erased_at": T0},
        {"tenant_id": "t2", "user_id": "alice", "erased_at": T0 + timedelta(days=1)},
        {"tenant_id": "t1", "user_id": "bob", "erased_at": T0},
    ]
    await run(database_url, lambda conn: conn.execute(ERASURES_0010.insert(), kept))
    await asyncio.to_thread(migrate.upgrade, database_url)

    def check(conn: Connection) -> tuple[list[str], list[tuple[Any, ...]]]:
        erasures = Erasures(conn)
        assert erasures.erased_since("t1", "alice", T0)
        assert not erasures.erased_since("t1", "alice", T0 + timedelta(seconds=1))
        assert erasures.erased_since("t2", "alice", T0 + timedelta(days=1))
        assert erasures.erased_since("t1", "bob", T0)
        assert not erasures.erased_since("t2", "bob", T0 - timedelta(days=1))
        return stored(conn)

    columns, rows = await run(database_url, check)
    assert columns == ["tenant_id", "user_hash", "erased_at"] and len(rows) == 3
    assert not [row for row in rows if "alice" in str(row) or "bob" in str(row)]

    # Down again: the ids cannot come back, so the 0010 table is empty; and up once more.
    await asyncio.to_thread(command.downgrade, migrate.alembic_config(database_url), "0010")
    assert await run(database_url, stored) == (["tenant_id", "user_id", "erased_at"], [])
    await asyncio.to_thread(migrate.upgrade, database_url)
    await run(database_url, lambda conn: Erasures(conn).record("t1", "carol", T0))
    assert await run(database_url, lambda conn: Erasures(conn).erased_since("t1", "carol", T0))
