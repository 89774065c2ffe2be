"""Costs added to exchanges after the fact, and the spend report, on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

from storage.database import Database
from storage.records import NewExchange
from storage.repositories.exchanges import Exchanges

DAY1 = datetime(2026, 3, 1, 23, 30, tzinfo=UTC)
DAY2 = datetime(2026, 3, 2, 0, 30, tzinfo=UTC)


async def start(db: Database, request_id: str, *, tenant: str = "t1", **extra: Any) -> None:
    started = extra.pop("started_at", DAY1)
    exchange = NewExchange(
        request_id=request_id,
        tenant_id=tenant,
        user_id=extra.pop("user_id", "alice"),
        model=extra.pop("model", "m1"),
        upstream="echo",
        mode="full",
        stream=False,
        started_at=started,
    )
    await db.write(lambda conn: Exchanges(conn).start(exchange))
    if extra:
        fields = {"status": "complete", "finished_at": started, **extra}
        await db.write(lambda conn: Exchanges(conn).finish(tenant, request_id, **fields))


async def test_memory_costs_added_later_accumulate_with_their_parts(db: Database) -> None:
    await start(db, "r1", cost_upstream_usd=0.001, prompt_tokens=10, completion_tokens=1)
    parts = [{"kind": "intent", "cost_usd": 0.0002}, {"kind": "extraction", "cost_usd": 0.0003}]
    # Concurrent additions (e.g. a late intent and an extraction job) both land.
    added = await asyncio.gather(
        *[
            db.write(lambda conn, p=p: Exchanges(conn).add_cost("t1", "r1", p, p["cost_usd"]))
            for p in parts
        ]
    )
    assert added == ["added", "added"]
    record = await db.read(lambda conn: Exchanges(conn).get("t1", "r1"))
    assert record is not None
    assert record.cost_memory_usd == 0.0005
    assert sorted(p["kind"] for p in record.cost_parts) == ["extraction", "intent"]
    assert record.cost_upstream_usd == 0.001


async def test_a_cost_for_another_tenants_exchange_is_not_added(db: Database) -> None:
    await start(db, "r1", cost_upstream_usd=0.001)
    added = await db.write(lambda conn: Exchanges(conn).add_cost("t2", "r1", {}, 1.0))
    assert added == "missing"
    record = await db.read(lambda conn: Exchanges(conn).get("t1", "r1"))
    assert record is not None and record.cost_memory_usd == 0


async def test_spend_report_groups_by_model_user_and_utc_day(db: Database) -> None:
    await start(db, "a", cost_upstream_usd=0.5, prompt_tokens=100, completion_tokens=10)
    await start(
        db,
        "b",
        started_at=DAY2,
        model="m2",
        cost_upstream_usd=0.25,
        prompt_tokens=5,
        completion_tokens=5,
    )
    await start(db, "c", started_at=DAY2, user_id="bob", prompt_tokens=1, completion_tokens=1)
    await start(db, "in-flight", started_at=DAY2)  # no cost yet: counted, not unpriced
    await start(db, "other", tenant="t2", cost_upstream_usd=9.0)
    span = (DAY1 - timedelta(days=1), DAY2 + timedelta(days=1))

    def report(group_by: Any = None, user: str | None = None) -> Any:
        return db.read(lambda conn: Exchanges(conn).usage("t1", *span, group_by, user))

    (total,) = await report()
    assert (total.key, total.requests, total.prompt_tokens, total.completion_tokens) == (
        None,
        4,
        106,
        16,
    )
    assert (total.cost_upstream_usd, total.unpriced_requests) == (0.75, 1)
    by_day = {r.key: r.requests for r in await report("day")}
    assert by_day == {"2026-03-01": 1, "2026-03-02": 3}
    by_model = {r.key: r.cost_upstream_usd for r in await report("model")}
    assert by_model == {"m1": 0.5, "m2": 0.25}
    # Largest spend first.
    assert [r.key for r in await report("user")] == ["alice", "bob"]
    assert [r.key for r in await report("intent")] == [None]
    (bob,) = await report(user="bob")
    assert bob.requests == 1
    (none,) = await db.read(
        lambda conn: Exchanges(conn).usage("t1", DAY2 + timedelta(days=1), DAY2 + timedelta(days=2))
    )
    assert none.requests == 0 and none.cost_upstream_usd == 0
