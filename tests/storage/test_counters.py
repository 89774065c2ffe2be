"""Usage counters (storage/repositories/counters.py) on SQLite and PostgreSQL: atomic increments
from many writers at once, tenant isolation, pruning of old minute windows."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest
from sqlalchemy import Connection

from storage.database import Database
from storage.repositories.counters import Counters, WindowCount
from storage.repositories.system import SystemRepository

NOW = datetime(2026, 11, 22, 2, 8, 30, tzinfo=UTC)
MINUTE, DAY, MONTH = "minute:2026-11-22T02:08", "day:2026-11-22", "month:2026-11"


async def add(db: Database, tenant: str, counts: dict[str, WindowCount]) -> None:
    await db.write(lambda conn: Counters(conn).add(tenant, counts, NOW))


async def get(db: Database, tenant: str, windows: list[str]) -> dict[str, WindowCount]:
    return await db.read(lambda conn: Counters(conn).get(tenant, windows))


async def test_increments_add_to_what_is_stored(db: Database) -> None:
    await add(db, "t1", {MINUTE: WindowCount(1, 10, 0.5), DAY: WindowCount(1, 10, 0.5)})
    await add(db, "t1", {MINUTE: WindowCount(2, 5, 0.25)})
    assert await get(db, "t1", [MINUTE, DAY, MONTH]) == {
        MINUTE: WindowCount(3, 15, 0.75),
        DAY: WindowCount(1, 10, 0.5),
    }


async def test_concurrent_increments_from_many_writers_all_count(db: Database) -> None:
    # Two engines on one database, as two replicas would be, each with many writes in flight.
    other = Database(db.url)
    try:
        writes = [
            add(engine, "t1", {MINUTE: WindowCount(1, n, 0.001), DAY: WindowCount(1, n, 0.001)})
            for n in range(40)
            for engine in (db, other)
        ]
        await asyncio.gather(*writes)
    finally:
        await other.dispose()
    totals = await get(db, "t1", [MINUTE, DAY])
    expected_tokens = 2 * sum(range(40))
    assert totals[MINUTE].requests == totals[DAY].requests == 80
    assert totals[MINUTE].tokens == totals[DAY].tokens == expected_tokens
    assert totals[DAY].cost_usd == pytest.approx(0.08)


async def test_many_tenants_in_one_write_and_one_read(db: Database) -> None:
    def work(conn: Connection) -> dict[str, dict[str, WindowCount]]:
        counters = Counters(conn)
        counters.add_many(
            {
                "t2": {MINUTE: WindowCount(2, 0, 0.0)},
                "t1": {MINUTE: WindowCount(1, 0, 0.0), MONTH: WindowCount(1, 7, 1.0)},
            },
            NOW,
        )
        return counters.get_many(["t1", "t2", "t3"], [MINUTE, MONTH])

    assert await db.write(work) == {
        "t1": {MINUTE: WindowCount(1, 0, 0.0), MONTH: WindowCount(1, 7, 1.0)},
        "t2": {MINUTE: WindowCount(2, 0, 0.0)},
    }


async def test_tenants_never_see_each_others_counts(db: Database) -> None:
    await add(db, "t1", {DAY: WindowCount(5, 50, 5.0)})
    await add(db, "t2", {DAY: WindowCount(1, 1, 0.01)})
    assert await get(db, "t2", [DAY]) == {DAY: WindowCount(1, 1, 0.01)}
    assert await get(db, "t3", [DAY]) == {}


async def test_only_the_asked_windows_are_read(db: Database) -> None:
    await add(db, "t1", {"minute:2026-11-22T02:07": WindowCount(9, 9, 0.0)})
    assert await get(db, "t1", [MINUTE]) == {}


async def test_pruning_deletes_old_minute_windows_of_every_tenant_only(db: Database) -> None:
    old = ["minute:2026-11-21T23:59", "minute:2026-11-22T00:59"]
    kept = ["minute:2026-11-22T01:00", MINUTE, "day:2026-11-01", "month:2026-10"]
    for tenant in ("t1", "t2"):
        await add(db, tenant, {w: WindowCount(1, 1, 0.0) for w in old + kept})

    pruned = await db.write(
        lambda conn: SystemRepository(conn).prune_minute_counters("minute:2026-11-22T01:00")
    )

    assert pruned == 4
    for tenant in ("t1", "t2"):
        assert sorted(await get(db, tenant, old + kept)) == sorted(kept)


async def test_pruning_refuses_a_key_that_is_not_a_minute(db: Database) -> None:
    with pytest.raises(ValueError, match="not a minute window"):
        await db.write(lambda conn: SystemRepository(conn).prune_minute_counters("month:2026-11"))
