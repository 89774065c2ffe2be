"""exchange traces: what the model saw and why, per exchange

Revision ID: 0023
Revises: 0022
Create Date: 2026-11-28 11:00:00.000000

One row per exchange whose tenant records traces (`trace: summary | full`), written with the
exchange's record and deleted with it (the foreign key cascades: erasure, retention).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0023"
down_revision: str | None = "0022"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "exchange_traces",
        sa.Column("request_id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.String(length=128), nullable=False),
        sa.Column("level", sa.String(length=8), nullable=False),
        sa.Column("size", sa.Integer(), nullable=False),
        sa.Column("truncated", sa.JSON(), nullable=False),
        sa.Column("trace", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(["request_id"], ["exchanges.request_id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("request_id"),
    )


def downgrade() -> None:
    op.drop_table("exchange_traces")
