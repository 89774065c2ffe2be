"""Engine set-up and transactions, for SQLite (embedded default) and PostgreSQL (replicas).

SQLite: WAL, foreign keys, a busy timeout, and one writer at a time. Writers queue on an
asyncio lock and then take the database with `BEGIN IMMEDIATE`, so a transaction never has to
upgrade its lock half-way (the source of `database is locked`), and waiting never blocks the
event loop (aiosqlite runs each statement in its own thread).

PostgreSQL: asyncpg with a connection pool; writers lock the rows they change.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from sqlalchemy import event, text
from sqlalchemy.engine.interfaces import DBAPIConnection
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.pool import ConnectionPoolEntry

from storage.errors import StorageUnavailable

SQLITE_PRAGMAS = (
    "PRAGMA journal_mode=WAL",
    "PRAGMA synchronous=NORMAL",  # durable across a process crash; WAL keeps it consistent
    "PRAGMA foreign_keys=ON",
    "PRAGMA busy_timeout=10000",
)


class Database:
    """The engine and the two ways to use it: `read()` and `write()` transactions."""

    def __init__(self, url: str, *, echo: bool = False, pool_size: int = 10) -> None:
        self.url = url
        self.is_sqlite = url.startswith("sqlite")
        options: dict[str, Any] = {"echo": echo, "pool_pre_ping": not self.is_sqlite}
        if not self.is_sqlite:
            options.update(pool_size=pool_size, max_overflow=pool_size * 2)
        self.engine: AsyncEngine = create_async_engine(url, **options)
        self._write_lock = asyncio.Lock() if self.is_sqlite else None
        if self.is_sqlite:
            event.listen(self.engine.sync_engine, "connect", _sqlite_on_connect)

    @asynccontextmanager
    async def read(self) -> AsyncIterator[AsyncConnection]:
        """A read-only unit of work."""
        try:
            async with self.engine.connect() as conn:
                yield conn
        except (DBAPIError, OSError) as exc:
            raise StorageUnavailable(str(exc)) from exc

    @asynccontextmanager
    async def write(self) -> AsyncIterator[AsyncConnection]:
        """One transaction that commits when the block ends and rolls back if it raises."""
        if self._write_lock is None:
            try:
                async with self.engine.begin() as conn:
                    yield conn
            except (DBAPIError, OSError) as exc:
                raise StorageUnavailable(str(exc)) from exc
            return
        async with self._write_lock:
            try:
                async with self.engine.connect() as conn:
                    raw = await conn.execution_options(isolation_level="AUTOCOMMIT")
                    await raw.exec_driver_sql("BEGIN IMMEDIATE")
                    try:
                        yield raw
                    except BaseException:
                        await raw.exec_driver_sql("ROLLBACK")
                        raise
                    await raw.exec_driver_sql("COMMIT")
            except (DBAPIError, OSError) as exc:
                raise StorageUnavailable(str(exc)) from exc

    async def ping(self) -> None:
        async with self.read() as conn:
            await conn.execute(text("SELECT 1"))

    async def dispose(self) -> None:
        await self.engine.dispose()


def _sqlite_on_connect(dbapi_connection: DBAPIConnection, _: ConnectionPoolEntry) -> None:
    cursor = dbapi_connection.cursor()
    for pragma in SQLITE_PRAGMAS:
        cursor.execute(pragma)
    cursor.close()
