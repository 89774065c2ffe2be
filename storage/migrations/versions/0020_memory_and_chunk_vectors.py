"""memory and chunk vectors: memories and attachment passages embedded as messages are

Revision ID: 0020
Revises: 0019
Create Date: 2026-11-28 09:00:00.000000

Two tables shaped like `message_vectors` (0007): one vector per memory (or passage) and
embedding model, going with it by a cascading foreign key. On SQLite they are AUTOINCREMENT
from the start, as migration 0012 made the others. Nothing is embedded here: the job queue
catches up at start-up (proxy/background/embedding_backlog.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

KEY = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
# table -> (the column naming what is embedded, the table it is in)
TABLES = {
    "memory_vectors": ("memory_pk", "memories", "memory"),
    "chunk_vectors": ("chunk_pk", "attachment_chunks", "chunk"),
}


def upgrade() -> None:
    for table, (column, parent, short) in TABLES.items():
        op.create_table(
            table,
            sa.Column("pk", KEY, autoincrement=True, nullable=False),
            sa.Column(column, KEY, nullable=False),
            sa.Column("tenant_id", sa.String(length=128), nullable=False),
            sa.Column("user_id", sa.String(length=256), nullable=False),
            sa.Column("model", sa.String(length=128), nullable=False),
            sa.Column("dims", sa.Integer(), nullable=False),
            sa.Column("vector", sa.LargeBinary(), nullable=False),
            sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
            sa.ForeignKeyConstraint([column], [f"{parent}.pk"], ondelete="CASCADE"),
            sa.PrimaryKeyConstraint("pk"),
            sa.UniqueConstraint(column, "model", name=f"uq_{table}_{short}_model"),
            sqlite_autoincrement=True,
        )
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.create_index(f"ix_{table}_user", ["tenant_id", "user_id", "model", "pk"])


def downgrade() -> None:
    for table in reversed(TABLES):
        op.drop_table(table)
