"""SQLite's units of work on their worker threads' own connections: a failure, wherever it
happens (beginning, working, committing), ends its transaction and leaves the database usable
for the next unit of work, and the errors are the storage errors callers catch."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy import Connection, text

from storage import database as database_module
from storage.database import Database
from storage.errors import ConflictError, StorageError, StorageUnavailable


@pytest.fixture
async def db(tmp_path: Path) -> AsyncIterator[Database]:
    database = Database(f"sqlite+aiosqlite:///{tmp_path / 'units.db'}")
    await database.write(
        lambda conn: conn.exec_driver_sql("CREATE TABLE parents (pk INTEGER PRIMARY KEY)")
    )
    # Checked when the transaction commits, not when the row goes in.
    await database.write(
        lambda conn: conn.exec_driver_sql(
            "CREATE TABLE children (pk INTEGER PRIMARY KEY, parent INTEGER REFERENCES parents(pk)"
            " DEFERRABLE INITIALLY DEFERRED)"
        )
    )
    try:
        yield database
    finally:
        await database.dispose()


def rows(conn: Connection) -> list[tuple[str, int]]:
    found = conn.execute(
        text("SELECT 'parent', pk FROM parents UNION ALL SELECT 'child', pk FROM children")
    )
    return sorted((str(kind), int(pk)) for kind, pk in found)


def add_parent(pk: int) -> database_module.Work[None]:
    def work(conn: Connection) -> None:
        conn.execute(text("INSERT INTO parents (pk) VALUES (:pk)"), {"pk": pk})

    return work


async def test_a_commit_that_fails_is_rolled_back_and_the_next_write_goes_in(db: Database) -> None:
    def orphan(conn: Connection) -> None:
        conn.execute(text("INSERT INTO parents (pk) VALUES (1)"))
        conn.execute(text("INSERT INTO children (pk, parent) VALUES (1, 99)"))

    with pytest.raises(ConflictError, match="FOREIGN KEY"):
        await db.write(orphan)  # (the deferred check fails at COMMIT)
    await db.write(add_parent(2))  # not "cannot start a transaction within a transaction"
    assert await db.read(rows) == [("parent", 2)]  # nothing of the failed one


async def test_a_failed_unit_of_work_leaves_nothing_and_the_connection_usable(
    db: Database,
) -> None:
    def half(conn: Connection) -> None:
        conn.execute(text("INSERT INTO parents (pk) VALUES (1)"))
        raise RuntimeError("a bug half-way")

    with pytest.raises(RuntimeError):
        await db.write(half)
    with pytest.raises(ConflictError):
        await db.write(lambda conn: [add_parent(3)(conn), add_parent(3)(conn)])
    await db.write(add_parent(2))
    assert await db.read(rows) == [("parent", 2)]


def broken(conn: Connection) -> None:
    """Close the connection under the unit of work (as one the driver lost would be)."""
    driver = conn.connection.driver_connection
    assert isinstance(driver, sqlite3.Connection)
    driver.close()


async def test_a_connection_that_breaks_is_replaced(db: Database) -> None:
    def breaks(conn: Connection) -> None:
        conn.execute(text("INSERT INTO parents (pk) VALUES (1)"))
        broken(conn)
        conn.execute(text("INSERT INTO parents (pk) VALUES (2)"))

    with pytest.raises(StorageError):
        await db.write(breaks)
    with pytest.raises(StorageError):
        await db.read(lambda conn: [broken(conn), rows(conn)])
    for pk in (3, 4):
        await db.write(add_parent(pk))  # a new connection, on the same writer thread
    for _ in range(2 * database_module.SQLITE_READERS):
        assert await db.read(rows) == [("parent", 3), ("parent", 4)]


async def test_a_file_another_process_holds_is_unavailable_not_a_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        database_module,
        "SQLITE_PRAGMAS",
        ("PRAGMA busy_timeout=0", *database_module.SQLITE_PRAGMAS[1:]),
    )
    path = tmp_path / "held.db"
    db = Database(f"sqlite+aiosqlite:///{path}")
    try:
        await db.write(lambda conn: conn.exec_driver_sql("CREATE TABLE t (a)"))
        other = sqlite3.connect(path, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")  # `memproxy migrate`, say, holding the write lock
        try:
            with pytest.raises(StorageUnavailable, match="locked"):
                await db.write(lambda conn: conn.exec_driver_sql("INSERT INTO t VALUES (1)"))
        finally:
            other.execute("ROLLBACK")
            other.close()
        await db.write(lambda conn: conn.exec_driver_sql("INSERT INTO t VALUES (2)"))
        assert await db.read(lambda c: c.exec_driver_sql("SELECT a FROM t").all()) == [(2,)]
    finally:
        await db.dispose()


async def test_a_write_its_caller_stopped_waiting_for_before_it_began_is_never_run(
    db: Database, tmp_path: Path
) -> None:
    """A storage timeout answers a turn unstored (or refuses it) while its write still waits
    for another process's lock; when the lock goes, that write is dropped, not run behind the
    caller's back. The writes queued after it, still awaited, go in."""
    other = sqlite3.connect(tmp_path / "units.db", isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(db.write(add_parent(1)), 0.2)
        awaited = asyncio.ensure_future(db.write(add_parent(2)))
        await asyncio.sleep(0.2)
        assert not awaited.done()  # (behind the lock too)
    finally:
        other.execute("ROLLBACK")
        other.close()
    await awaited
    assert await db.read(rows) == [("parent", 2)]
