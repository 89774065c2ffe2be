"""memories.folded: the text lowercased by Python, what the word search matches

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-24 09:30:00.000000

The search used the database's lower(), which on SQLite folds ASCII letters only and on
PostgreSQL follows the database's locale (none beyond ASCII under C): a memory "Études" was
not found by "études". Existing memories are folded here, a batch at a time; new and edited
ones by storage/repositories/memories.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BATCH = 1000


def fold(text: str) -> str:
    """storage/repositories/memories.py's fold as it was when this was written."""
    return text.lower()


def upgrade() -> None:
    with op.batch_alter_table("memories", schema=None) as batch_op:
        batch_op.add_column(sa.Column("folded", sa.Text(), server_default="", nullable=False))
    memories = sa.table(
        "memories", sa.column("pk", sa.Integer), sa.column("text", sa.Text), sa.column("folded")
    )
    conn = op.get_bind()
    after = 0
    while True:
        rows = conn.execute(
            sa.select(memories.c.pk, memories.c.text)
            .where(memories.c.pk > after)
            .order_by(memories.c.pk)
            .limit(BATCH)
        ).all()
        if not rows:
            break
        conn.execute(
            sa.update(memories)
            .where(memories.c.pk == sa.bindparam("w_pk"))
            .values(folded=sa.bindparam("w_folded")),
            [{"w_pk": pk, "w_folded": fold(text)} for pk, text in rows],
        )
        after = rows[-1][0]


def downgrade() -> None:
    with op.batch_alter_table("memories", schema=None) as batch_op:
        batch_op.drop_column("folded")
