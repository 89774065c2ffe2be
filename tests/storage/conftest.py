"""A migrated database of each kind (SQLite and PostgreSQL), fresh for every test.

The migrations run once per session and kind, into a template that each test's database is
copied from (a file copy, or `CREATE DATABASE ... TEMPLATE`): the same schema as migrating
every database, in a fraction of the time. Migrating empty databases has tests of its own.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from storage import migrate
from storage.database import Database
from tests.postgres import PostgresServer, fresh_database

# The session fixture holding each kind's template, built on first use.
TEMPLATES = {"sqlite": "sqlite_template", "postgresql": "postgres_template"}


def upgrade_in_thread(url: str) -> None:
    # migrate.upgrade runs an event loop of its own: keep it off the caller's thread.
    with ThreadPoolExecutor(1) as pool:
        pool.submit(migrate.upgrade, url).result()


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("schema") / "template.db"
    upgrade_in_thread(f"sqlite+aiosqlite:///{path}")
    return str(path)


@pytest.fixture(scope="session")
def postgres_template(postgres_server: PostgresServer) -> str:
    name = postgres_server.create_database()
    upgrade_in_thread(postgres_server.url(name))
    return name


@pytest.fixture
async def db(
    database_kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[Database]:
    """A new database of each kind, migrated, and open (its URL is `db.url`)."""
    template = request.getfixturevalue(TEMPLATES[database_kind])
    with fresh_database(database_kind, request, tmp_path, template) as url:
        database = Database(url)
        try:
            yield database
        finally:
            await database.dispose()
