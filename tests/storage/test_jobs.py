"""The durable job queue on SQLite and PostgreSQL: queued once per subject, claimed by one
worker at a time (SKIP LOCKED on PostgreSQL), taken over when a worker's lease runs out,
retried with backoff, dead-lettered with the reason; and the runner that writes a job's
results only while the job is still its own."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Connection, text
from sqlalchemy.ext.asyncio import create_async_engine

from policies.jobs import RetryPolicy
from proxy.accounting.metrics import Metrics
from proxy.background.jobs import Apply, JobFailed, JobRunner
from storage.database import Database
from storage.records import JobRecord
from storage.repositories.jobs import Jobs
from storage.repositories.memories import Memories
from storage.repositories.system import SystemRepository
from tests.polling import eventually

LEASE = timedelta(minutes=5)


def now() -> datetime:
    return datetime.now(UTC)


async def enqueue(db: Database, ref: str, tenant: str = "t1", user: str = "alice") -> bool:
    return await db.write(lambda conn: Jobs(conn).enqueue(tenant, user, "k", ref, now=now()))


async def claim(
    db: Database,
    worker: str,
    *,
    at: datetime | None = None,
    limit: int = 10,
    lease: timedelta = LEASE,
) -> list[JobRecord]:
    when = at or now()
    return await db.write(
        lambda conn: SystemRepository(conn).claim_jobs(worker, now=when, lease=lease, limit=limit)
    )


async def job(db: Database, ref: str, tenant: str = "t1") -> JobRecord:
    (found,) = await db.read(lambda conn: Jobs(conn).find(tenant, limit=10, ref=ref))
    return found


async def test_a_subject_is_queued_once_per_tenant(db: Database) -> None:
    assert await enqueue(db, "req_1")
    assert not await enqueue(db, "req_1")  # a retried request
    assert await enqueue(db, "req_1", tenant="t2")
    queued = await job(db, "req_1")
    assert (queued.status, queued.attempts, queued.user_id) == ("queued", 0, "alice")
    assert await db.read(lambda conn: Jobs(conn).find("t3", limit=10)) == []


async def test_a_claimed_job_is_nobody_elses_until_its_lease_runs_out(db: Database) -> None:
    await enqueue(db, "req_1")
    (mine,) = await claim(db, "a")
    assert (mine.status, mine.worker, mine.attempts) == ("running", "a", 1)
    assert await claim(db, "b") == []
    # Worker a stalls past its lease: b takes the job over, and a can no longer settle it.
    (taken,) = await claim(db, "b", at=now() + LEASE + timedelta(seconds=1))
    assert (taken.pk, taken.worker, taken.attempts) == (mine.pk, "b", 2)
    settled = await db.write(
        lambda conn: SystemRepository(conn).settle_job(
            mine.pk, "a", attempt=1, status="done", now=now()
        )
    )
    assert not settled
    settled = await db.write(
        lambda conn: SystemRepository(conn).settle_job(
            mine.pk, "b", attempt=2, status="done", now=now(), result={"ok": 1}
        )
    )
    assert settled
    done = await job(db, "req_1")
    assert (done.status, done.worker, done.result) == ("done", None, {"ok": 1})
    assert await claim(db, "c", at=now() + 2 * LEASE) == []


async def test_an_attempt_that_outlived_its_lease_cannot_end_the_next_attempt_of_its_worker(
    db: Database,
) -> None:
    """One runner's first attempt stalls past its lease and the same runner claims the job
    again: the stale attempt neither holds the job nor settles it; the new one does both."""
    await enqueue(db, "req_1")
    (first,) = await claim(db, "a")
    (second,) = await claim(db, "a", at=now() + LEASE + timedelta(seconds=1))
    assert (second.pk, second.worker, second.attempts) == (first.pk, "a", 2)
    assert not await db.write(lambda conn: Jobs(conn).hold("t1", first.pk, "a", first.attempts))
    stale = await db.write(
        lambda conn: SystemRepository(conn).settle_job(
            first.pk, "a", attempt=first.attempts, status="dead", now=now(), error="stale"
        )
    )
    assert not stale
    assert (await job(db, "req_1")).status == "running"
    assert await db.write(lambda conn: Jobs(conn).hold("t1", second.pk, "a", second.attempts))
    assert await db.write(
        lambda conn: SystemRepository(conn).settle_job(
            second.pk, "a", attempt=second.attempts, status="done", now=now()
        )
    )
    assert (await job(db, "req_1")).status == "done"


async def test_concurrent_claims_split_the_jobs_between_workers(db: Database) -> None:
    for i in range(12):
        await enqueue(db, f"req_{i}")
    batches = await asyncio.gather(*(claim(db, f"w{i}", limit=4) for i in range(4)))
    claimed = [j.pk for batch in batches for j in batch]
    assert len(claimed) == len(set(claimed)) == 12


@pytest.mark.parametrize("database_kind", ["postgresql"], indirect=True)
async def test_a_claim_skips_a_job_another_replica_holds_instead_of_waiting(db: Database) -> None:
    """Another replica's claim transaction still holds the first job's row: a claim takes the
    others, at once (SKIP LOCKED), rather than waiting for that transaction or taking it."""
    for i in range(3):
        await enqueue(db, f"req_{i}")
    other = create_async_engine(db.url)
    try:
        async with other.begin() as held:  # (SQLite has one writer: PostgreSQL only)
            first = (
                await held.execute(
                    text("SELECT pk FROM jobs ORDER BY run_after, pk LIMIT 1 FOR UPDATE")
                )
            ).scalar_one()
            claimed = await asyncio.wait_for(claim(db, "w2"), timeout=30)
            assert sorted(j.pk for j in claimed) == sorted(
                j.pk for j in await jobs_of(db) if j.pk != first
            )
        # Once the other transaction has ended, its row is there to claim.
        assert [j.pk for j in await claim(db, "w3")] == [first]
    finally:
        await other.dispose()


async def jobs_of(db: Database) -> list[JobRecord]:
    return list(await db.read(lambda conn: Jobs(conn).find("t1", limit=10)))


async def test_a_job_not_yet_due_waits(db: Database) -> None:
    await enqueue(db, "req_1")
    (first,) = await claim(db, "a")
    later = now() + timedelta(minutes=1)
    await db.write(
        lambda conn: SystemRepository(conn).settle_job(
            first.pk, "a", attempt=1, status="queued", now=now(), error="boom", run_after=later
        )
    )
    assert await claim(db, "a") == []
    (again,) = await claim(db, "a", at=later)
    assert (again.attempts, again.last_error) == (2, "boom")


async def test_start_up_on_one_file_releases_what_was_running(db: Database) -> None:
    await enqueue(db, "req_1")
    await claim(db, "crashed")
    released = await db.write(lambda conn: SystemRepository(conn).release_jobs(now()))
    assert released == 1
    (again,) = await claim(db, "next")
    assert again.worker == "next"


async def test_a_job_whose_worker_died_on_every_attempt_is_dead_lettered(db: Database) -> None:
    """A job that kills its process (say) is not claimed again and again for ever."""
    await enqueue(db, "poison")
    await enqueue(db, "fine")
    max_attempts, at = 2, now()
    for attempt in range(1, max_attempts + 1):  # each worker dies before settling
        at += LEASE + timedelta(seconds=1)
        claimed = await db.write(
            lambda conn, at=at, worker=f"w{attempt}": SystemRepository(conn).claim_jobs(
                worker, now=at, lease=LEASE, limit=1, max_attempts=max_attempts
            )
        )
        assert [(j.ref, j.attempts) for j in claimed] == [("poison", attempt)]
    at += LEASE + timedelta(seconds=1)
    claimed = await db.write(
        lambda conn: SystemRepository(conn).claim_jobs(
            "w3", now=at, lease=LEASE, limit=10, max_attempts=max_attempts
        )
    )
    assert [j.ref for j in claimed] == ["fine"]
    dead = await job(db, "poison")
    assert (dead.status, dead.worker, dead.attempts) == ("dead", None, max_attempts)
    assert dead.last_error == "its worker stopped during each of its 2 attempts"


async def test_start_up_on_one_file_buries_a_job_out_of_attempts_and_releases_the_rest(
    db: Database,
) -> None:
    await enqueue(db, "poison")
    await claim(db, "crashed")  # the process died running it, twice
    await claim(db, "crashed", at=now() + LEASE + timedelta(seconds=1))
    await enqueue(db, "fine")
    await claim(db, "crashed")  # and then once running this one

    def start(conn: Connection) -> tuple[int, int]:
        system = SystemRepository(conn)
        buried = system.bury_abandoned(now(), 2, expired_only=False)
        return buried, system.release_jobs(now())

    assert await db.write(start) == (1, 1)
    assert (await job(db, "poison")).status == "dead"
    assert [j.ref for j in await claim(db, "next")] == ["fine"]


async def test_erasing_a_user_removes_their_jobs_and_a_held_job_is_gone(db: Database) -> None:
    await enqueue(db, "req_1")
    await enqueue(db, "req_2", user="bob")
    (mine, _) = await claim(db, "a")
    assert await db.write(lambda conn: Jobs(conn).hold("t1", mine.pk, "a", 1))
    assert not await db.write(lambda conn: Jobs(conn).hold("t1", mine.pk, "b", 1))
    assert not await db.write(lambda conn: Jobs(conn).hold("t2", mine.pk, "a", 1))
    assert await db.write(lambda conn: Jobs(conn).delete_user("t1", "alice")) == 1
    assert not await db.write(lambda conn: Jobs(conn).hold("t1", mine.pk, "a", 1))
    assert [j.user_id for j in await db.read(lambda conn: Jobs(conn).find("t1", limit=10))] == [
        "bob"
    ]


# The runner, with handlers scripted per test.


def remember(text: str) -> Apply:
    def apply(conn: Connection) -> dict[str, Any]:
        Memories(conn).create("t1", "alice", "mem_" + text, text, now=now())
        return {"remembered": text}

    return apply


def runner(db: Database, **handlers: Any) -> JobRunner:
    jobs = JobRunner(
        db, Metrics(), retry=RetryPolicy(max_attempts=2, first_delay_s=60), worker="me"
    )
    for kind, handler in handlers.items():
        jobs.register(kind, handler)
    return jobs


async def memories(db: Database) -> list[str]:
    found = await db.read(lambda conn: Memories(conn).find("t1", "alice", limit=10))
    return [m.text for m in found]


async def test_a_jobs_results_are_written_with_its_completion(db: Database) -> None:
    calls: list[str] = []

    async def handler(job: JobRecord) -> Apply:
        calls.append(job.ref)
        return remember("tea")

    jobs = runner(db, k=handler)
    await enqueue(db, "req_1")
    assert await jobs.run_once() == 1
    assert await jobs.run_once() == 0
    assert calls == ["req_1"]
    assert await memories(db) == ["tea"]
    done = await job(db, "req_1")
    assert (done.status, done.result) == ("done", {"remembered": "tea"})
    assert 'memproxy_jobs_total{kind="k",outcome="done"} 1.0' in jobs.metrics.exposition().decode()


async def test_failures_are_recorded_retried_later_and_dead_lettered(db: Database) -> None:
    async def handler(job: JobRecord) -> Apply:
        raise JobFailed("the reply is not a JSON object", output="I think the user likes tea")

    jobs = runner(db, k=handler)
    await enqueue(db, "req_1")
    assert await jobs.run_once() == 1
    failed = await job(db, "req_1")
    assert (failed.status, failed.last_error) == ("queued", "the reply is not a JSON object")
    assert failed.run_after > now() + timedelta(seconds=50)  # the backoff
    assert failed.result is not None
    assert [(e["attempt"], e["output"]) for e in failed.result["errors"]] == [
        (1, "I think the user likes tea")
    ]
    assert await jobs.run_once() == 0  # not due yet
    (again,) = await claim(db, "me", at=failed.run_after)
    await jobs._run(again)  # the second and last attempt
    dead = await job(db, "req_1")
    assert (dead.status, dead.attempts) == ("dead", 2)
    assert dead.result is not None and len(dead.result["errors"]) == 2
    assert await memories(db) == []


async def test_an_unexpected_error_and_an_unknown_kind_are_failures_too(db: Database) -> None:
    async def broken(job: JobRecord) -> Apply:
        raise KeyError("surprise")

    jobs = runner(db, k=broken)
    await enqueue(db, "req_1")
    await db.write(lambda conn: Jobs(conn).enqueue("t1", "alice", "unknown", "req_2", now=now()))
    assert await jobs.run_once() == 2
    assert (await job(db, "req_1")).last_error == "KeyError('surprise')"
    assert (await job(db, "req_2")).last_error == "no handler for jobs of kind 'unknown'"


async def test_a_user_erased_while_the_job_ran_gets_nothing_written(db: Database) -> None:
    async def handler(job: JobRecord) -> Apply:
        # The model call takes a while; meanwhile the user is erased.
        await db.write(lambda conn: Jobs(conn).delete_user("t1", "alice"))
        return remember("tea")

    jobs = runner(db, k=handler)
    await enqueue(db, "req_1")
    assert await jobs.run_once() == 1
    assert await memories(db) == []
    assert 'outcome="dropped"' in jobs.metrics.exposition().decode()


async def test_a_job_whose_worker_died_runs_again_on_the_next(db: Database) -> None:
    await enqueue(db, "req_1")
    # Its worker died; its lease (a short one, here) is over.
    (abandoned,) = await claim(db, "crashed", lease=timedelta(microseconds=1))
    await asyncio.sleep(0.01)

    async def handler(job: JobRecord) -> Apply:
        return remember("tea")

    jobs = runner(db, k=handler)
    assert await jobs.run_once() == 1
    done = await job(db, "req_1")
    assert (done.pk, done.status, done.attempts) == (abandoned.pk, "done", 2)
    assert await memories(db) == ["tea"]


async def test_stopping_puts_a_running_job_back(db: Database) -> None:
    started = asyncio.Event()

    async def slow(job: JobRecord) -> Apply:
        started.set()
        await asyncio.Event().wait()  # never answers
        raise AssertionError("unreachable")

    jobs = runner(db, k=slow)
    await enqueue(db, "req_1")
    await jobs.start()
    await started.wait()
    await jobs.stop()
    back = await job(db, "req_1")
    assert (back.status, back.worker) == ("queued", None)
    # A stop is not a failure: the attempt is given back, so deploys never use a job's
    # attempts up (here, two: one more stop, then a real failure, still leaves a retry).
    assert back.attempts == 0
    started.clear()
    await jobs.start()
    await started.wait()
    await jobs.stop()
    assert (await job(db, "req_1")).attempts == 0

    async def failing(job: JobRecord) -> Apply:
        raise JobFailed("the memory model answered 503")

    assert await runner(db, k=failing).run_once() == 1
    failed = await job(db, "req_1")
    assert (failed.status, failed.attempts) == ("queued", 1)


async def test_a_stop_during_a_claim_puts_what_it_claimed_back(db: Database) -> None:
    """The claim waits behind another transaction holding the jobs (on SQLite, the file); the
    runner is stopped meanwhile, and then the claim goes through. Its job must be queued
    again with no attempt used: on SQLite the cut-short claim still committed in its thread,
    leaving the job `running` with an attempt used until the next start."""
    jobs = runner(db, k=lambda job: asyncio.sleep(0, result=remember("tea")))
    await jobs.start()
    other = create_async_engine(db.url)
    try:
        async with other.begin() as holding:
            if db.is_sqlite:
                await holding.execute(text("UPDATE jobs SET kind = kind"))  # the write lock
            else:
                await holding.execute(text("LOCK TABLE jobs IN EXCLUSIVE MODE"))
            queued = now() - timedelta(seconds=1)
            await holding.run_sync(
                lambda conn: Jobs(conn).enqueue("t1", "alice", "k", "req_1", now=queued)
            )
            jobs.wake()
            await _claim_waiting(db)
            stopping = asyncio.create_task(jobs.stop())
            await asyncio.sleep(0.05)
        await stopping
    finally:
        await other.dispose()
    await db.write(lambda conn: None)  # (after the claim: on SQLite, the one writer's turn)
    back = await job(db, "req_1")
    assert (back.status, back.worker, back.attempts) == ("queued", None, 0)
    assert await memories(db) == []  # and it did not run


async def _claim_waiting(db: Database) -> None:
    """Until the runner's claim waits for the lock (on SQLite, which cannot tell: a while)."""
    if db.is_sqlite:
        await asyncio.sleep(0.2)
        return
    query = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
    await eventually(
        lambda: db.read(lambda conn: bool(conn.execute(text(query)).scalar())), "claim waits"
    )


