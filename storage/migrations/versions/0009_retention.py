"""retention: conversations by last activity per tenant

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-23 21:30:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index(
        "ix_conversations_tenant_idle", "conversations", ["tenant_id", "updated_at"], unique=False
    )


def downgrade() -> None:
    op.drop_index("ix_conversations_tenant_idle", table_name="conversations")
