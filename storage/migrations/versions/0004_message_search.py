"""full-text search over messages

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-22 03:30:00

SQLite: an FTS5 table over `messages.search_text` and `messages.search_scope` (a token naming
the tenant's user; external content, porter stemming), kept in sync by triggers on insert,
update and delete (conversation deletes cascade to messages, and their triggers fire).
PostgreSQL: a GIN index on the English tsvector of `search_text`; queries use the same
expression (storage/repositories/search.py).

A later migration that rebuilds the messages table on SQLite (batch mode) drops the triggers:
it must create them again (0012 does).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from storage.repositories.search import scope_token, searchable_text

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SQLITE = [
    "CREATE VIRTUAL TABLE messages_fts USING fts5(search_text, search_scope, "
    "content='messages', content_rowid='pk', tokenize='porter unicode61 remove_diacritics 2')",
    "CREATE TRIGGER messages_fts_insert AFTER INSERT ON messages "
    "WHEN new.search_text IS NOT NULL BEGIN "
    "INSERT INTO messages_fts(rowid, search_text, search_scope) "
    "VALUES (new.pk, new.search_text, new.search_scope); END",
    "CREATE TRIGGER messages_fts_delete AFTER DELETE ON messages "
    "WHEN old.search_text IS NOT NULL BEGIN "
    "INSERT INTO messages_fts(messages_fts, rowid, search_text, search_scope) "
    "VALUES ('delete', old.pk, old.search_text, old.search_scope); END",
    "CREATE TRIGGER messages_fts_update AFTER UPDATE OF search_text, search_scope ON messages "
    "BEGIN "
    "INSERT INTO messages_fts(messages_fts, rowid, search_text, search_scope) "
    "SELECT 'delete', old.pk, old.search_text, old.search_scope "
    "WHERE old.search_text IS NOT NULL; "
    "INSERT INTO messages_fts(rowid, search_text, search_scope) "
    "SELECT new.pk, new.search_text, new.search_scope WHERE new.search_text IS NOT NULL; END",
]
POSTGRESQL = [
    "CREATE INDEX ix_messages_search ON messages "
    "USING gin (to_tsvector('english', coalesce(search_text, '')))",
]


def upgrade() -> None:
    with op.batch_alter_table("messages", schema=None) as batch_op:
        batch_op.add_column(sa.Column("search_text", sa.Text(), nullable=True))
        batch_op.add_column(sa.Column("search_scope", sa.String(length=24), nullable=True))
    conn = op.get_bind()
    messages = sa.table(
        "messages",
        sa.column("pk", sa.Integer),
        sa.column("role", sa.String),
        sa.column("content", sa.JSON),
        sa.column("search_text", sa.Text),
        sa.column("search_scope", sa.String),
        sa.column("tenant_id", sa.String),
        sa.column("user_id", sa.String),
        sa.column("status", sa.String),
    )
    query = sa.select(
        messages.c.pk, messages.c.role, messages.c.content, messages.c.tenant_id, messages.c.user_id
    ).where(messages.c.status == "complete")
    for pk, role, content, tenant_id, user_id in conn.execute(query).all():
        text = searchable_text(role, content)
        if text is not None:
            scope = scope_token(tenant_id, user_id)
            conn.execute(
                messages.update()
                .where(messages.c.pk == pk)
                .values(search_text=text, search_scope=scope)
            )
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
        batch_op.drop_column("search_scope")
        batch_op.drop_column("search_text")
