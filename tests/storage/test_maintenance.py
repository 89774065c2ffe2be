"""Each replica's upkeep on both databases: retention deletes what a tenant keeps no longer
(idle conversations with everything made of them, old exchange records and Responses API
responses, memories nobody pinned, changed or used, jobs that ended long ago) and nothing of
other tenants or newer; the sweeper marks exchanges a dead process left `in_progress` as
`incomplete`, all of them at start-up on SQLite, only stale ones on PostgreSQL, where other
replicas are serving theirs."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import Connection, func, select, update

from proxy.background.maintenance import Maintenance
from proxy.core.config import Config, TenantConfig
from proxy.pipeline.turn import now
from storage.database import Database
from storage.models import ATTACHMENT_CHUNKS, JOBS, MESSAGES, SUMMARIES
from storage.repositories.attachments import Attachments, new_attachment_id
from storage.repositories.conversations import Conversations
from storage.repositories.exchanges import Exchanges
from storage.repositories.jobs import Jobs
from storage.repositories.memories import Memories
from storage.repositories.responses import Responses
from storage.repositories.summaries import Summaries
from storage.repositories.system import SystemRepository
from tests.storage.test_repositories import T0, at, chained, exchange, new_conversation
from tests.storage.test_responses import response

CONFIG = Config(
    tenants={
        "t1": TenantConfig(api_keys=["k1"], retention_days=30),
        "t2": TenantConfig(api_keys=["k2"]),
    }
)
HELLO = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]


async def count(db: Database, table: object, tenant: str) -> int:
    def work(conn: Connection) -> int:
        return int(
            conn.execute(
                select(func.count()).select_from(table).where(table.c.tenant_id == tenant)  # type: ignore[attr-defined]
            ).scalar_one()
        )

    return await db.read(work)


async def test_retention_deletes_what_the_tenant_keeps_no_longer_and_nothing_else(
    db: Database,
) -> None:
    old = await new_conversation(db, "old", HELLO, when=T0)
    await new_conversation(db, "new", HELLO, when=at(1000))
    await new_conversation(db, "old", HELLO, tenant="t2", when=T0)

    def seed(conn: Connection) -> None:
        document = Attachments(conn).create(
            "t1",
            "alice",
            old.pk,
            new_attachment_id(),
            content="notes",
            chunks=[("notes", 1)],
            now=T0,
        )
        summaries = Summaries(conn)
        for key, subject in (("h", "old"), ("a", document.id), ("n", "new")):
            summaries.put(
                "t1",
                key,
                kind="history",
                user_id="alice",
                subject=subject,
                model="m",
                text="s",
                tokens=1,
                now=T0,
            )
        exchanges = Exchanges(conn)
        for request_id, started in (("req_old", T0), ("req_new", at(1000))):
            exchanges.start(exchange(request_id, started=started))
            exchanges.finish("t1", request_id, status="complete")
        exchanges.start(exchange("req_running", started=T0))  # left in progress
        exchanges.start(exchange("req_other", tenant="t2", started=T0))
        responses = Responses(conn)
        for response_id, conversation, created in (
            ("resp_old", "new", T0),
            ("resp_new", "new", at(1000)),
            ("resp_in_old_conversation", "old", at(1000)),  # (goes with its conversation)
        ):
            responses.save(response(response_id, conversation=conversation, when=created))
        responses.save(response("resp_other", tenant="t2", conversation="old", when=T0))
        memories = Memories(conn)
        memories.create("t1", "alice", "mem_old", "likes tea", now=T0)
        memories.create("t1", "alice", "mem_pinned", "is vegan", now=T0, pinned=True)
        memories.create("t1", "alice", "mem_used", "has a cat", now=T0)
        memories.used("t1", [memories.get("t1", "mem_used").pk], at(1000))  # type: ignore[union-attr]
        memories.create("t1", "alice", "mem_new", "plays chess", now=at(1000))
        memories.create("t2", "bob", "mem_other", "likes tea", now=T0)
        jobs, system = Jobs(conn), SystemRepository(conn)
        for tenant, ref in (("t1", "done"), ("t1", "dead"), ("t1", "new"), ("t1", "queued")):
            jobs.enqueue(tenant, "alice", "extract_memories", ref, now=T0)
        jobs.enqueue("t2", "bob", "extract_memories", "other", now=T0)
        claimed = system.claim_jobs("w", now=T0, lease=timedelta(minutes=1), limit=10)
        ended = {"done": ("done", T0), "dead": ("dead", T0), "new": ("done", at(1000))}
        for job in claimed:
            status, when = ended.get(job.ref, ("done", T0))
            system.settle_job(job.pk, "w", attempt=1, status=status, now=when)
        requeued = next(j for j in claimed if j.ref == "queued")
        conn.execute(update(JOBS).where(JOBS.c.pk == requeued.pk).values(status="queued"))

    await db.write(seed)
    deleted = await Maintenance(db, CONFIG).retain("t1", at(500))
    assert deleted == {
        "conversations": 1,
        "exchanges": 1,
        "responses": 1,
        "memories": 1,
        "jobs": 2,
    }

    def left(conn: Connection) -> dict[str, object]:
        return {
            "conversations": [c.id for c in Conversations(conn).list("t1", "alice", limit=10)],
            "t2": [c.id for c in Conversations(conn).list("t2", "alice", limit=10)],
            "exchanges": [
                e
                for e in ("req_old", "req_new", "req_running")
                if Exchanges(conn).get("t1", e) is not None
            ],
            "t2 exchange": Exchanges(conn).get("t2", "req_other") is not None,
            "responses": [r.id for r in Responses(conn).for_user("t1", "alice", limit=10)],
            "t2 response": Responses(conn).get("t2", "resp_other") is not None,
            "memories": sorted(m.id for m in Memories(conn).find("t1", "alice", limit=10)),
            "t2 memory": Memories(conn).get("t2", "mem_other") is not None,
            "summaries": sorted(
                s for s in ("h", "a", "n") if Summaries(conn).get("t1", s) is not None
            ),
            "jobs": sorted(
                (j.tenant_id, j.ref)
                for tenant in ("t1", "t2")
                for j in Jobs(conn).find(tenant, limit=10)
            ),
        }

    assert await db.read(left) == {
        "conversations": ["new"],
        "t2": ["old"],
        "exchanges": ["req_new", "req_running"],
        "t2 exchange": True,
        "responses": ["resp_new"],
        "t2 response": True,
        "memories": ["mem_new", "mem_pinned", "mem_used"],
        "t2 memory": True,
        "summaries": ["n"],
        "jobs": [("t1", "new"), ("t1", "queued"), ("t2", "other")],  # ended recently, or not
    }
    assert await count(db, MESSAGES, "t1") == 2  # the new conversation's
    assert await count(db, ATTACHMENT_CHUNKS, "t1") == 0
    assert await count(db, SUMMARIES, "t1") == 1
    # Again: nothing more to do.
    assert await Maintenance(db, CONFIG).retain("t1", at(500)) == {
        "conversations": 0,
        "exchanges": 0,
        "responses": 0,
        "memories": 0,
        "jobs": 0,
    }


async def test_the_sweeper_takes_only_what_no_live_process_can_be_serving(db: Database) -> None:
    fresh = now() - timedelta(seconds=5)

    def seed(conn: Connection) -> None:
        exchanges = Exchanges(conn)
        exchanges.start(exchange("req_stale", started=T0))
        exchanges.start(exchange("req_fresh", started=fresh))

    await db.write(seed)
    maintenance = Maintenance(db, Config())

    async def statuses() -> dict[str, str]:
        def work(conn: Connection) -> dict[str, str]:
            found = {r: Exchanges(conn).get("t1", r) for r in ("req_stale", "req_fresh")}
            return {r: e.status for r, e in found.items() if e is not None}

        return await db.read(work)

    periodic = await maintenance.run_once()
    if db.is_sqlite:  # one process owns the file: between start-ups nothing is abandoned
        assert periodic.swept == 0
        assert await statuses() == {"req_stale": "in_progress", "req_fresh": "in_progress"}
        assert (await maintenance.run_once(starting=True)).swept == 2
        assert await statuses() == {"req_stale": "incomplete", "req_fresh": "incomplete"}
    else:  # another replica may be serving the fresh one
        assert periodic.swept == 1
        assert await statuses() == {"req_stale": "incomplete", "req_fresh": "in_progress"}
        assert (await maintenance.run_once(starting=True)).swept == 0


async def test_a_conversation_used_again_after_it_was_found_idle_is_kept(db: Database) -> None:
    await new_conversation(db, "old", HELLO, when=T0)
    idle = await db.read(lambda conn: Conversations(conn).idle_since("t1", at(500), limit=10))
    assert idle == ["old"]
    await new_conversation(db, "other", when=T0)  # (unrelated)

    def used(conn: Connection) -> None:  # a turn lands before retention gets to it
        conversations = Conversations(conn)
        found = conversations.get("t1", "old", for_update=True)
        assert found is not None
        turn = [{"role": "user", "content": "still here"}]
        conversations.append(found, "alice", chained(found, turn), now=at(1000))

    await db.write(used)
    kept = await db.write(lambda conn: Conversations(conn).delete_if_idle("t1", "old", at(500)))
    assert kept is False
    assert await count(db, MESSAGES, "t1") == 3
    assert await Maintenance(db, CONFIG).retain("t1", at(500)) == {
        "conversations": 1,  # "other" only
        "exchanges": 0,
        "responses": 0,
        "memories": 0,
        "jobs": 0,
    }
