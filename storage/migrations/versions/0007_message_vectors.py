"""message vectors

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-22 05:05:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "message_vectors",
        sa.Column(
            "pk",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column(
            "message_pk",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            nullable=False,
        ),
        sa.Column("tenant_id", sa.String(length=128), nullable=False),
        sa.Column("user_id", sa.String(length=256), nullable=False),
        sa.Column("model", sa.String(length=128), nullable=False),
        sa.Column("dims", sa.Integer(), nullable=False),
        sa.Column("vector", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["message_pk"], ["messages.pk"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("pk"),
        sa.UniqueConstraint("message_pk", "model", name="uq_message_vectors_message_model"),
    )
    with op.batch_alter_table("message_vectors", schema=None) as batch_op:
        batch_op.create_index(
            "ix_message_vectors_user", ["tenant_id", "user_id", "model", "pk"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("message_vectors", schema=None) as batch_op:
        batch_op.drop_index("ix_message_vectors_user")
    op.drop_table("message_vectors")
