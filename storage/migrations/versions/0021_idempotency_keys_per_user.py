"""exchanges: idempotency keys are each user's own

Revision ID: 0021
Revises: 0020
Create Date: 2026-11-28 08:00:00.000000

The key was unique per tenant, so one user's `Idempotency-Key` blocked another user's request
that happened to send the same one (a 422). It is now unique per (tenant, user, key). On SQLite
the table is rebuilt (a UNIQUE constraint cannot be dropped there; alembic's batch "move and
copy", rows kept as they are, its indexes made again). A downgrade puts the tenant-wide
constraint back, and fails if two users of a tenant have used one key since.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0021"
down_revision: str | None = "0020"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OLD, NEW = "uq_exchanges_idempotency", "uq_exchanges_user_idempotency"


def _swap(drop: str, create: str, columns: list[str]) -> None:
    with op.batch_alter_table("exchanges", recreate="auto") as batch_op:
        batch_op.drop_constraint(drop, type_="unique")
        batch_op.create_unique_constraint(create, columns)
    if op.get_bind().dialect.name == "sqlite":
        # The rebuild makes the table's indexes again from what SQLite reports of them, which
        # leaves out a partial index's WHERE: this one is made again as 0001 made it.
        op.drop_index("ix_exchanges_in_progress", table_name="exchanges")
        op.create_index(
            "ix_exchanges_in_progress",
            "exchanges",
            ["started_at"],
            sqlite_where=sa.text("status = 'in_progress'"),
        )


def upgrade() -> None:
    _swap(OLD, NEW, ["tenant_id", "user_id", "idempotency_key"])


def downgrade() -> None:
    _swap(NEW, OLD, ["tenant_id", "idempotency_key"])
