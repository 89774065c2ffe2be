"""The background job runner: takes due jobs from the durable queue (the `jobs` table) and runs
them off the request path.

A job's handler does the slow part (a model call) outside any transaction and returns what to
write; the runner writes it in one transaction with the job's completion, and only while the
job is still this attempt's (`Jobs.hold`: the worker and its count of attempts): a user erased
meanwhile, or a lease taken over after this attempt stalled past it (by another replica, or by
this worker's own next claim), means nothing is written. A failure (an exception, a
`JobFailed` with the raw output that could not be used) is recorded on the job with each
attempt's reason; the job runs again after a backoff, and is dead-lettered (`dead`, with the
reason) when it runs out of attempts. A worker that dies mid-job leaves it `running` until its
lease ends; then any worker takes it again (on SQLite, at the next start).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import structlog
from sqlalchemy import Connection

from policies.jobs import RetryPolicy
from policies.pricing import Usage
from proxy.accounting.costs import usage_or_estimate
from proxy.accounting.metrics import Metrics
from proxy.upstream.base import Upstream
from proxy.upstream.sse import reply_from_completion
from storage.database import Database
from storage.errors import StorageError
from storage.records import JobRecord
from storage.repositories.jobs import Jobs
from storage.repositories.system import SystemRepository

log = structlog.get_logger("memproxy.jobs")
# What a handler returns: the writes of its result, run in the transaction that ends the job;
# it returns the summary stored on the job.
Apply = Callable[[Connection], dict[str, Any]]
Handler = Callable[[JobRecord], Awaitable[Apply]]
KEPT_ERRORS = 10  # attempts' errors kept on a job
KEPT_OUTPUT_CHARS = 4000


class JobFailed(Exception):
    """A job attempt that did not work out, with what it got (e.g. a model's reply that could
    not be parsed), kept on the job."""

    def __init__(self, reason: str, *, output: str | None = None) -> None:
        super().__init__(reason)
        self.reason, self.output = reason, output


@dataclass(frozen=True, slots=True)
class Answer:
    """A model's answer to a job's call."""

    message: dict[str, Any] | None
    usage: Usage  # as reported, or counted (marked estimated): the call is charged either way
    raw: str  # the body, as text

    @property
    def content(self) -> Any:
        return (self.message or {}).get("content")

    @property
    def output(self) -> str:
        """What a job that fails on the answer keeps of it: its text, else the whole body."""
        return self.content if isinstance(self.content, str) else self.raw


async def ask_model(
    upstream: Upstream, body: dict[str, Any], *, seconds: float, what: str
) -> Answer:
    """A job's call to a model (`what`: "the memory model", say) within `seconds`: its
    answer, or JobFailed for a timeout, an upstream out of reach or an error status (with
    its body)."""
    try:
        async with asyncio.timeout(seconds):
            reply = await upstream.chat_completions(body, stream=False)
    except TimeoutError as exc:
        raise JobFailed(f"{what} did not answer within {seconds:g} s") from exc
    except Exception as exc:
        raise JobFailed(f"{what} could not be reached: {exc!r}") from exc
    data = reply.body or b""
    raw = data.decode("utf-8", "replace")
    if reply.status >= 400:
        raise JobFailed(f"{what} answered {reply.status}", output=raw)
    message, reported = reply_from_completion(data)
    usage = await usage_or_estimate(body["model"], reported, body["messages"], message)
    return Answer(message, usage, raw)


def _now() -> datetime:
    return datetime.now(UTC)


def worker_name() -> str:
    return f"{socket.gethostname()[:64]}:{os.getpid()}:{secrets.token_hex(3)}"


class JobRunner:
    def __init__(
        self,
        db: Database,
        metrics: Metrics,
        *,
        poll_seconds: float = 1.0,
        lease_seconds: float = 300.0,
        concurrency: int = 2,
        retry: RetryPolicy | None = None,
        worker: str | None = None,
    ) -> None:
        self.db, self.metrics = db, metrics
        self.poll_seconds, self.concurrency = poll_seconds, concurrency
        self.lease = timedelta(seconds=lease_seconds)
        self.retry = retry or RetryPolicy()
        self.worker = worker or worker_name()
        self.handlers: dict[str, Handler] = {}
        self._wake = asyncio.Event()
        self._loop: asyncio.Task[None] | None = None

    def register(self, kind: str, handler: Handler) -> None:
        self.handlers[kind] = handler

    def wake(self) -> None:
        """A job was queued: look now rather than at the next poll."""
        self._wake.set()

    async def start(self) -> None:
        if self.db.is_sqlite:  # this process owns the file: what was running was abandoned

            def release(conn: Connection) -> tuple[int, int]:
                system, now = SystemRepository(conn), _now()
                buried = system.bury_abandoned(now, self.retry.max_attempts, expired_only=False)
                return buried, system.release_jobs(now)

            buried, released = await self.db.write(release)
            if buried:
                log.error("jobs_dead_after_crashes", count=buried)
            if released:
                log.warning("jobs_released", count=released)
        self._loop = asyncio.create_task(self._poll())

    async def stop(self) -> None:
        """Stop taking jobs; a job in progress is put back in the queue."""
        if self._loop is not None:
            self._loop.cancel()
            await asyncio.gather(self._loop, return_exceptions=True)
            self._loop = None

    async def run_once(self) -> int:
        """Claim up to `concurrency` due jobs and run them to the end; how many were claimed."""
        claimed = await self._claim(self.concurrency)
        if claimed:
            await asyncio.gather(*(self._run(job) for job in claimed))
        return len(claimed)

    async def _claim(self, limit: int) -> list[JobRecord]:
        now = _now()
        return await self.db.write(
            lambda conn: SystemRepository(conn).claim_jobs(
                self.worker,
                now=now,
                lease=self.lease,
                limit=limit,
                max_attempts=self.retry.max_attempts,
            )
        )

    async def _claim_whole(self, limit: int) -> list[JobRecord]:
        """`_claim`, which a stop does not cut short: it waits for the claim to end and puts
        back what it took. (A claim on SQLite commits in its thread whatever becomes of its
        caller: cut short, its jobs stayed `running`, an attempt used, until the next start.)"""
        claiming = asyncio.ensure_future(self._claim(limit))
        try:
            return await asyncio.shield(claiming)
        except asyncio.CancelledError:
            (taken,) = await asyncio.gather(claiming, return_exceptions=True)
            for job in taken if isinstance(taken, list) else []:
                await self._put_back(job)
            raise

    async def _put_back(self, job: JobRecord) -> None:
        """Stopping: the job is due again at once, and this attempt does not count."""
        errors = list((job.result or {}).get("errors", []))
        await self._settle(job, "queued", errors, None, run_after=_now(), retake=True)

    async def _poll(self) -> None:
        """Keep up to `concurrency` jobs running: a free slot is filled as soon as a job ends,
        so one slow job does not hold up the others queued behind it."""
        running: set[asyncio.Task[None]] = set()
        try:
            while True:
                if len(running) < self.concurrency:
                    self._wake.clear()  # (before the claim: a job queued during it wakes us)
                    claimed: list[JobRecord] = []
                    try:
                        claimed = await self._claim_whole(self.concurrency - len(running))
                    except StorageError as exc:
                        log.warning("jobs_poll_failed", error=str(exc))
                    except Exception:  # the loop goes on: it is every job's way in
                        log.error("jobs_poll_error", exc_info=True)
                    for job in claimed:
                        task = asyncio.create_task(self._run(job))
                        running.add(task)
                        task.add_done_callback(running.discard)
                        task.add_done_callback(self._ended)
                    if claimed:
                        continue  # there may be more
                waits: set[asyncio.Future[Any]] = set(running)
                waker = None
                if len(running) < self.concurrency:  # room for a job queued meanwhile
                    waker = asyncio.ensure_future(self._wake.wait())
                    waits.add(waker)
                try:
                    await asyncio.wait(
                        waits, timeout=self.poll_seconds, return_when=asyncio.FIRST_COMPLETED
                    )
                finally:
                    if waker is not None:
                        waker.cancel()
        finally:  # stopping: each job still running is put back in the queue
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)

    def _ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:  # (settling it failed)
            log.error("job_not_settled", error=repr(task.exception()))

    async def _run(self, job: JobRecord) -> None:
        handler = self.handlers.get(job.kind)
        errors = list((job.result or {}).get("errors", []))
        try:
            if handler is None:
                raise JobFailed(f"no handler for jobs of kind {job.kind!r}")
            # Well inside the lease, so that no other worker takes the job meanwhile.
            async with asyncio.timeout(self.lease.total_seconds() * 0.8):
                apply = await handler(job)
            written = await self.db.write(lambda conn: self._complete(conn, job, apply, errors))
            outcome = "done" if written else "dropped"
            if not written:
                log.info("job_dropped", job=job.pk, kind=job.kind, tenant=job.tenant_id)
        except asyncio.CancelledError:
            await self._put_back(job)
            raise
        except Exception as exc:
            failure = exc if isinstance(exc, JobFailed) else JobFailed(repr(exc))
            if not isinstance(exc, JobFailed):
                log.error("job_error", job=job.pk, kind=job.kind, exc_info=True)
            now = _now()
            output = failure.output
            errors = [
                *errors,
                {
                    "attempt": job.attempts,
                    "at": now.isoformat(),
                    "error": failure.reason,
                    **({"output": output[:KEPT_OUTPUT_CHARS]} if output is not None else {}),
                },
            ][-KEPT_ERRORS:]
            run_after = self.retry.next_run(job.attempts, now)
            status = "queued" if run_after is not None else "dead"
            outcome = "retry" if run_after is not None else "dead"
            log.warning(
                "job_failed",
                job=job.pk,
                kind=job.kind,
                tenant=job.tenant_id,
                attempt=job.attempts,
                reason=failure.reason,
                next=status,
            )
            await self._settle(job, status, errors, failure.reason, run_after=run_after)
        self.metrics.jobs.labels(job.kind, outcome).inc()

    def _complete(self, conn: Connection, job: JobRecord, apply: Apply, errors: list[Any]) -> bool:
        if not Jobs(conn).hold(job.tenant_id, job.pk, self.worker, job.attempts):
            return False
        result = apply(conn)
        if errors:
            result = {**result, "errors": errors}
        return SystemRepository(conn).settle_job(
            job.pk, self.worker, attempt=job.attempts, status="done", now=_now(), result=result
        )

    async def _settle(
        self,
        job: JobRecord,
        status: str,
        errors: list[Any],
        error: str | None,
        *,
        run_after: datetime | None,
        retake: bool = False,
    ) -> None:
        try:
            await self.db.write(
                lambda conn: SystemRepository(conn).settle_job(
                    job.pk,
                    self.worker,
                    attempt=job.attempts,
                    status=status,
                    now=_now(),
                    result={"errors": errors} if errors else None,
                    error=error,
                    run_after=run_after,
                    retake=retake,
                )
            )
        except StorageError as exc:  # the lease runs out and the job is taken again
            log.error("job_not_settled", job=job.pk, error=str(exc))
