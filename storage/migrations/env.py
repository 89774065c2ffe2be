"""Alembic environment: runs the migrations on SQLite (standard driver) or PostgreSQL (asyncpg)."""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

from storage.migrate import include_object
from storage.models import Base

# Any fixed number: replicas starting together take turns on it (PostgreSQL only).
MIGRATION_LOCK_ID = 727_274_001


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        include_object=include_object,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    if connection.dialect.name == "postgresql":
        connection.execute(text(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK_ID})"))
        # Each lock on a table, once it is this replica's turn, waited for so long at most
        # (storage.migrate.upgrade tries again).
        wait = context.config.attributes.get("lock_timeout")
        if wait:
            connection.execute(text(f"SET LOCAL lock_timeout = {max(1, round(wait * 1000))}"))
    with context.begin_transaction():
        context.run_migrations()


def _run_sqlite(url: str) -> None:
    """SQLite with the standard driver, as `Database` runs it (aiosqlite's thread outlives a
    failed connection and calls into the closed event loop)."""
    engine = create_engine(url.replace("+aiosqlite", "", 1))
    try:
        with engine.connect() as conn:
            _run(conn)
            conn.commit()
    finally:
        engine.dispose()


async def _run_async(url: str, connect_timeout: float | None) -> None:
    options = {} if connect_timeout is None else {"connect_args": {"timeout": connect_timeout}}
    engine = create_async_engine(url, **options)
    try:
        async with engine.connect() as conn:
            await conn.run_sync(_run)
            await conn.commit()
    finally:
        await engine.dispose()


if context.is_offline_mode():
    context.configure(
        url=context.config.get_main_option("sqlalchemy.url"), target_metadata=Base.metadata
    )
    with context.begin_transaction():
        context.run_migrations()
else:
    _url = context.config.get_main_option("sqlalchemy.url")
    assert _url, "sqlalchemy.url is not set"
    if _url.startswith("sqlite"):
        _run_sqlite(_url)
    else:
        asyncio.run(_run_async(_url, context.config.attributes.get("connect_timeout")))
