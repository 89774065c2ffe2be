"""LimitKeeper (proxy/accounting/limits.py) on real SQLite and PostgreSQL databases: local decisions,
counts shared between keepers through the database, restarts, and a database that fails."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import text

from proxy.accounting.limits import LimitKeeper
from proxy.core.auth import Principal
from proxy.core.config import ALL_SCOPES, Config, Limits, TenantConfig
from proxy.core.errors import RateLimited
from storage.database import Database
from storage.repositories.counters import Counters, WindowCount
from storage.repositories.exchanges import Exchanges
from tests.storage.test_exchange_costs import start as start_exchange

START = datetime(2026, 11, 22, 2, 8, 0, tzinfo=UTC).timestamp()


class Clock:
    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> float:
        return self.now


def config(**limits: Any) -> Config:
    return Config(
        tenants={
            "t1": TenantConfig(api_keys=["k1"], limits=Limits(**limits)),
            "free": TenantConfig(api_keys=["k2"]),
        }
    )


def principal(cfg: Config, tenant: str = "t1") -> Principal:
    return Principal(tenant, cfg.tenants[tenant], ALL_SCOPES)


def keeper(db: Database, cfg: Config, clock: Callable[[], float]) -> LimitKeeper:
    return LimitKeeper(db, cfg, interval=3600, clock=clock)  # tests call sync() themselves


def admitted(keeper: LimitKeeper, who: Principal, tries: int) -> int:
    count = 0
    for _ in range(tries):
        try:
            keeper.admit(who)
        except RateLimited:
            continue
        count += 1
    return count


async def stored(db: Database, tenant: str, window: str) -> WindowCount | None:
    return (await db.read(lambda conn: Counters(conn).get(tenant, [window]))).get(window)


async def test_rpm_is_decided_locally_with_retry_after_to_the_end_of_the_minute(
    db: Database,
) -> None:
    cfg, clock = config(rpm=3), Clock()
    clock.now = START + 45.5
    k = keeper(db, cfg, clock)
    assert admitted(k, principal(cfg), 3) == 3
    with pytest.raises(RateLimited) as caught:
        k.admit(principal(cfg))
    error = caught.value
    assert (error.status, error.type, error.code) == (429, "requests", "rate_limit_exceeded")
    assert error.headers == {"retry-after": "15"}
    assert error.body()["error"]["message"].startswith("Rate limit reached for requests per minute")


async def test_a_new_minute_admits_again(db: Database) -> None:
    cfg, clock = config(rpm=2), Clock()
    k = keeper(db, cfg, clock)
    assert admitted(k, principal(cfg), 5) == 2
    clock.now = START + 60
    assert admitted(k, principal(cfg), 5) == 2


async def test_two_keepers_share_one_limit_through_the_database(db: Database) -> None:
    cfg, clock = config(rpm=10), Clock()
    a, b = keeper(db, cfg, clock), keeper(db, cfg, clock)
    assert admitted(a, principal(cfg), 7) == 7
    assert await a.sync()  # A writes its 7
    assert await b.sync()  # B reads them
    assert admitted(b, principal(cfg), 10) == 3
    assert await b.sync()
    assert await a.sync()
    assert admitted(a, principal(cfg), 1) == 0
    assert await stored(db, "t1", "minute:2026-11-22T02:08") == WindowCount(10, 0, 0.0)


async def test_budget_counts_priced_spend_only_and_answers_insufficient_quota(
    db: Database,
) -> None:
    cfg, clock = config(budget_usd_day=0.01), Clock()
    k = keeper(db, cfg, clock)
    k.admit(principal(cfg))
    k.spend("t1", 1000, None)  # unpriced: no cost
    k.admit(principal(cfg))
    k.spend("t1", 1000, Decimal("0.006"))
    k.admit(principal(cfg))  # 0.006 < 0.01: admitted, still in flight
    k.spend("t1", 1000, Decimal("0.006"))  # 0.012: over, by at most this one call
    with pytest.raises(RateLimited) as caught:
        k.admit(principal(cfg))
    assert (caught.value.type, caught.value.code) == ("insufficient_quota", "insufficient_quota")
    assert caught.value.headers["retry-after"] == str(22 * 3600 - 8 * 60)  # until 00:00 UTC
    view = k.view("t1")
    [day] = view.usage
    assert (day.limit, day.used, day.remaining) == ("budget_usd_day", pytest.approx(0.012), 0.0)


async def test_tpm_counts_the_tokens_of_finished_calls(db: Database) -> None:
    cfg, clock = config(tpm=100), Clock()
    k = keeper(db, cfg, clock)
    k.admit(principal(cfg))
    k.admit(principal(cfg))  # tokens are known when calls finish
    k.spend("t1", 60, None)
    k.spend("t1", 60, None)
    with pytest.raises(RateLimited) as caught:
        k.admit(principal(cfg))
    assert caught.value.type == "tokens"


async def test_a_restarted_keeper_knows_todays_spend(db: Database) -> None:
    cfg, clock = config(budget_usd_day=1.0), Clock()
    first = LimitKeeper(db, cfg, interval=3600, clock=clock)
    await first.start()
    first.admit(principal(cfg))
    first.spend("t1", 10, Decimal("1.5"))
    await first.stop()  # writes what was only counted locally

    clock.now += 3600  # later the same day
    second = LimitKeeper(db, cfg, interval=3600, clock=clock)
    await second.start()
    try:
        with pytest.raises(RateLimited):
            second.admit(principal(cfg))
    finally:
        await second.stop()


async def test_a_budget_set_mid_month_starts_from_the_months_spend(db: Database) -> None:
    """The tenant ran without limits: nothing was counted as it went. A budget that appears
    (at start-up, or by a reload) knows what its window has cost from the exchange records."""
    started = datetime.fromtimestamp(START, UTC)
    for n, (when, upstream, memory) in enumerate(
        [
            (started - timedelta(days=20), 0.25, 0.05),  # this month, an earlier day
            (started - timedelta(hours=1), 0.5, None),  # today (and this month)
            (started - timedelta(days=30), 9.0, None),  # last month: not counted
        ]
    ):
        await start_exchange(db, f"r{n}", started_at=when, cost_upstream_usd=upstream)
        if memory is not None:
            part = {"kind": "summary", "model": "m", "cost_usd": memory}
            await db.write(
                lambda c, p=part, r=f"r{n}": Exchanges(c).add_cost("t1", r, p, p["cost_usd"])
            )
    clock, plain = Clock(), config()
    k = keeper(db, plain, clock)
    await k.start()
    try:
        await k.reconfigure(config(budget_usd_month=0.8, budget_usd_day=5.0))
        (month, day) = k.view("t1").usage
        assert (month.limit, round(month.used, 10)) == ("budget_usd_month", 0.8)
        assert (day.limit, round(day.used, 10)) == ("budget_usd_day", 0.5)
        with pytest.raises(RateLimited):
            k.admit(principal(config(budget_usd_month=0.8)))
    finally:
        await k.stop()
    # A counter already above the records (a call not yet in them) is never lowered; a
    # restart with the budget in place from the start reads the same.
    await db.write(
        lambda c: Counters(c).add("t1", {"month:2026-11": WindowCount(cost_usd=0.2)}, started)
    )
    again = keeper(db, config(budget_usd_month=5.0), clock)
    await again.start()
    try:
        (month,) = again.view("t1").usage
        assert round(month.used, 10) == 1.0
    finally:
        await again.stop()


async def test_what_a_replica_counted_before_its_seeding_is_not_counted_twice(
    db: Database,
) -> None:
    """The start-up sync failed (or a reload is still syncing): calls were counted locally,
    and their exchange records hold them too. The window takes the larger, not the sum."""
    started = datetime.fromtimestamp(START - 60, UTC)
    await start_exchange(db, "r1", started_at=started, cost_upstream_usd=0.5)
    cfg, clock = config(budget_usd_day=5.0), Clock()
    k = keeper(db, cfg, clock)
    k.admit(principal(cfg))
    k.spend("t1", 10, Decimal("0.5"))  # the call r1 records
    assert await k.sync()
    (day,) = k.view("t1").usage
    assert day.used == 0.5


async def test_tenants_without_limits_are_not_counted(db: Database) -> None:
    cfg, clock = config(rpm=1), Clock()
    k = keeper(db, cfg, clock)
    assert admitted(k, principal(cfg, "free"), 50) == 50
    k.spend("free", 10_000, Decimal(5))
    assert await k.sync()
    assert await stored(db, "free", "minute:2026-11-22T02:08") is None
    assert k.view("free").usage == []


async def test_a_failing_database_keeps_the_counts_and_the_decisions(db: Database) -> None:
    cfg, clock = config(rpm=5), Clock()
    a, b = keeper(db, cfg, clock), keeper(db, cfg, clock)
    assert admitted(a, principal(cfg), 2) == 2
    assert await a.sync()
    await db.write(lambda conn: conn.execute(text("ALTER TABLE usage_counters RENAME TO gone")))

    assert admitted(a, principal(cfg), 2) == 2
    assert not await a.sync()  # logged, never raised
    assert admitted(a, principal(cfg), 5) == 1  # last shared 2 + 3 local: the limit holds

    await db.write(lambda conn: conn.execute(text("ALTER TABLE gone RENAME TO usage_counters")))
    assert await a.sync()  # the counts kept through the failure are written now
    assert await b.sync()
    assert admitted(b, principal(cfg), 1) == 0
    assert await stored(db, "t1", "minute:2026-11-22T02:08") == WindowCount(5, 0, 0.0)


async def test_the_background_task_shares_counts_without_being_asked(db: Database) -> None:
    cfg, clock = config(rpm=4), Clock()
    a = LimitKeeper(db, cfg, interval=0.05, clock=clock)
    b = LimitKeeper(db, cfg, interval=0.05, clock=clock)
    await a.start()
    await b.start()
    try:
        assert admitted(a, principal(cfg), 4) == 4
        for _ in range(400):  # until B's own task has read A's counts
            if b.view("t1").usage[0].used == 4:
                break
            await asyncio.sleep(0.01)
        assert admitted(b, principal(cfg), 1) == 0
    finally:
        await a.stop()
        await b.stop()
