"""exchanges.request_hash: what a request with an idempotency key asked, to tell a retry
from another request that reuses the key

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-24 11:00:00.000000

A request that reused a key with other messages was taken for a retry of the first: answered,
but its turn never stored. Exchanges recorded before this have no hash and are still taken for
what they were (a request with their key is a retry).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("exchanges", sa.Column("request_hash", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("exchanges", schema=None) as batch_op:
        batch_op.drop_column("request_hash")
