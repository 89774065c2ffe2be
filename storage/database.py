"""Engine set-up and transactions, for SQLite (embedded default) and PostgreSQL (replicas).

A unit of work is a plain function of a SQLAlchemy `Connection`; `write()` runs it in one
transaction that commits when it returns and rolls back if it raises, `read()` in one
read-only snapshot. Repositories are synchronous Core code, and each backend gets the cheapest
way to run them without blocking the event loop:

- SQLite: the whole unit of work runs in a worker thread, one hand-off per transaction (a
  per-statement async driver costs several thread hand-offs per statement). Writes go through
  a single writer thread and take the file with `BEGIN IMMEDIATE`, so a transaction never has
  to upgrade its lock half-way (the cause of `database is locked`); reads run in a small pool
  beside it, which WAL allows. Each of these threads keeps its own connection for its life
  (`_ThreadConnections`), and begins and ends transactions on the driver's connection: a
  pool checkout and SQLAlchemy's statement machinery for BEGIN and COMMIT cost a turn's
  writes a measurable part of their time.
- PostgreSQL: asyncpg, natively async; the unit of work runs on the event loop through
  SQLAlchemy's `run_sync`, whose statements await the driver rather than block.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any, Protocol, TypeVar

from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy.engine.interfaces import DBAPIConnection
from sqlalchemy.exc import (
    DBAPIError,
    IntegrityError,
    InterfaceError,
    InvalidatePoolError,
    OperationalError,
    SQLAlchemyError,
)
from sqlalchemy.ext.asyncio import AsyncConnection, create_async_engine
from sqlalchemy.pool import ConnectionPoolEntry

from storage.errors import ConflictError, StorageError, StorageUnavailable
from storage.fair_slots import FairSlots

T = TypeVar("T")
Work = Callable[[Connection], T]


class WriteAbandoned(StorageError):
    """A write whose caller stopped waiting before it began: rolled back, never run. Nobody
    is left to catch it (Database.write)."""


SQLITE_PRAGMAS = (
    "PRAGMA busy_timeout=10000",  # another process (e.g. `memproxy migrate`) holding the file
    "PRAGMA synchronous=NORMAL",  # durable across a process crash; WAL keeps it consistent
    "PRAGMA foreign_keys=ON",
    # What is deleted is overwritten, not left in the file's free space (an erased user's
    # words, say); no measurable cost on writes (bench in docs/design/storage.md).
    "PRAGMA secure_delete=ON",
)
SQLITE_READERS = 4
WAL_ATTEMPTS = 20
# PostgreSQL: a pooled connection idle longer than this is checked before use. The check is
# three round trips (asyncpg's ping: BEGIN, an empty statement, ROLLBACK), so checking on every
# use, as `pool_pre_ping` does, cost a turn with memory on 1.6-1.9 ms (its four transactions).
# A connection used this recently is alive unless the server restarted since: then the units
# of work holding or taking such a connection before the first failure fail, as in any outage
# (docs/performance/latency-notes.md: pooled connections), and the pool replaces every older
# connection.
IDLE_CHECK_SECONDS = 2.0


class Database:
    """The engine and the two ways to use it: `read(work)` and `write(work)`."""

    def __init__(
        self, url: str, *, echo: bool = False, pool_size: int = 10, max_overflow: int = 20
    ) -> None:
        self.url = url
        self.is_sqlite = url.startswith("sqlite")
        if self.is_sqlite:
            # The configured URL names the async driver; the threads use the standard one.
            self._sync = create_engine(
                url.replace("+aiosqlite", "", 1),
                echo=echo,
                isolation_level="AUTOCOMMIT",  # transactions are begun and ended below
                # (the worker threads keep one each; an export's snapshot takes another)
                pool_size=SQLITE_READERS + 3,
                pool_reset_on_return=None,
                connect_args={"check_same_thread": False},
            )
            event.listen(self._sync, "connect", _sqlite_on_connect)
            self._connections = _ThreadConnections(self._sync)
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="sqlite-writer")
            self.write_slots = FairSlots(1)
            self._readers = ThreadPoolExecutor(SQLITE_READERS, thread_name_prefix="sqlite-reader")
        else:
            self._async = create_async_engine(
                url, echo=echo, pool_size=pool_size, max_overflow=max_overflow
            )
            self.write_slots = FairSlots(pool_size)
            event.listen(self._async.sync_engine, "checkin", _postgres_checked_in)
            event.listen(self._async.sync_engine, "checkout", _postgres_checked_out)

    async def write(self, work: Work[T], *, tenant: str | None = None, large: bool = False) -> T:
        """Run `work` in one transaction: committed when it returns, rolled back if it raises.
        Writes wait for a slot in `tenant`'s lane (storage/fair_slots.py): one tenant's many
        writes do not hold up the others'. A `large` write first gives way to the small
        writes on their way (FairSlots.expecting).

        A caller that stops waiting (a storage timeout, a cancelled request) abandons its
        write if the write has not begun yet: on SQLite, one still queued for the writer
        thread or waiting for another process's lock on the file is dropped when its turn
        comes, so a turn answered unstored (or refused) is not stored behind the caller's back.
        A write already running may still land."""
        if self.is_sqlite:
            await self.write_slots.acquire(tenant, large=large)
            loop = asyncio.get_running_loop()
            abandoned = threading.Event()
            try:
                unit = partial(self._sqlite_unit, "BEGIN IMMEDIATE", work, abandoned)
                future = loop.run_in_executor(self._writer, unit)
            except BaseException:
                self.write_slots.release()
                raise
            # The slot is the writer thread's: held until the unit ends there, even when the
            # caller stops waiting (a timeout), so the next write is not queued behind it.
            future.add_done_callback(self._unit_ended)
            try:
                return await asyncio.shield(future)
            except asyncio.CancelledError:
                abandoned.set()
                raise
        async with self.write_slots.slot(tenant, large=large):
            with _translated():
                async with self._async.begin() as conn:
                    return await conn.run_sync(work)

    def _unit_ended(self, future: asyncio.Future[Any]) -> None:
        self.write_slots.release()
        if not future.cancelled():
            future.exception()  # (retrieved: a caller that stopped waiting never will)

    async def read(self, work: Work[T]) -> T:
        """Run `work` against one consistent snapshot; it must not write."""
        if self.is_sqlite:
            return await self._in_thread(self._readers, "BEGIN", work)
        with _translated():
            async with self._async.connect() as conn:
                snapshot = await conn.execution_options(isolation_level="REPEATABLE READ")
                async with snapshot.begin():
                    return await snapshot.run_sync(work)

    @contextlib.asynccontextmanager
    async def snapshot(self) -> AsyncIterator[Snapshot]:
        """One consistent read snapshot for several units of work, one after another. It holds
        a connection (and, on PostgreSQL, a transaction) until the block is left."""
        if self.is_sqlite:
            held = _SqliteSnapshot(self._sync, self._readers)
            try:
                yield held
            finally:
                held.close()
            return
        with _translated():
            async with self._async.connect() as conn:  # (closing it rolls back, shielded)
                snapshot = await conn.execution_options(isolation_level="REPEATABLE READ")
                await snapshot.begin()
                yield _PostgresSnapshot(snapshot)

    async def checkpoint(self) -> bool:
        """SQLite: copy the write-ahead log into the database and empty it, so it holds no
        earlier version of what was just deleted; False when a reader still needs part of it,
        or the file is busy (the log is then emptied as writing goes on). PostgreSQL: nothing
        to do, True."""
        if not self.is_sqlite:
            return True
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._writer, self._sqlite_checkpoint)
        except StorageError:
            return False

    def _sqlite_checkpoint(self) -> bool:
        with _translated():
            conn = self._connections.get()  # (the writer's)
            busy, _, _ = conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)").one()
            return not busy

    async def ping(self) -> None:
        await self.read(lambda conn: conn.execute(text("SELECT 1")))

    async def dispose(self) -> None:
        if self.is_sqlite:
            await asyncio.to_thread(self._writer.shutdown)
            await asyncio.to_thread(self._readers.shutdown)
            self._connections.close()
            self._sync.dispose()
        else:
            await self._async.dispose()

    async def _in_thread(self, pool: ThreadPoolExecutor, begin: str, work: Work[T]) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(pool, partial(self._sqlite_unit, begin, work))

    def _sqlite_unit(
        self, begin: str, work: Work[T], abandoned: threading.Event | None = None
    ) -> T:
        with _translated():
            conn = self._connections.get()
            driver = conn.connection.driver_connection
            assert isinstance(driver, sqlite3.Connection)
            try:
                driver.execute(begin)
            except sqlite3.Error as exc:
                raise _driver_error(exc) from exc
            try:
                if abandoned is not None and abandoned.is_set():
                    raise WriteAbandoned("the caller stopped waiting before the write began")
                result = work(conn)
            except BaseException:
                self._connections.roll_back(conn, driver)
                raise
            try:
                driver.execute("COMMIT")
            except sqlite3.Error as exc:
                self._connections.roll_back(conn, driver)
                raise _driver_error(exc) from exc
            return result


class Snapshot(Protocol):
    """A read snapshot held open (`Database.snapshot()`): `read(work)` runs `work` in it.
    Units of work run one at a time; none may write."""

    async def read(self, work: Work[T]) -> T: ...


class _PostgresSnapshot:
    def __init__(self, conn: AsyncConnection) -> None:
        self._conn = conn

    async def read(self, work: Work[T]) -> T:
        with _translated():
            return await self._conn.run_sync(work)


class _SqliteSnapshot:
    """A connection in a read transaction, used by one reader thread at a time. It is opened
    by the first unit of work and ended without awaiting anything, so that a caller cancelled
    half-way (an export whose request is cancelled while it reads) still ends it: after the
    unit of work running then."""

    def __init__(self, engine: Engine, readers: ThreadPoolExecutor) -> None:
        self._engine, self._readers = engine, readers
        self._conn: Connection | None = None
        self._last: Future[Any] | None = None

    async def read(self, work: Work[T]) -> T:
        self._last = self._readers.submit(self._unit, work)
        return await asyncio.wrap_future(self._last)

    def _unit(self, work: Work[T]) -> T:
        with _translated():
            if self._conn is None:
                self._conn = self._engine.connect()
                self._conn.exec_driver_sql("BEGIN")
            return work(self._conn)

    def close(self) -> None:
        if self._last is None:
            return
        self._last.add_done_callback(lambda _: self._end_soon())

    def _end_soon(self) -> None:
        try:
            self._readers.submit(self._end)
        except RuntimeError:  # the pool is shut down (the app stopping): end it here
            self._end()

    def _end(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):  # (a connection the database dropped)
                self._conn.exec_driver_sql("ROLLBACK")
            self._conn.close()


class _ThreadConnections:
    """SQLite: one connection per worker thread, kept for the thread's life (the threads are
    the writer and the readers; only its own thread uses a connection, so none is shared). A
    connection a failure left unusable is closed and the thread's next unit of work opens
    another."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._local = threading.local()
        self._open: set[Connection] = set()
        self._lock = threading.Lock()

    def get(self) -> Connection:
        conn: Connection | None = getattr(self._local, "conn", None)
        if conn is not None and (conn.closed or conn.invalidated):
            self._discard(conn)  # (SQLAlchemy let it go: a lost connection, say)
            conn = None
        if conn is None:
            conn = self._engine.connect()
            self._local.conn = conn
            with self._lock:
                self._open.add(conn)
        return conn

    def roll_back(self, conn: Connection, driver: sqlite3.Connection) -> None:
        """End a failed unit of work's transaction; a connection that cannot is let go."""
        try:
            if driver.in_transaction:
                driver.execute("ROLLBACK")
        except sqlite3.Error:
            self._discard(conn)

    def _discard(self, conn: Connection) -> None:
        self._local.conn = None
        with self._lock:
            self._open.discard(conn)
        with contextlib.suppress(Exception):
            conn.invalidate()  # (the pool opens a new one in its place)

    def close(self) -> None:
        """Close them all (the threads have stopped)."""
        with self._lock:
            held, self._open = self._open, set()
        for conn in held:
            with contextlib.suppress(Exception):
                conn.close()


