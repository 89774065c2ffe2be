"""The job queue as a tenant sees it: enqueue work about its data, list it, erase a user's.
Claiming and settling jobs across tenants is the system's business (repositories/system.py)."""

from __future__ import annotations

from collections.abc import Collection
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, delete, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from storage.models import JOBS
from storage.records import JobRecord
from storage.repositories.rows import columns, delete_chosen, utc_row

J = JOBS
_COLUMNS = columns(J, JobRecord)
STATUSES = ("queued", "running", "done", "dead")


def job_record(row: Any) -> JobRecord:
    return JobRecord(**utc_row(row))


def job_columns() -> list[Any]:
    return list(_COLUMNS)


class Jobs:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def enqueue(
        self,
        tenant_id: str,
        user_id: str,
        kind: str,
        ref: str,
        *,
        now: datetime,
        payload: dict[str, Any] | None = None,
    ) -> bool:
        """Queue a job of `kind` about `ref`, due now; False if there is one already (a job
        is queued once per subject, so a retried request does not queue it twice)."""
        values = {
            "tenant_id": tenant_id,
            "user_id": user_id,
            "kind": kind,
            "ref": ref,
            "payload": payload or {},
            "status": "queued",
            "attempts": 0,
            "run_after": now,
            "created_at": now,
            "updated_at": now,
        }
        dialect = self.conn.dialect.name
        insert = pg_insert if dialect == "postgresql" else sqlite_insert
        result = self.conn.execute(insert(J).values(values).on_conflict_do_nothing())
        return bool(result.rowcount)

    def get(self, tenant_id: str, pk: int) -> JobRecord | None:
        row = self.conn.execute(
            select(*_COLUMNS).where(J.c.tenant_id == tenant_id, J.c.pk == pk)
        ).first()
        return job_record(row) if row else None

    def find(
        self,
        tenant_id: str,
        *,
        limit: int,
        status: str | None = None,
        kind: str | None = None,
        user_id: str | None = None,
        ref: str | None = None,
        after_pk: int | None = None,
    ) -> list[JobRecord]:
        """Newest first."""
        query = select(*_COLUMNS).where(J.c.tenant_id == tenant_id)
        for column, value in (
            (J.c.status, status),
            (J.c.kind, kind),
            (J.c.user_id, user_id),
            (J.c.ref, ref),
        ):
            if value is not None:
                query = query.where(column == value)
        if after_pk is not None:
            query = query.where(J.c.pk < after_pk)
        rows = self.conn.execute(query.order_by(J.c.pk.desc()).limit(limit))
        return [job_record(r) for r in rows]

    def retry(self, tenant_id: str, pk: int, *, now: datetime) -> JobRecord | None:
        """A dead job queued again, due now, with all its attempts back (its last error kept
        until the next attempt ends); None if the tenant has no such job or it is not dead."""
        result = self.conn.execute(
            update(J)
            .where(J.c.tenant_id == tenant_id, J.c.pk == pk, J.c.status == "dead")
            .values(status="queued", attempts=0, run_after=now, updated_at=now, result=None)
        )
        return self.get(tenant_id, pk) if result.rowcount else None

    def hold(self, tenant_id: str, pk: int, worker: str, attempt: int) -> bool:
        """Lock a running job for the rest of this transaction, if `worker`'s `attempt` (the
        job's `attempts` when claimed) still holds it: a job's results are written in the
        transaction that holds it, so a user erased meanwhile (whose jobs go with them) or a
        lease taken over after it ran out (by another worker, or by this one's next claim)
        means its results are not written at all."""
        row = self.conn.execute(
            select(J.c.pk)
            .where(
                J.c.tenant_id == tenant_id,
                J.c.pk == pk,
                J.c.status == "running",
                J.c.worker == worker,
                J.c.attempts == attempt,
            )
            .with_for_update()
        ).first()
        return row is not None

    def finish_queued(
        self,
        tenant_id: str,
        user_id: str,
        kind: str,
        refs: Collection[str],
        *,
        now: datetime,
        result: dict[str, Any],
    ) -> int:
        """The user's jobs of `kind` done by another (their work done in its transaction):
        those of these refs still queued and never tried (none running, dead or done, nor
        waiting to retry: their errors stay theirs) end as `done` with `result`, and are
        never run. How many."""
        if not refs:
            return 0
        outcome = self.conn.execute(
            update(J)
            .where(
                J.c.tenant_id == tenant_id,
                J.c.user_id == user_id,
                J.c.kind == kind,
                J.c.ref.in_(list(refs)),
                J.c.status == "queued",
                J.c.attempts == 0,
            )
            .values(status="done", updated_at=now, result=result)
        )
        return int(outcome.rowcount)

    def delete_finished_before(self, tenant_id: str, cutoff: datetime, *, limit: int) -> int:
        """Delete up to `limit` of the tenant's jobs that ended (`done`, or `dead` with the
        model's raw output) before `cutoff` (retention, in batches); how many. Queued and
        running ones stay whatever their age."""
        oldest = (
            select(J.c.pk)
            .where(
                J.c.tenant_id == tenant_id,
                J.c.status.in_(("done", "dead")),
                J.c.updated_at < cutoff,
            )
            .order_by(J.c.updated_at)
            .limit(limit)
        )
        return delete_chosen(self.conn, J, tenant_id, oldest)

    def delete_user(self, tenant_id: str, user_id: str) -> int:
        result = self.conn.execute(
            delete(J).where(J.c.tenant_id == tenant_id, J.c.user_id == user_id)
        )
        return int(result.rowcount)
