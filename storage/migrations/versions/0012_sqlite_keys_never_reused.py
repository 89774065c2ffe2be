"""SQLite: keys are never reused (AUTOINCREMENT), as PostgreSQL's sequences never reuse them

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-24 08:30:00.000000

Without AUTOINCREMENT, SQLite gives a new row the largest key in use plus one, so deleting the
newest conversation (or message, memory, ...) frees its key for the next one made. What still
held the old key (a turn waiting for its reply, a queued job, a spilled exchange, an exchange
record's list of recalled messages) then named a row that may be another user's. Each table
with a surrogate key is rebuilt with AUTOINCREMENT (alembic's batch "move and copy"; keys and
rows are kept as they are), and its triggers (the full-text index's) are made again, as the
rebuild drops them. Foreign keys are off while migrations run (storage/migrations/env.py's
engine does not turn them on), so dropping the old tables cascades nothing. PostgreSQL is
left as it is. A downgrade rebuilds the tables without AUTOINCREMENT.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLES = (
    "conversations",
    "messages",
    "memories",
    "jobs",
    "message_vectors",
    "attachments",
    "attachment_chunks",
    "summaries",
)


def _rebuild(autoincrement: bool) -> None:
    conn = op.get_bind()
    if conn.dialect.name != "sqlite":
        return
    if conn.execute(sa.text("PRAGMA foreign_keys")).scalar():
        # DROP TABLE would delete the rows of every table that cascades from it.
        raise RuntimeError("migration 0012 must run with SQLite's foreign keys off")
    for table in TABLES:
        triggers = (
            conn.execute(
                sa.text("SELECT sql FROM sqlite_master WHERE type = 'trigger' AND tbl_name = :t"),
                {"t": table},
            )
            .scalars()
            .all()
        )
        with op.batch_alter_table(
            table, recreate="always", table_kwargs={"sqlite_autoincrement": autoincrement}
        ):
            pass
        for sql in triggers:
            conn.execute(sa.text(sql))


def upgrade() -> None:
    _rebuild(True)


def downgrade() -> None:
    _rebuild(False)