def _driver_error(exc: sqlite3.Error) -> StorageError:
    """A driver error met outside SQLAlchemy (beginning or ending a transaction), as the
    storage error `_translated` makes of the same error met inside it."""
    if isinstance(exc, sqlite3.IntegrityError):
        return ConflictError(str(exc))
    if isinstance(exc, sqlite3.OperationalError | sqlite3.InterfaceError):
        return StorageUnavailable(str(exc))
    return StorageError(str(exc))


class _translated:
    """Driver errors become storage errors: what callers may catch (storage/errors.py)."""

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any
    ) -> None:
        if exc is None or isinstance(exc, StorageError):
            return
        if isinstance(exc, IntegrityError):
            raise ConflictError(str(exc.orig)) from exc
        if isinstance(exc, OperationalError | InterfaceError | OSError):
            raise StorageUnavailable(str(exc)) from exc
        if isinstance(exc, DBAPIError):
            raise StorageError(str(exc.orig)) from exc
        if isinstance(exc, SQLAlchemyError):  # e.g. the pool timing out under load
            raise StorageUnavailable(str(exc)) from exc


def _postgres_checked_in(_: DBAPIConnection | None, record: ConnectionPoolEntry) -> None:
    record.info["idle_since"] = time.monotonic()


def _postgres_checked_out(
    dbapi_connection: DBAPIConnection, record: ConnectionPoolEntry, _: object
) -> None:
    """Check a connection idle longer than IDLE_CHECK_SECONDS. A dead one means the server
    went away since: the pool replaces it and every other connection it holds (some were used
    too recently to be checked), then tries again with a new one."""
    idle_since = record.info.get("idle_since")
    if idle_since is None or time.monotonic() - idle_since <= IDLE_CHECK_SECONDS:
        return  # (new, or used a moment ago)
    try:
        dbapi_connection.ping()
    except Exception as exc:
        raise InvalidatePoolError(f"a pooled connection was closed: {exc}") from exc


def _sqlite_on_connect(dbapi_connection: DBAPIConnection, _: ConnectionPoolEntry) -> None:
    cursor = dbapi_connection.cursor()
    for pragma in SQLITE_PRAGMAS:
        cursor.execute(pragma)
    # WAL is a property of the file, set once: asking again on every new connection takes a
    # lock that a busy writer elsewhere may hold, and SQLite may refuse at once ("database is
    # locked") rather than wait for it.
    for attempt in range(WAL_ATTEMPTS):
        cursor.execute("PRAGMA journal_mode")
        mode = cursor.fetchone()
        if mode and str(mode[0]).lower() == "wal":
            break
        try:
            # Switching a file to WAL needs it to itself for a moment; SQLite answers "database
            # is locked" at once, without its busy wait, while another connection has it.
            cursor.execute("PRAGMA journal_mode=WAL")
            break
        except sqlite3.OperationalError:
            if attempt == WAL_ATTEMPTS - 1:
                raise
            time.sleep(0.02 * (attempt + 1))  # a worker thread, opening a connection
    cursor.close()
