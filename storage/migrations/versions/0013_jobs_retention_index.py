"""jobs: an index for retention to find a tenant's ended jobs by age

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-24 09:00:00.000000

Retention now deletes jobs that ended (`done`, or `dead` with the model's raw output) before
the tenant's cutoff, as it deletes old exchange records.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_jobs_tenant_ended", "jobs", ["tenant_id", "status", "updated_at"])


def downgrade() -> None:
    op.drop_index("ix_jobs_tenant_ended", table_name="jobs")
