"""Exchange traces on both databases: written with the exchange's record (its finish, or a
finished record inserted whole), read per tenant, replaced when written again, and gone with
their exchange (erasure, retention) by the foreign key's cascade."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Connection

from proxy.routes.users import erase_user
from storage.database import Database
from storage.records import NewExchange
from storage.repositories.conversations import Conversations
from storage.repositories.exchanges import Exchanges
from storage.repositories.traces import Traces

T0 = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)


def exchange(
    request_id: str, *, tenant: str = "t1", user: str = "alice", conversation_pk: int | None = None
) -> NewExchange:
    return NewExchange(
        request_id=request_id,
        tenant_id=tenant,
        user_id=user,
        model="gpt-4o-mini",
        upstream="main",
        mode="full",
        stream=False,
        started_at=T0,
        conversation_pk=conversation_pk,
    )


def trace(marker: str, size: int = 100) -> dict[str, Any]:
    """A trace as the pipeline hands it over (policies/trace.bounded)."""
    text = json.dumps({"recall": {"terms": [marker]}})
    return {"level": "summary", "size": size, "truncated": [], "text": text}


def finished(request_id: str, **fields: Any) -> dict[str, Any]:
    return {"status": "complete", "finished_at": T0 + timedelta(seconds=1), **fields}


async def test_a_trace_is_written_with_the_exchanges_finish_and_read_per_tenant(
    db: Database,
) -> None:
    def work(conn: Connection) -> None:
        repo = Exchanges(conn)
        repo.start(exchange("req_1"))
        repo.finish("t1", "req_1", **finished("req_1", trace=trace("beagle", 321)))
        repo.start(exchange("req_2"))
        repo.finish("t1", "req_2", **finished("req_2"))  # (no trace: the tenant's is off)

    await db.write(work)
    found = await db.read(lambda conn: Traces(conn).get("t1", "req_1"))
    assert found is not None
    assert found.user_id == "alice" and found.level == "summary" and found.size == 321
    assert found.truncated == []
    assert found.trace["recall"] == {"terms": ["beagle"]}
    assert await db.read(lambda conn: Traces(conn).get("t2", "req_1")) is None
    assert await db.read(lambda conn: Traces(conn).get("t1", "req_2")) is None
    record = await db.read(lambda conn: Exchanges(conn).get("t1", "req_1"))
    assert record is not None and record.status == "complete"


async def test_finished_records_inserted_whole_keep_their_traces(db: Database) -> None:
    rows = [
        exchange("req_a").row() | finished("req_a", trace=trace("a")),
        exchange("req_b", user="bob").row() | finished("req_b"),
    ]

    await db.write(lambda conn: Exchanges(conn).insert_finished(rows))
    a = await db.read(lambda conn: Traces(conn).get("t1", "req_a"))
    assert a is not None and a.trace["recall"] == {"terms": ["a"]}
    assert await db.read(lambda conn: Traces(conn).get("t1", "req_b")) is None
    assert "trace" in rows[0]  # (the caller's rows are left as they were: a batch may retry)


async def test_a_trace_written_again_replaces_the_first(db: Database) -> None:
    def work(conn: Connection) -> None:
        repo = Exchanges(conn)
        repo.start(exchange("req_1"))
        repo.finish("t1", "req_1", **finished("req_1", trace=trace("first")))
        repo.finish("t1", "req_1", **finished("req_1", trace=trace("again")))  # (a replay)

    await db.write(work)
    found = await db.read(lambda conn: Traces(conn).get("t1", "req_1"))
    assert found is not None and found.trace["recall"] == {"terms": ["again"]}


async def test_a_finish_for_an_exchange_gone_meanwhile_writes_no_trace(db: Database) -> None:
    await db.write(
        lambda conn: Exchanges(conn).finish("t1", "req_gone", **finished("x", trace=trace("x")))
    )
    assert await db.read(lambda conn: Traces(conn).count("t1")) == 0


async def test_traces_go_with_their_exchanges_on_erasure_and_retention(db: Database) -> None:
    def work(conn: Connection) -> None:
        repo = Exchanges(conn)
        for request_id, user in (("req_1", "alice"), ("req_2", "bob"), ("req_3", "bob")):
            repo.start(exchange(request_id, user=user))
            repo.finish("t1", request_id, **finished(request_id, trace=trace(request_id)))

    await db.write(work)
    assert await db.read(lambda conn: Traces(conn).count("t1")) == 3
    await db.write(lambda conn: erase_user(conn, "t1", "alice"))
    assert await db.read(lambda conn: Traces(conn).count("t1", "alice")) == 0
    assert await db.read(lambda conn: Traces(conn).count("t1", "bob")) == 2
    deleted = await db.write(
        lambda conn: Exchanges(conn).delete_before("t1", T0 + timedelta(days=1), limit=10)
    )
    assert deleted == 2
    assert await db.read(lambda conn: Traces(conn).count("t1")) == 0


async def test_a_users_traces_are_read_in_pages_for_their_export(db: Database) -> None:
    def work(conn: Connection) -> None:
        repo = Exchanges(conn)
        for n, user in enumerate(("alice", "alice", "bob", "alice")):
            request_id = f"req_{n}"
            repo.start(exchange(request_id, user=user))
            repo.finish("t1", request_id, **finished(request_id, trace=trace(request_id)))

    await db.write(work)
    first = await db.read(lambda conn: Traces(conn).for_user("t1", "alice", limit=2))
    rest = await db.read(
        lambda conn: Traces(conn).for_user("t1", "alice", limit=2, after=first[-1])
    )
    assert [t.request_id for t in first + rest] == ["req_0", "req_1", "req_3"]
    assert rest[-1].trace["recall"] == {"terms": ["req_3"]}
    assert await db.read(lambda conn: Traces(conn).for_user("t2", "alice", limit=9)) == []


async def test_deleting_a_conversation_deletes_its_exchanges_traces_only(db: Database) -> None:
    def work(conn: Connection) -> None:
        conversations, repo = Conversations(conn), Exchanges(conn)
        trip = conversations.create("t1", "alice", "trip", now=T0)
        pets = conversations.create("t1", "alice", "pets", now=T0)
        for request_id, conversation in (("req_1", trip), ("req_2", trip), ("req_3", pets)):
            repo.start(exchange(request_id, conversation_pk=conversation.pk))
            repo.finish("t1", request_id, **finished(request_id, trace=trace(request_id)))

    await db.write(work)
    assert await db.write(lambda conn: Conversations(conn).delete("t1", "trip"))
    assert await db.read(lambda conn: Traces(conn).get("t1", "req_1")) is None
    assert await db.read(lambda conn: Traces(conn).get("t1", "req_3")) is not None
    kept = await db.read(lambda conn: Exchanges(conn).get("t1", "req_1"))
    assert kept is not None and kept.status == "complete"  # (the record keeps its figures)
