"""A migrated database of each kind (SQLite and PostgreSQL), fresh for every test, and open
(copied from the session's templates: tests/postgres.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from storage.database import Database
from tests.postgres import TEMPLATES, fresh_database


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
