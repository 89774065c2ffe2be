"""System tasks that span tenants on purpose: readiness, the crash sweeper, counter pruning,
the job queue's claiming and settling, and rewriting the search indexes after an erasure.

This is the one repository whose queries do not take a tenant; nothing here returns tenant
content."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, and_, delete, or_, select, text, update

from storage.models import EXCHANGES, JOBS, SERVER_SECRETS, USAGE_COUNTERS
from storage.records import JobRecord
from storage.repositories.jobs import job_columns, job_record

E = EXCHANGES
C = USAGE_COUNTERS
J = JOBS
MINUTE_WINDOWS = "minute:"  # every minute window's key starts so, and sorts after it
# The error of an exchange the sweeper closed (a spilled outcome may still complete it).
SWEPT = "abandoned: the proxy stopped mid-exchange"
# SQLite's full-text indexes (FTS5), each kept in sync with its table by triggers.
SEARCH_INDEXES = ("messages_fts", "attachment_chunks_fts")


class SystemRepository:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def drop_deleted_from_search(self) -> None:
        """SQLite: rewrite the full-text indexes (messages', documents' chunks') without what
        deleted rows left in them (FTS5 keeps a deleted row's words in its segments, marked
        deleted, until they merge). The whole of each, every tenant's: about 0.1 s for 27,560
        messages (bench/sqlite_erasure.py). PostgreSQL's index entries go with their rows:
        nothing to do."""
        if self.conn.dialect.name == "sqlite":
            for index in SEARCH_INDEXES:
                self.conn.execute(text(f"INSERT INTO {index}({index}) VALUES ('optimize')"))

    def secret(self, name: str) -> str:
        """The deployment's secret `name`, made by the migrations (LookupError if it is not
        there: the database was not migrated)."""
        value = self.conn.execute(
            select(SERVER_SECRETS.c.value).where(SERVER_SECRETS.c.name == name)
        ).scalar_one_or_none()
        if value is None:
            raise LookupError(f"no server secret {name!r}: is the database migrated?")
        return str(value)

    def sweep_in_progress(self, started_before: datetime, now: datetime) -> int:
        """Mark exchanges a crashed process left `in_progress` as `incomplete`."""
        result = self.conn.execute(
            update(E)
            .where(E.c.status == "in_progress", E.c.started_at < started_before)
            .values(
                status="incomplete",
                finished_at=now,
                error=SWEPT,
            )
        )
        return result.rowcount

    def prune_minute_counters(self, before_window: str) -> int:
        """Delete every tenant's minute usage counters older than `before_window` (a key like
        `minute:2026-11-22T02:08`; keys sort in time order). Day and month counters stay."""
        if not before_window.startswith(MINUTE_WINDOWS):
            raise ValueError(f"not a minute window: {before_window!r}")
        result = self.conn.execute(
            delete(C).where(C.c.window > MINUTE_WINDOWS, C.c.window < before_window)
        )
        return result.rowcount

    def claim_jobs(
        self,
        worker: str,
        *,
        now: datetime,
        lease: timedelta,
        limit: int,
        max_attempts: int | None = None,
    ) -> list[JobRecord]:
        """Take up to `limit` due jobs for `worker` until `now + lease`: queued ones whose
        time has come, and running ones whose lease ran out (their worker died). On
        PostgreSQL, rows another replica is claiming are skipped, not waited for. A job whose
        worker died on each of its `max_attempts` attempts (one that kills the process, say)
        is dead-lettered instead (`bury_abandoned`)."""
        if max_attempts is not None:
            self.bury_abandoned(now, max_attempts, expired_only=True)
        due = or_(
            and_(J.c.status == "queued", J.c.run_after <= now),
            and_(J.c.status == "running", J.c.lease_until < now),
        )
        pks = list(
            self.conn.execute(
                select(J.c.pk)
                .where(due)
                .order_by(J.c.run_after, J.c.pk)
                .limit(limit)
                .with_for_update(skip_locked=True)
            ).scalars()
        )
        if not pks:
            return []
        self.conn.execute(
            update(J)
            .where(J.c.pk.in_(pks))
            .values(
                status="running",
                worker=worker,
                lease_until=now + lease,
                attempts=J.c.attempts + 1,
                updated_at=now,
            )
        )
        rows = self.conn.execute(select(*job_columns()).where(J.c.pk.in_(pks)).order_by(J.c.pk))
        return [job_record(r) for r in rows]

    def settle_job(
        self,
        pk: int,
        worker: str,
        *,
        attempt: int,
        status: str,
        now: datetime,
        result: dict[str, Any] | None = None,
        error: str | None = None,
        run_after: datetime | None = None,
        retake: bool = False,
    ) -> bool:
        """End `worker`'s `attempt` at a job (its `attempts` when claimed): `done`, `queued`
        again (a retry at `run_after`) or `dead`; `retake`: the attempt is given back (the worker
        stopped, the job did not fail). False if the job is no longer that attempt's (erased,
        or its lease was taken, by another worker or by this one again)."""
        values: dict[str, Any] = {
            "status": status,
            "worker": None,
            "lease_until": None,
            "updated_at": now,
            "result": result,
        }
        if error is not None:
            values["last_error"] = error
        if run_after is not None:
            values["run_after"] = run_after
        if retake:
            values["attempts"] = J.c.attempts - 1
        outcome = self.conn.execute(
            update(J)
            .where(
                J.c.pk == pk,
                J.c.worker == worker,
                J.c.attempts == attempt,
                J.c.status == "running",
            )
            .values(values)
        )
        return bool(outcome.rowcount)

    def bury_abandoned(self, now: datetime, max_attempts: int, *, expired_only: bool) -> int:
        """Running jobs left by a dead worker (`expired_only`: whose lease ran out; else every
        one, at start-up on SQLite) that have had all their attempts: dead, with the reason."""
        abandoned = [J.c.status == "running", J.c.attempts >= max_attempts]
        if expired_only:
            abandoned.append(J.c.lease_until < now)
        result = self.conn.execute(
            update(J)
            .where(*abandoned)
            .values(
                status="dead",
                worker=None,
                lease_until=None,
                updated_at=now,
                last_error=f"its worker stopped during each of its {max_attempts} attempts",
            )
        )
        return int(result.rowcount)

    def release_jobs(self, now: datetime) -> int:
        """Running jobs become due again at once: at start-up on SQLite, where no other
        process can be running them (PostgreSQL replicas wait for the lease instead)."""
        result = self.conn.execute(
            update(J)
            .where(J.c.status == "running")
            .values(status="queued", worker=None, lease_until=None, run_after=now, updated_at=now)
        )
        return result.rowcount
