"""server secrets: the key of the public ids of numbered rows (messages, jobs)

Revision ID: 0022
Revises: 0021
Create Date: 2026-11-28 08:00:00.000000

Message and job ids were their rows' keys (`msg_18`), counting up across all tenants; they are
now a keyed permutation of them (policies/public_ids.py). The key is made here, once, at
random, so that every replica reads the same one; ids given before stay valid.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0022"
down_revision: str | None = "0021"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    table = op.create_table(
        "server_secrets",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("value", sa.String(length=256), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )
    op.bulk_insert(table, [{"name": "public_ids", "value": secrets.token_hex(32)}])


def downgrade() -> None:
    op.drop_table("server_secrets")
