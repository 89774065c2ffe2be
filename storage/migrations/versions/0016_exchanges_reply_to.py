"""exchanges.reply_to: the seq of the message the exchange's reply answers, so that a retry's
reply (which stored no messages of its own) is known to answer its original's turn

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-24 13:00:00.000000

Exchanges recorded before this have none: a reply to them is placed as before (after the
newest message when its turn began).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("exchanges", sa.Column("reply_to", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("exchanges", schema=None) as batch_op:
        batch_op.drop_column("reply_to")