async def test_a_slow_job_does_not_hold_up_the_jobs_queued_behind_it(db: Database) -> None:
    """The runner fills a free slot as soon as one frees up, not once the whole batch it
    claimed has ended."""
    release = asyncio.Event()

    async def handler(job: JobRecord) -> Apply:
        if job.ref == "req_slow":
            await release.wait()  # a memory model taking its time
        return remember(job.ref)

    jobs = runner(db, k=handler)
    await enqueue(db, "req_slow")
    await jobs.start()
    try:
        await eventually(lambda: _status(db, "req_slow", "running"))
        for ref in ("req_2", "req_3"):  # queued later, each run while the slow one waits
            await enqueue(db, ref)
            jobs.wake()
            await eventually(lambda r=ref: _status(db, r, "done"))  # type: ignore[misc]
        assert (await job(db, "req_slow")).status == "running"
        release.set()
        await eventually(lambda: _status(db, "req_slow", "done"))
    finally:
        release.set()
        await jobs.stop()
    assert sorted(await memories(db)) == ["req_2", "req_3", "req_slow"]


async def test_a_job_whose_bookkeeping_fails_does_not_stop_the_runner(db: Database) -> None:
    class Broken(RetryPolicy):
        def next_run(self, attempts: int, now: datetime) -> datetime | None:
            raise RuntimeError("no next run")

    async def handler(job: JobRecord) -> Apply:
        if job.ref == "req_1":
            raise JobFailed("the memory model answered 503")
        return remember(job.ref)

    jobs = JobRunner(db, Metrics(), poll_seconds=0.05, retry=Broken(), worker="me")
    jobs.register("k", handler)
    await enqueue(db, "req_1")
    await jobs.start()
    try:
        await eventually(lambda: _status(db, "req_1", "running"))  # left to its lease
        await enqueue(db, "req_2")
        await eventually(lambda: _status(db, "req_2", "done"))
    finally:
        await jobs.stop()


async def _status(db: Database, ref: str, status: str) -> bool:
    return (await job(db, ref)).status == status
