"""PostgreSQL: search reads stored tsvectors

Migrations 0004 and 0008 indexed the English tsvector of `messages.search_text` and of
`attachment_chunks.text` as an expression, so the index found the rows but ranking them
(`ts_rank_cd`) computed each matching row's tsvector again on every search: most of recall's
time on PostgreSQL. Each table now keeps the tsvector in a generated column, `search_vector`
(computed by PostgreSQL on insert and update, so it cannot fall out of sync), GIN-indexed in
place of the expression index. Adding a stored column rewrites the table once, under a lock.

SQLite is unchanged: FTS5 keeps its own index.

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-24 16:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# table: (the text searched, as 0004 and 0008 indexed it; their expression index)
SEARCHED = {
    "messages": ("coalesce(search_text, '')", "ix_messages_search"),
    "attachment_chunks": ("text", "ix_attachment_chunks_search"),
}


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table, (searched, expression_index) in SEARCHED.items():
        op.execute(
            f"ALTER TABLE {table} ADD COLUMN search_vector tsvector "
            f"GENERATED ALWAYS AS (to_tsvector('english', {searched})) STORED"
        )
        op.execute(f"CREATE INDEX {expression_index}_vector ON {table} USING gin (search_vector)")
        op.execute(f"DROP INDEX {expression_index}")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table, (searched, expression_index) in SEARCHED.items():
        op.execute(
            f"CREATE INDEX {expression_index} ON {table} "
            f"USING gin (to_tsvector('english', {searched}))"
        )
        op.execute(f"DROP INDEX {expression_index}_vector")
        op.execute(f"ALTER TABLE {table} DROP COLUMN search_vector")
