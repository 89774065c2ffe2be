"""responses: memproxy's own store of Responses API responses, for upstreams that keep no state

Revision ID: 0019
Revises: 0018
Create Date: 2026-11-25 09:00:00.000000

On SQLite the table is AUTOINCREMENT from the start, as migration 0012 made the others: a
deleted row's key is never given to another.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "responses",
        sa.Column(
            "pk",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("tenant_id", sa.String(length=128), nullable=False),
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("user_id", sa.String(length=256), nullable=False),
        sa.Column("conversation_id", sa.String(length=128), nullable=True),
        sa.Column("request_id", sa.String(length=64), nullable=False),
        sa.Column("model", sa.String(length=256), nullable=False),
        sa.Column("previous_response_id", sa.String(length=64), nullable=True),
        sa.Column("store", sa.Boolean(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("response", sa.JSON(), nullable=False),
        sa.Column("input_items", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("pk"),
        sa.UniqueConstraint("tenant_id", "id", name="uq_responses_tenant_id"),
        sqlite_autoincrement=True,
    )
    with op.batch_alter_table("responses", schema=None) as batch_op:
        batch_op.create_index("ix_responses_tenant_user", ["tenant_id", "user_id"])
        batch_op.create_index("ix_responses_tenant_conversation", ["tenant_id", "conversation_id"])
        batch_op.create_index("ix_responses_tenant_created", ["tenant_id", "created_at"])


def downgrade() -> None:
    op.drop_table("responses")
