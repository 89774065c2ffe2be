"""erasures name the user by a hash of the tenant and user id, not by the id

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-24 03:00:00.000000

The user id kept after an erasure was itself personal data. Existing records are converted:
each keeps its tenant and time, with `user_hash` (storage/repositories/erasures.py) in place
of `user_id`. A downgrade cannot turn the hashes back into ids: the 0010 table comes back
empty, so a turn of a user erased before it that still waits in some replica's spill would be
written back at its replay.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def erased_user_hash(tenant_id: str, user_id: str) -> str:
    """storage/repositories/erasures.py's hash as it was when this migration was written (a
    migration must not change with the code after it)."""
    return hashlib.blake2b(f"{tenant_id}\x00{user_id}".encode(), digest_size=32).hexdigest()


def _erasures(user_column: str, length: int) -> sa.Table:
    return op.create_table(
        "erasures",
        sa.Column("tenant_id", sa.String(length=128), nullable=False),
        sa.Column(user_column, sa.String(length=length), nullable=False),
        sa.Column("erased_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("tenant_id", user_column),
    )


def upgrade() -> None:
    before = sa.table(
        "erasures",
        sa.column("tenant_id", sa.String),
        sa.column("user_id", sa.String),
        sa.column("erased_at", sa.DateTime(timezone=True)),
    )
    rows = op.get_bind().execute(sa.select(before)).all()
    op.drop_table("erasures")
    hashed = _erasures("user_hash", 64)
    op.bulk_insert(
        hashed,
        [
            {
                "tenant_id": tenant_id,
                "user_hash": erased_user_hash(tenant_id, user_id),
                "erased_at": erased_at,
            }
            for tenant_id, user_id, erased_at in rows
        ],
    )


def downgrade() -> None:
    op.drop_table("erasures")
    _erasures("user_id", 256)
