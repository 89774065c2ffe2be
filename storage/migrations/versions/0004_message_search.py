"""full-text search over messages

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-22 03:30:00

SQLite: an FTS5 table over `messages.search_text` (external content, porter stemming), kept in
sync by triggers on insert, update and delete (conversation deletes cascade to messages, and
their triggers fire). PostgreSQL: a GIN index on the English tsvector of `search_text`; queries
use the same expression (storage/repositories/search.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from storage.repositories.search import searchable_text

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SQLITE = [
    "CREATE VIRTUAL TABLE messages_fts USING fts5(search_text, content='messages', "
    "content_rowid='pk', tokenize='porter unicode61 remove_diacritics 2')",
    "CREATE TRIGGER messages_fts_insert AFTER INSERT ON messages "
    "WHEN new.search_text IS NOT NULL BEGIN "
    "INSERT INTO messages_fts(rowid, search_text) VALUES (new.pk, new.search_text); END",
    "CREATE TRIGGER messages_fts_delete AFTER DELETE ON messages "
    "WHEN old.search_text IS NOT NULL BEGIN "
    "INSERT INTO messages_fts(messages_fts, rowid, search_text) "
    "VALUES ('delete', old.pk, old.search_text); END",
    "CREATE TRIGGER messages_fts_update AFTER UPDATE OF search_text ON messages BEGIN "
    "INSERT INTO messages_fts(messages_fts, rowid, search_text) "
    "SELECT 'delete', old.pk, old.search_text WHERE old.search_text IS NOT NULL; "
    "INSERT INTO messages_fts(rowid, search_text) "
    "SELECT new.pk, new.search_text WHERE new.search_text IS NOT NULL; END",
]
POSTGRESQL = [
    "CREATE INDEX ix_messages_search ON messages "
    "USING gin (to_tsvector('english', coalesce(search_text, '')))",
]


def upgrade() -> None:
    with op.batch_alter_table("messages", schema=None) as batch_op:
        batch_op.add_column(sa.Column("search_text", sa.Text(), nullable=True))
    conn = op.get_bind()
    messages = sa.table(
        "messages",
        sa.column("pk", sa.Integer),
        sa.column("role", sa.String),
        sa.column("content", sa.JSON),
        sa.column("search_text", sa.Text),
    )
    rows = conn.execute(sa.select(messages.c.pk, messages.c.role, messages.c.content)).all()
    for pk, role, content in rows:
        text = searchable_text(role, content)
        if text is not None:
            conn.execute(messages.update().where(messages.c.pk == pk).values(search_text=text))
    for statement in SQLITE if conn.dialect.name == "sqlite" else POSTGRESQL:
        op.execute(statement)
    if conn.dialect.name == "sqlite":
        op.execute("INSERT INTO messages_fts(messages_fts) VALUES ('rebuild')")


def downgrade() -> None:
    conn = op.get_bind()
    if conn.dialect.name == "sqlite":
        for name in ("messages_fts_insert", "messages_fts_delete", "messages_fts_update"):
            op.execute(f"DROP TRIGGER IF EXISTS {name}")
        op.execute("DROP TABLE IF EXISTS messages_fts")
    else:
        op.execute("DROP INDEX IF EXISTS ix_messages_search")
    with op.batch_alter_table("messages", schema=None) as batch_op:
        batch_op.drop_column("search_text")
