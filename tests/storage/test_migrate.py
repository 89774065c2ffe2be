"""Migrating at start-up: a database that is not there yet is waited for, anything else fails
at once, and either way one line says why, without the URL's password."""

from __future__ import annotations

import asyncio
import socket
import threading

import asyncpg
import pytest
from alembic.script import ScriptDirectory

from storage import migrate
from storage.errors import StorageUnavailable
from tests.polling import eventually
from tests.postgres import PostgresServer, free_port, lock_waits


def test_a_database_that_cannot_be_reached_is_tried_until_the_wait_ends() -> None:
    url = f"postgresql+asyncpg://memproxy:hunter2@127.0.0.1:{free_port()}/m"
    waits: list[tuple[int, float, str]] = []
    with pytest.raises(StorageUnavailable) as info:
        migrate.upgrade(url, wait_seconds=1.0, on_wait=lambda *wait: waits.append(wait))
    assert [attempt for attempt, _, _ in waits] == list(range(1, len(waits) + 1))
    assert waits[0][1] == migrate.FIRST_PAUSE
    assert all("Connect call failed" in reason for _, _, reason in waits)
    message = str(info.value)
    assert message.startswith(f"postgresql+asyncpg://memproxy:***@127.0.0.1:{url.split(':')[3]}")
    assert f"(tried {len(waits) + 1} times)" in message
    assert "hunter2" not in message and "\n" not in message


def test_without_a_wait_the_first_failure_is_final() -> None:
    url = f"postgresql+asyncpg://memproxy@127.0.0.1:{free_port()}/m"
    waits: list[tuple[int, float, str]] = []
    with pytest.raises(StorageUnavailable, match="Connect call failed"):
        migrate.upgrade(url, on_wait=lambda *wait: waits.append(wait))
    assert waits == []


def test_a_database_that_refuses_is_not_waited_for(postgres_server: PostgresServer) -> None:
    url = postgres_server.url("no_such_database")
    waits: list[tuple[int, float, str]] = []
    with pytest.raises(StorageUnavailable, match='database "no_such_database" does not exist'):
        migrate.upgrade(url, wait_seconds=60, on_wait=lambda *wait: waits.append(wait))
    assert waits == []


def test_a_sqlite_file_that_cannot_be_opened_is_one_line() -> None:
    url = "sqlite+aiosqlite:///no/such/directory/m.db"
    with pytest.raises(StorageUnavailable) as info:
        migrate.upgrade(url, wait_seconds=60)
    assert str(info.value) == f"{url}: unable to open database file"


def test_a_database_that_accepts_but_never_answers_is_given_up_on_when_the_wait_ends() -> None:
    """A host that takes the connection and says nothing (a server hung, a proxy in front of
    none): each try is cut at what is left of the wait, not the driver's own 60 s."""
    silent = socket.create_server(("127.0.0.1", 0))  # the kernel accepts; nobody answers
    url = f"postgresql+asyncpg://memproxy@127.0.0.1:{silent.getsockname()[1]}/m"
    outcome: list[BaseException] = []

    def start() -> None:
        try:
            migrate.upgrade(url, wait_seconds=1.0)
        except BaseException as exc:  # (what the test checks)
            outcome.append(exc)

    trying = threading.Thread(target=start, daemon=True)
    try:
        trying.start()
        trying.join(timeout=30)  # a hang guard: the driver's own timeout is 60 s
        assert not trying.is_alive(), "still waiting for the first answer"
    finally:
        silent.close()
    assert len(outcome) == 1 and isinstance(outcome[0], StorageUnavailable)
    assert str(outcome[0]) == f"{url}: no answer within 1 s"


async def busy_messages(url: str) -> asyncpg.Connection:
    """A transaction that wrote to `messages` and has not ended: it holds the lock that a
    trigger's creation (migration 0018) waits for."""
    conn = await asyncpg.connect(url.replace("+asyncpg", "", 1))
    await conn.execute("BEGIN")
    await conn.execute("UPDATE messages SET status = status")
    return conn


async def test_a_migration_waiting_for_a_table_in_use_gives_up_and_tries_again(
    postgres_server: PostgresServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(migrate, "LOCK_TIMEOUT_SECONDS", 0.2)
    monkeypatch.setattr(migrate, "FIRST_PAUSE", 0.05)
    url = postgres_server.url(postgres_server.create_database())
    await asyncio.to_thread(migrate.upgrade, url, "0017")
    holder = await busy_messages(url)
    waits: list[tuple[int, float, str]] = []
    migrating = asyncio.create_task(
        asyncio.to_thread(migrate.upgrade, url, on_busy=lambda *wait: waits.append(wait))
    )
    try:
        await eventually(lambda: lock_waits(url), "the migration waiting for the table")
        # A writer queues behind the migration's wait for the table, and goes ahead when the
        # migration gives up, though the long transaction still holds the table (without a
        # lock timeout it would wait for that transaction to end).
        writer = await asyncpg.connect(url.replace("+asyncpg", "", 1))
        try:
            await writer.execute("SET statement_timeout = 30000")  # (a hang guard)
            await writer.execute("UPDATE messages SET status = status")
        finally:
            await writer.close()
    finally:
        await holder.execute("COMMIT")
        await holder.close()
    await migrating
    assert waits and [attempt for attempt, _, _ in waits] == list(range(1, len(waits) + 1))
    assert all("lock timeout" in reason for _, _, reason in waits)
    head = ScriptDirectory.from_config(migrate.alembic_config(url)).get_current_head()
    assert await revision(url) == head


async def test_a_migration_that_never_gets_the_table_leaves_the_schema_as_it_was(
    postgres_server: PostgresServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(migrate, "LOCK_TIMEOUT_SECONDS", 0.1)
    monkeypatch.setattr(migrate, "LOCK_ATTEMPTS", 3)
    monkeypatch.setattr(migrate, "FIRST_PAUSE", 0.01)
    url = postgres_server.url(postgres_server.create_database())
    await asyncio.to_thread(migrate.upgrade, url, "0017")
    holder = await busy_messages(url)
    try:
        with pytest.raises(StorageUnavailable) as info:
            await asyncio.to_thread(migrate.upgrade, url)
    finally:
        await holder.execute("ROLLBACK")
        await holder.close()
    assert str(info.value).endswith(
        "canceling statement due to lock timeout (tried 3 times, each waiting 0.1 s): a "
        "transaction holds a table the migration changes (see pg_stat_activity)"
    )
    assert await revision(url) == "0017"
    conn = await asyncpg.connect(url.replace("+asyncpg", "", 1))
    try:  # (nothing of 0018 is left half-made)
        assert await conn.fetchval("SELECT to_regclass('message_words')") is None
    finally:
        await conn.close()


async def revision(url: str) -> str:
    conn = await asyncpg.connect(url.replace("+asyncpg", "", 1))
    try:
        return str(await conn.fetchval("SELECT version_num FROM alembic_version"))
    finally:
        await conn.close()
