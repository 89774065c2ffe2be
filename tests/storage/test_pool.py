"""PostgreSQL's pooled connections across a server restart: a connection idle longer than
IDLE_CHECK_SECONDS is checked before use, and a dead one renews the whole pool; one used more
recently is not checked (that check cost every transaction three round trips), so after a
restart within that time the unit of work that meets it fails, and the pool then replaces
every connection it held."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from sqlalchemy import Connection, text

from storage import database as database_module
from storage.database import Database
from storage.errors import StorageUnavailable
from tests.postgres import PostgresServer


def answer(conn: Connection) -> int:
    return int(conn.execute(text("SELECT 42")).scalar_one())


@pytest.fixture
async def pooled(own_postgres: PostgresServer) -> AsyncIterator[Database]:
    """A Database on the test's own server (which the test restarts)."""
    db = Database(own_postgres.url("postgres"))
    try:
        yield db
    finally:
        await db.dispose()


async def restarted(server: PostgresServer) -> None:
    await asyncio.to_thread(server.pause)
    await asyncio.to_thread(server.resume)


async def test_an_idle_connection_is_checked_and_replaced_after_a_restart(
    own_postgres: PostgresServer, pooled: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(database_module, "IDLE_CHECK_SECONDS", 0.0)  # every one is "idle"
    assert await pooled.read(answer) == 42 and await pooled.write(answer) == 42
    await restarted(own_postgres)
    assert await pooled.read(answer) == 42  # the dead connection was found and replaced
    assert await pooled.write(answer) == 42


async def test_a_connection_used_a_moment_ago_is_not_checked_and_one_failure_renews_the_pool(
    own_postgres: PostgresServer, pooled: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(database_module, "IDLE_CHECK_SECONDS", 3600.0)
    # Two connections in the pool, both used a moment ago.
    async with pooled.snapshot() as first, pooled.snapshot() as second:
        assert await first.read(answer) == 42 and await second.read(answer) == 42
    await restarted(own_postgres)
    with pytest.raises(StorageUnavailable):
        await pooled.read(answer)  # not checked: the statement meets the closed connection
    # That failure replaced the pool's other connection too.
    assert await pooled.read(answer) == 42
    assert await pooled.write(answer) == 42


async def test_a_dead_idle_connection_renews_the_recently_used_ones_too(
    own_postgres: PostgresServer, pooled: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(database_module, "IDLE_CHECK_SECONDS", 5.0)  # longer than a restart
    async with pooled.snapshot() as first, pooled.snapshot() as second:
        assert await first.read(answer) == 42 and await second.read(answer) == 42
    await asyncio.sleep(5.2)
    assert await pooled.read(answer) == 42  # one of the two (the pool hands out the oldest)
    await restarted(own_postgres)
    # The other one is idle (checked: dead) and comes first; the one just used is not
    # checked, and would meet the closed connection had finding the first dead not
    # replaced it too.
    assert await pooled.read(answer) == 42
    assert await pooled.read(answer) == 42
